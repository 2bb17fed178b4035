"""Step time of our own runs on this machine: `scaletrain plan --config run.yaml --calibrate`.

A profile-based cost model, the approach of PipeDream's profiler (Narayanan et al., arXiv 1806.03377,
Sec. 3.1) and Alpa (Zheng et al., arXiv 2201.12023, Sec. 5): measure each *kind* of layer once, at the
sizes and shapes one rank of the run will use, then compose the measurements analytically over layers,
microbatches, the pipeline schedule, the collectives and the optimizer. Nothing is fitted; the profile
replaces the catalog's peak FLOP/s, because on a CPU small layers are far from the peak rate of a large
matmul (a d_model 64 block runs its matmuls at a fraction of the 1024-wide rate, and element-wise ops such
as GELU's backward, the autograd engine and Python module calls take as long as the matmuls).

Measured (`RunProbe.sample`, medians over repeats in `profile_run`):
- one transformer block of this rank (tensor-parallel shapes from `run_memory.engine_module_on_meta`,
  fp32 layer norms under bf16/fp16, the run's recomputation wrapper, dropout), forward and backward
  separately, one microbatch, with the per-parameter gradient hooks the engine installs (fp32 gradient
  accumulation under mixed precision, bucket readiness under data parallelism or ZeRO);
- the embedding (forward, backward) and the final norm + head + loss (forward, backward);
- the optimizer: gradient-norm passes (unscale check and clipping) and the optimizer's step over the
  tensors this rank's optimizer really holds (whole parameters with ZeRO 0, the shard pieces with ZeRO),
  plus the fp32-master copy-back under mixed precision;
- the loader producing this rank's micro-batches;
- with several processes (`RunProbe(cfg, mesh)` on the run's groups): under tensor parallelism the block,
  embedding and head split over the real tp group, so their times include the Megatron collectives;
  every other collective of the step timed in place (`run_comm.measure_comm`, a sample's `comm`), and
  the alpha-beta link (`measure_link`) for sizes beyond those.

Composed (`predict_step_time`), per optimizer step:
- compute: m microbatches x (blocks of the stage x (t_f + t_b) + embedding / head on the first / last
  stage); with pipeline parallelism the schedule's action lists are simulated
  (`parallel.pipeline.simulate`) with these per-(rank, chunk) times and a p2p message time;
- tensor parallelism: the Megatron all-reduces (2 forward, 2 backward per block, one each for the
  vocabulary-parallel embedding and head, two small ones for the loss), blocking: inside the measured
  times when the probe ran on the tp group, else looked up / alpha-beta timed;
- data parallelism / ZeRO: the exposed part of the gradient reduction (only the last bucket of the last
  microbatch cannot overlap the backward), ZeRO-1/2's parameter all-gather after the step, and ZeRO-3's
  per-unit gathers and reduce-scatters through `costs.zero3_exposed_time`;
- the optimizer, the loader, and the trainer's per-step synchronisation (two small all-reduces: the loss
  and the overflow flag, plus the gradient norm).

A step is predicted once per profile sample and the median is reported (`estimate_step_time`; with
several processes the slowest rank per moment, `estimate_step_time_ranks`). Validation and its limits
(one process within a few percent; two processes within 25% as a median of repeats): docs/
planner-validation.md section 6. Mixture-of-experts runs: the MoE block is profiled too (block
`every - 1` of the probe, with all E experts on this rank's slots: under expert parallelism a rank runs
E/ep experts on ep times the slots, the same work), and each MoE block adds per microbatch its 4
all-to-alls (2 forward, 2 backward) of the (E, G, K, C) slots over ep, timed in place on the ep group
(alpha-beta on the measured link without a mesh). Not modelled: the all-gather of partitioned
checkpoints, activation compression.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from scaletrain.config import Config
from scaletrain.plan import run_memory


@dataclass
class RunProfile:
    """Times measured on this machine at the run's sizes (seconds)."""

    block_f: float
    block_b: float
    embed_f: float
    embed_b: float
    head_f: float
    head_b: float
    optimizer: float
    loader: float
    moe_f: float = 0.0  # an MoE block (0 without experts)
    moe_b: float = 0.0
    link_bw: float = math.inf  # gloo all-reduce bus bandwidth, bytes/s
    link_latency: float = 0.0  # per ring step, s
    tp_in_blocks: float = 0.0
    """1: the blocks, embedding and head were timed with their tensor-parallel collectives on the run's
    tp group (`RunProbe(cfg, mesh)`), so the composition adds none."""
    disk_read_bw: float = math.inf
    """offload=nvme: bytes/s of the offload folder through the engine's I/O path (`nvme_io.measure_bandwidth`)."""
    disk_write_bw: float = math.inf
    comm: dict | None = None
    """Per mesh dimension (tp, dp, pp, ep, world), the collectives timed in place (`run_comm.measure_comm`);
    None: alpha-beta on (link_bw, link_latency) for every group."""

    def link(self, dim: str = "world"):
        """The link of the group of mesh dimension `dim`: measured in place when the profile has it."""
        from scaletrain.plan.costs import MeasuredLink

        if self.comm is None:
            return self.link_bw, self.link_latency
        table = self.comm.get(dim, {})
        launch, overlap = table.get("launch", {}), table.get("overlap", {})
        return MeasuredLink(self.link_bw, self.link_latency,
                            tuple((k, tuple(sorted(v))) for k, v in sorted(table.items())
                                  if k not in ("launch", "overlap")),
                            tuple(sorted(launch.items())), tuple(sorted(overlap.items())))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _materialize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Real (CPU) storage for a meta module; small random values (the time does not depend on them)."""
    module.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
    return module


def _engine_hooks(cfg: Config) -> bool:
    """Whether the engine's optimizer installs a post-accumulate-grad hook on every parameter."""
    low = cfg.train.dtype in run_memory.LOW
    return cfg.parallel.zero >= 1 or cfg.parallel.dp > 1 or low


class RunProbe:
    """The pieces of one rank's step, built once at the run's sizes; `sample()` times each once."""

    def __init__(self, cfg: Config, seed: int = 0, mesh=None):
        """`mesh`: the run's process groups (every rank builds its probe together). With tensor
        parallelism the probe's model is then split over the real tp group by the engine's own pass, so
        its timings include the Megatron collectives and the tensor-parallel layers' own overhead."""
        from scaletrain.memory.precision import apply_precision
        from scaletrain.model.gpt import loss_sum

        self.cfg = cfg
        m, tr = cfg.model, cfg.train
        B, T = tr.micro_batch, m.seq_len
        dtype = run_memory._TORCH[tr.dtype]
        moe = m.moe.experts > 0
        # one block, or up to the first MoE block (experts unsharded: same work as E/ep on ep x the slots)
        one = dataclasses.replace(cfg, model=dataclasses.replace(m, n_layers=m.moe.every if moe else 1),
                                  parallel=dataclasses.replace(cfg.parallel, pp=1, virtual_stages=1, ep=1))
        # with the run's groups: whole shapes, then the engine's tp pass on the run's tp group
        self.tp_in_blocks = mesh is not None and cfg.parallel.tp > 1
        if self.tp_in_blocks:
            one = dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, tp=1))
        model = _materialize(run_memory.engine_module_on_meta(one), seed)
        if m.tie_embeddings:
            model.lm_head.weight = model.wte.weight
        self.loss_fn = loss_sum
        if self.tp_in_blocks:
            from scaletrain.parallel.tp_plan import apply_tp_plan, gpt_plan

            apply_tp_plan(model, gpt_plan(m), mesh.group("tp"), sequence_parallel=cfg.parallel.sequence_parallel)
            self.loss_fn = model.lm_head.loss_fn()
        if tr.dtype in run_memory.LOW:
            apply_precision(model)
        model.train()
        self.model = model
        self.block = model.blocks[0]
        self.moe_block = model.blocks[m.moe.every - 1] if moe else None
        self.dense = not moe or m.moe.every > 1  # the run has dense blocks
        self._wrap_recompute()
        self.rope = model.rope(T, torch.device("cpu"))
        g = torch.Generator().manual_seed(seed)
        t_sp = cfg.parallel.tp if self.tp_in_blocks and cfg.parallel.sequence_parallel else 1
        self.x = torch.randn(B, T // t_sp, m.d_model, generator=g).to(dtype).requires_grad_()
        self.dy = torch.randn(B, T // t_sp, m.d_model, generator=g).to(dtype)
        self.idx = torch.randint(0, m.vocab_size, (B, T), generator=g)
        self.local_vocab = model.lm_head.weight.shape[0]
        # ids of the local vocabulary shard when the probe's layers are only shaped like the shards
        self.targets = self.idx if self.tp_in_blocks else self.idx % self.local_vocab
        mb = cfg.parallel.microbatches or cfg.grad_accum
        self.passes = max(1, min(16, (m.n_layers // cfg.parallel.pp) * mb))
        self.hooks = []
        if _engine_hooks(cfg):
            self._install_hooks(tr.dtype in run_memory.LOW)
        self._build_optimizer(seed)
        self._build_loader()

    # ------------------------------------------------------------------ construction

    def _wrap_recompute(self) -> None:
        """The engine's own recomputation pass over the probe's model (no tensor-parallel group: a
        partitioned checkpoint's all-gather is not timed)."""
        import types

        from scaletrain.memory.recompute import apply_recompute

        if self.cfg.memory.recompute != "none" or self.cfg.memory.offload_activations:
            apply_recompute(types.SimpleNamespace(module=self.model), self.cfg.memory)

    def _install_hooks(self, low: bool) -> None:
        """The engine's per-parameter gradient hook: fp32 accumulation (mixed precision) or a readiness
        count (data parallelism / ZeRO)."""
        counter = [0]
        for p in self.model.parameters():
            buf = torch.zeros(p.shape, dtype=torch.float32) if low else None

            def hook(param, buf=buf):
                counter[0] += 1
                if buf is not None:
                    buf.add_(param.grad)
                    param.grad = None

            self.hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _optimizer_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the tensors this rank's optimizer steps: whole parameters (ZeRO 0) or the pieces of
        the fullest rank's shard (ZeRO 1-3, `parallel.zero`'s grouping)."""
        cfg = self.cfg
        module = run_memory.engine_module_on_meta(cfg, 0)
        params = [p for p in module.parameters() if p.requires_grad]
        if cfg.parallel.zero == 0:
            return [tuple(p.shape) for p in params]
        from scaletrain.parallel.zero import group_params

        n = cfg.parallel.dp
        shapes: list[tuple[int, ...]] = []
        for group in group_params(module, cfg.parallel.zero, cfg.parallel.bucket_mb):
            numel = sum(p.numel() for p in group)
            shard = max(1, math.ceil(numel / n))
            off = 0
            for p in group:  # rank 0's pieces
                a, b = max(off, 0), min(off + p.numel(), shard)
                if a < b:
                    shapes.append((b - a,))
                off += p.numel()
        return shapes

    def _build_optimizer(self, seed: int) -> None:
        from scaletrain.optim import build_optimizer, config_hyper

        cfg = self.cfg
        low = cfg.train.dtype in run_memory.LOW
        dtype = torch.float32 if low else run_memory._TORCH[cfg.train.dtype]
        g = torch.Generator().manual_seed(seed + 1)
        shapes = self._optimizer_shapes()
        self.opt_params = [nn.Parameter(torch.randn(s, generator=g, dtype=dtype) * 0.02) for s in shapes]
        for p in self.opt_params:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * 1e-3
        name = cfg.optim.name if cfg.parallel.zero == 0 else "adamw"
        self.opt = build_optimizer(name, [{"params": self.opt_params, "weight_decay": cfg.optim.weight_decay}],
                                   **config_hyper(cfg.optim, cfg.train.lr))
        self.low_params = [torch.empty(s, dtype=run_memory._TORCH[cfg.train.dtype]) for s in shapes] if low else []

    def _build_loader(self) -> None:
        import numpy as np

        from scaletrain.data.loader import BatchLoader

        cfg = self.cfg
        n = max(100_000, 4 * cfg.train.global_batch * (cfg.model.seq_len + 1))
        tokens = (np.arange(n) % cfg.model.vocab_size).astype(np.uint16)
        self.loader = BatchLoader(tokens, cfg.model.seq_len, cfg.train.global_batch, 0, 0.05)

    # ------------------------------------------------------------------ timing

    def _block(self, block: nn.Module | None = None) -> tuple[float, float]:
        block = block if block is not None else self.block
        out: list[torch.Tensor] = []
        t_f = _timed(lambda: out.append(block(self.x, self.rope)))
        t_b = _timed(lambda: out[0].backward(self.dy))
        return t_f, t_b

    def _embed(self) -> tuple[float, float]:
        m = self.model
        out: list[torch.Tensor] = []

        def fwd():
            x = m.wte(self.targets)  # ids of the local vocabulary shard (tensor parallelism)
            if m.wpe is not None:
                x = x + m.wpe(torch.arange(self.idx.shape[1]))
            out.append(m.drop(x))

        t_f = _timed(fwd)
        t_b = _timed(lambda: out[0].backward(self.dy))
        return t_f, t_b

    def _head(self) -> tuple[float, float]:
        m = self.model
        out: list[torch.Tensor] = []
        t_f = _timed(lambda: out.append(self.loss_fn(m.lm_head(m.ln_f(self.x)), self.targets)))
        t_b = _timed(lambda: out[0].backward())
        return t_f, t_b

    def _optimizer(self) -> float:
        params = self.opt_params

        def step():
            grads = [p.grad for p in params]
            for _ in range(2):  # the overflow check and the clipping norm
                norms = torch._foreach_norm(grads)
                float(torch.stack([n.double() for n in norms]).square().sum().sqrt())
            self.opt.step()
            if self.low_params:
                torch._foreach_copy_(self.low_params, [p.detach() for p in params])

        return _timed(step)

    def _loader(self) -> float:
        cfg = self.cfg
        return _timed(lambda: self.loader.micro_batches(1, 0, cfg.parallel.dp, cfg.train.micro_batch))

    def sample(self) -> dict[str, float]:
        """One timing of every piece (the first calls of a fresh probe are warm-up: discard them). The
        block, which a step runs layers x microbatches times, is timed `passes` times and averaged, so a
        sample spans a good part of a step and sees the same interference from other processes."""
        with torch.random.fork_rng():
            f = b = mf = mb = 0.0
            if self.dense:
                fb = [self._block() for _ in range(self.passes)]
                f, b = sum(x[0] for x in fb) / len(fb), sum(x[1] for x in fb) / len(fb)
            if self.moe_block is not None:
                fb = [self._block(self.moe_block) for _ in range(self.passes)]
                mf, mb = sum(x[0] for x in fb) / len(fb), sum(x[1] for x in fb) / len(fb)
            ef, eb = self._embed()
            hf, hb = self._head()
        self.model.zero_grad(set_to_none=True)
        self.x.grad = None
        out = {"block_f": f, "block_b": b, "embed_f": ef, "embed_b": eb, "head_f": hf, "head_b": hb,
               "optimizer": self._optimizer(), "loader": self._loader()}
        if self.moe_block is not None:
            out.update(moe_f=mf, moe_b=mb)
        if self.tp_in_blocks:
            out["tp_in_blocks"] = 1.0
        return out


def collect_samples(cfg: Config, repeats: int = 9, warmup: int = 2, probe: RunProbe | None = None) -> list[dict]:
    """`repeats` samples of every piece after `warmup` discarded ones."""
    probe = probe or RunProbe(cfg)
    for _ in range(warmup):
        probe.sample()
    return [{**probe.sample(), **disk_bandwidth(cfg)} for _ in range(repeats)]


def disk_bandwidth(cfg: Config) -> dict[str, float]:
    """offload=nvme: the offload folder's read and write bandwidth, measured once per config (else {})."""
    if cfg.parallel.offload != "nvme":
        return {}
    key = cfg.parallel.offload_dir
    if key not in _DISK:
        import tempfile

        from scaletrain.memory.nvme_io import measure_bandwidth

        runs = [measure_bandwidth(cfg.parallel.offload_dir or tempfile.gettempdir(), 128 << 20) for _ in range(3)]
        _DISK[key] = {"disk_read_bw": sorted(r for r, _ in runs)[1], "disk_write_bw": sorted(w for _, w in runs)[1]}
    return _DISK[key]


_DISK: dict[str, dict[str, float]] = {}  # a cache of measurements, not configuration


def profile_from_sample(sample: dict, link: tuple[float, float] | None = None) -> RunProfile:
    """A profile from one sample (and the link); a sample's `comm` entry holds its in-place collective
    times (`run_comm.measure_comm`)."""
    bw, lat = link if link is not None else (math.inf, 0.0)
    return RunProfile(**sample, link_bw=bw, link_latency=lat)


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


def measure_link(cfg: Config, samples: list[dict[str, float]], group=None) -> tuple[float, float]:
    """(bus bandwidth, per-step latency alpha) of the run's collectives, measured on `group` (every rank
    calls): the bandwidth of an all-reduce of the run's largest message, and alpha from what a small
    collective costs after the run's mean compute between two collectives (`calibrate.sync_cost`:
    on a shared machine a collective waits for descheduled peers, which is most of its cost)."""
    import statistics

    import torch.distributed as dist

    from scaletrain.plan.calibrate import link_on_group, sync_cost

    comp = statistics.median(compute_time(cfg, profile_from_sample(s)) for s in samples)
    gap = comp / max(collectives_per_step(cfg), 1)
    m, tr = cfg.model, cfg.train
    e = run_memory._TORCH[tr.dtype].itemsize
    act = tr.micro_batch * m.seq_len * m.d_model * e
    grads = run_memory.model_state_bytes(cfg)["grads"] if cfg.parallel.dp > 1 else 0
    bw, _ = link_on_group(group, nbytes=int(min(max(64 << 10, act, grads), 64 << 20)), repeats=5)
    n = dist.get_world_size(group)
    return bw, sync_cost(gap, group, repeats=25) / (2 * (n - 1))


def _rank_worker(rank: int, world: int, path: str, cfg: Config, repeats: int, out) -> None:
    import os

    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the launcher's OMP_NUM_THREADS
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        from scaletrain.distributed.mesh import Mesh, ParallelDims
        from scaletrain.plan.run_comm import sample_with_comm

        p = cfg.parallel
        mesh = Mesh.build(ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, ep=p.ep), p.timeout_s)
        probe = RunProbe(cfg, mesh=mesh)
        for _ in range(2):  # warm-up
            probe.sample()
        samples = [{**sample_with_comm(cfg, probe, mesh), **disk_bandwidth(cfg)} for _ in range(repeats)]
        link = measure_link(cfg, samples)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, samples)
        if rank == 0:
            out["samples"], out["link"] = everyone, link
    finally:
        dist.destroy_process_group()


def calibrate_run(cfg: Config, repeats: int = 9) -> tuple[StepTime, tuple[float, float] | None]:
    """Profile the run on this machine, in as many local processes as the run has (so that they compete
    for the cores as the run's ranks will), and predict its step time. Returns (prediction, link)."""
    import os

    world = cfg.world_size
    if world == 1:
        return estimate_step_time(cfg, collect_samples(cfg, repeats)), None
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(_rank_worker, args=(world, os.path.join(d, "store"), cfg, repeats, out), nprocs=world, join=True)
        samples, link = out["samples"], out["link"]
    return estimate_step_time_ranks(cfg, samples, link), link


# --------------------------------------------------------------------------- composition


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


def _allreduce(nbytes: float, n: int, link) -> float:
    from scaletrain.plan.costs import allreduce_time

    return allreduce_time(nbytes, n, link)


def _gather(nbytes: float, n: int, link, kind: str = "all_gather") -> float:
    from scaletrain.plan.costs import gather_time

    return gather_time(nbytes, n, link, kind)


def _p2p(nbytes: float, link) -> float:
    """One pipeline message: measured in place (`p2p`) or latency + bytes / bandwidth."""
    from scaletrain.plan.costs import MeasuredLink

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
    tp_block = 4 * _allreduce(act, t, tp_link) if t > 1 else 0.0
    tp_embed = _allreduce(act, t, tp_link) if t > 1 else 0.0
    tp_head = _allreduce(act, t, tp_link) + 2 * _allreduce(4 * 2 * n_tok, t, tp_link) if t > 1 else 0.0

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
        from scaletrain.parallel.pipeline.schedules import build_schedule
        from scaletrain.parallel.pipeline.simulate import simulate
        from scaletrain.plan.costs import overlap_efficiency

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
        if par.schedule == "zb-h1":  # the weight pass is the matmul-weight half of the backward
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
    sync = 3 * _allreduce(8, world, link) if world > 1 else 0.0

    nvme_io = 0.0
    if par.offload == "nvme":  # ZeRO-Infinity: disk I/O behind the compute, the step streamed (parallel/zero_nvme)
        from scaletrain.parallel.zero_nvme import STEP_CHUNK
        from scaletrain.plan.offload_costs import step_time

        shards, e_, low, ge = run_memory.nvme_shards(cfg)
        exposed, streamed = step_time(shards, e_, low, ge, mb, par.nvme_grads, prof.disk_read_bw, prof.disk_write_bw,
                                      compute, prof.optimizer, STEP_CHUNK)
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
    from scaletrain.model.moe import is_moe_layer

    return sum(is_moe_layer(cfg.model, i) for i in range(lo, hi))


def ep_all_to_all_bytes(cfg: Config) -> int:
    """Bytes of one expert all-to-all of one MoE block and microbatch: the (E, G, K, C) slots of this
    rank's tokens (capacity_factor x k rows per token, rounded up per group; `parallel.experts`)."""
    from scaletrain.model.moe import capacity

    m, tr = cfg.model, cfg.train
    moe = m.moe
    k = 1 if moe.router == "switch" else moe.top_k
    G = tr.micro_batch * m.seq_len // moe.group_tokens
    K = capacity(moe.group_tokens, moe.experts, k, moe.capacity_factor)
    return moe.experts * G * K * m.d_model * run_memory._TORCH[tr.dtype].itemsize


def ep_all_to_all_time(cfg: Config, link: tuple[float, float]) -> float:
    """Time of the 2 all-to-alls of one MoE block's forward (and again of its backward) over ep."""
    ep = cfg.parallel.ep
    if cfg.model.moe.experts == 0 or ep == 1:
        return 0.0
    return 2 * _gather(ep_all_to_all_bytes(cfg), ep, link, "all_to_all")


def _dp_time(cfg: Config, e: int, grad_e: int, mb: int, last_b: float, times: tuple, link) -> float:
    """Exposed data-parallel / ZeRO communication per step over dp (gloo, alpha-beta).

    ZeRO 0 and 1: the buckets are reduced after the last microbatch's backward, each launched when its
    gradients are ready; all but the last bucket (the embeddings, ready at the very end) can overlap the
    rest of that backward (`last_b`), which hides them by the link's overlap efficiency. ZeRO 2: the same
    every microbatch. ZeRO 1 and 2 then all-gather the updated parameters after the step (not overlapped).
    ZeRO 3: `costs.zero3_exposed_time` per microbatch.
    """
    from scaletrain.parallel.zero import group_params
    from scaletrain.plan.costs import MeasuredLink, overlap_efficiency, zero3_exposed_time

    par = cfg.parallel
    dp, zero = par.dp, par.zero
    module = run_memory.engine_module_on_meta(cfg, 0)
    groups = group_params(module, 3 if zero == 3 else 1, par.bucket_mb)
    sizes = [sum(p.numel() for p in g) for g in groups]
    if zero == 3:
        bf, bb, ef, hf, hb, eb = times
        n_blocks = len(sizes) - 1
        blocks = [k * e for k in sizes[1:]]
        return mb * zero3_exposed_time(sizes[0] * e, blocks, grad_e / e, bf if n_blocks else 0.0, bb, ef, hf, hb,
                                       eb, dp, link)
    total = sum(sizes) * grad_e
    last = sizes[-1] * grad_e
    def reduce(nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return _allreduce(nbytes, dp, link) if zero == 0 else _gather(nbytes, dp, link, "reduce_scatter")

    kind = "all_reduce" if zero == 0 else "reduce_scatter"
    launch = link.launch_time(kind) if isinstance(link, MeasuredLink) else 0.0  # one async launch per bucket
    early = reduce(total - last)  # the buckets launched during the backward: hidden by the overlap efficiency
    hidden = min(early, last_b) * overlap_efficiency(link, kind)
    per_pass = reduce(last) + early - hidden + len(sizes) * launch
    t = (mb if zero == 2 else 1) * per_pass
    if zero in (1, 2):
        t += sum(_gather(k * e, dp, link) for k in sizes)
    return t


def apply_to_estimate(est, cfg: Config, step: StepTime, peak_flops: float) -> None:
    """Put the run's predicted step time (and what follows from it) into a planner `Estimate`."""
    from scaletrain.plan.catalog import from_model_config
    from scaletrain.plan.costs import recompute_kind, step_flops

    tokens = cfg.train.global_batch * cfg.model.seq_len
    model_f, hw_f = step_flops(from_model_config(cfg.model), tokens, recompute_kind(est.layout.recompute)[0])
    n = cfg.world_size
    est.step_time_s = step.step_time_s
    est.tokens_per_s = tokens / step.step_time_s
    est.model_tflops_per_gpu = model_f / step.step_time_s / n / 1e12
    est.hardware_tflops_per_gpu = hw_f / step.step_time_s / n / 1e12
    est.mfu = model_f / step.step_time_s / n / peak_flops
    est.bubble_fraction = step.bubble_fraction
    est.time_breakdown = dict(step.breakdown)
