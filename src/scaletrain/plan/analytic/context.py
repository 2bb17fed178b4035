"""Context parallelism in the cost model: what splitting every sequence over cp ranks costs and saves (ring
attention, Liu et al. arXiv 2310.01889; DeepSpeed-Ulysses, Jacobs et al. arXiv 2309.14509; parallel/context/).

- Activations, compute and the other dimensions' messages per rank follow T / cp tokens (`estimate` divides the
  micro-batch's tokens by cp); ring attention keeps only a flash kernel's log-sum-exp of its scores (it is
  blockwise), Ulysses keeps what the attention core keeps for h / cp heads of all T tokens — per local token the
  same as without cp.
- Bytes a rank sends per attention call (tokens = micro-batch x T / cp, kv = key/value width of a tp rank, e the
  element size, e_acc that of the gradient accumulators, fp32 or fp64):
    ring, forward   (cp - 1) x 2 tokens kv e                  the key/value chunk, once per ring step but the last
    ring, backward  (cp - 1) x 2 tokens kv e + cp x 2 tokens kv e_acc   the chunks again, and the travelling
                                                              key/value gradient accumulators (cp hops)
    ulysses, each   (cp - 1) / cp x tokens (2 q + 2 kv) e      q, k, v in and the output back (the same in backward)
  A recomputed forward (memory.recompute, reversible blocks) sends its messages again; a selective recomputation
  of the Ulysses core only its input all-to-all (torch's checkpoint stops once the core's saved tensors exist).
- Time: each ring step's transfer is posted before the step's block is computed, so only what the block does not
  hide is exposed: (cp - 1) x max(0, transfer - block) per pass (the blocks are equal: load balancing). Ulysses'
  all-to-alls sit on the critical path (exposed whole). cp ranks are placed next to tp (parallel/context docs):
  a ring of cp ranks t apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scaletrain.config.schema import CP_MODES, Config
from scaletrain.errors import UserError
from scaletrain.plan.analytic.comm import gather_time, group_link


def check_cp(seq_len: int, heads: int, kv_heads: int, tp: int, cp: int, mode: str) -> None:
    """Raise UserError when the sequence or the heads cannot be split over cp (as validate() for our runs)."""
    if cp < 1:
        raise UserError(f"layout cp must be >= 1, got {cp}")
    if mode not in CP_MODES:
        raise UserError(f"layout cp_mode must be one of {', '.join(CP_MODES)}, got {mode!r}")
    if cp == 1:
        return
    chunks = 2 * cp if mode == "ring" else cp
    if seq_len % chunks:
        raise UserError(f"cp_mode={mode} splits each sequence into {chunks} chunks: sequence length ({seq_len}) is "
                        f"not divisible by {chunks}")
    if mode == "ulysses":
        for what, n in (("heads", heads), ("kv heads", kv_heads)):
            if (n // tp if n >= tp else 1) % cp:
                raise UserError(f"cp_mode=ulysses needs {what} per tp rank ({n} / tp {tp}) divisible by cp ({cp})")


def ring_bytes(tokens: int, kv_width: int, elem: int, acc_elem: int, cp: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends for one ring-attention call (module docstring)."""
    if cp == 1:
        return 0, 0
    chunk = 2 * tokens * kv_width * elem
    return (cp - 1) * chunk, (cp - 1) * chunk + cp * 2 * tokens * kv_width * acc_elem


def ulysses_bytes(tokens: int, q_width: int, kv_width: int, elem: int, cp: int) -> tuple[int, int, int]:
    """(forward, backward, the forward's input part) bytes one rank sends for one Ulysses call: the all-to-alls of
    q, k, v (one message when they have the same width, else q and k/v apart) and of the output; each sends
    (cp - 1) / cp of its buffer (counted per message, rounded down, as `CommStats` does). The input part is what a
    selective recomputation sends again: torch's checkpoint stops recomputing once the core's saved tensors exist,
    before the output all-to-all."""
    if cp == 1:
        return 0, 0, 0

    def a2a(width: int) -> int:
        return int((cp - 1) / cp * tokens * width * elem)

    ins = a2a(q_width + 2 * kv_width) if q_width == kv_width else a2a(q_width) + a2a(2 * kv_width)
    total = ins + a2a(q_width)
    return total, total, ins


@dataclass(frozen=True)
class CpStepBytes:
    """Bytes one rank sends per optimizer step, by `CommStats` kind."""

    ring: int = 0
    all_to_all: int = 0

    def as_metrics(self) -> dict[str, int]:
        """As the trainer logs them: `comm_cp.ring_bytes`, `comm_cp.all_to_all_bytes` (only the kinds that occur)."""
        out = {}
        if self.ring:
            out["comm_cp.ring_bytes"] = self.ring
        if self.all_to_all:
            out["comm_cp.all_to_all_bytes"] = self.all_to_all
        return out


def recomputed_forwards(cfg: Config) -> tuple[int, int]:
    """(whole extra forwards, extra forwards of the attention core alone) of each attention call per micro-batch:
    full / every:k recomputation and a reversible block's backward run the block's forward again; selective
    recomputation runs the core again."""
    from scaletrain.config.parse import parse_recompute

    kind = parse_recompute(cfg.memory.recompute).kind
    return int(kind in ("full", "every")) + int(bool(cfg.model.reversible)), int(kind == "attn-core")


def step_bytes(cfg: Config, layers: int | None = None) -> CpStepBytes:
    """What our engine sends for context parallelism in one step on a rank holding `layers` attention layers (all
    of them, or a pipeline stage's): per micro-batch and layer the ring's or Ulysses' bytes, the forward's sent
    again for each recomputation (`recomputed_forwards`). Exact for every layout the engine runs (tested against
    the trainer's `comm_cp.*_bytes`)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp <= 1:
        return CpStepBytes()
    width = m.d_model // 2 if m.reversible else m.d_model
    q_width = width // p.tp
    kv_width = q_width  # grouped-query attention: the key/value heads' width, when the model has them
    kv_heads = getattr(m, "n_kv_heads", 0) or 0
    if kv_heads:  # a rank's key/value heads: kv / tp, or one head copied over tp / kv ranks when tp > kv
        kv_width = max(kv_heads // p.tp, 1) * (width // m.n_heads)
    elem = {"fp32": 4, "fp64": 8, "bf16": 2, "fp16": 2}[t.dtype]
    if t.precision == "autocast-bf16":
        elem = 2
    acc = 8 if elem == 8 else 4
    tokens = t.micro_batch * m.seq_len // p.cp
    micro = p.microbatches or cfg.grad_accum
    layers = m.n_layers // p.pp if layers is None else layers
    calls = micro * layers
    whole, core = recomputed_forwards(cfg)
    if p.cp_mode == "ring":  # the ring is one autograd node: a recomputation runs all of it
        f, b = ring_bytes(tokens, kv_width, elem, acc, p.cp)
        return CpStepBytes(ring=calls * ((1 + whole + core) * f + b))
    f, b, ins = ulysses_bytes(tokens, q_width, kv_width, elem, p.cp)
    return CpStepBytes(all_to_all=calls * ((1 + whole) * f + core * ins + b))


def exposed_ring_time(transfer: float, block: float, cp: int) -> float:
    """Seconds of one ring pass not hidden by compute: cp - 1 transfers, each overlapped with one block."""
    return (cp - 1) * max(0.0, transfer - block) if cp > 1 else 0.0


def attention_kind(lay, attention: str) -> str:
    """The attention kernel whose activations a layout keeps: ring attention is blockwise (a flash kernel's
    log-sum-exp only), whatever `attention` the run's single-device kernel is."""
    return "flash" if lay.cp > 1 and lay.cp_mode == "ring" else attention


def as_reduction_layout(lay):
    """The layout as gradient reduction and ZeRO see it: dp x cp data-parallel ranks (cp's ranks hold the same
    weights), for the data-parallel and optimizer terms of the step time."""
    return replace(lay, dp=lay.dp * lay.cp, cp=1) if lay.cp > 1 else lay


def layer_comm(m, gpu, lay, a, tokens: float, elem: int, t_attn: float) -> tuple[float, float, tuple[float, float]]:
    """(exposed forward seconds, exposed backward seconds, (forward, backward) bytes) of one layer's attention call
    on one rank for `tokens` local tokens, whose attention core takes `t_attn` seconds forward. The ring's transfers
    overlap its blocks (the last accumulator hop home does not); Ulysses' all-to-alls are exposed."""
    cp, t = lay.cp, lay.tp
    if cp <= 1:
        return 0.0, 0.0, (0.0, 0.0)
    bw, lat = group_link(gpu, cp, t, a)  # cp ranks sit next to tp: a ring of ranks t apart
    q_width = m.width / t
    kv_width = max(m.kv_heads / t, 1) * m.head_dim  # a key/value head is copied over tp / kv ranks when tp > kv
    if lay.cp_mode == "ring":
        acc = 8 if elem == 8 else 4
        chunk = 2 * tokens * kv_width * elem
        grads = 2 * tokens * kv_width * acc
        fwd = exposed_ring_time(lat + chunk / bw, t_attn / cp, cp)
        bwd = exposed_ring_time(lat + (chunk + grads) / bw, 2 * t_attn / cp, cp) + lat + grads / bw
        return fwd, bwd, ((cp - 1) * chunk, (cp - 1) * chunk + cp * grads)
    ins, out = tokens * (q_width + 2 * kv_width) * elem, tokens * q_width * elem
    each = gather_time(ins, cp, (bw, lat), "all_to_all") + gather_time(out, cp, (bw, lat), "all_to_all")
    sent = (cp - 1) / cp * (ins + out)
    return each, each, (sent, sent)
