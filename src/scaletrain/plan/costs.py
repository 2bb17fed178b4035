"""The planner's cost model: parameters, FLOPs, memory per category, communication and step time.

One module, so that every number the planner prints comes from one formula, each with its paper:

- Parameters: exact count from the dimensions, the form of Narayanan et al. (Megatron-LM 2021,
  arXiv 2104.04473) eq. 2, P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)), generalised to SwiGLU, grouped-query
  attention, untied heads, bias-free norms and experts; split over tp (Megatron-LM, arXiv 1909.08053),
  pp stages and ep ranks.
- FLOPs: model FLOPs per step 3 x forward, forward per token and layer 2 x (matmul parameters) + 4sh
  (attention scores and values, the full s x s square as in arXiv 2104.04473 eq. 3 and Korthikanti et al.
  arXiv 2205.05198 App. A); hardware FLOPs add the recomputed forward (full) or attention core (selective).
- Memory: model states per ZeRO stage (Rajbhandari et al., arXiv 1910.02054 Sec. 5: (2+2+K)Psi, Pos
  4Psi + K Psi/Nd, Pos+g 2Psi + (2+K)Psi/Nd, Pos+g+p (2+2+K)Psi/Nd); activations per layer from
  Korthikanti et al. (arXiv 2205.05198 eqs. 1-6: sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t +
  5as/(ht)) with tp, sbh/t (34 + 5as/h) with tp + sp, 34 sbh/t with selective recompute, 2sbh(/t) per layer
  with full recompute), written term by term so that SwiGLU, GQA, dropout-free models, flash attention
  and fp32 elements follow; times the layers in flight of the pipeline schedule.
- Mixture of experts (GShard arXiv 2006.16668, Switch arXiv 2101.03961): total vs active parameters
  (E bias-free expert MLPs per MoE layer, k active plus the router), expert FLOPs over capacity_factor x
  k slots per token (empty slots are computed; model FLOPs count k), expert states sharded over ep and
  replicated over tp (our engine), and per MoE layer and microbatch 2 all-to-alls forward and 2 backward
  of capacity_factor x k x tokens x d_model x bytes x (ep-1)/ep on the ep group's link.
- Communication: alpha-beta model with ring factors (all-reduce 2(n-1)/n, reduce-scatter / all-gather
  (n-1)/n, all-to-all (n-1)/n; Thakur et al. 2005, Patarasuk & Yuan 2009), placed on the node topology
  with Megatron's rank order tp (fastest) - ep - dp - pp.
- Compute time: GEMM time at an efficiency fraction of peak plus a memory-bound term for the
  element-wise work (see `Assumptions`); pipeline time from the schedule's closed form (agreeing with
  `scaletrain.parallel.pipeline.simulate` when it is installed, see `pipeline_time`).
- ZeRO-3: the exposed part of the per-unit all-gathers and reduce-scatters with one unit of prefetch
  (`zero3_exposed_time`, arXiv 1910.02054 Sec. 7.2.2, FSDP arXiv 2304.11277).

Our own runs are predicted exactly by `plan.run_memory` (memory, through `predict_run`) and
`plan.run_time` (step time after `--calibrate`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from scaletrain.config.schema import OFFLOADS, RECOMPUTE_KINDS
from scaletrain.config.schema import SCHEDULES as _SCHEDULES
from scaletrain.errors import UserError
from scaletrain.optim.registry import OPTIMIZERS as OPTIMIZER_SPECS
from scaletrain.optim.registry import optimizer_spec
from scaletrain.plan.catalog import ModelSpec
from scaletrain.plan.hardware import GPU

RECOMPUTE = tuple(k for k in RECOMPUTE_KINDS if k != "every")  # and every:k (segments of k blocks, arXiv 1604.06174)


def recompute_kind(spec: str) -> tuple[str, int]:
    """("none" | "selective" | "full", k): `every:k` recomputes like `full` but keeps one input per k
    blocks (k = 1 for the others)."""
    if spec.startswith("every:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return "full", k
    if spec in RECOMPUTE:
        return spec, 1
    raise UserError(f"recompute must be one of {', '.join(RECOMPUTE)} or every:k, got {spec!r}")
SCHEDULES = ("1f1b", *(s for s in _SCHEDULES if s != "1f1b"))  # the config's, 1F1B (the default) listed first
OFFLOAD = OFFLOADS
# bytes per element of parameters / gradients / activations, and K (optimizer bytes per parameter)
DTYPES = {
    "bf16": (2, 2, 2, 12),  # mixed precision Adam: fp32 master + m + v = 12 (ZeRO paper, K = 12)
    "fp16": (2, 2, 2, 12),
    "fp32": (4, 4, 4, 8),  # plain Adam in fp32: m + v
    "fp64": (8, 8, 8, 16),
}


@dataclass(frozen=True)
class Training:
    global_batch: int
    dtype: str = "bf16"
    attention: str = "flash"
    """`flash` (no s x s scores stored, fused kernel) or `standard` (scores, softmax, dropout stored)."""
    dp_overlap: bool = True
    """Gradient reduction overlapped with the backward pass (PyTorch DDP buckets); Megatron-LM 2021 and
    Korthikanti 2022 did not overlap."""
    optimizer_k: float | None = None
    """Optimizer bytes per parameter, sharded by ZeRO; None = what `optimizer` keeps in this dtype."""
    optimizer: str = "adamw"
    """adamw (two moments), adafactor (factored second moment, Shazeer & Stern arXiv 1804.04235) or sm3
    (one accumulator per row and per column, Anil et al. arXiv 1901.11150); see `optimizer_bytes`."""
    first_moment: bool = False
    """Adafactor with beta1 / SM3 with momentum: one more element-wise state per parameter."""
    grad_bytes: int | None = None
    """Bytes per gradient element; None = the dtype's (2 in bf16/fp16; our engine keeps fp32 buffers: 4)."""
    param_bytes: int | None = None
    """Bytes per parameter element; None = the dtype's (autocast keeps fp32 parameters, 4, with bf16 compute)."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    offload: str = "none"
    tp_mode: str = "1d"
    """`1d` (Megatron), `2d`, `2.5d`, `3d` (plan/tp_nd.py)."""
    tp_depth: int = 1
    """The depth d of tp_mode=2.5d."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("dp", "tp", "pp", "ep", "zero", "micro_batch", "recompute",
                                               "schedule", "virtual_stages", "sequence_parallel", "offload",
                                               "tp_mode", "tp_depth")}

    def short(self) -> str:
        mode = "" if self.tp_mode == "1d" else f"({self.tp_mode}" + (f" d{self.tp_depth})" if self.tp_depth > 1
                                                                      else ")")
        s = f"dp{self.dp} tp{self.tp}{mode} pp{self.pp}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        s += f" z{self.zero} mb{self.micro_batch} {self.recompute}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.sequence_parallel:
            s += " sp"
        if self.offload != "none":
            s += f" off:{self.offload}"
        return s


@dataclass(frozen=True)
class Assumptions:
    """The constants of the time model. Each is a stated assumption, not a measurement."""

    link_efficiency: float = 0.8
    """Fraction of the link bandwidth a large NCCL collective reaches (bus bandwidth / link)."""
    gemm_half_dim: float = 64.0
    """GEMM efficiency falls as d/(d + d0) with the sharded hidden size d = h/t (small GEMMs are slower)."""
    attn_efficiency: float = 0.5
    """Unfused attention batched matmuls (QK^T, AV) run at this fraction of the GEMM efficiency."""
    mem_traffic: float = 2.0
    """HBM bytes moved by the element-wise work of a forward pass per byte of activations it stores
    (each stored tensor written once and read once); backward moves twice that."""
    hbm_efficiency: float = 0.8
    tp_overlap: float = 0.0
    """Fraction of backward tp communication hidden behind weight-gradient GEMMs."""
    fragmentation: float = 0.05
    """Allocator fragmentation allowance, a fraction of everything else (ZeRO-R's M_D)."""
    reserved_bytes: float = 1.0 * (1 << 30)
    """CUDA context, NCCL and cuBLAS workspaces per GPU."""
    bucket_bytes: float = 25 * (1 << 20)
    """DP gradient bucket (PyTorch DDP default 25 MiB), two in flight."""
    cpu_adam_params_per_s: float = 1.0e9
    """CPU Adam throughput per GPU's share of host cores (ZeRO-Offload, arXiv 2101.06840)."""
    nvme_read_bw: float = 1.6e9
    """offload=nvme: NVMe read bytes/s per GPU's share of the node's drives (a DGX-2 of ZeRO-Infinity,
    arXiv 2104.07857 Sec. 8: ~25 GB/s over 16 GPUs). `scaletrain plan --config --calibrate` measures our own."""
    nvme_write_bw: float = 1.0e9
    """offload=nvme: NVMe write bytes/s per GPU's share."""
    zero3_style: str = "prefetch"
    """How the ZeRO-3 implementation moves parameters (`zero3_exposed_time`). `prefetch`: one all-gather
    per layer, issued one layer ahead, gradients reduce-scattered while the backward goes on (our engine,
    PyTorch FSDP arXiv 2304.11277, DeepSpeed since its coalesced collectives of late 2021). `per-tensor`:
    DeepSpeed ZeRO-3 up to v0.4 (the runs of arXiv 2104.04473 Table 2): one all-gather per weight behind a
    device synchronise, so only the next weight's gather hides behind the current compute; weights are
    gathered again for the recomputed forward, and each gradient reduce-scatter is waited for."""
    zero3_link_bw: float | None = None
    """Per-GPU bandwidth (bytes/s) ZeRO-3's collectives reach over a dp group that spans nodes; None = a
    ring over all the node's NICs (`group_link`). Set it from a measurement of your implementation."""


DEFAULT_ASSUMPTIONS = Assumptions()


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    position: int
    layer_tp: float
    """Per layer, split over tp: attention and dense-MLP matrices and column-parallel biases."""
    layer_rep: float
    """Per layer, replicated over tp: norms, row-parallel biases, the router."""
    layer_expert: float
    """Per layer, all experts together (split over ep, replicated over tp as in our engine).

    The three per-layer counts are means over the layers when only every `moe_every`-th one is MoE."""
    final_norm: int
    head: int
    """Untied output projection (0 when tied to the embedding)."""
    tensors: int
    """Number of parameter tensors (AdamW keeps one `step` scalar per tensor)."""

    @property
    def per_layer(self) -> int:
        return self.layer_tp + self.layer_rep + self.layer_expert


@functools.lru_cache(maxsize=256)
def param_counts(m: ModelSpec) -> ParamCounts:
    d, h, f, b = m.d_model, m.width, m.ffn, int(m.bias)  # stream and block widths (h < d: reversible blocks)
    kv = m.kv_heads * m.head_dim
    qkv = h * (h + 2 * kv) + b * (h + 2 * kv)
    proj_w, proj_b = h * h, b * h
    norm = h * (1 + b)
    n_mats = 3 if m.mlp == "swiglu" else 2
    mlp_tp = n_mats * h * f + b * (n_mats - 1) * f  # column-parallel biases split with their matrix
    mlp_rep = b * h  # the down-projection bias
    tensors_attn = 2 * (1 + b) + 2 * (1 + b)  # qkv, proj, ln1, ln2 (weight [+ bias])
    tensors_mlp = n_mats * (1 + b)
    L, Lm = m.n_layers, m.n_moe_layers
    dense = (qkv + proj_w + mlp_tp, proj_b + 2 * norm + mlp_rep, 0)
    # MoE block: attention as dense; router Linear(h, E, bias=False); E bias-free expert MLPs, stacked
    moe = (qkv + proj_w, proj_b + 2 * norm + h * m.n_experts, m.n_experts * n_mats * h * f)
    layer_tp, layer_rep, layer_expert = (((L - Lm) * d + Lm * x) / L for d, x in zip(dense, moe))
    tensors_layers = (L - Lm) * (tensors_attn + tensors_mlp) + Lm * (tensors_attn + n_mats + 1)
    position = m.seq_len * d if m.position == "learned" else 0
    head = 0 if m.tie_embeddings else m.vocab_size * d
    tensors = 1 + (position > 0) + tensors_layers + (1 + b) + (head > 0)
    return ParamCounts(m.vocab_size * d, position, layer_tp, layer_rep, layer_expert, d * (1 + b), head, tensors)


def total_params(m: ModelSpec) -> int:
    c = param_counts(m)
    return int(round(c.embedding + c.position + m.n_layers * c.per_layer + c.final_norm + c.head))


def expert_params(m: ModelSpec) -> int:
    """Parameters of one expert MLP (bias-free)."""
    return (3 if m.mlp == "swiglu" else 2) * m.width * m.ffn if m.n_experts else 0


def active_params(m: ModelSpec) -> int:
    """Parameters a token passes through: the dense part, the routers and k experts per MoE layer
    (k = top_k; expert choice: its expected c). Capacity padding is not a parameter (see FLOPs)."""
    if not m.n_experts:
        return total_params(m)
    return int(round(total_params(m) - m.n_moe_layers * (m.n_experts - m.top_k) * expert_params(m)))


@dataclass(frozen=True)
class StageParams:
    dense: float
    """Parameters on one rank that are replicated over the whole dp group."""
    expert: float
    """Expert parameters on one rank (replicated over dp / ep ranks only)."""

    @property
    def total(self) -> float:
        return self.dense + self.expert


def stage_params(m: ModelSpec, lay: Layout) -> tuple[StageParams, StageParams]:
    """Parameters held by one rank of the first and of the last pipeline stage."""
    c = param_counts(m)
    t, lps = lay.tp, m.n_layers / lay.pp
    layers = lps * (c.layer_tp / t + c.layer_rep)
    expert = lps * c.layer_expert / lay.ep  # experts replicated over tp (docs/moe.md)
    emb = c.embedding / t  # vocabulary-parallel embedding
    first = layers + emb + c.position
    if lay.pp == 1:
        return (StageParams(first + c.final_norm + c.head / t, expert),) * 2
    # The last stage holds the output projection; a tied one is a copy of the embedding (Megatron).
    last = layers + c.final_norm + (c.head / t if c.head else emb)
    return StageParams(first, expert), StageParams(last, expert)


# --------------------------------------------------------------------------- FLOPs


def layer_matmul_flops(m: ModelSpec, padded: bool = True) -> tuple[float, float]:
    """Forward matmul FLOPs per token of the whole model's blocks: (split over tp: attention and dense
    MLPs, replicated over tp: routers and experts). An MoE layer's experts compute `expert_slots_per_token`
    rows per token when `padded` (capacity_factor x k: empty capacity slots are computed too, GShard /
    Switch), k rows otherwise (the useful work, for model FLOPs / MFU)."""
    h, f = m.width, m.ffn
    kv = m.kv_heads * m.head_dim
    attn_mats = h * (h + 2 * kv) + h * h
    mlp = (3 if m.mlp == "swiglu" else 2) * h * f
    L, Lm = m.n_layers, m.n_moe_layers
    rows = m.expert_slots_per_token if padded else m.top_k
    return 2.0 * (L * attn_mats + (L - Lm) * mlp), 2.0 * Lm * (mlp * rows + h * m.n_experts)


def forward_flops_per_token(m: ModelSpec, padded: bool = True) -> tuple[float, float, float]:
    """(layer matmuls, attention core, logits) forward FLOPs per token for the whole model."""
    split, rep = layer_matmul_flops(m, padded)
    return split + rep, 4.0 * m.n_layers * m.seq_len * m.width, 2.0 * m.vocab_size * m.d_model


def step_flops(m: ModelSpec, tokens: float, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one optimizer step over `tokens` tokens. Model FLOPs count the
    routed tokens' expert work (6 N_active per token plus attention); hardware FLOPs also the empty
    capacity slots and the recomputation (reversible blocks run every layer's forward again in backward)."""
    mats, attn, logits = forward_flops_per_token(m, padded=False)
    model = 3.0 * (mats + attn + logits) * tokens
    padded = forward_flops_per_token(m)[0]
    extra = {"none": 0.0, "selective": attn, "full": padded + attn}[recompute] + (padded + attn) * m.reversible
    return model, model + (3.0 * (padded - mats) + extra) * tokens


# --------------------------------------------------------------------------- activations


def layer_activation_bytes(m: ModelSpec, tokens: float, t: int, sp: bool, recompute: str, attention: str,
                           elem: int) -> float:
    """Bytes one layer keeps for backward for `tokens` tokens of one microbatch (Korthikanti eq. 1-6).

    Term by term (e = bytes per element, masks 1 byte, per token): replicated over tp unless sp:
    ln1 input e.h, qkv input e.h, ln2 input e.h, mlp input e.h, two dropout masks h;
    split over tp: Q,K e(h+kv), V e.kv, attention output e.h, MLP 2e.f (gelu: fc out, gelu out;
    swiglu: 4e.f); attention core (standard, split over tp): softmax e.as, dropout mask as, dropout
    output e.as. With e=2, f=4h, kv=h and dropout this is exactly sbh(10 + 24/t + 5as/(ht)).
    """
    h, f, a, s = m.width, m.ffn, m.n_heads, m.seq_len
    kv = m.kv_heads * m.head_dim
    drop = 1 if m.dropout else 0
    if recompute == "full":
        return elem * h * tokens / (t if sp else 1)  # the block input only (2sbh in 16-bit)
    mlp_elems = (4 if m.mlp == "swiglu" else 2) * f
    rep = 4 * elem * h + 2 * drop * h
    split = elem * (h + 2 * kv) + elem * h
    if attention == "standard" and recompute != "selective":
        core = (elem * (1 + drop) + drop) * a * s
    else:
        core = 4 * a  # flash attention / selective: only the fp32 log-sum-exp per head and token
    dense = tokens * ((rep / t if sp else rep) + (split + core) / t)
    frac = m.n_moe_layers / m.n_layers
    moe = frac * moe_layer_bytes_per_token(m, elem) / (t if sp else 1)  # sp: each tp rank routes its shard
    return dense + tokens * ((1 - frac) * elem * mlp_elems / t + moe)


def moe_layer_bytes_per_token(m: ModelSpec, elem: int) -> float:
    """What an MoE layer saves in place of the MLP's hidden activations, per token (replicated over tp):
    per expert slot (capacity_factor x k of them) the dispatched input, the expert hidden (2f or 4f) and
    the expert output; per token a padded copy of the input, the router's fp32 logits and probabilities
    and log-sum-exp (2E + 1), and 2k int64 indices (chosen experts, slots). `plan.run_memory.
    moe_layer_extra_bytes` counts our layer's tensors exactly (with the slot tables' rounding)."""
    r = max(elem, 4)
    slots = m.expert_slots_per_token
    hidden = (4 if m.mlp == "swiglu" else 2) * m.ffn
    return slots * elem * (hidden + 2 * m.width) + elem * m.width + r * (2 * m.n_experts + 1) + 16 * m.top_k


def inflight_chunks(schedule: str, p: int, m: int, v: int) -> int:
    """Peak microbatch-chunks whose activations rank 0 holds (the most loaded rank).

    GPipe: all m; 1F1B, ZB-H1 and 2BW: min(p, m) (PipeDream-flush, arXiv 2006.09503; ZB-H1 keeps 1F1B's
    memory, arXiv 2401.10241); interleaved: Megatron's warm-up (p-1)*2 + (v-1)*p plus the one in steady
    state, i.e. L(1 + (p-1)/(pv)) layers' worth (Korthikanti Sec. 4.2.3).
    """
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved" and v > 1:
        return min(m * v, 2 * (p - 1) + (v - 1) * p + 1)
    return min(p, m)


def pipeline_time(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float = 0.0) -> float:
    """Time of one step's pipeline for per-microbatch stage times t_f (forward), t_b (backward for
    inputs, or the whole backward when t_w = 0) and t_w (backward for weights); closed forms:

    GPipe / 1F1B: (m + p - 1)(t_f + t_b + t_w) (GPipe arXiv 1811.06965, bubble (p-1)/(m+p-1));
    interleaved with v chunks: (m + (p-1)/v)(t_f + t_b + t_w) (arXiv 2104.04473 Sec. 2.2.2);
    ZB-H1: m(t_f + t_b + t_w) + (p-1) max(t_f + t_b - t_w, t_f) (arXiv 2401.10241 Sec. 3);
    2BW: no flush between steps, so in steady state m(t_f + t_b + t_w) per step (arXiv 2006.09503);
    the simulator, which runs one isolated step, adds the fill and drain (p-1)(t_f + t_b + t_w) once.
    These agree with `scaletrain.parallel.pipeline.simulate` for uniform stage times
    (tests/test_plan_search.py); the planner uses the closed forms because they cost nothing.
    """
    work = t_f + t_b + t_w
    if p == 1 or schedule == "2bw":
        return m * work
    if schedule == "interleaved":
        return (m + (p - 1) / v) * work
    if schedule == "zb-h1":  # the W passes cannot fill more than the forward warm-up leaves
        return m * work + (p - 1) * max(t_f + t_b - t_w, t_f)
    return (m + p - 1) * work


# --------------------------------------------------------------------------- communication


def group_link(gpu: GPU, size: int, stride: int, a: Assumptions) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a ring over `size` ranks spaced `stride` apart.

    A group inside one node runs on NVLink. A group that spans nodes is limited by the InfiniBand NICs
    of its members in each node (NCCL runs one ring per NIC), never more than NVLink.
    """
    gpn = gpu.gpus_per_node
    if size * stride <= gpn:
        return gpu.intra_bw * a.link_efficiency, gpu.intra_latency
    per_node = max(1, gpn // stride) if stride < gpn else 1
    return min(gpu.intra_bw, gpu.inter_bw * per_node) * a.link_efficiency, gpu.inter_latency


@dataclass(frozen=True)
class MeasuredLink:
    """A link given by collectives timed where the run will issue them (`plan/run_comm.py`): per kind
    (all_reduce, all_gather, reduce_scatter, p2p), (bytes, seconds) pairs measured on the run's group
    after the run's compute between two collectives. Sizes between two measured ones are interpolated
    linearly; beyond the largest, the alpha-beta increment of (bw, latency) is added; a kind that was not
    measured falls back to alpha-beta. Indexes like the (bandwidth, latency) tuple links."""

    bw: float
    latency: float
    table: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    launch: tuple[tuple[str, float], ...] = ()
    """Per kind, the time an asynchronous collective keeps the calling thread before it returns (its
    launch); the compute clock pays it for every collective it issues and does not wait for."""

    overlap: tuple[tuple[str, float], ...] = ()
    """Per kind, the overlap efficiency: the fraction of an asynchronous collective's time that concurrent
    compute hides (`run_comm.overlap_efficiency`). 1 (what a GPU's separate communication engine comes
    close to) when not measured; on CPU ranks that have one core each the transport threads take their
    time from the compute, and measured values are well below 1."""

    def __getitem__(self, i: int) -> float:
        return (self.bw, self.latency)[i]

    def launch_time(self, kind: str) -> float:
        return dict(self.launch).get(kind, 0.0)

    def overlap_efficiency(self, kind: str) -> float:
        return dict(self.overlap).get(kind, 1.0)

    def time(self, kind: str, nbytes: float, n: int) -> float:
        ab = allreduce_time if kind == "all_reduce" else gather_time
        plain = (self.bw, self.latency)
        points = dict(self.table).get(kind)
        if not points:
            return ab(nbytes, n, plain) if kind != "p2p" else self.latency + nbytes / self.bw
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        b_max, t_max = points[-1]
        if kind == "p2p":
            return t_max + (nbytes - b_max) / self.bw
        return t_max + ab(nbytes, n, plain) - ab(b_max, n, plain)


def overlap_efficiency(link, kind: str) -> float:
    """`MeasuredLink.overlap_efficiency` of a link; 1 (perfect overlap) for an alpha-beta link."""
    return link.overlap_efficiency(kind) if isinstance(link, MeasuredLink) else 1.0


def allreduce_time(nbytes: float, n: int, link: tuple[float, float] | MeasuredLink) -> float:
    if n <= 1:
        return 0.0
    if isinstance(link, MeasuredLink):
        return link.time("all_reduce", nbytes, n)
    return 2 * (n - 1) / n * nbytes / link[0] + 2 * (n - 1) * link[1]


def gather_time(nbytes: float, n: int, link: tuple[float, float] | MeasuredLink, kind: str = "all_gather") -> float:
    """All-gather, reduce-scatter (`kind`) or all-to-all of `nbytes` (the full tensor) over n ranks."""
    if n <= 1:
        return 0.0
    if isinstance(link, MeasuredLink):
        return link.time(kind, nbytes, n)
    return (n - 1) / n * nbytes / link[0] + (n - 1) * link[1]


def zero3_exposed_time(root_bytes: float, block_bytes: list[float], grad_ratio: float, block_f: float,
                       block_b: float, embed_f: float, head_f: float, head_b: float, embed_b: float, n: int,
                       link: tuple[float, float] | MeasuredLink, style: str = "prefetch",
                       block_r: float = 0.0) -> float:
    """Communication time ZeRO-3 adds to one microbatch beyond its compute (Rajbhandari et al., arXiv
    1910.02054 Sec. 7.2.2; the schedule of our `parallel.zero` and of FSDP, arXiv 2304.11277 Sec. 3.3).

    Units: the root (embeddings, final norm, head: `root_bytes` of 16-bit parameters) and each block
    (`block_bytes`, forward order). Each unit's parameters are all-gathered before its forward and again
    before its backward, and its gradients (`grad_ratio` x its parameter bytes) are reduce-scattered after
    its backward. Prefetch is one unit ahead: the gather of unit i+1 is issued when unit i starts, so it
    hides behind at most unit i's compute; the root is gathered with nothing to hide behind, once before
    the forward and once before the backward. All collectives share one link and run in issue order
    (a FIFO channel, as one NCCL/gloo stream does); each costs alpha-beta time with the ring latency
    (n-1) alpha, so many small units are latency-bound. Returns the time the compute waits, found by
    running the two clocks (compute, channel) through the step's issue order, plus the part of the
    collective time the compute covered that it does not hide: 1 - the link's overlap efficiency of
    each kind (`MeasuredLink.overlap`; nothing for an alpha-beta link, which assumes perfect overlap).

    `style="per-tensor"` (DeepSpeed ZeRO-3 up to v0.4, `Assumptions.zero3_style`): the same forward; in
    the backward a block whose forward is recomputed (`block_r` of its `block_b` seconds) is gathered
    before the recomputation and again before its backward (the recomputed forward releases it), and the
    compute waits for each block's gradient reduce-scatter before it goes on.
    """
    if n <= 1:
        return 0.0
    measured = isinstance(link, MeasuredLink)
    launch_g = link.launch_time("all_gather") if measured else 0.0  # compute-thread cost of async issues
    launch_rs = link.launch_time("reduce_scatter") if measured else 0.0
    g = [gather_time(b, n, link) for b in block_bytes]
    rs = [gather_time(b * grad_ratio, n, link, "reduce_scatter") for b in block_bytes]
    g_root = gather_time(root_bytes, n, link)
    rs_root = gather_time(root_bytes * grad_ratio, n, link, "reduce_scatter")
    L = len(block_bytes)
    ch = 0.0  # when the channel is free
    ready = [0.0] * L
    unhidden = 0.0  # sum over collectives of duration x (1 - overlap efficiency of its kind)
    total = 0.0
    keep_g, keep_rs = 1.0 - overlap_efficiency(link, "all_gather"), 1.0 - overlap_efficiency(link, "reduce_scatter")

    def issue(at: float, dur: float, keep: float = keep_g) -> float:
        nonlocal ch, unhidden, total
        ch = max(ch, at) + dur
        unhidden += keep * dur
        total += dur
        return ch

    tc = issue(0.0, g_root)  # forward: the root, then block 0 prefetched behind the embedding
    if L:
        ready[0] = issue(tc, g[0])
        tc += launch_g
    tc += embed_f
    for i in range(L):
        tc = max(tc, ready[i])
        if i + 1 < L:
            ready[i + 1] = issue(tc, g[i + 1])
            tc += launch_g
        tc += block_f
    tc += head_f
    tc = issue(tc, g_root)  # backward: the root again (released after the forward), the last block prefetched
    if L:
        ready[L - 1] = issue(tc, g[L - 1])
        tc += launch_g
    tc += head_b
    per_tensor = style == "per-tensor"
    for i in reversed(range(L)):
        tc = max(tc, ready[i])
        if per_tensor and block_r > 0:  # gathered again behind the recomputation
            again = issue(tc, g[i])
            tc = max(tc + block_r, again)
        if i > 0:
            ready[i - 1] = issue(tc, g[i - 1])
            tc += launch_g
        tc += block_b - (block_r if per_tensor else 0.0)
        done = issue(tc, rs[i], keep_rs)
        tc = done if per_tensor else tc + launch_rs
    tc += embed_b
    tc = max(tc, issue(tc, rs_root, keep_rs))
    exposed = max(tc - (embed_f + L * block_f + head_f + head_b + L * block_b + embed_b), 0.0)
    # what the two clocks let the compute hide, it hides only by the overlap efficiency: the rest of the
    # covered collective time is paid by the compute (its share of that time, weighted by kind)
    covered = max(total - exposed, 0.0)
    return exposed + (unhidden / total if total else 0.0) * covered


# --------------------------------------------------------------------------- the estimate


@dataclass
class Estimate:
    layout: Layout
    microbatches: int
    memory: dict[str, float]
    capacity: float
    step_time_s: float = math.inf
    tokens_per_s: float = 0.0
    model_tflops_per_gpu: float = 0.0
    hardware_tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    bubble_fraction: float = 0.0
    comm_bytes: dict[str, float] = field(default_factory=dict)
    time_breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.capacity

    @property
    def over_by(self) -> float:
        return self.memory["total"] - self.capacity

    @property
    def dominant(self) -> str:
        if not self.time_breakdown:
            return "-"
        return max(self.time_breakdown, key=self.time_breakdown.get)

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "fits": self.fits,
            "memory_bytes": {k: int(round(v)) for k, v in self.memory.items()},
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "comm_bytes_per_step": {k: int(round(v)) for k, v in self.comm_bytes.items()},
            "time_breakdown_s": self.time_breakdown,
            "microbatches": self.microbatches,
            "dominant_cost": self.dominant,
        }


def check_layout(m: ModelSpec, train: Training, lay: Layout, n_gpus: int | None = None) -> int:
    """Raise UserError for an impossible layout; return the number of microbatches per dp rank."""
    for name in ("dp", "tp", "pp", "ep", "micro_batch", "virtual_stages"):
        if getattr(lay, name) < 1:
            raise UserError(f"layout {name} must be >= 1, got {getattr(lay, name)}")
    if n_gpus is not None and lay.world != n_gpus:
        raise UserError(f"layout dp ({lay.dp}) x tp ({lay.tp}) x pp ({lay.pp}) = {lay.world}"
                        f" does not match --gpus ({n_gpus})")
    if lay.tp_mode != "1d" or lay.tp_depth != 1:  # 2d / 2.5d / 3d: the grid's own constraints
        from scaletrain.plan import tp_nd

        tp_nd.check_layout(m, lay)
    elif m.n_heads % lay.tp:
        raise UserError(f"heads ({m.n_heads}) is not divisible by tp ({lay.tp})")
    elif m.kv_heads % lay.tp and lay.tp % m.kv_heads:
        raise UserError(f"kv heads ({m.kv_heads}) and tp ({lay.tp}) do not divide each other")
    chunks = lay.pp * lay.virtual_stages
    if m.n_layers % chunks:
        raise UserError(f"layers ({m.n_layers}) is not divisible by pp ({lay.pp}) x virtual_stages"
                        f" ({lay.virtual_stages}) = {chunks}")
    if lay.zero not in (0, 1, 2, 3):
        raise UserError(f"zero must be 0, 1, 2 or 3, got {lay.zero}")
    recompute_kind(lay.recompute)
    if lay.schedule not in SCHEDULES:
        raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {lay.schedule!r}")
    if lay.offload not in OFFLOAD:
        raise UserError(f"offload must be one of {', '.join(OFFLOAD)}, got {lay.offload!r}")
    if lay.offload in ("params", "nvme") and lay.zero != 3:
        raise UserError(f"offload={lay.offload} needs zero=3")
    if lay.virtual_stages > 1 and lay.schedule != "interleaved":
        raise UserError(f"virtual_stages ({lay.virtual_stages}) > 1 needs schedule=interleaved")
    if lay.ep > 1 and (not m.n_experts or m.n_experts % lay.ep or lay.dp % lay.ep):
        raise UserError(f"ep ({lay.ep}) must divide experts ({m.n_experts}) and dp ({lay.dp})")
    if lay.sequence_parallel and lay.tp == 1:
        raise UserError("sequence_parallel needs tp > 1")
    split = lay.micro_batch * lay.dp
    if train.global_batch % split:
        raise UserError(f"global batch ({train.global_batch}) is not divisible by micro_batch"
                        f" ({lay.micro_batch}) x dp ({lay.dp}) = {split}")
    mbs = train.global_batch // split
    if lay.schedule == "interleaved" and lay.pp > 1 and mbs % lay.pp:
        raise UserError(f"interleaved schedule needs microbatches ({mbs}) divisible by pp ({lay.pp})")
    return mbs


OPTIMIZERS = tuple(name for name, spec in OPTIMIZER_SPECS.items() if spec.sharded)  # the ones layouts can shard


def factored_statistics(m: ModelSpec) -> float:
    """Numbers Adafactor / SM3 keep per parameter for their factored statistics: rows + columns of every
    matrix (an n x m matrix keeps n + m, not n·m) over the model's elements, weighted like the parameters.
    Our engine keeps them whole on every rank under ZeRO (`parallel/zero_factored.py`); they are tiny
    (about 2/d_model of the parameters)."""
    d, h, f, kv = m.d_model, m.width, m.ffn, m.kv_heads * m.head_dim
    n_mats = 3 if m.mlp == "swiglu" else 2
    layer = (h + h + 2 * kv) + 2 * h + n_mats * (h + f)
    position = m.seq_len + d if m.position == "learned" else 0
    rows_cols = m.n_layers * layer + (m.vocab_size + d) * (1 + (not m.tie_embeddings)) + position
    return rows_cols / total_params(m)


def optimizer_bytes(m: ModelSpec, train: Training) -> tuple[float, float]:
    """(bytes per parameter sharded by ZeRO, bytes per parameter kept whole on every rank) of the
    optimizer state. AdamW: K = 12 under bf16/fp16 (fp32 master, m, v; ZeRO paper), 2x the element size
    otherwise. Adafactor / SM3: the fp32 master under bf16/fp16, an optional first moment, and their
    factored statistics (replicated)."""
    pb, _, _, k_default = DTYPES[train.dtype]
    if train.optimizer_k is not None:
        return train.optimizer_k, 0.0
    if not optimizer_spec(train.optimizer).factored:  # AdamW: K of the dtype
        return k_default, 0.0
    state = 4 if pb == 2 else pb
    master = 4 if pb == 2 else 0
    return master + state * train.first_moment, state * factored_statistics(m)


def memory_model_states(psi: float, dp: int, zero: int, param_b: float = 2, grad_b: float = 2,
                        k: float = 12, psi_expert: float = 0.0, edp: int = 1) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per device under ZeRO stage `zero` (arXiv 1910.02054 Sec. 5.1).

    Expert parameters are replicated over `edp` = dp / ep ranks only, so they shard over edp.
    """
    def shard(n: float, on: bool) -> float:
        return psi / dp + psi_expert / edp if on else n

    full = psi + psi_expert
    params = shard(full, zero >= 3) * param_b
    grads = shard(full, zero >= 2) * grad_b
    optim = shard(full, zero >= 1) * k
    return params, grads, optim


def estimate(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions = DEFAULT_ASSUMPTIONS,
             n_gpus: int | None = None, memory_only: bool = False) -> Estimate:
    """Memory, time and communication of one layout. Raises UserError for impossible layouts."""
    mbs = check_layout(m, train, lay, n_gpus)
    pb, gb, eb, _ = DTYPES[train.dtype]
    gb, pb = train.grad_bytes or gb, train.param_bytes or pb
    k, k_whole = optimizer_bytes(m, train)
    t, p, v, b, s, h = lay.tp, lay.pp, lay.virtual_stages, lay.micro_batch, m.seq_len, m.d_model
    edp = lay.dp // lay.ep
    first, last = stage_params(m, lay)
    tokens = b * s
    if lay.tp_mode != "1d":  # 2d / 2.5d / 3d (plan/tp_nd.py): their parameters per rank
        from scaletrain.plan import tp_nd

        if lay.tp_mode == "2.5d":  # the same bytes and times as 2d with d times the dp (tp_nd.as_2d)
            return replace(estimate(m, gpu, train, tp_nd.as_2d(lay), a, n_gpus, memory_only), layout=lay)
        first, last = tp_nd.stage_params(m, lay)

    # ---- memory of the most loaded rank (first or last stage)
    # (the grid modes split every activation over the t ranks: Korthikanti's fully partitioned form, as with sp)
    sp = lay.sequence_parallel or lay.tp_mode != "1d"
    kind, seg = recompute_kind(lay.recompute)
    layer_act = layer_activation_bytes(m, tokens, t, sp, kind, train.attention, eb)
    layers_per_chunk = m.n_layers / (p * v)
    chunks = inflight_chunks(lay.schedule, p, mbs, v)
    acts = layer_act * layers_per_chunk * chunks / seg  # every:k keeps one input per segment of k blocks
    if kind == "full":  # one segment's full activations live while it is recomputed
        acts += seg * layer_activation_bytes(m, tokens, t, sp, "none", train.attention, eb)
    sp_div = t if sp else 1
    if m.reversible:  # a chunk keeps its output stream; one layer's activations live while it is rebuilt
        acts = chunks * tokens * eb * h / sp_div + layer_act
    # first stage: embedding output (+ dropout mask) per in-flight microbatch; last stage: final norm
    # and head inputs plus fp32 logits for the loss, 4sbv/t (Korthikanti Sec. 4.3)
    first_extra = tokens * (eb + (1 if m.dropout else 0)) * h / sp_div * min(chunks, mbs)
    last_extra = tokens * (2 * eb * h / sp_div + 4 * m.vocab_size / t)
    pc = param_counts(m)
    rows = []
    stages = ((first, acts + first_extra + last_extra),) if p == 1 else \
        ((first, acts + first_extra), (last, acts + last_extra))
    for st, stage_acts in stages:
        params, grads, optim = memory_model_states(st.dense, lay.dp, lay.zero, pb, gb, k, st.expert, edp)
        optim += (st.dense + st.expert) * k_whole
        if lay.offload != "none":
            optim = 0.0
        buffers = 0.0
        if lay.zero == 3 and p > 1:  # with pp the stage's parameters stay gathered for the step (16-bit)
            buffers += st.total * pb
            if lay.offload == "params":
                params = 0.0
        elif lay.zero == 3:  # two gathered layers (current + prefetch) in 16-bit
            per_layer = pc.layer_tp / t + pc.layer_rep + pc.layer_expert / lay.ep
            buffers += 2 * per_layer * pb
            if lay.offload == "params":
                params = 0.0
        if lay.offload == "nvme":  # ZeRO-Infinity: only staging buffers stay (offload_costs.resident_bytes)
            from scaletrain.parallel.zero_nvme import STEP_CHUNK

            params = grads = optim = 0.0
            layer_shard = (pc.layer_tp / t + pc.layer_rep + pc.layer_expert / lay.ep) / lay.dp
            buffers += 3 * layer_shard * (pb + gb) + 3 * min(STEP_CHUNK, layer_shard) * (k + gb)
        if lay.dp > 1 and lay.zero < 3:
            buffers += 2 * a.bucket_bytes
        if p > 1:  # send/recv buffers of one activation each way
            buffers += 2 * tokens * h * eb / sp_div
        rows.append((params, grads, optim, stage_acts, buffers))
    params, grads, optim, act_bytes, buffers = max(rows, key=sum)
    core = params + grads + optim + act_bytes + buffers
    buffers += a.reserved_bytes + a.fragmentation * core
    memory = {"params": params, "grads": grads, "optimizer": optim, "activations": act_bytes,
              "buffers": buffers}
    memory["total"] = sum(memory.values())
    est = Estimate(lay, mbs, memory, gpu.memory_bytes)
    if memory_only:
        return est
    _time(est, m, gpu, train, lay, a, first, last, mbs, k)
    return est


def _time(est: Estimate, m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions,
          first: StageParams, last: StageParams, mbs: int, k: float) -> None:
    pb, gb, eb, _ = DTYPES[train.dtype]
    gb, pb = train.grad_bytes or gb, train.param_bytes or pb
    t, p, v, b, s, h = lay.tp, lay.pp, lay.virtual_stages, lay.micro_batch, m.seq_len, m.d_model
    tokens = b * s
    n_gpus = lay.world
    peak = gpu.peak_flops
    nd = lay.tp_mode != "1d"  # 2d / 3d (plan/tp_nd.py): a rank's GEMMs are h/q wide, every activation is split
    d = m.width / t if not nd else m.width / round(t ** (0.5 if lay.tp_mode == "2d" else 1 / 3))
    eff = gpu.gemm_efficiency * d / (d + a.gemm_half_dim)
    hbm = gpu.hbm_bandwidth * a.hbm_efficiency
    mats_split, mats_rep = layer_matmul_flops(m)
    _, attn, logits = forward_flops_per_token(m)
    lps = m.n_layers / p

    # ---- one layer (the mean over dense and MoE layers), one microbatch
    t_gemm = tokens * (mats_split / t + mats_rep) / m.n_layers / (peak * eff)
    attn_eff = eff * (a.attn_efficiency if train.attention == "standard" else 1.0)
    t_attn = tokens * attn / m.n_layers / t / (peak * attn_eff)
    sp = lay.sequence_parallel or nd
    stored = layer_activation_bytes(m, tokens, t, sp, "none", train.attention, eb)
    t_mem = a.mem_traffic * stored / hbm
    tp_link = group_link(gpu, t, 1, a)
    msg = tokens * m.width * eb  # a sub-layer's output (half the stream with reversible blocks)
    t_tp = 2 * allreduce_time(msg, t, tp_link)  # 2 all-reduces (or AG + RS pairs with sp) per pass
    if nd:  # the grid's collectives per layer, each on its group's link
        from scaletrain.plan import tp_nd

        t_tp, t_tp_nd_b = tp_nd.layer_comm_time(lay.tp_mode, t, tp_nd.dims_of(m, b, eb), gpu, a)
    # expert all-to-alls: dispatch + combine of capacity_factor x k slots per token, on the ep group (ranks
    # t apart: intra- or inter-node by `group_link`), per MoE layer; n_moe = the MoE share of the layers
    n_moe = m.n_moe_layers / m.n_layers
    ep_link = group_link(gpu, lay.ep, t, a)
    a2a_bytes = msg * m.expert_slots_per_token
    t_ep = n_moe * 2 * gather_time(a2a_bytes, lay.ep, ep_link)
    f_layer = t_gemm + t_attn + t_mem
    recompute = {"none": 0.0, "full": f_layer + t_tp + t_ep,
                 "selective": t_attn + (a.mem_traffic * (stored - layer_activation_bytes(
                     m, tokens, t, sp, "selective", train.attention, eb)) / hbm)}
    r_layer = recompute[recompute_kind(lay.recompute)[0]] + recompute["full"] * m.reversible
    t_tp_b = (t_tp_nd_b if nd else t_tp) * (1 - a.tp_overlap)

    # ---- stage level (the slower of the first and the last stage)
    t_logits = tokens * logits / t / (peak * eff) + a.mem_traffic * tokens * 4 * m.vocab_size / t / hbm
    fwd = lps * (f_layer + t_tp + t_ep)
    bwd = lps * (2 * f_layer + t_tp_b + t_ep + r_layer)
    w_part = lps * t_gemm  # weight-gradient GEMMs (the zero-bubble W pass)
    fwd_last, bwd_last = fwd + t_logits, bwd + 2 * t_logits
    t_f, t_b = max(fwd, fwd_last), max(bwd, bwd_last)
    pp_bytes = tokens * h * eb / t  # Megatron's scatter/gather of the p2p message over tp ranks
    pp_link = group_link(gpu, p, t * lay.dp, a)
    t_pp = 0.0
    if p > 1:
        t_pp = v * (pp_bytes / pp_link[0] + pp_link[1])
    t_f += t_pp
    t_b += t_pp
    if lay.schedule == "zb-h1":
        t_pipe = pipeline_time(lay.schedule, p, mbs, v, t_f, t_b - w_part, w_part)
    else:
        t_pipe = pipeline_time(lay.schedule, p, mbs, v, t_f, t_b)
    busy = mbs * (t_f + t_b)
    bubble = max(t_pipe - busy, 0.0)

    # ---- data parallel / ZeRO communication, exposed part
    dp_link = group_link(gpu, lay.dp, t, a)
    if lay.zero == 3 and a.zero3_link_bw is not None and lay.dp * t > gpu.gpus_per_node:
        dp_link = (a.zero3_link_bw, dp_link[1])
    edp = lay.dp // lay.ep
    edp_link = group_link(gpu, edp, t * lay.ep, a)
    st = max(first, last, key=lambda x: x.total)
    dense_b, expert_b = st.dense * gb, st.expert * gb
    dp_bytes = 0.0
    t_dp = 0.0
    window = t_b if train.dp_overlap else 0.0
    if lay.dp > 1:
        if lay.zero <= 1:
            ar = allreduce_time(dense_b, lay.dp, dp_link) + allreduce_time(expert_b, edp, edp_link)
            t_dp = max(ar - window, 0.0)
            dp_bytes = 2 * (lay.dp - 1) / lay.dp * dense_b + 2 * (edp - 1) / max(edp, 1) * expert_b
        elif lay.zero == 2:  # reduce-scatter every microbatch, all-gather of the params after the step
            rs = gather_time(dense_b, lay.dp, dp_link) + gather_time(expert_b, edp, edp_link)
            ag = gather_time(st.dense * pb, lay.dp, dp_link) + gather_time(st.expert * pb, edp, edp_link)
            t_dp = mbs * max(rs - window, 0.0) + ag
            dp_bytes = (lay.dp - 1) / lay.dp * (mbs * dense_b + st.dense * pb) + \
                (edp - 1) / max(edp, 1) * (mbs * expert_b + st.expert * pb)
        elif lay.pp > 1:  # ZeRO-3 under pp: the stage gathered once per step (exposed), ZeRO-2's reduce-scatters
            rs = gather_time(dense_b, lay.dp, dp_link) + gather_time(expert_b, edp, edp_link)
            ag = gather_time(st.dense * pb, lay.dp, dp_link) + gather_time(st.expert * pb, edp, edp_link)
            t_dp = mbs * max(rs - window, 0.0) + ag
            dp_bytes = (lay.dp - 1) / lay.dp * (mbs * dense_b + st.dense * pb) + \
                (edp - 1) / max(edp, 1) * (mbs * expert_b + st.expert * pb)
        else:  # ZeRO-3: per-layer all-gathers in forward and backward and reduce-scatters, every microbatch
            pc = param_counts(m)
            layer = pc.layer_tp / t + pc.layer_rep
            root = max(st.total - lps * (layer + pc.layer_expert / lay.ep), 0.0)
            t_dp = mbs * zero3_exposed_time(
                root * pb, [layer * pb] * int(round(lps)), gb / pb, f_layer + t_tp + t_ep,
                2 * f_layer + t_tp_b + t_ep + r_layer, 0.0, fwd_last - fwd, bwd_last - bwd, 0.0, lay.dp, dp_link,
                a.zero3_style, r_layer if recompute_kind(lay.recompute)[0] == "full" else 0.0)
            if st.expert:  # experts shard over dp / ep: their gathers, on their own group, assumed hidden
                t_dp += mbs * max(3 * gather_time(st.expert * pb, edp, edp_link) - t_f - t_b, 0.0)
            gathers = 3 if a.zero3_style == "per-tensor" and recompute_kind(lay.recompute)[0] == "full" else 2
            dp_bytes = mbs * ((lay.dp - 1) / lay.dp * (gathers * st.dense * pb + dense_b) +
                              (edp - 1) / max(edp, 1) * (2 * st.expert * pb + expert_b))

    # ---- optimizer step and offload
    shard = st.dense / (lay.dp if lay.zero >= 1 else 1) + st.expert / (edp if lay.zero >= 1 else 1)
    t_opt, t_off = 0.0, 0.0
    if lay.offload == "none":
        t_opt = shard * (2 * k + gb + pb + 4) / hbm  # read m, v, master, grad; write them and the param
    elif lay.offload == "nvme":  # disk I/O behind the compute, the step streamed (offload_costs.step_time)
        from scaletrain.parallel.zero_nvme import STEP_CHUNK
        from scaletrain.plan.offload_costs import step_time

        pc = param_counts(m)
        layer = (pc.layer_tp / t + pc.layer_rep + pc.layer_expert / lay.ep) / lay.dp
        units = [max(shard - lps * layer, 1.0)] + [layer] * int(round(lps))
        exposed, streamed = step_time(units, pb, pb == 2, gb, mbs, True, a.nvme_read_bw, a.nvme_write_bw, t_pipe,
                                      shard / a.cpu_adam_params_per_s, STEP_CHUNK)
        t_off = exposed + streamed + 2 * mbs * st.total * pb / (gpu.host_bw * a.link_efficiency)
    else:
        t_off = shard * (gb + pb) / (gpu.host_bw * a.link_efficiency) + shard / a.cpu_adam_params_per_s
        if lay.offload == "params":
            t_off += 2 * mbs * st.total * pb / (gpu.host_bw * a.link_efficiency)

    step = t_pipe + t_dp + t_opt + t_off
    model_f, hw_f = step_flops(m, train.global_batch * s, recompute_kind(lay.recompute)[0])
    est.step_time_s = step
    est.tokens_per_s = train.global_batch * s / step
    est.model_tflops_per_gpu = model_f / step / n_gpus / 1e12
    est.hardware_tflops_per_gpu = hw_f / step / n_gpus / 1e12
    est.mfu = model_f / step / n_gpus / peak
    est.bubble_fraction = bubble / t_pipe if t_pipe else 0.0
    comp = lps * 3 * f_layer + t_logits * 3
    recomp = lps * r_layer
    tp_c = lps * (t_tp + t_tp_b)
    ep_c = lps * 2 * t_ep
    share = busy / max(mbs * (comp + recomp + tp_c + ep_c + 2 * t_pp), 1e-30)
    est.time_breakdown = {
        "compute": mbs * comp * share, "recompute": mbs * recomp * share, "tp_comm": mbs * tp_c * share,
        "ep_comm": mbs * ep_c * share, "pp_comm": mbs * 2 * t_pp * share, "bubble": bubble,
        "dp_comm": t_dp, "optimizer": t_opt, "offload": t_off,
    }
    tp_bytes = 0.0
    if t > 1 and nd:
        per_layer = tp_nd.layer_comm_bytes(lay.tp_mode, t, tp_nd.dims_of(m, b, eb), 1, recompute_kind(lay.recompute)[0])
        tp_bytes = mbs * lps * sum(per_layer.values())
    elif t > 1:
        n_coll = 4 + (2 if recompute_kind(lay.recompute)[0] == "full" or m.reversible else 0)
        tp_bytes = mbs * lps * n_coll * 2 * (t - 1) / t * msg
    ep_bytes = mbs * lps * n_moe * 4 * (lay.ep - 1) / lay.ep * a2a_bytes if lay.ep > 1 else 0.0
    pp_total = mbs * 2 * v * pp_bytes if p > 1 else 0.0
    est.comm_bytes = {"dp": dp_bytes, "tp": tp_bytes, "pp": pp_total, "ep": ep_bytes,
                      "offload": (shard * (gb + pb) if lay.offload != "none" else 0.0)}


def with_assumptions(a: Assumptions, **kw) -> Assumptions:
    return replace(a, **kw)


# --------------------------------------------------------------------------- our own runs (exact)


def implementation_activation_bytes(m: ModelSpec, batch: int, elem: int) -> float:
    """Bytes our `scaletrain.model.gpt.GPT` saves for backward for one forward of `batch` sequences
    (distinct storages seen by `saved_tensors_hooks`, parameters excluded) when the token ids are one
    (batch, seq_len) int64 tensor that is also the target: the count of `plan.run_memory` for a plain
    single-process forward, without the trainer's loader batch. `elem` is 4 (fp32), 8 (fp64) or 2 (bf16)."""
    from scaletrain.config import Config, ModelConfig
    from scaletrain.plan import run_memory

    cfg = Config(model=ModelConfig(
        n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=m.seq_len, vocab_size=m.vocab_size,
        d_ff=m.d_ff, mlp=m.mlp, position=m.position, tie_embeddings=m.tie_embeddings, bias=m.bias,
        dropout=0.1 if m.dropout else 0.0))
    cfg.train.dtype = {4: "fp32", 8: "fp64", 2: "bf16"}[elem]
    cfg.train.micro_batch = cfg.train.global_batch = batch
    loader_batch = 8 * batch * (m.seq_len + 1)  # the trainer's ids are views of it; here ids are targets
    return run_memory.activation_bytes(cfg) - loader_batch


def predict_run(cfg) -> dict:
    """The planner's memory prediction for a scaletrain run config, per rank, in bytes: what the trainer
    will log as `mem_params`, `mem_grads`, `mem_optim` (exact to the byte, for every layout the engine
    runs: dp, ZeRO 0-3 with padding and offload, tp with the padded vocabulary, pp stages, fp32 / fp64 /
    bf16 / fp16 with fp32 masters and gradient buffers, AdamW / Adafactor / SM3) and `mem_activations`
    (exact without dropout, within 10% with it; left out with activation compression, which is not
    modelled, and for MoE layers with router noise, random routing or expert dropout). MoE layers: exact
    for every router, dtype and layout (`run_memory.moe_layer_extra_bytes`). See `scaletrain.plan.run_memory`.
    """
    from scaletrain.plan import run_memory

    states = run_memory.model_state_bytes(cfg)
    out = {f"plan_mem_{k}": int(v) for k, v in states.items()}
    if run_memory.predicts_activations(cfg):
        out["plan_mem_activations"] = int(run_memory.activation_bytes(cfg))
    return out
