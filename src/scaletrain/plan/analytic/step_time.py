"""Step time of a layout, its parts and what follows from it: tokens/s, model and hardware TFLOP/s per GPU, MFU,
the pipeline bubble, and the bytes each kind of parallelism moves per step.

Compute: GEMM time at an efficiency fraction of peak that falls with the sharded width d as d/(d + d0), unfused
attention at a fraction of that, plus a memory-bound term for the element-wise work (`Assumptions`). tp
collectives are not overlapped (Megatron-LM, arXiv 1909.08053: 2 all-reduces per layer and pass; the grid modes
from `tp_nd`); expert all-to-alls per MoE layer (GShard arXiv 2006.16668). The pipeline from the schedule's
closed form (`pipeline.pipeline_time`). Data parallelism / ZeRO (arXiv 1910.02054): the gradient all-reduce
overlapped with the last backward (PyTorch DDP), ZeRO-2's reduce-scatter per microbatch and parameter all-gather,
ZeRO-3's exposed per-unit collectives (`zero3.zero3_exposed_time`). Then the optimizer step (memory-bound) and
offload (PCIe and CPU Adam, ZeRO-Offload arXiv 2101.06840; NVMe, ZeRO-Infinity arXiv 2104.07857).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

from scaletrain.parallel.pipeline.balance import LayerCosts
from scaletrain.plan.analytic import context, offload_costs, tp_nd
from scaletrain.plan.analytic.comm import allreduce_time, gather_time, group_link
from scaletrain.plan.analytic.flops import attention_kept, forward_flops_per_token, layer_matmul_flops, step_flops
from scaletrain.plan.analytic.inputs import DTYPES, Assumptions, Layout, Training, recompute_policy
from scaletrain.plan.analytic.memory import layer_activation_bytes
from scaletrain.plan.analytic.params import StageParams, block_kinds, param_counts
from scaletrain.plan.analytic.stages import Stages, pipeline_makespan, recomputed_blocks, v_makespan
from scaletrain.plan.analytic.zero3 import zero3_exposed_time
from scaletrain.plan.catalog import ModelSpec
from scaletrain.plan.hardware import GPU


@dataclass(frozen=True)
class LayerTimes:
    """One layer (the mean over dense and MoE layers), one microbatch, on one rank: seconds, and the bytes of
    the messages they come from."""

    gemm: float
    attn: float
    mem: float
    tp_f: float
    """tp collectives of the forward."""
    tp_b: float
    """tp collectives of the backward (exposed part with `Assumptions.tp_comm_overlap`)."""
    ep: float
    """Expert all-to-alls of one pass."""
    recompute: float
    """What a block the policy recomputes runs again in backward: its forward (full, every:k, nth:k's checkpoints),
    all but the kept ops (ops:...), the attention core (attn-core), plus the reversible blocks' rebuild."""
    msg: float
    """Bytes of a sub-layer's output (half the stream with reversible blocks)."""
    a2a_bytes: float
    n_moe: float
    """The MoE share of the layers."""
    eff: float
    """GEMM efficiency at this rank's width."""
    hbm: float
    """Reached HBM bandwidth, bytes/s."""
    tp_raw: float = 0.0
    """tp collectives of one pass before any overlap (what `tp_f` would be with all of it exposed)."""
    cp_f: float = 0.0
    """Context parallelism's exposed communication of the forward (ring steps not hidden, Ulysses' all-to-alls)."""
    cp_b: float = 0.0
    """... of the backward."""
    cp_bytes: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) bytes one rank sends per attention call."""

    @property
    def forward(self) -> float:
        return self.gemm + self.attn + self.mem


@dataclass(frozen=True)
class PipelineTimes:
    """The stage level of one microbatch (the slower of the first and the last stage) and the pipeline's step."""

    logits: float
    fwd: float
    bwd: float
    fwd_last: float
    bwd_last: float
    t_f: float
    t_b: float
    pp: float
    """p2p time of one pass."""
    pp_bytes: float
    pipe: float
    busy: float
    bubble: float
    recompute: float = 0.0
    """Seconds of recomputation per microbatch on the heaviest rank."""
    tp_again: float = 0.0
    """Blocks of the heaviest rank whose forward tp collectives run again in backward."""


@dataclass
class StepCost:
    """The time fields of an `estimate.Estimate`."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    time_breakdown: dict[str, float]
    comm_bytes: dict[str, float]
    notes: tuple[str, ...] = ()


def _elem_bytes(train: Training) -> tuple[int, int, int]:
    """(parameter, gradient, activation) bytes per element of the training settings."""
    pb, gb, eb, _ = DTYPES[train.dtype]
    return train.param_bytes or pb, train.grad_bytes or gb, eb


def layer_times(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions) -> LayerTimes:
    """Compute, memory traffic, tp and ep communication and recomputation of one layer and microbatch."""
    _, _, eb = _elem_bytes(train)
    t, b = lay.tp, lay.micro_batch
    tokens = b * m.seq_len / lay.cp  # context parallelism: this rank's tokens (its attention reads all T keys)
    peak = gpu.peak_flops
    attention = context.attention_kind(lay, train.attention)
    nd = lay.tp_mode != "1d"  # 2d / 3d (tp_nd.py): a rank's GEMMs are h/q wide, every activation is split
    d = m.width / t if not nd else m.width / tp_nd.grid(lay.tp_mode, t).q
    eff = gpu.gemm_efficiency * d / (d + a.gemm_half_dim)
    hbm = gpu.hbm_bandwidth * a.hbm_efficiency
    mats_split, mats_rep = layer_matmul_flops(m)
    _, attn, _ = forward_flops_per_token(m)
    fp8 = train.dtype == "fp8"  # the blocks' linear layers (split over tp) in FP8; experts, routers in bf16
    split_rate = gpu.fp8_flops * gpu.fp8_gemm_efficiency * d / (d + a.gemm_half_dim) if fp8 else peak * eff
    t_gemm = tokens * (mats_split / t / split_rate + mats_rep / (peak * eff)) / m.n_layers
    t_attn = tokens * attn / m.n_layers / t / attention_rate(gpu, attention, a, eff)
    sp = lay.sequence_parallel or nd
    stored = layer_activation_bytes(m, tokens, t, sp, "none", attention, eb)
    traffic = elementwise_traffic(train, a)
    t_mem = traffic * stored / hbm + (fp8_cast_bytes(m, tokens, t) / hbm / 3 if fp8 else 0.0)
    tp_link = group_link(gpu, t, 1, a)
    msg = tokens * m.width * eb  # a sub-layer's output (half the stream with reversible blocks)
    t_tp = t_tp_raw = 2 * allreduce_time(msg, t, tp_link)  # 2 all-reduces (or AG + RS pairs with sp) per pass
    if nd:  # the grid's collectives per layer, each on its group's link
        t_tp, t_tp_nd_b = tp_nd.layer_comm_time(lay.tp_mode, t, tp_nd.dims_of(m, b, eb), gpu, a)
        t_tp_raw = t_tp
    elif t > 1 and lay.sequence_parallel and a.tp_comm_overlap:
        t_tp = tp_exposed(m, tokens, t, allreduce_time(msg, t, tp_link) / 2, peak * eff)
    if fp8 and t > 1 and not nd:  # each FP8 GEMM's scales: the absolute maxima all-reduced over tp (tensorwise)
        scales = 6 * allreduce_time(4, t, tp_link)  # inputs and weights in the forward, gradients and weights back
        t_tp, t_tp_raw = t_tp + scales, t_tp_raw + scales
    # expert all-to-alls: dispatch + combine of capacity_factor x k slots per token, on the ep group (ranks
    # t apart: intra- or inter-node by `group_link`), per MoE layer; n_moe = the MoE share of the layers
    n_moe = m.n_moe_layers / m.n_layers
    ep_link = group_link(gpu, lay.ep, t * lay.cp, a)
    a2a_bytes = msg * m.expert_slots_per_token
    t_ep = n_moe * 2 * gather_time(a2a_bytes, lay.ep, ep_link)
    f_layer = t_gemm + t_attn + t_mem
    cp_f, cp_b, cp_bytes = context.layer_comm(m, gpu, lay, a, tokens, eb, t_attn)
    pol = recompute_policy(lay.recompute)
    full = f_layer + t_tp + t_ep + cp_f  # a recomputed forward sends its cp messages again (context.py)
    if pol.kind == "ops":  # everything but the kept ops' outputs runs again; in-place all-reduces on kept outputs not
        kept_gemm, kept_attn = "matmul" in pol.ops, attention_kept(pol, attention)
        r_block = t_mem + (0.0 if kept_gemm else t_gemm) + (0.0 if kept_attn else t_attn + cp_f) + t_ep + \
            (t_tp if sp or not kept_gemm else 0.0)
    elif pol.kind == "attn-core":  # the attention core again (with flash attention: the kernel's forward again)
        r_block = t_attn + cp_f + traffic * (stored - layer_activation_bytes(
            m, tokens, t, sp, "attn-core", attention, eb)) / hbm
    else:
        r_block = 0.0 if pol.kind == "none" else full
    r_layer = r_block + full * m.reversible
    t_tp_b = t_tp_nd_b if nd else t_tp
    return LayerTimes(t_gemm, t_attn, t_mem, t_tp, t_tp_b, t_ep, r_layer, msg, a2a_bytes, n_moe, eff, hbm, t_tp_raw,
                      cp_f, cp_b, cp_bytes)


def elementwise_traffic(train: Training, a: Assumptions) -> float:
    """HBM bytes the element-wise work of a forward moves per byte of activations it stores: `Assumptions.mem_traffic`
    with fused kernels, `Assumptions.eager_mem_traffic` with PyTorch eager ones (`Training.kernels`)."""
    return a.eager_mem_traffic if train.kernels == "eager" else a.mem_traffic


def attention_rate(gpu: GPU, attention: str, a: Assumptions, eff: float) -> float:
    """FLOP/s at which the attention core's counted FLOPs (the full s x s square, as MFU counts them) are done:
    unfused batched matmuls at `attn_efficiency` of the GEMM rate; the flash kernel at the GPU's
    `flash_efficiency` of peak on the work it executes - half the square for causal attention, 1 forward and 2.5
    backward (its backward recomputes the scores), which is 1.75 of the 3 passes counted - or, for a GPU
    without that figure, at the GEMM rate. `attention` is the kernel the layout runs (`context.attention_kind`:
    ring attention is blockwise flash whatever the run's kernel)."""
    if attention == "standard":
        return gpu.peak_flops * eff * a.attn_efficiency
    if not gpu.flash_efficiency:
        return gpu.peak_flops * eff
    return gpu.peak_flops * gpu.flash_efficiency * 3 / 1.75


def fp8_cast_bytes(m: ModelSpec, tokens: float, t: int) -> float:
    """HBM bytes of one block's FP8 casts for one microbatch, forward and backward, with dynamic tensorwise scaling
    (Micikevicius et al., arXiv 2209.05433; torchao float8): every input of the four linear layers (h, h, h and the
    MLP hidden) and every gradient of their outputs (q k v, h, the MLP hidden, h) read once for its absolute
    maximum and once to write its FP8 copy (2 + 2 + 1 bytes), plus an FP8 transposed copy for the other GEMM that
    uses it (1 + 1 bytes): 7 bytes per element; the weights the same per microbatch."""
    h, f = m.width, m.ffn
    kv = m.kv_heads * m.head_dim
    cols = (2 if m.mlp == "swiglu" else 1) * f
    dense = 1 - m.n_moe_layers / m.n_layers
    acts = (2 * h + (h + 2 * kv) + h + dense * (h + f + cols + h)) / t
    weights = (h * (h + 2 * kv) + h * h + dense * (h * cols + f * h)) / t
    return 7 * (tokens * acts + weights)


def tp_exposed(m: ModelSpec, tokens: float, t: int, collective: float, rate: float) -> float:
    """Exposed seconds of one pass's four sequence-parallel collectives (all-gather before the qkv and first MLP
    GEMMs, reduce-scatter after the attention projection and the second MLP GEMM), each of `collective` seconds,
    decomposed into t chunks around its GEMM (`Assumptions.tp_comm_overlap`): the first chunk's transfer waits, the
    other t - 1 hide behind the GEMM's chunks as far as the GEMM is longer, i.e. c/t + (t - 1)/t max(0, c - g). The
    MLP GEMMs of an MoE block are the experts' (not tp-split, after their all-to-all): its MLP collectives stay
    exposed."""
    h, f = m.width, m.ffn
    kv = m.kv_heads * m.head_dim
    cols = (2 if m.mlp == "swiglu" else 1) * f
    gemms = [2 * h * (h + 2 * kv), 2 * h * h, 2 * h * cols, 2 * f * h]  # qkv, projection, MLP in, MLP out
    dense = 1 - m.n_moe_layers / m.n_layers
    out = 0.0
    for i, flops in enumerate(gemms):
        g = tokens * flops / t / rate
        hidden = collective / t + (t - 1) / t * max(0.0, collective - g)
        out += hidden if i < 2 else dense * hidden + (1 - dense) * collective
    return out


def kind_times(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions,
               lt: LayerTimes) -> tuple[LayerTimes, LayerTimes]:
    """The times of one dense and of one mixture-of-experts block (`lt`, the mean, for models of one kind)."""
    if not m.n_experts or m.moe_every == 1:
        return lt, lt
    return tuple(layer_times(x, gpu, train, lay, a) for x in block_kinds(m))


def logits_time(m: ModelSpec, gpu: GPU, lay: Layout, a: Assumptions, lt: LayerTimes) -> float:
    """Forward of the head on one microbatch: the 2Vh logits GEMM and the fp32 logits' memory traffic (the loss's few
    kernels, the same eager or compiled: `train.compile` compiles the blocks)."""
    tokens = lay.micro_batch * m.seq_len / lay.cp  # context parallelism: this rank's tokens
    _, _, logits = forward_flops_per_token(m)
    t = lay.tp
    return tokens * logits / t / (gpu.peak_flops * lt.eff) + a.mem_traffic * tokens * 4 * m.vocab_size / t / lt.hbm


def block_time_costs(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions) -> LayerCosts:
    """Forward + backward seconds of every block, the embedding and the head (with the loss) on one microbatch: the
    costs `partition=time` balances (the engine profiles the same three on its own rank 0)."""
    from scaletrain.plan.analytic.stages import is_moe_block

    _, _, eb = _elem_bytes(train)
    lt = layer_times(m, gpu, train, lay, a)
    kinds = kind_times(m, gpu, train, lay, a, lt)
    per = [3 * k.forward + k.tp_f + k.tp_b + 2 * k.ep + k.cp_f + k.cp_b + k.recompute for k in kinds]
    blocks = tuple(per[is_moe_block(m, i)] for i in range(m.n_layers))
    tokens = lay.micro_batch * m.seq_len / lay.cp
    embed = 3 * tokens * m.d_model * eb / lt.hbm  # a gather, and its gradient's scatter-add
    return LayerCosts(blocks, embed, 3 * logits_time(m, gpu, lay, a, lt), "s")

def pipeline_times(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions, mbs: int,
                   lt: LayerTimes, st: Stages) -> PipelineTimes:
    """Every stage's forward and backward per microbatch (its blocks, logits on the last, its p2p sends), and the
    pipeline's step time and bubble (`stages.pipeline_makespan`); the fields are the heaviest rank's."""
    _, _, eb = _elem_bytes(train)
    t, p, v = lay.tp, lay.pp, lay.virtual_stages
    tokens = lay.micro_batch * m.seq_len / lay.cp  # context parallelism: this rank's tokens
    t_logits = logits_time(m, gpu, lay, a, lt)
    pp_bytes = tokens * m.d_model * eb / t  # Megatron's scatter/gather of the p2p message over tp ranks
    pp_link = group_link(gpu, p, t * lay.dp * lay.cp, a)
    t_pp = v * (pp_bytes / pp_link[0] + pp_link[1]) if p > 1 else 0.0
    kinds = kind_times(m, gpu, train, lay, a, lt)
    fwd, bwd, wgt = [], [], []
    groups = st.groups
    last = [g.rank == st.last_rank for g in groups]
    pol = recompute_policy(lay.recompute)
    recomp, tp_again = [], []
    for g in groups:
        n, again = (g.dense, g.moe), recomputed_blocks(m, st, g, pol)
        fwd.append(sum(c * (k.forward + k.tp_f + k.ep + k.cp_f) for c, k in zip(n, kinds)))
        recomp.append(sum(r * k.recompute for r, k in zip(again, kinds)))
        bwd.append(sum(c * (2 * k.forward + k.tp_b + k.ep + k.cp_b) for c, k in zip(n, kinds)) + recomp[-1])
        tp_again.append(sum(again) if pol.kind in ("full", "every", "nth") or (
            pol.kind == "ops" and (lay.sequence_parallel or "matmul" not in pol.ops)) else 0.0)
        wgt.append(sum(c * k.gemm for c, k in zip(n, kinds)))  # weight-gradient GEMMs (the zero-bubble W pass)
    f_all = [f + (t_logits if is_last else 0.0) + t_pp for f, is_last in zip(fwd, last)]
    b_all = [b + (2 * t_logits if is_last else 0.0) + t_pp for b, is_last in zip(bwd, last)]
    work = [f + b for f, b in zip(f_all, b_all)]
    fill = [max(f + b - 2 * w, f) for f, b, w in zip(f_all, b_all, wgt)] if lay.schedule in ("zb-h1", "zb-v") else work
    if lay.schedule in ("zb-v", "dualpipev") and p > 1:  # the V schedules' own lists, simulated
        ranks = [i for i, g in enumerate(groups) for _ in range(g.count)]  # groups are in rank order
        t_pipe = v_makespan(lay.schedule, p, mbs, *(tuple(xs[i] for i in ranks) for xs in (
            f_all, [b - w for b, w in zip(b_all, wgt)], wgt)))
    else:
        t_pipe = pipeline_makespan(lay.schedule, p, mbs, v, work, fill, [g.count for g in groups])
    h = max(range(len(groups)), key=lambda i: work[i])
    busy = mbs * work[h]
    return PipelineTimes(t_logits, fwd[h], bwd[h], fwd[h] + t_logits, bwd[h] + 2 * t_logits, f_all[h], b_all[h],
                         t_pp, pp_bytes, t_pipe, busy, max(t_pipe - busy, 0.0), recomp[h], tp_again[h])


def fp8_gather_bytes(train: Training, pb: float) -> float:
    """Bytes per block parameter element ZeRO-3 all-gathers: `pb`, or under train.fp8_all_gather one byte for the
    `train.fp8_gather` fraction that is FP8 weights (measured: tests/test_fp8_layouts.py)."""
    return train.fp8_gather + (1.0 - train.fp8_gather) * pb


def dp_time(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions, st: StageParams, mbs: int,
            lt: LayerTimes, pt: PipelineTimes) -> tuple[float, float]:
    """(exposed seconds, bytes sent per GPU) of the data-parallel / ZeRO communication of one step for the
    stage holding `st`."""
    pb, gb, _ = _elem_bytes(train)
    t = lay.tp
    dp_link = group_link(gpu, lay.dp, t, a)
    if lay.zero == 3 and a.zero3_link_bw is not None and lay.dp * t > gpu.gpus_per_node:
        dp_link = (a.zero3_link_bw, dp_link[1])
    edp = lay.dp // lay.ep
    edp_link = group_link(gpu, edp, t * lay.ep, a)
    dense_b, expert_b = st.dense * gb, st.expert * gb
    dp_bytes = 0.0
    t_dp = 0.0
    window = pt.t_b if train.dp_overlap else 0.0
    if lay.dp <= 1:
        return t_dp, dp_bytes
    if lay.zero <= 1:
        ar = allreduce_time(dense_b, lay.dp, dp_link) + allreduce_time(expert_b, edp, edp_link)
        t_dp = max(ar - window, 0.0)
        dp_bytes = 2 * (lay.dp - 1) / lay.dp * dense_b + 2 * (edp - 1) / max(edp, 1) * expert_b
    elif lay.zero == 2 or lay.pp > 1:
        # ZeRO-2: reduce-scatter every microbatch, all-gather of the params after the step; ZeRO-3 under pp:
        # the stage gathered once per step (exposed) and ZeRO-2's reduce-scatters
        rs = gather_time(dense_b, lay.dp, dp_link) + gather_time(expert_b, edp, edp_link)
        gathered = st.dense * pb  # the stage's parameters, gathered once per step; under fp8_all_gather its blocks'
        if lay.zero == 3 and train.fp8_gather:  # FP8 weights in one byte each
            blocks = min(m.n_layers / lay.pp * (param_counts(m).layer_per_rank(t) - param_counts(m).layer_expert),
                         st.dense)
            gathered -= blocks * (pb - fp8_gather_bytes(train, pb))
        ag = gather_time(gathered, lay.dp, dp_link) + gather_time(st.expert * pb, edp, edp_link)
        t_dp = mbs * max(rs - window, 0.0) + ag
        dp_bytes = (lay.dp - 1) / lay.dp * (mbs * dense_b + gathered) + \
            (edp - 1) / max(edp, 1) * (mbs * expert_b + st.expert * pb)
    else:  # ZeRO-3: per-layer all-gathers in forward and backward and reduce-scatters, every microbatch
        pc = param_counts(m)
        lps = m.n_layers / lay.pp
        layer = pc.layer_per_rank(t) - pc.layer_expert
        split = layer - pc.layer_rep  # the blocks' split (tp and kv) weights
        # FP8 training gathers the blocks' linear weights in FP8 (1 byte, torchao's float8 all-gather) and
        # all-reduces their scales once per step
        gather_pb = (split * 1 + pc.layer_rep * pb) / layer if train.dtype == "fp8" else fp8_gather_bytes(train, pb)
        root = max(st.total - lps * (layer + pc.layer_expert / lay.ep), 0.0)
        full = recompute_policy(lay.recompute).kind in ("full", "every", "nth", "ops")  # checkpoints: gathered again
        f_layer = lt.forward
        t_dp = mbs * zero3_exposed_time(
            root * pb, [layer * gather_pb] * int(round(lps)), gb / gather_pb, f_layer + lt.tp_f + lt.ep,
            2 * f_layer + lt.tp_b + lt.ep + lt.recompute, 0.0, pt.fwd_last - pt.fwd, pt.bwd_last - pt.bwd, 0.0,
            lay.dp, dp_link, a.zero3_style, lt.recompute if full else 0.0, lay.reshards)
        if st.expert:  # experts shard over dp / ep: their gathers, on their own group, assumed hidden
            t_dp += mbs * max(3 * gather_time(st.expert * pb, edp, edp_link) - pt.t_f - pt.t_b, 0.0)
        gathers = 3 if a.zero3_style == "per-tensor" and full else 2 if lay.reshards else 1
        block_w = lps * layer
        dp_bytes = mbs * ((lay.dp - 1) / lay.dp * (gathers * (root * pb + block_w * gather_pb) + dense_b) +
                          (edp - 1) / max(edp, 1) * (2 * st.expert * pb + expert_b))
        if train.dtype == "fp8" or train.fp8_gather:  # the FP8 weights' amaxes, one MAX all-reduce per unit
            t_dp += allreduce_time(4 * 4 * lps, lay.dp, dp_link)
        # each gather and reduce-scatter also moves its unit through HBM, on the compute's time: the shard copied into
        # the collective's buffer, the gathered buffer written, then copied out into the parameters (3 passes of
        # the unit's bytes), the gradients copied into the reduce-scatter's input and read by it (3 passes); as
        # PyTorch FSDP2 does (all_gather_copy_in / foreach_all_gather_copy_out, arXiv 2304.11277)
        t_dp += mbs * 3 * (gathers * (root * pb + block_w * gather_pb) + st.dense * gb) / (
            gpu.hbm_bandwidth * a.hbm_efficiency)
    return t_dp, dp_bytes


def optimizer_time(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions, st: StageParams,
                   mbs: int, k: float, pt: PipelineTimes, lps: float) -> tuple[float, float, float]:
    """(optimizer step seconds, offload seconds, parameters of this rank's shard): the step is memory-bound on
    the GPU; offloaded, it runs on the CPU behind PCIe transfers (or NVMe I/O)."""
    pb, gb, _ = _elem_bytes(train)
    t = lay.tp
    edp = lay.dp // lay.ep
    link_bw = gpu.host_bw * a.link_efficiency
    shard = st.dense / (lay.dp if lay.zero >= 1 else 1) + st.expert / (edp if lay.zero >= 1 else 1)
    t_opt, t_off = 0.0, 0.0
    if lay.offload == "none":
        hbm = gpu.hbm_bandwidth * a.hbm_efficiency
        t_opt = shard * (2 * k + gb + pb + 4) / hbm  # read m, v, master, grad; write them and the param
    elif lay.offload == "nvme":  # disk I/O behind the compute, the step streamed (offload_costs.step_time)
        from scaletrain.config.sizes import NVME_STEP_CHUNK as STEP_CHUNK

        pc = param_counts(m)
        layer = pc.layer_per_rank(t, lay.ep) / lay.dp
        units = [max(shard - lps * layer, 1.0)] + [layer] * int(round(lps))
        exposed, streamed = offload_costs.step_time(units, pb, pb == 2, gb, mbs, True, a.nvme_read_bw,
                                                    a.nvme_write_bw, pt.pipe, shard / a.cpu_adam_params_per_s,
                                                    STEP_CHUNK)
        t_off = exposed + streamed + 2 * mbs * st.total * pb / link_bw
    else:
        t_off = shard * (gb + pb) / link_bw + shard / a.cpu_adam_params_per_s
        if lay.offload == "params":
            t_off += 2 * mbs * st.total * pb / link_bw
    return t_opt, t_off, shard


def step_cost(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions, ranks: list[StageParams],
              stages: Stages, mbs: int, k: float) -> StepCost:
    """The step time of the layout (memory already checked) with its breakdown, rates and bytes moved; `ranks` are
    the parameters of every pipeline rank, `stages` their blocks."""
    pb, gb, eb = _elem_bytes(train)
    t, p, v, s = lay.tp, lay.pp, lay.virtual_stages, m.seq_len
    n_gpus = lay.world
    lps = stages.heaviest_blocks
    lt = layer_times(m, gpu, train, lay, a)
    pt = pipeline_times(m, gpu, train, lay, a, mbs, lt, stages)
    st = max(ranks, key=lambda x: x.total)
    reduce_lay = context.as_reduction_layout(lay)  # gradients reduced and ZeRO-sharded over dp x cp
    t_dp, dp_bytes = dp_time(m, gpu, train, reduce_lay, a, st, mbs, lt, pt)
    t_opt, t_off, shard = optimizer_time(m, gpu, train, reduce_lay, a, st, mbs, k, pt, lps)

    slow = straggler_factor(n_gpus, a.gpu_speed_spread)
    step = (pt.pipe + t_opt) * slow + t_dp + t_off
    pol = recompute_policy(lay.recompute)
    model_f, hw_f = step_flops(m, train.global_batch * s, pol, train.attention)
    comp = lps * 3 * lt.forward + pt.logits * 3
    recomp = pt.recompute
    tp_c = lps * (lt.tp_f + lt.tp_b)
    ep_c = lps * 2 * lt.ep
    cp_c = lps * (lt.cp_f + lt.cp_b)
    share = pt.busy / max(mbs * (comp + recomp + tp_c + ep_c + cp_c + 2 * pt.pp), 1e-30)
    breakdown = {
        "compute": mbs * comp * share, "recompute": mbs * recomp * share, "tp_comm": mbs * tp_c * share,
        "ep_comm": mbs * ep_c * share, "cp_comm": mbs * cp_c * share, "pp_comm": mbs * 2 * pt.pp * share,
        "bubble": pt.bubble,
        "dp_comm": t_dp, "optimizer": t_opt, "offload": t_off, "stragglers": (pt.pipe + t_opt) * (slow - 1),
    }
    tp_bytes = 0.0
    if t > 1 and lay.tp_mode != "1d":
        again = "full" if pol.kind in ("full", "every") else "none"
        per_layer = tp_nd.layer_comm_bytes(lay.tp_mode, t, tp_nd.dims_of(m, lay.micro_batch, eb), 1, again)
        tp_bytes = mbs * lps * sum(per_layer.values())
    elif t > 1:  # 4 collectives per block, 2 more for each whose forward (with its collectives) runs again
        n_coll = 4 + 2 * (pt.tp_again / max(lps, 1) if not m.reversible else 1.0)
        tp_bytes = mbs * lps * n_coll * 2 * (t - 1) / t * lt.msg
    ep_bytes = mbs * lps * lt.n_moe * 4 * (lay.ep - 1) / lay.ep * lt.a2a_bytes if lay.ep > 1 else 0.0
    pp_total = mbs * 2 * v * pt.pp_bytes if p > 1 else 0.0
    cp_f_bytes, cp_b_bytes = lt.cp_bytes
    cp_fwds = 1 + cp_again(pol, pt, lps, context.attention_kind(lay, train.attention)) + m.reversible
    comm = {"dp": dp_bytes, "tp": tp_bytes, "pp": pp_total, "ep": ep_bytes,
            "cp": mbs * lps * (cp_fwds * cp_f_bytes + cp_b_bytes),
            "offload": (shard * (gb + pb) if lay.offload != "none" else 0.0)}
    return StepCost(step, train.global_batch * s / step, model_f / step / n_gpus / 1e12,
                    hw_f / step / n_gpus / 1e12, model_f / step / n_gpus / gpu.peak_flops,
                    pt.bubble / pt.pipe if pt.pipe else 0.0, breakdown, comm, tp_notes(lay, a, lt))


def cp_again(pol, pt: PipelineTimes, lps: float, attention: str) -> float:
    """Extra forwards per block whose context-parallel messages are sent again in backward (context.py): the share
    of the heaviest rank's blocks that are checkpoints (full, every:k, nth:k), the attention core of every block
    with attn-core and with ops:... unless the attention output is kept."""
    if pol.kind in ("full", "every", "nth"):
        return pt.tp_again / max(lps, 1)
    if pol.kind == "attn-core" or (pol.kind == "ops" and not attention_kept(pol, attention)):
        return 1.0
    return 0.0


def straggler_factor(n: int, spread: float) -> float:
    """How much longer a synchronous step of n GPUs computes than one GPU of average speed: 1 + sigma E[max of n
    standard normals] (Blom's approximation Phi^-1((n - 0.375) / (n + 0.25))), sigma = spread / E[range of 8]."""
    if n <= 1 or spread <= 0:
        return 1.0
    return 1.0 + spread / (2 * _expected_max(8)) * _expected_max(n)


def _expected_max(n: int) -> float:
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def tp_notes(lay: Layout, a: Assumptions, lt: LayerTimes) -> tuple[str, ...]:
    """Which tensor-parallel communication the step time assumed exposed."""
    if lay.tp == 1:
        return ()
    if lay.tp_mode != "1d":
        return (f"{lay.tp_mode.upper()} tensor-parallel collectives assumed fully exposed"
                + (" (--tp-overlap models 1D tensor parallelism with sequence parallelism only)" if a.tp_comm_overlap
                   else ""),)
    if not lay.sequence_parallel:
        return ("tensor-parallel all-reduces assumed fully exposed (without sequence parallelism they are not"
                " overlapped)",)
    if not a.tp_comm_overlap:
        return ("tensor-parallel all-gathers and reduce-scatters assumed fully exposed (--tp-overlap models them"
                " decomposed and overlapped with their GEMMs)",)
    share = (lt.tp_f + lt.tp_b) / (2 * lt.tp_raw) if lt.tp_raw else 0.0
    return (f"tensor-parallel communication {share:.0%} exposed: all-gathers and reduce-scatters decomposed into tp"
            " chunks overlapped with their GEMMs (--tp-overlap)",)
