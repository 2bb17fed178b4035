"""What context parallelism changes in the exact memory of our runs (`run_memory.py`): a rank holds T / cp tokens of
every sequence (ring attention arXiv 2310.01889, DeepSpeed-Ulysses arXiv 2309.14509; parallel/context/).

Per token the block saves what it saves without cp, for T / cp tokens, with these differences:
- ring: the ring's autograd function keeps q, k, v (views of the qkv output, 3c), its output (c, laid out as SDPA
  lays out its output, so the projection's input is the same tensor) and the log-sum-exp (nh): a flash kernel's
  tensors, also with dropout (the masks are recomputed from global indices in backward, none is saved);
- ulysses: q, k and v after the all-to-all (3c, one new tensor), the core's output (c, per head) and the output
  all-to-all's result, which the projection keeps as a copy (c); with RoPE the rotated q and k are not kept (only
  the all-to-all's copy); with dropout the explicit core keeps what it keeps without cp (its T x T tensors are
  h / cp heads x all T keys: the same per local token);
- the loader's ids: the rank's columns of its rows are a new (rows, T / cp) tensor, for inputs and targets each;
- parameters, gradients and optimizer state: ZeRO shards over dp x cp ranks, experts over edp x cp.
"""

from __future__ import annotations

from scaletrain.config import Config, ParallelConfig


def dp_cp_ranks(par: ParallelConfig) -> int:
    """Ranks the optimizer reduces and shards over: dp x cp."""
    return par.dp * max(par.cp, 1)


def expert_rank(par: ParallelConfig, r: int) -> int:
    """The edp x cp rank of dp x cp rank r (dp-major, as the mesh orders both groups)."""
    cp = max(par.cp, 1)
    return (r // cp) // par.ep * cp + r % cp


def cp_core_extra(s: dict, explicit: bool, recompute: str) -> int:
    """Bytes per token the attention core keeps beyond the single-process count: Ulysses' output all-to-all copy
    (not with the explicit dropout core, whose output is not kept, nor under attn-core recomputation)."""
    if s["ulysses"] and not explicit and recompute != "attn-core":
        return s["c"] * s["e"]
    return 0


def cp_rope_extra(s: dict, plain: int) -> int:
    """RoPE's extra elements per token (in units of c): Ulysses keeps neither the rotated q and k nor a second
    copy of the output (both counted already); otherwise as without cp."""
    return 0 if s["ulysses"] else plain


def loader_ids_bytes(cfg: Config, s: dict) -> int:
    """The input ids the embedding keeps (no tp): a view of the loader's (global batch, T + 1) int64 tensor, or
    under cp this rank's own (rows, T / cp) copy of its columns."""
    if s["cp"] == 1:
        return 8 * cfg.train.global_batch * (cfg.model.seq_len + 1)
    return 8 * (cfg.train.global_batch // cfg.parallel.dp) * s["Tl"]


def loader_targets_bytes(cfg: Config, s: dict) -> int:
    """The targets the loss keeps (no tp): a flattened copy of the micro-batch's (8 n), or under cp a view of the
    rank's (rows, T / cp) copy."""
    if s["cp"] == 1:
        return 8 * s["n"]
    return 8 * (cfg.train.global_batch // cfg.parallel.dp) * s["Tl"]
