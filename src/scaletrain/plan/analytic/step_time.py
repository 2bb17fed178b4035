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

from scaletrain.plan.analytic import context, offload_costs, tp_nd
from scaletrain.plan.analytic.comm import allreduce_time, gather_time, group_link
from scaletrain.plan.analytic.flops import forward_flops_per_token, layer_matmul_flops, step_flops
from scaletrain.plan.analytic.inputs import DTYPES, Assumptions, Layout, Training, recompute_kind
from scaletrain.plan.analytic.memory import layer_activation_bytes
from scaletrain.plan.analytic.params import StageParams, param_counts
from scaletrain.plan.analytic.pipeline import pipeline_time
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
    """tp collectives of the backward, less what `Assumptions.tp_overlap` hides."""
    ep: float
    """Expert all-to-alls of one pass."""
    recompute: float
    """The recomputed forward (full), attention core (selective), or the reversible blocks' rebuild."""
    msg: float
    """Bytes of a sub-layer's output (half the stream with reversible blocks)."""
    a2a_bytes: float
    n_moe: float
    """The MoE share of the layers."""
    eff: float
    """GEMM efficiency at this rank's width."""
    hbm: float
    """Reached HBM bandwidth, bytes/s."""
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
    t_gemm = tokens * (mats_split / t + mats_rep) / m.n_layers / (peak * eff)
    attn_eff = eff * (a.attn_efficiency if attention == "standard" else 1.0)
    t_attn = tokens * attn / m.n_layers / t / (peak * attn_eff)
    sp = lay.sequence_parallel or nd
    stored = layer_activation_bytes(m, tokens, t, sp, "none", attention, eb)
    t_mem = a.mem_traffic * stored / hbm
    tp_link = group_link(gpu, t, 1, a)
    msg = tokens * m.width * eb  # a sub-layer's output (half the stream with reversible blocks)
    t_tp = 2 * allreduce_time(msg, t, tp_link)  # 2 all-reduces (or AG + RS pairs with sp) per pass
    if nd:  # the grid's collectives per layer, each on its group's link
        t_tp, t_tp_nd_b = tp_nd.layer_comm_time(lay.tp_mode, t, tp_nd.dims_of(m, b, eb), gpu, a)
    # expert all-to-alls: dispatch + combine of capacity_factor x k slots per token, on the ep group (ranks
    # t apart: intra- or inter-node by `group_link`), per MoE layer; n_moe = the MoE share of the layers
    n_moe = m.n_moe_layers / m.n_layers
    ep_link = group_link(gpu, lay.ep, t * lay.cp, a)
    a2a_bytes = msg * m.expert_slots_per_token
    t_ep = n_moe * 2 * gather_time(a2a_bytes, lay.ep, ep_link)
    f_layer = t_gemm + t_attn + t_mem
    cp_f, cp_b, cp_bytes = context.layer_comm(m, gpu, lay, a, tokens, eb, t_attn)
    recompute = {"none": 0.0, "full": f_layer + t_tp + t_ep + cp_f,
                 "selective": t_attn + cp_f + (a.mem_traffic * (stored - layer_activation_bytes(
                     m, tokens, t, sp, "selective", attention, eb)) / hbm)}
    r_layer = recompute[recompute_kind(lay.recompute)[0]] + recompute["full"] * m.reversible
    t_tp_b = (t_tp_nd_b if nd else t_tp) * (1 - a.tp_overlap)
    return LayerTimes(t_gemm, t_attn, t_mem, t_tp, t_tp_b, t_ep, r_layer, msg, a2a_bytes, n_moe, eff, hbm,
                      cp_f, cp_b, cp_bytes)


def pipeline_times(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions, mbs: int,
                   lt: LayerTimes) -> PipelineTimes:
    """A stage's forward and backward per microbatch (logits on the last), its p2p sends, and the pipeline's
    step time and bubble from the schedule's closed form."""
    _, _, eb = _elem_bytes(train)
    t, p, v = lay.tp, lay.pp, lay.virtual_stages
    tokens = lay.micro_batch * m.seq_len / lay.cp
    lps = m.n_layers / p
    _, _, logits = forward_flops_per_token(m)
    f_layer = lt.forward
    t_logits = tokens * logits / t / (gpu.peak_flops * lt.eff) + a.mem_traffic * tokens * 4 * m.vocab_size / t / lt.hbm
    fwd = lps * (f_layer + lt.tp_f + lt.ep + lt.cp_f)
    bwd = lps * (2 * f_layer + lt.tp_b + lt.ep + lt.recompute + lt.cp_b)
    w_part = lps * lt.gemm  # weight-gradient GEMMs (the zero-bubble W pass)
    fwd_last, bwd_last = fwd + t_logits, bwd + 2 * t_logits
    t_f, t_b = max(fwd, fwd_last), max(bwd, bwd_last)
    pp_bytes = tokens * m.d_model * eb / t  # Megatron's scatter/gather of the p2p message over tp ranks
    pp_link = group_link(gpu, p, t * lay.dp * lay.cp, a)
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
    return PipelineTimes(t_logits, fwd, bwd, fwd_last, bwd_last, t_f, t_b, t_pp, pp_bytes, t_pipe, busy, bubble)


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
        ag = gather_time(st.dense * pb, lay.dp, dp_link) + gather_time(st.expert * pb, edp, edp_link)
        t_dp = mbs * max(rs - window, 0.0) + ag
        dp_bytes = (lay.dp - 1) / lay.dp * (mbs * dense_b + st.dense * pb) + \
            (edp - 1) / max(edp, 1) * (mbs * expert_b + st.expert * pb)
    else:  # ZeRO-3: per-layer all-gathers in forward and backward and reduce-scatters, every microbatch
        pc = param_counts(m)
        lps = m.n_layers / lay.pp
        layer = pc.layer_tp / t + pc.layer_rep
        root = max(st.total - lps * (layer + pc.layer_expert / lay.ep), 0.0)
        full = recompute_kind(lay.recompute)[0] == "full"
        f_layer = lt.forward
        t_dp = mbs * zero3_exposed_time(
            root * pb, [layer * pb] * int(round(lps)), gb / pb, f_layer + lt.tp_f + lt.ep,
            2 * f_layer + lt.tp_b + lt.ep + lt.recompute, 0.0, pt.fwd_last - pt.fwd, pt.bwd_last - pt.bwd, 0.0,
            lay.dp, dp_link, a.zero3_style, lt.recompute if full else 0.0)
        if st.expert:  # experts shard over dp / ep: their gathers, on their own group, assumed hidden
            t_dp += mbs * max(3 * gather_time(st.expert * pb, edp, edp_link) - pt.t_f - pt.t_b, 0.0)
        gathers = 3 if a.zero3_style == "per-tensor" and full else 2
        dp_bytes = mbs * ((lay.dp - 1) / lay.dp * (gathers * st.dense * pb + dense_b) +
                          (edp - 1) / max(edp, 1) * (2 * st.expert * pb + expert_b))
    return t_dp, dp_bytes


def optimizer_time(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions, st: StageParams,
                   mbs: int, k: float, pt: PipelineTimes) -> tuple[float, float, float]:
    """(optimizer step seconds, offload seconds, parameters of this rank's shard): the step is memory-bound on
    the GPU; offloaded, it runs on the CPU behind PCIe transfers (or NVMe I/O)."""
    pb, gb, _ = _elem_bytes(train)
    t = lay.tp
    edp = lay.dp // lay.ep
    lps = m.n_layers / lay.pp
    link_bw = gpu.host_bw * a.link_efficiency
    shard = st.dense / (lay.dp if lay.zero >= 1 else 1) + st.expert / (edp if lay.zero >= 1 else 1)
    t_opt, t_off = 0.0, 0.0
    if lay.offload == "none":
        hbm = gpu.hbm_bandwidth * a.hbm_efficiency
        t_opt = shard * (2 * k + gb + pb + 4) / hbm  # read m, v, master, grad; write them and the param
    elif lay.offload == "nvme":  # disk I/O behind the compute, the step streamed (offload_costs.step_time)
        from scaletrain.config.sizes import NVME_STEP_CHUNK as STEP_CHUNK

        pc = param_counts(m)
        layer = (pc.layer_tp / t + pc.layer_rep + pc.layer_expert / lay.ep) / lay.dp
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


def step_cost(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions, first: StageParams,
              last: StageParams, mbs: int, k: float) -> StepCost:
    """The step time of the layout (memory already checked) with its breakdown, rates and bytes moved."""
    pb, gb, eb = _elem_bytes(train)
    t, p, v, s = lay.tp, lay.pp, lay.virtual_stages, m.seq_len
    n_gpus = lay.world
    lps = m.n_layers / p
    lt = layer_times(m, gpu, train, lay, a)
    pt = pipeline_times(m, gpu, train, lay, a, mbs, lt)
    st = max(first, last, key=lambda x: x.total)
    reduce_lay = context.as_reduction_layout(lay)  # gradients reduced and ZeRO-sharded over dp x cp
    t_dp, dp_bytes = dp_time(m, gpu, train, reduce_lay, a, st, mbs, lt, pt)
    t_opt, t_off, shard = optimizer_time(m, gpu, train, reduce_lay, a, st, mbs, k, pt)

    step = pt.pipe + t_dp + t_opt + t_off
    kind = recompute_kind(lay.recompute)[0]
    model_f, hw_f = step_flops(m, train.global_batch * s, kind)
    comp = lps * 3 * lt.forward + pt.logits * 3
    recomp = lps * lt.recompute
    tp_c = lps * (lt.tp_f + lt.tp_b)
    ep_c = lps * 2 * lt.ep
    cp_c = lps * (lt.cp_f + lt.cp_b)
    share = pt.busy / max(mbs * (comp + recomp + tp_c + ep_c + cp_c + 2 * pt.pp), 1e-30)
    breakdown = {
        "compute": mbs * comp * share, "recompute": mbs * recomp * share, "tp_comm": mbs * tp_c * share,
        "ep_comm": mbs * ep_c * share, "cp_comm": mbs * cp_c * share, "pp_comm": mbs * 2 * pt.pp * share,
        "bubble": pt.bubble,
        "dp_comm": t_dp, "optimizer": t_opt, "offload": t_off,
    }
    tp_bytes = 0.0
    if t > 1 and lay.tp_mode != "1d":
        per_layer = tp_nd.layer_comm_bytes(lay.tp_mode, t, tp_nd.dims_of(m, lay.micro_batch, eb), 1, kind)
        tp_bytes = mbs * lps * sum(per_layer.values())
    elif t > 1:
        n_coll = 4 + (2 if kind == "full" or m.reversible else 0)
        tp_bytes = mbs * lps * n_coll * 2 * (t - 1) / t * lt.msg
    ep_bytes = mbs * lps * lt.n_moe * 4 * (lay.ep - 1) / lay.ep * lt.a2a_bytes if lay.ep > 1 else 0.0
    pp_total = mbs * 2 * v * pt.pp_bytes if p > 1 else 0.0
    cp_f_bytes, cp_b_bytes = lt.cp_bytes
    cp_fwds = 1 + (kind != "none") + m.reversible  # recomputed forwards send again (context.py)
    comm = {"dp": dp_bytes, "tp": tp_bytes, "pp": pp_total, "ep": ep_bytes,
            "cp": mbs * lps * (cp_fwds * cp_f_bytes + cp_b_bytes),
            "offload": (shard * (gb + pb) if lay.offload != "none" else 0.0)}
    return StepCost(step, train.global_batch * s / step, model_f / step / n_gpus / 1e12,
                    hw_f / step / n_gpus / 1e12, model_f / step / n_gpus / gpu.peak_flops,
                    pt.bubble / pt.pipe if pt.pipe else 0.0, breakdown, comm)
