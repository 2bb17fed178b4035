"""Step time of our own runs on this machine, composed from a profile (`probe.py`, taken by `run_calibrate.py`):
`scaletrain plan --config run.yaml --calibrate`.

A profile-based cost model, the approach of PipeDream's profiler (Narayanan et al., arXiv 1806.03377,
Sec. 3.1) and Alpa (Zheng et al., arXiv 2201.12023, Sec. 5): measure each *kind* of layer once, at the
sizes and shapes one rank of the run will use, then compose the measurements analytically over layers,
microbatches, the pipeline schedule, the collectives and the optimizer. Nothing is fitted; the profile
replaces the catalog's peak FLOP/s, because on a CPU small layers are far from the peak rate of a large
matmul (a d_model 64 block runs its matmuls at a fraction of the 1024-wide rate, and element-wise ops such
as GELU's backward, the autograd engine and Python module calls take as long as the matmuls).

Composed (`predict_step_time`), per optimizer step:
- compute: m microbatches x (blocks of the stage x (t_f + t_b) + embedding / head on the first / last
  stage); with pipeline parallelism the schedule's action lists are simulated
  (`parallel.pipeline.simulate`) with these per-(rank, chunk) times and a p2p message time;
- tensor parallelism: the Megatron all-reduces (2 forward, 2 backward per block, one each for the
  vocabulary-parallel embedding and head, two small ones for the loss), blocking: inside the measured
  times when the probe ran on the tp group, else looked up / alpha-beta timed;
- data parallelism / ZeRO: the exposed part of the gradient reduction (only the last bucket of the last
  microbatch cannot overlap the backward), ZeRO-1/2's parameter all-gather after the step, and ZeRO-3's
  per-unit gathers and reduce-scatters through `analytic.zero3.zero3_exposed_time`;
- mixture of experts: each MoE block adds per microbatch its 4 all-to-alls (2 forward, 2 backward) of the
  (E, G, K, C) slots over ep, timed in place on the ep group (alpha-beta on the measured link without a mesh);
- the optimizer, the loader, and the trainer's per-step synchronisation (two small all-reduces: the loss
  and the overflow flag, plus the gradient norm).

A step is predicted once per profile sample and the median is reported (`estimate_step_time`; with
several processes the slowest rank per moment, `estimate_step_time_ranks`). Validation and its limits
(one process within a few percent; two processes within 25% as a median of repeats): docs/
planner-validation.md section 6. Not modelled: the all-gather of partitioned checkpoints, activation
compression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scaletrain.config import Config
from scaletrain.parallel.pipeline.schedules import build_schedule
from scaletrain.parallel.pipeline.simulate import simulate
from scaletrain.plan.analytic import offload_costs
from scaletrain.plan.analytic.comm import MeasuredLink, allreduce_time, gather_time, overlap_efficiency
from scaletrain.plan.analytic.flops import step_flops
from scaletrain.plan.analytic.inputs import recompute_policy
from scaletrain.plan.analytic.zero3 import zero3_exposed_time
from scaletrain.plan.catalog import from_model_config
from scaletrain.plan.exact import run_memory
from scaletrain.plan.exact.probe import RunProfile, profile_from_sample


@dataclass
class StepTime:
    step_time_s: float
    breakdown: dict[str, float] = field(default_factory=dict)
    bubble_fraction: float = 0.0


def collectives_per_step(cfg: Config) -> int:
    """Blocking collectives one rank waits on per step (tp all-reduces, ZeRO-3 gathers, pipeline
    receives, the trainer's loss / overflow / norm reductions): the run's synchronisation points."""
    par, m = cfg.parallel, cfg.model
    mb = par.microbatches or cfg.grad_accum
    blocks = m.n_layers // par.pp
    n = 3 if cfg.world_size > 1 else 0
    if par.tp > 1:
        n += mb * (4 * blocks + 4)
    if par.dp > 1:
        n += 1 if par.zero < 3 else mb * 2 * (blocks + 1)
    if par.pp > 1:
        n += 2 * mb * par.virtual_stages
    return n


def compute_time(cfg: Config, prof: RunProfile) -> float:
    """Compute of one rank per step without any communication (the gaps between collectives)."""
    m = cfg.model
    mb = cfg.parallel.microbatches or cfg.grad_accum
    blocks = m.n_layers // cfg.parallel.pp
    return mb * (blocks * (prof.block_f + prof.block_b) + prof.embed_f + prof.embed_b + prof.head_f + prof.head_b)


def _p2p(nbytes: float, link) -> float:
    """One pipeline message: measured in place (`p2p`) or latency + bytes / bandwidth."""
    if isinstance(link, MeasuredLink):
        return link.time("p2p", nbytes, 2)
    return link[1] + nbytes / link[0] if math.isfinite(link[0]) else link[1]


def predict_step_time(cfg: Config, prof: RunProfile) -> StepTime:
    """The step time `scaletrain train` will report (`step_time_s`) for `cfg` on the profiled machine."""

    par, m, tr = cfg.parallel, cfg.model, cfg.train
    link, tp_link, pp_link = prof.link("world"), prof.link("tp"), prof.link("pp")
    e = run_memory._TORCH[tr.dtype].itemsize
    grad_e = 4 if tr.dtype in run_memory.LOW else e
    mb = par.microbatches or cfg.grad_accum
    n_tok = tr.micro_batch * m.seq_len
    act = n_tok * m.d_model * e  # one (b, s, h) activation

    # ---- tensor parallelism: blocking all-reduces (Megatron's f and g), per block and microbatch
    t = par.tp
    tp_block = 4 * allreduce_time(act, t, tp_link) if t > 1 else 0.0
    tp_embed = allreduce_time(act, t, tp_link) if t > 1 else 0.0
    tp_head = allreduce_time(act, t, tp_link) + 2 * allreduce_time(4 * 2 * n_tok, t, tp_link) if t > 1 else 0.0

    add_tp = 0.0 if prof.tp_in_blocks else 0.5  # measured inside the blocks already, or added per pass
    bf, bb = prof.block_f + add_tp * tp_block, prof.block_b + add_tp * tp_block
    # MoE blocks: their own profile, plus 2 all-to-alls forward and 2 backward of the slots over ep
    a2a = ep_all_to_all_time(cfg, prof.link("ep"))
    mf, mbk = prof.moe_f + add_tp * tp_block + a2a, prof.moe_b + add_tp * tp_block + a2a

    def blocks_f(lo: int, hi: int) -> float:
        n_moe = n_moe_blocks(cfg, lo, hi)
        return (hi - lo - n_moe) * bf + n_moe * mf

    def blocks_b(lo: int, hi: int) -> float:
        n_moe = n_moe_blocks(cfg, lo, hi)
        return (hi - lo - n_moe) * bb + n_moe * mbk

    ef, eb = prof.embed_f + add_tp * tp_embed, prof.embed_b + add_tp * tp_embed
    hf, hb = prof.head_f + add_tp * tp_head, prof.head_b + add_tp * tp_head

    # ---- compute over microbatches (and the pipeline schedule)
    bounds = run_memory.pipeline_partition(cfg).bounds if par.pp > 1 else [(0, m.n_layers)]
    S = len(bounds)
    if par.pp == 1:
        per_micro_f = blocks_f(0, m.n_layers) + ef + hf
        per_micro_b = blocks_b(0, m.n_layers) + eb + hb
        compute = mb * (per_micro_f + per_micro_b)
        bubble = 0.0
        last_b = per_micro_b
        stage_blocks = m.n_layers
    else:
        v = par.virtual_stages
        shards = t if par.sequence_parallel else 1
        p2p = _p2p(act / shards, pp_link)
        # a send overlaps the sender's next compute, which pays the part the overlap efficiency does not hide
        send = (1.0 - overlap_efficiency(pp_link, "p2p")) * p2p
        tf, tb = [], []
        for r in range(par.pp):
            row_f, row_b = [], []
            for s in run_memory.stage_ids(cfg, r):
                row_f.append(blocks_f(*bounds[s]) + (ef if s == 0 else 0.0) + (hf if s == S - 1 else send))
                row_b.append(blocks_b(*bounds[s]) + (eb if s == 0 else send) + (hb if s == S - 1 else 0.0))
            tf.append(row_f)
            tb.append(row_b)
        actions = build_schedule(par.schedule, par.pp, mb, v)
        if par.schedule in ("zb-h1", "dualpipev"):  # the weight pass is the matmul-weight half of the backward
            tw = [[x / 2 for x in row] for row in tb]
            tb = [[x / 2 for x in row] for row in tb]
        else:
            tw = 0.0
        sim = simulate(actions, tf, tb, tw, t_comm=p2p)
        compute = sim.makespan
        busy = max(sim.busy)
        bubble = compute - busy
        stage_blocks = max(hi - lo for lo, hi in bounds) * v
        last_b = max(max(row) for row in tb) / v

    # ---- data parallelism / ZeRO over dp
    dp_comm = _dp_time(cfg, e, grad_e, mb, last_b, (bf, bb, ef, hf, hb, eb), prof.link("dp")) if par.dp > 1 else 0.0
    # the trainer's synchronisation per step: the loss and the overflow flag (and the gradient norm)
    world = cfg.world_size
    sync = 3 * allreduce_time(8, world, link) if world > 1 else 0.0

    nvme_io = 0.0
    if par.offload == "nvme":  # ZeRO-Infinity: disk I/O behind the compute, the step streamed (parallel/zero_nvme)
        from scaletrain.config.sizes import NVME_STEP_CHUNK as STEP_CHUNK

        shards, e_, low, ge = run_memory.nvme_shards(cfg)
        exposed, streamed = offload_costs.step_time(shards, e_, low, ge, mb, par.nvme_grads, prof.disk_read_bw,
                                                    prof.disk_write_bw, compute, prof.optimizer, STEP_CHUNK)
        nvme_io = exposed + streamed - prof.optimizer  # what the disk adds to the in-memory step
    total = compute + dp_comm + prof.optimizer + nvme_io + prof.loader + sync
    tp_comm = mb * (stage_blocks * tp_block + tp_embed + tp_head)
    ep_comm = mb * 2 * a2a * max((n_moe_blocks(cfg, lo, hi) for lo, hi in bounds), default=0) * \
        (par.virtual_stages if par.pp > 1 else 1)
    breakdown = {"compute": compute - bubble - tp_comm - ep_comm, "bubble": bubble, "dp_comm": dp_comm,
                 "tp_comm": tp_comm, "ep_comm": ep_comm, "optimizer": prof.optimizer, "loader": prof.loader,
                 "sync": sync, **({"nvme_io": nvme_io} if par.offload == "nvme" else {})}
    return StepTime(total, breakdown, bubble / compute if compute else 0.0)


def n_moe_blocks(cfg: Config, lo: int, hi: int) -> int:
    """MoE blocks among blocks lo..hi-1."""
    from scaletrain.config.sizes import is_moe_layer

    return sum(is_moe_layer(cfg.model, i) for i in range(lo, hi))


def ep_all_to_all_bytes(cfg: Config) -> int:
    """Bytes of one expert all-to-all of one MoE block and microbatch: the (E, G, K, C) slots of this
    rank's tokens (capacity_factor x k rows per token, rounded up per group; `parallel.experts`)."""
    from scaletrain.config.sizes import capacity, experts_per_token

    m, tr = cfg.model, cfg.train
    moe = m.moe
    k = experts_per_token(moe)
    G = tr.micro_batch * m.seq_len // moe.group_tokens
    K = capacity(moe.group_tokens, moe.experts, k, moe.capacity_factor)
    return moe.experts * G * K * m.d_model * run_memory._TORCH[tr.dtype].itemsize


def ep_all_to_all_time(cfg: Config, link: tuple[float, float]) -> float:
    """Time of the 2 all-to-alls of one MoE block's forward (and again of its backward) over ep."""
    ep = cfg.parallel.ep
    if cfg.model.moe.experts == 0 or ep == 1:
        return 0.0
    return 2 * gather_time(ep_all_to_all_bytes(cfg), ep, link, "all_to_all")


def zero3_unit_bytes(cfg: Config, e: int) -> tuple[int, list[int]]:
    """(root, [block units]): the bytes one ZeRO-3 all-gather of each unit carries, `e` per element, the FP8 layers'
    weights one byte each under train.fp8_all_gather (parallel/zero_fp8.py; shards' padding not counted)."""
    from scaletrain.parallel.zero import group_params

    module = run_memory.engine_module_on_meta(cfg, 0)
    groups = group_params(module, 3, cfg.parallel.bucket_mb)
    fp8: set = set()
    if cfg.train.precision == "fp8" and cfg.train.fp8_all_gather:
        from scaletrain.memory.fp8_layers import fp8_layer_names

        names = {f"{name}.weight" for name in fp8_layer_names(cfg.model, cfg.train)}
        fp8 = {id(p) for name, p in module.named_parameters() if name in names}
    units = [sum(p.numel() * (1 if id(p) in fp8 else e) for p in g) for g in groups]
    return units[0], units[1:]


def _dp_time(cfg: Config, e: int, grad_e: int, mb: int, last_b: float, times: tuple, link) -> float:
    """Exposed data-parallel / ZeRO communication per step over dp (gloo, alpha-beta).

    ZeRO 0 and 1: the buckets are reduced after the last microbatch's backward, each launched when its
    gradients are ready; all but the last bucket (the embeddings, ready at the very end) can overlap the
    rest of that backward (`last_b`), which hides them by the link's overlap efficiency. ZeRO 2: the same
    every microbatch. ZeRO 1 and 2 then all-gather the updated parameters after the step (not overlapped).
    ZeRO 3: `zero3_exposed_time` per microbatch.
    """
    from scaletrain.parallel.zero import group_params

    par = cfg.parallel
    dp, zero = par.dp, par.zero
    module = run_memory.engine_module_on_meta(cfg, 0)
    groups = group_params(module, 3 if zero == 3 else 1, par.bucket_mb)
    sizes = [sum(p.numel() for p in g) for g in groups]
    if zero == 3:
        bf, bb, ef, hf, hb, eb = times
        n_blocks = len(sizes) - 1
        root, blocks = zero3_unit_bytes(cfg, e)
        return mb * zero3_exposed_time(root, blocks, grad_e / e, bf if n_blocks else 0.0, bb, ef, hf, hb,
                                       eb, dp, link)
    total = sum(sizes) * grad_e
    last = sizes[-1] * grad_e
    def reduce(nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return allreduce_time(nbytes, dp, link) if zero == 0 else gather_time(nbytes, dp, link, "reduce_scatter")

    kind = "all_reduce" if zero == 0 else "reduce_scatter"
    launch = link.launch_time(kind) if isinstance(link, MeasuredLink) else 0.0  # one async launch per bucket
    early = reduce(total - last)  # the buckets launched during the backward: hidden by the overlap efficiency
    hidden = min(early, last_b) * overlap_efficiency(link, kind)
    per_pass = reduce(last) + early - hidden + len(sizes) * launch
    t = (mb if zero == 2 else 1) * per_pass
    if zero in (1, 2):
        t += sum(gather_time(k * e, dp, link) for k in sizes)
    return t


def apply_to_estimate(est, cfg: Config, step: StepTime, peak_flops: float) -> None:
    """Put the run's predicted step time (and what follows from it) into a planner `Estimate`."""
    tokens = cfg.train.global_batch * cfg.model.seq_len
    model_f, hw_f = step_flops(from_model_config(cfg.model), tokens, recompute_policy(est.layout.recompute))
    n = cfg.world_size
    est.step_time_s = step.step_time_s
    est.tokens_per_s = tokens / step.step_time_s
    est.model_tflops_per_gpu = model_f / step.step_time_s / n / 1e12
    est.hardware_tflops_per_gpu = hw_f / step.step_time_s / n / 1e12
    est.mfu = model_f / step.step_time_s / n / peak_flops
    est.bubble_fraction = step.bubble_fraction
    est.time_breakdown = dict(step.breakdown)


def estimate_step_time(cfg: Config, samples: list[dict[str, float]],
                       link: tuple[float, float] | None = None) -> StepTime:
    """The median over samples of the step time composed from each sample (and its breakdown).

    Why the median of whole-step compositions and not the composition of per-piece medians: on a
    shared machine the time of a small piece is skewed by descheduling; a step adds up many pieces, so
    its median sits near the sum of their means, which the sum of their medians underestimates (by 10
    to 50% on our 2-core machine under load), while the median of per-sample sums tracks it."""
    steps = sorted((predict_step_time(cfg, profile_from_sample(s, link)) for s in samples),
                   key=lambda st: st.step_time_s)
    return steps[len(steps) // 2]


def estimate_step_time_ranks(cfg: Config, samples_by_rank: list[list[dict[str, float]]],
                             link: tuple[float, float] | None = None) -> StepTime:
    """`estimate_step_time` for samples taken at the same moments on every rank of the run: per moment,
    the slowest rank's composition (a synchronous step goes at the pace of its slowest rank), then the
    median over moments."""
    steps = []
    for moment in zip(*samples_by_rank):
        steps.append(max((predict_step_time(cfg, profile_from_sample(s, link)) for s in moment),
                         key=lambda st: st.step_time_s))
    steps.sort(key=lambda st: st.step_time_s)
    return steps[len(steps) // 2]
