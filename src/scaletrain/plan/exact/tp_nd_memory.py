"""Exact activation bytes and parameter shapes of our own 2D, 2.5D and 3D tensor-parallel runs (Optimus arXiv
2104.05343, Tesseract arXiv 2105.14500, 3D arXiv 2105.14450), as the engine (`parallel.tensor_nd`) builds and
saves them: `plan.exact.run_memory` calls these for a run with tp_mode 2d, 2.5d or 3d. The planner's model of
the same modes is `plan/analytic/tp_nd.py`.
"""

from __future__ import annotations

from scaletrain.config.sizes import ffn_size
from scaletrain.parallel.tensor_nd import make_plan, shard_gpt
from scaletrain.parallel.tensor_nd.grid import Grid, padded, shape_of


def shard_meta(model, cfg) -> None:
    """Give the meta-device GPT every rank's shard shapes by running the engine's own pass with a grid of no groups
    (`tensor_nd.shard_gpt`: the same placements; all ranks hold equal shapes)."""
    shard_gpt(model, make_plan(Grid(shape_of(cfg.parallel), 0, 0, 0), cfg.train.micro_batch, cfg.model.d_model))


def _local(cfg) -> dict:
    s = shape_of(cfg.parallel)
    m, dtype = cfg.model, cfg.train.dtype
    low = dtype in ("bf16", "fp16")
    e = {"fp32": 4, "fp64": 8, "bf16": 2, "fp16": 2}[dtype]
    q = s.q
    return dict(mode=s.mode, q=q, n=cfg.train.micro_batch // s.row_blocks * m.seq_len, T=m.seq_len,
                c=m.d_model // q, f=ffn_size(m) // q, nh=m.n_heads // q, hd=m.d_model // m.n_heads, e=e,
                e32=4 if low else e, low=low, bias=int(m.bias), V=m.vocab_size,
                Vl=padded(m.vocab_size, q * q if s.mode == "3d" else q) // q,
                lookup=(cfg.train.micro_batch // (s.depth if s.mode == "2.5d" else 1)) * m.seq_len)


def _norm_bytes(s: dict) -> int:
    """One norm for one micro-batch: x_hat and 1/sigma per token (fp32 under bf16 / fp16), and the weight chunk
    its product keeps: the gathered chunk in 2D / 2.5D, nothing in 3D (a view of the parameter), its fp32 copy
    under bf16 / fp16."""
    weight = s["c"] * 4 if s["low"] else (s["c"] * s["e"] if s["mode"] != "3d" else 0)
    return s["n"] * (s["c"] + 1) * s["e32"] + weight


def layer_saved_bytes(cfg, recompute: str = "none") -> int:
    """Bytes one block of the grid modes saves for backward for one micro-batch, as `tensor_nd` does it
    (`run_memory.layer_saved_bytes` for 1D). Per token of the rank (n = its sequences x T), elements of its
    blocks (c = h/q, f = MLP/q, nh = heads/q): two norms (`_norm_bytes`) and their outputs, the inputs of qkv and
    fc (2c); the qkv output (3c: q, k, v are views), the attention output (c, the projection's input), the
    flash kernel's log-sum-exp (nh, fp32 under bf16 / fp16); the MLP's 2f (GELU) or 4f (SwiGLU) -- the element
    counts of 1D's split part, all divided by t. Dropout (the global masks: bool, the explicit attention's
    probabilities, mask and dropped probabilities, nh T each), RoPE (the rotated q and k, 2c, kept besides the
    qkv output that v views; plus the projection's input copy with the flash kernel) and selective recomputation
    (no log-sum-exp) follow the same attention code as 1D. `full` / `every`: the block input only."""
    s = _local(cfg)
    n, c, f, nh, e, e32, T = s["n"], s["c"], s["f"], s["nh"], s["e"], s["e32"], s["T"]
    if recompute in ("full", "every"):
        return n * c * e
    m = cfg.model
    mlp = (4 if m.mlp == "swiglu" else 2) * f
    dropout = m.dropout > 0
    explicit = dropout and recompute != "attn-core"  # the global dropout's explicit attention
    if explicit:
        core = 3 * c * e + nh * T * (2 * e + 1) + c * e
    else:
        core = 3 * c * e + c * e + (0 if recompute == "attn-core" else nh * e32)
    total = 2 * _norm_bytes(s) + n * (2 * c * e + core + mlp * e) + (T * T if explicit else 0)
    if dropout:
        total += n * 2 * c  # the two residual dropouts' bool masks
    if m.position == "rope":  # the rotated q and k; with the flash kernel the projection's input is a copy too
        extra = 2 if explicit or recompute == "attn-core" else 3
        total += n * extra * c * e + (0 if e == 8 else 2 * T * s["hd"] * e)
    return total


def outside_saved_bytes(cfg, first: bool, last: bool, tied_copy: bool) -> int:
    """What one micro-batch saves outside the blocks: first stage: the looked-up ids (int64) and their
    out-of-range mask for every sequence the rank's embedding looks up (the whole micro-batch; the depth layer's
    in 2.5D), the positions (int64 T) and the embedding dropout's mask; last stage: the final norm and its
    output (the head's input), then the loss: the local softmax (V'/q per token, fp32 or wider), the local
    targets (int64) and their mask, and a pipeline stage's copy of the tied table."""
    s = _local(cfg)
    n, c, e = s["n"], s["c"], s["e"]
    total = 0
    if first:
        total += 9 * s["lookup"]
        if cfg.model.position == "learned":
            total += 8 * s["T"]
        if cfg.model.dropout > 0:
            total += n * c
    if last:
        total += _norm_bytes(s) + n * c * e + n * s["Vl"] * s["e32"] + 9 * n
        if tied_copy:
            total += s["Vl"] // (s["q"] if s["mode"] == "3d" else 1) * c * e
    return total
