"""What `scaletrain plan --config --calibrate` measures of one rank's step, at the run's sizes and shapes, on this
machine: the profile of a profile-based cost model (PipeDream's profiler, Narayanan et al. arXiv 1806.03377
Sec. 3.1; Alpa, Zheng et al. arXiv 2201.12023 Sec. 5). `run_time.py` composes the step from it.

Measured (`RunProbe.sample`, repeated by `collect_samples`):
- one transformer block of this rank (tensor-parallel shapes from `run_memory.engine_module_on_meta`,
  fp32 layer norms under bf16/fp16, the run's recomputation wrapper, dropout), forward and backward
  separately, one microbatch, with the per-parameter gradient hooks the engine installs (fp32 gradient
  accumulation under mixed precision, bucket readiness under data parallelism or ZeRO); for a
  mixture-of-experts run also the MoE block (block `every - 1`, with all E experts on this rank's slots: under
  expert parallelism a rank runs E/ep experts on ep times the slots, the same work);
- the embedding (forward, backward) and the final norm + head + loss (forward, backward);
- the optimizer: gradient-norm passes (unscale check and clipping) and the optimizer's step over the
  tensors this rank's optimizer really holds (whole parameters with ZeRO 0, the shard pieces with ZeRO),
  plus the fp32-master copy-back under mixed precision;
- the loader producing this rank's micro-batches;
- with several processes (`RunProbe(cfg, mesh)` on the run's groups): under tensor parallelism the block,
  embedding and head split over the real tp group, so their times include the Megatron collectives (the other
  collectives are timed in place by `run_comm.py`);
- offload=nvme: the offload folder's read and write bandwidth (`disk_bandwidth`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from scaletrain.config import Config
from scaletrain.plan.analytic.comm import MeasuredLink
from scaletrain.plan.exact import run_memory


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

    def _optimizer_pieces(self) -> list[tuple[tuple[int, ...], int, int]]:
        """(whole shape, a, b) of the tensors this rank's optimizer steps: whole parameters (ZeRO 0, [0, numel)) or
        the flat ranges [a, b) of each parameter that the fullest rank's shard holds (ZeRO 1-3, `parallel.zero`'s
        grouping)."""
        cfg = self.cfg
        module = run_memory.engine_module_on_meta(cfg, 0)
        params = [p for p in module.parameters() if p.requires_grad]
        if cfg.parallel.zero == 0:
            return [(tuple(p.shape), 0, p.numel()) for p in params]
        from scaletrain.parallel.zero import group_params

        n = cfg.parallel.dp
        pieces: list[tuple[tuple[int, ...], int, int]] = []
        for group in group_params(module, cfg.parallel.zero, cfg.parallel.bucket_mb):
            numel = sum(p.numel() for p in group)
            shard = max(1, math.ceil(numel / n))
            off = 0
            for p in group:  # rank 0's pieces
                a, b = max(off, 0), min(off + p.numel(), shard)
                if a < b:
                    pieces.append((tuple(p.shape), a - off, b - off))
                off += p.numel()
        return pieces

    def _build_optimizer(self, seed: int) -> None:
        """The optimizer the engine steps, over this rank's tensors: the configured one on whole parameters (ZeRO 0)
        or on the shard's flat pieces (element-wise ones under ZeRO), or `zero_factored.ShardedFactored` over the
        pieces (Adafactor / SM3 under ZeRO; its statistics' all-reduces are not timed here)."""
        from scaletrain.optim import build_optimizer, config_hyper, optimizer_spec

        cfg = self.cfg
        low = cfg.train.dtype in run_memory.LOW
        dtype = torch.float32 if low else run_memory._TORCH[cfg.train.dtype]
        g = torch.Generator().manual_seed(seed + 1)
        pieces = self._optimizer_pieces()
        whole = cfg.parallel.zero == 0
        shapes = [shape if whole else (b - a,) for shape, a, b in pieces]
        self.opt_params = [nn.Parameter(torch.randn(s, generator=g, dtype=dtype) * 0.02) for s in shapes]
        for p in self.opt_params:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * 1e-3
        hyper = config_hyper(cfg.optim, cfg.train.lr)
        if not whole and optimizer_spec(cfg.optim.name).factored:
            from scaletrain.parallel.zero_factored import DEFAULTS, ShardedFactored

            views = [{"shape": shape, "a": a, "b": b, "x": p.data, "grad": p.grad, "dtype": dtype,
                      "device": p.device, "contribute": True} for (shape, a, b), p in zip(pieces, self.opt_params)]
            self.opt = ShardedFactored(cfg.optim.name, views, None, {**DEFAULTS[cfg.optim.name], **hyper},
                                       cfg.optim.weight_decay)
        else:
            self.opt = build_optimizer(cfg.optim.name, [{"params": self.opt_params,
                                                         "weight_decay": cfg.optim.weight_decay}], **hyper)
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
