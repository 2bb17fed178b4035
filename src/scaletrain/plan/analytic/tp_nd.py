"""The planner's model of 2D, 2.5D and 3D tensor parallelism: communication per layer and memory per rank
(the exact bytes of our own runs: `plan/exact/tp_nd_memory.py`).

Papers: Optimus (2D, Xu et al., arXiv 2104.05343), Tesseract (2.5D, Wang et al., arXiv 2105.14500), 3D (Bian et
al., arXiv 2105.14450); Megatron's 1D (arXiv 1909.08053) for comparison. The engine is `parallel.tensor_nd`.

Communication (`layer_collectives`): every collective one transformer layer issues for one micro-batch, forward
and backward, with its group, buffer size and count, written from the algorithms (per linear layer in -> out,
n = the rank's tokens, e = bytes per element, q the grid side):

    2D / 2.5D (SUMMA, per linear)   forward   q broadcasts of the X block (n x in/q) along the row and of the W
                                              block (out/q x in/q) along the column
                                    backward  dX: q broadcasts of W, q reduces of the dX block (n x in/q);
                                              dW: q broadcasts of X, q reduces of the dW block
                                    per rank (q-1) blocks per product: broadcasts (q-1) e (2 n in/q + 2 in out/q^2),
                                    reduces (q-1) e (n in/q + in out/q^2); n = B T / q (2D), B T / (d q) (2.5D)
    3D (per linear)                 forward   all-gather X (n q x in/q rows), all-gather W over the depth,
                                              reduce-scatter Y (n q x out/q)
                                    backward  all-gather dY, re-gather X and W (our deviation, tp3d.py),
                                              reduce-scatter dX and dW; n = B T / q^2
    1D (Megatron)                   4 all-reduces of the (B T x h) activation per layer (2 forward, 2 backward)

plus, per layer, the layer norms' statistics (two all-reduces of one number per token forward, one of two
backward, over the group holding the token's other hidden blocks), and the vectors: 2D all-gathers each bias /
norm weight along the column and reduce-scatters its gradient; 3D all-reduces their gradients over a plane of q^2
ranks. Full recomputation repeats the forward's collectives. The counted bytes per rank follow `tensor_nd.comm`'s
conventions (ring: all-reduce 2(n-1)/n, all-gather / reduce-scatter / one broadcast or reduce (n-1)/n of the
buffer), so `layer_comm_bytes` is what the engine's CommStats measure, to the byte (tests/test_tensor_nd.py).
Time: alpha-beta on each group's link (`comm.group_link`: the row group is q consecutive ranks, the column q
ranks q apart, the depth q^2 apart); the q broadcasts (reduces) of one SUMMA product cost one all-gather
(reduce-scatter) of the q blocks.

Memory: every activation of a layer is split over all t ranks (t = q^2, d q^2, q^3), so the planner's activation
model is Korthikanti et al.'s fully partitioned form (arXiv 2205.05198, the sequence-parallel formula
s b h / t (34 + 5 a s / h)); parameters: 2D and 3D hold 1/t of every matrix, 2.5D 1/q^2 (replicated over the d
depth layers, whose gradients are summed with data parallelism: ZeRO shards over dp x d), 3D keeps vectors as
1/q replicated over q^2 ranks. For our own runs `plan.exact.tp_nd_memory` gives the engine's bytes exactly.

Where each wins (docs/tensor_parallel.md): per layer 1D moves ~8 B T h e bytes per rank whatever t is; 2D moves
~3(q-1)/q^2 e (7 B T h + 12 h^2) (GELU, f = 4h): the activation term falls as 1/q but the weight term 36 h^2/q
does not depend on the batch, so 2D/3D win at large B T / h (many tokens per micro-batch), and whenever 1D's
t spans nodes (its all-reduces then run on the inter-node links while 2D's row groups stay inside a node).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scaletrain.config.schema import TP_MODES
from scaletrain.distributed.grid import GridShape, grid_shape
from scaletrain.errors import UserError
from scaletrain.plan.analytic.comm import allreduce_time, gather_time, group_link
from scaletrain.plan.analytic.inputs import Assumptions, Layout
from scaletrain.plan.analytic.params import StageParams, param_counts
from scaletrain.plan.catalog import ModelSpec
from scaletrain.plan.hardware import GPU


@dataclass(frozen=True)
class Collective:
    kind: str  # broadcast, reduce, all_gather, reduce_scatter, all_reduce
    group: str  # row, col, dep, dep_row, dep_col (the tp grid's groups), tp (1D)
    n: int  # group size
    size: float  # bytes of the buffer of one call (all-gather: its output; reduce-scatter: its input)
    calls: int = 1
    phase: str = "fwd"  # fwd or bwd

    @property
    def sent(self) -> float:
        """Bytes this rank sends over all calls (tensor_nd.comm's conventions)."""
        factor = 2 * (self.n - 1) / self.n if self.kind == "all_reduce" else (self.n - 1) / self.n
        return self.calls * factor * self.size


@dataclass(frozen=True)
class Dims:
    """One micro-batch of a layer: B sequences of T tokens, hidden h, MLP f, heads a, kv width (GQA)."""

    B: int
    T: int
    h: int
    f: int
    mlp: str = "gelu"
    bias: bool = True
    kv: int = 0  # width of k and v (0 = h)
    e: int = 2  # bytes per element of activations and weights
    e32: int = 4  # bytes per element of the layer norms' statistics (fp32 under bf16 / fp16)


def grid(mode: str, tp: int, depth: int = 1) -> GridShape:
    """The grid of `tp` ranks in `mode` (`distributed.grid`); UserError when tp does not form one."""
    s = grid_shape(mode, tp, depth)
    if s is None:
        need = {"2d": "q*q", "2.5d": f"{depth}*q*q", "3d": "q*q*q"}[mode]
        raise UserError(f"tp ({tp}) is not {need} for tp_mode={mode}")
    return s


def _linears(x: Dims) -> list[tuple[int, int, str]]:
    """(in, out, role) of the layer's linears in forward order (role A: qkv / fc / gate / up, B: projections)."""
    qkv = x.h + 2 * (x.kv or x.h)
    mlp = [(x.h, x.f, "A"), (x.h, x.f, "A")] if x.mlp == "swiglu" else [(x.h, x.f, "A")]
    return [(x.h, qkv, "A"), (x.h, x.h, "B"), *mlp, (x.f, x.h, "B")]


def layer_collectives(mode: str, tp: int, x: Dims, depth: int = 1, recompute: str = "none") -> list[Collective]:
    """Every collective of one layer, one micro-batch, forward and backward (module docstring)."""
    out: list[Collective] = []
    if mode == "1d":
        act = x.B * x.T * x.h * x.e
        n_fwd = 2 * (2 if recompute == "full" else 1)
        return [Collective("all_reduce", "tp", tp, act, n_fwd, "fwd"),
                Collective("all_reduce", "tp", tp, act, 2, "bwd")]
    g = grid(mode, tp, depth)
    q = g.q
    n = x.B * x.T // g.row_blocks  # the rank's tokens
    e = x.e
    fwd_times = 2 if recompute == "full" else 1
    for cin, cout, role in _linears(x):
        w = cout * cin // (q * q) * e  # a W block (2D) / a gathered W (3D)
        if mode in ("2d", "2.5d"):
            xb = n * cin // q * e
            out += [Collective("broadcast", "row", q, xb, q * fwd_times),
                    Collective("broadcast", "col", q, w, q * fwd_times),
                    Collective("broadcast", "col", q, w, q, "bwd"), Collective("reduce", "row", q, xb, q, "bwd"),
                    Collective("broadcast", "row", q, xb, q, "bwd"), Collective("reduce", "col", q, w, q, "bwd")]
            if x.bias:
                out += [Collective("all_gather", "col", q, cout // q * e, fwd_times),
                        Collective("reduce_scatter", "col", q, cout // q * e, 1, "bwd")]
        else:
            g_in, g_out = ("row", "col") if role == "A" else ("col", "row")
            xg, yg = n * q * cin // q * e, n * q * cout // q * e  # gathered input, output before the scatter
            out += [Collective("all_gather", g_in, q, xg, fwd_times), Collective("all_gather", "dep", q, w, fwd_times),
                    Collective("reduce_scatter", g_out, q, yg, fwd_times),
                    Collective("all_gather", g_out, q, yg, 1, "bwd"), Collective("all_gather", g_in, q, xg, 1, "bwd"),
                    Collective("all_gather", "dep", q, w, 1, "bwd"),
                    Collective("reduce_scatter", g_in, q, xg, 1, "bwd"),
                    Collective("reduce_scatter", "dep", q, w, 1, "bwd")]
            if x.bias:
                out.append(Collective("all_reduce", "dep_col" if role == "A" else "dep_row", q * q, cout // q * e,
                                      1, "bwd"))
    # two layer norms: statistics along the hidden blocks; their weight and bias
    stat_group = "row" if mode in ("2d", "2.5d") else "col"
    for _ in range(2):
        out += [Collective("all_reduce", stat_group, q, n * x.e32, 2 * fwd_times),
                Collective("all_reduce", stat_group, q, 2 * n * x.e32, 1, "bwd")]
        for _ in range(1 + x.bias):
            if mode in ("2d", "2.5d"):
                out += [Collective("all_gather", "col", q, x.h // q * e, fwd_times),
                        Collective("reduce_scatter", "col", q, x.h // q * e, 1, "bwd")]
            else:
                out.append(Collective("all_reduce", "dep_row", q * q, x.h // q * e, 1, "bwd"))
    return out


def layer_comm_bytes(mode: str, tp: int, x: Dims, depth: int = 1, recompute: str = "none") -> dict[str, float]:
    """Bytes one rank sends per collective kind for one layer and micro-batch (`tp.<kind>` in CommStats)."""
    out: dict[str, float] = {}
    for c in layer_collectives(mode, tp, x, depth, recompute):
        out[f"tp.{c.kind}"] = out.get(f"tp.{c.kind}", 0.0) + c.sent
    return out


def group_strides(mode: str, tp: int, depth: int = 1) -> dict[str, tuple[int, int]]:
    """(size, stride) of each grid group inside the tp group (consecutive global ranks within it)."""
    if mode == "1d":
        return {"tp": (tp, 1)}
    g = grid(mode, tp, depth)
    d, q = g.depth, g.q
    return {"row": (q, 1), "col": (q, q), "dep": (d, q * q), "dep_row": (q * q, 1), "dep_col": (q * q, q)}


def collective_time(c: Collective, link) -> float:
    """Alpha-beta time of all calls of `c` on `link` (a (bandwidth, latency) pair or comm.MeasuredLink)."""
    if c.kind == "all_reduce":
        return c.calls * allreduce_time(c.size, c.n, link)
    if c.kind in ("broadcast", "reduce"):  # q calls of one product = one all-gather (reduce-scatter) of q blocks
        kind = "all_gather" if c.kind == "broadcast" else "reduce_scatter"
        return c.calls * gather_time(c.n * c.size, c.n, link, kind) / c.n
    return c.calls * gather_time(c.size, c.n, link, c.kind)


def layer_comm_time(mode: str, tp: int, x: Dims, gpu: GPU, a: Assumptions, depth: int = 1, recompute: str = "none",
                    tp_stride: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's tp collectives for one micro-batch (recomputation's repeated
    forward collectives are counted in the backward, where they run). `tp_stride`: the tp group's first rank
    spacing (1: Megatron's order, tp innermost)."""
    links = {g: group_link(gpu, size, stride * tp_stride, a) for g, (size, stride) in
             group_strides(mode, tp, depth).items()}
    fwd = bwd = 0.0
    for c in layer_collectives(mode, tp, x, depth, "none"):
        t = collective_time(c, links[c.group])
        if c.phase == "fwd":
            fwd += t
        else:
            bwd += t
    if recompute == "full":
        bwd += fwd
    return fwd, bwd


# --------------------------------------------------------------------------- memory (the planner's model)


def check_layout(m: ModelSpec, lay: Layout) -> None:
    """UserError for a grid layout the engine (or the papers) do not define (see parallel/rules.py, tensor_grid)."""
    if lay.tp_mode not in TP_MODES:
        raise UserError(f"tp_mode must be one of {', '.join(TP_MODES)}, got {lay.tp_mode!r}")
    if lay.tp_mode != "2.5d" and lay.tp_depth != 1:
        raise UserError(f"tp_depth ({lay.tp_depth}) needs tp_mode=2.5d")
    if lay.tp_mode == "1d":
        return
    g = grid(lay.tp_mode, lay.tp, lay.tp_depth)
    d, q = g.depth, g.q
    if q < 2 or (lay.tp_mode == "2.5d" and d < 2):
        raise UserError(f"tp_mode={lay.tp_mode} needs q >= 2 (and tp_depth >= 2 for 2.5d), got tp ({lay.tp})")
    if m.n_heads % q or m.kv_heads % q:
        raise UserError(f"heads ({m.n_heads}) and kv heads ({m.kv_heads}) must be divisible by q ({q}) of "
                        f"tp_mode={lay.tp_mode}")
    if m.d_model % (q * q) or m.ffn % (q * q):
        raise UserError(f"d_model ({m.d_model}) and the MLP size ({m.ffn}) must be divisible by q*q ({q * q}) of "
                        f"tp_mode={lay.tp_mode}")
    rows = g.row_blocks
    if lay.micro_batch % rows:
        raise UserError(f"micro_batch ({lay.micro_batch}) is not divisible by the {rows} sequence blocks of "
                        f"tp_mode={lay.tp_mode}")
    why = f"with tp_mode={lay.tp_mode} is not available"
    if lay.sequence_parallel:
        raise UserError(f"sequence_parallel {why} (the grid splits every activation already)")
    if lay.zero >= 2 or lay.offload != "none":
        raise UserError(f"zero={lay.zero} / offload={lay.offload} {why} (ZeRO-1 is)")
    if lay.pp > 1 and lay.tp_mode != "2d":
        raise UserError(f"pp ({lay.pp}) > 1 {why} (2d is)")
    if lay.pp > 1 and lay.schedule in ("zb-h1", "zb-v", "dualpipev", "2bw"):
        raise UserError(f"schedule={lay.schedule} {why}")
    if lay.ep > 1 or m.n_experts:
        raise UserError(f"mixture-of-experts {why}")
    if m.reversible:
        raise UserError(f"reversible blocks {why}")


def as_2d(lay: Layout) -> Layout:
    """The 2D layout a 2.5D one costs the same as: each of the d depth layers is a q x q SUMMA grid on 1/d of the
    micro-batch's sequences with the same weight blocks, and the depth's gradient sum is a data-parallel
    reduction (tp2p5d.py), so 2.5D (dp, d, q, micro-batch b) moves the bytes and holds the memory of 2D (dp x d,
    q, micro-batch b / d) on the same ranks (the depth fibre is q^2 ranks apart, like the next dp replica)."""
    g = grid(lay.tp_mode, lay.tp, lay.tp_depth)
    d, q = g.depth, g.q
    if lay.micro_batch % d:
        raise UserError(f"micro_batch ({lay.micro_batch}) is not divisible by tp_depth ({d})")
    return replace(lay, tp_mode="2d", tp=q * q, tp_depth=1, dp=lay.dp * d, micro_batch=lay.micro_batch // d)


def dims_of(m: ModelSpec, micro_batch: int, elem: int) -> Dims:
    """The `Dims` of a catalog model's layer for one micro-batch in `elem`-byte elements."""
    return Dims(micro_batch, m.seq_len, m.d_model, m.ffn, m.mlp, m.bias, m.kv_heads * m.head_dim, elem, max(elem, 4))


def stage_params(m: ModelSpec, lay: Layout) -> tuple[StageParams, StageParams]:
    """`params.StageParams` of the first and last pipeline stage's rank: 2D / 2.5D hold 1/q^2 of everything
    (vectors split too), 3D 1/q^3 of every matrix and 1/q of every vector (replicated over q^2 ranks)."""
    c = param_counts(m)
    q = grid(lay.tp_mode, lay.tp, lay.tp_depth).q
    h, b = m.d_model, int(m.bias)
    if lay.tp_mode == "3d":
        vec = c.layer_rep + b * (m.kv_heads * m.head_dim * 2 + h + (2 if m.mlp == "swiglu" else 1) * m.ffn)
        mats = c.per_layer - vec
        per_layer, emb, pos, norm = mats / q**3 + vec / q, c.embedding / q**3, c.position / q, c.final_norm / q
        head = c.head / q**3
    else:
        s = q * q
        per_layer, emb, pos, norm, head = c.per_layer / s, c.embedding / s, c.position / s, c.final_norm / s, c.head / s
    lps = m.n_layers / lay.pp
    first = lps * per_layer + emb + pos
    if lay.pp == 1:
        return (StageParams(first + norm + head, 0.0),) * 2
    last = lps * per_layer + norm + (head if c.head else emb)
    return StageParams(first, 0.0), StageParams(last, 0.0)
