"""ZeRO stages 1, 2 and 3 over the data-parallel group, with CPU offload.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv 1910.02054; ZeRO-Offload, Ren et al., arXiv 2101.06840.

Parameters are packed into flat buffers padded to a multiple of the dp size N; rank r owns the slice
[r*S, (r+1)*S), S = padded / N. The optimizer (AdamW) runs on *pieces*: the intersections of each
parameter with the owned slice, as views, grouped by weight decay, so its arithmetic is elementwise the
same as the unsharded AdamW and the padding never enters it.

- Stage 1: gradients live in full flat buffers (as plain DP); after the last micro-batch each bucket is
  reduce-scattered in place (so a rank's shard of the summed gradient is its slice of the buffer);
  each rank updates its shard; the updated shards are all-gathered. Volume = DP's (RS + AG = AR).
- Stage 2: as stage 1, but gradients are not kept: when every parameter of a bucket has its gradient,
  the bucket is copied to a transient flat buffer, reduce-scattered into the owned shard accumulator and
  the full gradients are dropped (every micro-batch, as DeepSpeed does with accumulation).
- Stage 3: parameters are partitioned too. Units (each transformer block, and the root module for what
  is left: embeddings, final norm, head) keep only their shard; a unit's flat buffer is re-allocated and
  all-gathered just before its forward and again before its backward (prefetching the next unit in
  execution order), and its storage is released right after (FSDP's storage-resize trick, so tensors
  autograd saved stay valid). Gradients are reduce-scattered per unit. Volume = 1.5x DP's (section 7).
- Offload: `optimizer` keeps the fp32 master shard and the AdamW state on the CPU and steps there;
  `params` (stage 3) also keeps the parameter shards on the CPU between uses. On a CPU-only machine the
  same code runs and the offload is a copy between separate buffers.

Gradient clipping uses the true global norm: squared norms of the owned shards are summed over all ranks.

Variants that keep the shards elsewhere (ZeRO-Infinity, `zero_nvme.py`) subclass `ZeroOptimizer` and build on this
module's public pieces: `FlatGroup` and `make_group` (a unit's padded flat buffer and this rank's pieces of it),
`unit_list` / `unit_params` (the ZeRO-3 units and their own parameters), `preserve_version` (write into a buffer
autograd saved without bumping its version) and `in_backward` (whether autograd's backward is running); the
overridable steps are `_setup_stage3`, `_setup_masters`, `_gather` / `_wait_gather`, `_complete` and the protocol's
methods.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import OptimConfig, ParallelConfig
from scaletrain.device.kernels import pinned
from scaletrain.distributed.comm import CommStats, all_gather_single, group_size, reduce_scatter_single
from scaletrain.distributed.mesh import Mesh
from scaletrain.optim import config_hyper, optimizer_spec, state_elements
from scaletrain.parallel.data_parallel import bucket_params
from scaletrain.parallel.engine import EngineOptimizer, weak_grad_hook
from scaletrain.parallel.norms import clip_coefficient, is_norm_owner, squared_norm
from scaletrain.parallel.shared_blocks import shared_modules
from scaletrain.parallel.zero_gather import GatherMeter

preserve_version = torch.autograd._unsafe_preserve_version_counter
"""Context manager: writes into a tensor inside it do not bump its version counter (a gathered ZeRO-3 buffer that
autograd saved stays valid)."""


def in_backward() -> bool:
    """Whether autograd's backward is running on this thread (a recomputation, not a first forward)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class Piece:
    """The part of parameter `param` that lies in this rank's shard: shard[lo:hi] == flat(param)[a:b]."""

    param: nn.Parameter
    lo: int
    hi: int
    a: int
    b: int


@dataclass
class FlatGroup:
    """A bucket (stages 1-2) or a unit's own parameters (stage 3) in one padded flat buffer."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    shard: int  # S, elements per rank
    rank: int
    full: torch.Tensor  # padded flat parameters (stage 3: storage released between uses)
    grad_full: torch.Tensor | None = None  # stage 1: persistent full gradient buffer
    shard_grad: torch.Tensor | None = None  # this rank's reduced gradient slice
    param_shard: torch.Tensor | None = None  # stage 3: the persistent parameter slice (device or CPU)
    master: torch.Tensor | None = None  # what the optimizer updates (a view of full, or its own buffer)
    master_grad: torch.Tensor | None = None  # offload: CPU copy of shard_grad
    pieces: list[Piece] = field(default_factory=list)
    piece_params: list[nn.Parameter] = field(default_factory=list)  # optimizer views of the pieces
    ready: int = 0
    pending: Any = None  # stage 3 all-gather in flight: (work, source)
    waiting: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # stages 2-3: (offset, .grad) not reduced yet
    offset_of: dict[int, int] = field(default_factory=dict)  # id(parameter) -> its offset in the flat buffer

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rank * self.shard: (self.rank + 1) * self.shard]


def make_group(params: list[nn.Parameter], n: int, rank: int, device: torch.device) -> FlatGroup:
    """`params` packed into one flat buffer padded to a multiple of `n`, with this rank's pieces of them."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    shard = max(1, math.ceil(total / n))
    full = torch.zeros(shard * n, dtype=params[0].dtype, device=device)
    g = FlatGroup(params, offsets, total, shard, rank, full, offset_of={id(p): o for p, o in zip(params, offsets)})
    lo_own, hi_own = rank * shard, (rank + 1) * shard
    for p, off in zip(params, offsets):
        a, b = max(off, lo_own), min(off + p.numel(), hi_own)
        if a < b:
            g.pieces.append(Piece(p, a - lo_own, b - lo_own, a - off, b - off))
    return g


class ZeroOptimizer(EngineOptimizer):
    """ZeRO stage 1, 2 or 3 over `group` for the parameters of `module`, with AdamW (or `optimizer`, another one
    the registry says ZeRO shards, with its constructor keywords `hyper`).

    The engine protocol (`engine.EngineOptimizer`): begin_micro(i, n) before each micro-batch, finish_backward() after
    the last backward, clip_grad_norm(max_norm), step(lr), zero_grad(). `reduce="mean"` averages gradients over
    the group (the usual convention for per-rank mean losses); the trainer uses "sum" because its loss is
    normalised by the global token count.
    """

    def __init__(self, module: nn.Module, stage: int, group: dist.ProcessGroup | None, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bucket_mb: float = 25.0, offload: str = "none", reduce: str = "sum",
                 comm: CommStats | None = None, units: Iterable[nn.Module] | None = None,
                 world_norm: bool = True, optimizer: str = "adamw", hyper: dict | None = None,
                 tp_group: dist.ProcessGroup | None = None, ep_group: dist.ProcessGroup | None = None,
                 params: list[nn.Parameter] | None = None, gather: str = "unit", reshard_after_forward: bool = True):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        spec = optimizer_spec(optimizer)
        if not spec.sharded:
            raise ValueError(f"ZeRO does not shard optimizer {spec.name}: its state is kept whole (parallel.zero=0)")
        if offload == "params" and stage != 3:
            raise ValueError("offload=params needs ZeRO stage 3")
        if offload not in ("none", "optimizer", "params") and type(self) is ZeroOptimizer:
            raise ValueError(f"offload={offload!r}: NVMe offload is parallel.zero_nvme.NvmeZeroOptimizer")
        self.module, self.stage, self.group, self.comm = module, stage, group, comm or CommStats()
        self.n = group_size(group)
        self.rank = dist.get_rank(group) if group is not None else 0
        self.offload, self.mean = offload, reduce == "mean"
        self.world_norm = world_norm
        # `params`: a subset of the module's parameters (expert parallelism shards the experts over another
        # group than the dense parameters: two ZeroOptimizers over one module)
        params = [p for p in (params if params is not None else module.parameters()) if p.requires_grad]
        self.device = params[0].device
        # Mixed precision: bf16/fp16 parameters, fp32 gradient accumulators and fp32 master shards.
        low = params[0].dtype in (torch.bfloat16, torch.float16)
        self.grad_dtype = torch.float32 if low else params[0].dtype
        self.main_grads = low  # low-precision .grad is added into fp32 buffers by the hook, then dropped
        self.sync = True
        self.in_flight: list[tuple] = []  # reduce-scatters in flight: (group, work, output, input)
        self.arena = None  # memory.contiguous: transient gradient buffers from this arena (`use_arena`)
        # ZeRO-3 parameter gathering: `unit` (each unit gathered before its forward and again before its
        # backward, released after each: the least memory) or `step` (every unit gathered once when a step
        # begins and kept until its backward work is done: for pipeline parallelism, whose schedules interleave
        # the forwards and backwards of many micro-batches — FSDP's reshard_after_forward=False under PP)
        if gather not in ("unit", "step"):
            raise ValueError(f"gather must be unit or step, got {gather!r}")
        self.gather_per_step = stage == 3 and gather == "step"
        # per unit: release after the forward and gather again for the backward (true), or keep the gathered
        # parameters from the forward until the unit's gradients are reduced (false: FSDP's reshard_after_forward)
        self.reshard_after_forward = reshard_after_forward
        self.gathered = GatherMeter()  # the gathered parameter bytes alive now and at most (mem_params_gathered)
        self.fp8_gather = None  # train.fp8_all_gather: FP8 weights gathered in float8 (parallel/zero_fp8.py)
        if stage == 3:
            self._setup_stage3(module, params, units)
        else:
            self.groups = [make_group(b, self.n, self.rank, self.device)
                           for b in bucket_params(list(reversed(params)), int(bucket_mb * 2**20))]
            self._setup_buckets()
        self._setup_masters()
        if spec.factored:  # Adafactor / SM3: factored states combined over the shards
            from scaletrain.parallel.zero_factored import DEFAULTS, ShardedFactored

            # statistics combined over the shards (group), tensor-parallel slices and expert-parallel stacks
            self.opt = ShardedFactored(spec.name, self._param_pieces(tp_group), [group, tp_group, ep_group],
                                       {**DEFAULTS[spec.name], **(hyper or {})}, weight_decay)
            return
        from scaletrain.optim import build_optimizer

        # an element-wise optimizer (AdamW) steps the pieces as views: the same arithmetic as on whole tensors
        decay = [pc for g in self.groups for pc in g.piece_params if pc.ndim_orig >= 2]
        no_decay = [pc for g in self.groups for pc in g.piece_params if pc.ndim_orig < 2]
        self.opt = build_optimizer(spec.name, [{"params": decay, "weight_decay": weight_decay},
                                               {"params": no_decay, "weight_decay": 0.0}],
                                   **(hyper if hyper is not None else {"lr": lr, "betas": betas, "eps": eps}))

    @classmethod
    def from_config(cls, module: nn.Module, optim: OptimConfig, par: ParallelConfig, lr: float, mesh: Mesh,
                    comm: CommStats, params: list[nn.Parameter] | None = None, dim: str = "dp") -> ZeroOptimizer:
        """The run's ZeroOptimizer (stage `par.zero`, `optim.name` at base learning rate `lr`) over mesh's `dim` group
        (dp, dp_dep under 2.5d tensor parallelism, or edp for expert parameters), for `params` (all of the module's
        by default)."""
        return cls(module, par.zero, mesh.group(dim), weight_decay=optim.weight_decay, bucket_mb=par.bucket_mb,
                   offload=par.offload, comm=comm, optimizer=optim.name, hyper=config_hyper(optim, lr),
                   tp_group=mesh.group("tp"), ep_group=mesh.group("ep") if dim in ("edp", "edp_cp") else None,
                   params=params, gather="step" if par.pp > 1 else "unit",
                   reshard_after_forward=par.reshards_after_forward)

    def _param_pieces(self, tp_group: dist.ProcessGroup | None = None) -> list[dict]:
        """Every parameter, in the same order on every rank, with this rank's piece of it (maybe empty). Under
        tensor parallelism a piece is a flat range of the local shard: its elements are placed in the whole
        parameter by `zero_factored.tp_placement`."""
        from scaletrain.parallel.zero_factored import tp_placement

        out = []
        for g in self.groups:
            grads = g.master_grad if g.master_grad is not None else g.shard_grad
            mine = {id(pc.param): pc for pc in g.pieces}
            for p in g.params:
                pc = mine.get(id(p))
                lo, hi, a, b = (pc.lo, pc.hi, pc.a, pc.b) if pc else (0, 0, 0, 0)
                piece = {"shape": tuple(p.shape), "a": a, "b": b, "x": g.master[lo:hi], "grad": grads[lo:hi],
                         "dtype": g.master.dtype, "device": g.master.device}
                if tp_group is not None or hasattr(p, "_st_ep_shard"):
                    shape, idx, mine_stats = tp_placement(p, tp_group)
                    piece.update(shape=shape, contribute=mine_stats)
                    if idx is not None:
                        piece["idx"] = idx[a:b]
                out.append(piece)
        return out

    # ------------------------------------------------------------------ layout

    def _setup_buckets(self) -> None:
        self._group_of: dict[int, FlatGroup] = {}
        for g in self.groups:
            with torch.no_grad():
                for p, off in zip(g.params, g.offsets):
                    g.full[off: off + p.numel()].copy_(p.reshape(-1))
                    p.data = g.full[off: off + p.numel()].view_as(p)
            if self.stage == 1:
                g.grad_full = torch.zeros(g.full.numel(), dtype=self.grad_dtype, device=self.device)
                g.shard_grad = g.own(g.grad_full)  # reduce-scattered in place
                if not self.main_grads:
                    for p, off in zip(g.params, g.offsets):
                        p.grad = g.grad_full[off: off + p.numel()].view_as(p)
            else:
                g.shard_grad = torch.zeros(g.shard, dtype=self.grad_dtype, device=self.device)
            for p in g.params:
                self._group_of[id(p)] = g
        for g in self.groups:
            for p in g.params:
                p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad_ready))

    def _setup_stage3(self, module: nn.Module, params: list[nn.Parameter], units) -> None:
        self.units = units = unit_list(module, units)
        self.groups = []
        self._group_of = {}
        self._unit_group: dict[int, FlatGroup] = {}
        for u, own in zip(units, unit_params(units, params)):
            if not own:
                continue
            g = make_group(own, self.n, self.rank, self.device)
            with torch.no_grad():
                for p, off in zip(g.params, g.offsets):
                    g.full[off: off + p.numel()].copy_(p.reshape(-1))
                    p.data = g.full[off: off + p.numel()].view_as(p)
            keep_on = torch.device("cpu") if self.offload == "params" else self.device
            g.param_shard = pinned(g.own(g.full).clone().to(keep_on), self.device)  # async copies to a GPU
            g.shard_grad = torch.zeros(g.shard, dtype=self.grad_dtype, device=self.device)
            self._release(g)
            self.groups.append(g)
            self._unit_group[id(u)] = g
            for p in g.params:
                self._group_of[id(p)] = g
                p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad_ready))
        self.order = [u for u in units if id(u) in self._unit_group]
        if self.gather_per_step:
            return  # gathered by begin_step / params_gathered, released by finish_backward
        for i, u in enumerate(self.order):
            u.register_forward_pre_hook(self._make_pre_forward(i))
            u.register_forward_hook(self._make_post_forward(i))

    def _setup_masters(self) -> None:
        """Masters: the owned parameter slice itself where possible; a separate buffer with CPU offload
        (on the host) or mixed precision (fp32)."""
        for g in self.groups:
            src = g.param_shard if self.stage == 3 else g.own(g.full)
            if self.offload != "none":
                keep = self.stage == 3 and self.offload == "params" and not self.main_grads
                g.master = src if keep else pinned(src.detach().to("cpu", self.grad_dtype, copy=True), self.device)
                g.master_grad = pinned(torch.zeros(g.shard, dtype=g.master.dtype, device="cpu"), self.device)
            elif self.main_grads:
                g.master = src.detach().to(self.grad_dtype, copy=True)
            else:
                g.master = src
            g.piece_params = []
            for pc in g.pieces:
                t = nn.Parameter(g.master[pc.lo: pc.hi])
                t.ndim_orig = pc.param.ndim
                grad_src = g.master_grad if g.master_grad is not None else g.shard_grad
                t.grad = grad_src[pc.lo: pc.hi]
                g.piece_params.append(t)

    # ------------------------------------------------------------------ stage 3 gather / release

    def _release(self, g: FlatGroup) -> None:
        g.full.untyped_storage().resize_(0)
        self.gathered.drop(g)

    def _gather(self, g: FlatGroup, async_op: bool) -> None:
        if g.full.untyped_storage().nbytes() > 0 or g.pending is not None:
            return
        g.full.untyped_storage().resize_(g.full.numel() * g.full.element_size())
        self.gathered.add(g, g.full.numel() * g.full.element_size())
        src = g.param_shard.to(self.device, non_blocking=True)
        if self.fp8_gather is not None and self.fp8_gather.handles(g):
            work, unpack = self.fp8_gather.start(g, src, async_op)
            g.pending = (work, src, unpack) if async_op else unpack()
            return
        if self.n == 1:
            with preserve_version(g.full):
                g.full.copy_(src)
            return
        self.comm.add("all_gather", (self.n - 1) / self.n * g.full.numel() * g.full.element_size())
        with preserve_version(g.full):
            work = all_gather_single(g.full, src, group=self.group, async_op=async_op)
        if async_op:
            g.pending = (work, src)

    def begin_step(self) -> None:
        """ZeRO-3 gathered per step: all-gather every unit of this rank (async, then wait for all)."""
        if self.gather_per_step:
            for g in self.groups:
                self._gather(g, async_op=True)
            for g in self.groups:
                self._wait_gather(g)

    @contextmanager
    def params_gathered(self):
        """The parameters gathered for the duration of the block (evaluation), released after."""
        self.begin_step()
        try:
            yield
        finally:
            if self.gather_per_step:
                for g in self.groups:
                    self._release(g)

    def _wait_gather(self, g: FlatGroup) -> None:
        self._gather(g, async_op=False)
        if g.pending is not None:
            g.pending[0].wait()
            if len(g.pending) > 2:
                g.pending[2]()  # float8 all-gather: unpack into the flat buffer
            g.pending = None

    def _make_pre_forward(self, i: int) -> Callable:
        def hook(module, args):
            g = self._unit_group[id(module)]
            self._wait_gather(g)
            if i + 1 < len(self.order):  # prefetch the next unit in forward order
                self._gather(self._unit_group[id(self.order[i + 1])], async_op=True)
        return hook

    def _make_post_forward(self, i: int) -> Callable:
        def hook(module, args, output):
            g = self._unit_group[id(module)]
            if in_backward():  # a recomputation inside backward: keep the parameters for that backward
                return output
            out = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                if not self.reshard_after_forward:
                    return output  # kept gathered for the backward; released when the unit's gradients are reduced
                out.register_hook(self._make_pre_backward(i))  # re-gather just before this unit's backward
            self._release(g)
            return output
        return hook

    def _make_pre_backward(self, i: int) -> Callable:
        def hook(grad):
            self._wait_gather(self._unit_group[id(self.order[i])])
            # prefetch the unit whose backward comes next: the previous block (the root's next is the last)
            nxt = len(self.order) - 1 if i == 0 else i - 1
            if nxt != i and nxt > 0:
                self._gather(self._unit_group[id(self.order[nxt])], async_op=True)
            return grad
        return hook

    # ------------------------------------------------------------------ gradients

    def begin_micro(self, index: int, count: int) -> None:
        self.sync = self.stage >= 2 or index == count - 1
        for g in self.groups:
            g.ready = 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        g = self._group_of[id(p)]
        if self.main_grads and self.stage == 1:  # accumulate into the fp32 buffer every micro-batch
            off = g.offset_of[id(p)]
            g.grad_full[off: off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        if self.stage >= 2:
            # taken now, not at the bucket's reduce: a pipeline whose weight passes interleave (ZB-V) can hand over the
            # next micro-batch's gradient first, and autograd would add the two in the parameters' precision (fp16
            # overflowing where the fp32 sum does not); _reduce adds them in grad_dtype
            g.waiting.append((g.offset_of[id(p)], p.grad))
            p.grad = None
        if not self.sync:
            return
        g.ready += 1
        if g.ready == len(g.params):
            self._reduce(g)

    def use_arena(self, arena) -> None:
        """memory.contiguous: stages 2-3 take each micro-batch's full-bucket gradient buffer and reduce-scatter output
        from `arena` (slots reused every step, memory/contiguous.py) instead of allocating them."""
        self.arena = arena

    def _buffer(self, numel: int, zero: bool) -> torch.Tensor:
        if self.arena is None:
            return (torch.zeros if zero else torch.empty)(numel, dtype=self.grad_dtype, device=self.device)
        slot = self.arena.zeros(numel, self.grad_dtype, self.device) if zero else \
            self.arena.take((numel,), self.grad_dtype, self.device)
        self._slots.append(slot)
        return slot.tensor

    def _reduce(self, g: FlatGroup) -> None:
        """Reduce-scatter the bucket's gradients into the owned shard (async; finished in _complete)."""
        self._slots: list = []
        if self.stage == 1:
            flat = g.grad_full
        else:
            flat = self._buffer(g.full.numel(), zero=True)
            for off, grad in g.waiting:
                flat[off: off + grad.numel()].add_(grad.reshape(-1))
            g.waiting.clear()
            for p, off in zip(g.params, g.offsets):
                if p.grad is not None:  # set by other code than autograd since the hook took the last one
                    flat[off: off + p.numel()].add_(p.grad.reshape(-1))
                p.grad = None  # a rank never keeps the full gradient after its bucket is reduced
            if self.stage == 3 and not self.gather_per_step:
                self._release(g)
        if self.n == 1:
            self._complete(g, flat, None)
            for slot in self._slots:
                slot.release()
            return
        self.comm.add("reduce_scatter", (self.n - 1) / self.n * flat.numel() * flat.element_size())
        out = g.own(flat) if self.stage == 1 else self._buffer(g.shard, zero=False)
        work = reduce_scatter_single(out, flat, group=self.group, async_op=True)
        self.in_flight.append((g, work, out, flat, self._slots))
        if self.stage >= 2 and len(self.in_flight) > 2:  # bound the transient full-gradient buffers
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        g, work, out, flat, slots = self.in_flight.pop(0)
        work.wait()
        self._complete(g, flat, out)
        for slot in slots:
            slot.release()

    def _complete(self, g: FlatGroup, flat: torch.Tensor, out: torch.Tensor | None) -> None:
        if self.stage >= 2:  # stage 1 reduced in place: its shard is already a slice of grad_full
            g.shard_grad += g.own(flat) if out is None else out

    def finish_backward(self) -> None:
        if self.sync:
            for g in self.groups:  # parameters that got no gradient this step
                if g.ready < len(g.params) or g.waiting:
                    self._reduce(g)
        while self.in_flight:
            self._complete_oldest()
        if self.mean and self.n > 1 and self.sync:
            for g in self.groups:
                g.shard_grad.div_(self.n)
        if self.stage == 3:
            for g in self.groups:
                if g.pending is not None:  # a prefetch nobody used
                    g.pending[0].wait()
                    g.pending = None
                self._release(g)

    # ------------------------------------------------------------------ step

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: its shards (disjoint over the group), the
        elements tensor or pipeline parallelism holds twice counted by their owner only."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in self.groups:
            for pc in g.pieces:
                if is_norm_owner(pc.param):
                    sq += g.shard_grad[pc.lo: pc.hi].double().square().sum()
        return sq

    def scale_grads_(self, coef: float | torch.Tensor) -> None:
        for g in self.groups:
            g.shard_grad.mul_(coef)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` by the global norm; returns the norm before clipping (0-dim device tensor)."""
        sq = self.local_grad_sq()
        if dist.is_initialized() and (self.world_norm or self.group is not None):
            dist.all_reduce(sq, group=None if self.world_norm else self.group)
        norm = sq.sqrt()
        if max_norm > 0:
            self.scale_grads_(clip_coefficient(norm, max_norm))  # no host read: x 1 when within bounds
        return norm

    def step(self, lr: float | None = None) -> None:
        if lr is not None:
            for pg in self.opt.param_groups:
                pg["lr"] = lr
        host = self.offload != "none" and self.device.type == "cuda"
        for g in self.groups:
            if g.master_grad is not None:
                g.master_grad.copy_(g.shard_grad, non_blocking=host)  # to pinned host memory
        if host:  # the one wait of an offloaded step: the host optimizer needs the gradients
            torch.cuda.current_stream(self.device).synchronize()
        self.opt.step()
        works = []
        for g in self.groups:
            if self.stage == 3:
                if g.master is not g.param_shard:
                    g.param_shard.copy_(g.master, non_blocking=host)
                continue
            if g.master is not None and g.master.data_ptr() != g.own(g.full).data_ptr():
                g.own(g.full).copy_(g.master, non_blocking=host)
            if self.n > 1:  # every rank gets everybody's updated slice
                self.comm.add("all_gather", (self.n - 1) / self.n * g.full.numel() * g.full.element_size())
                works.append(all_gather_single(g.full, g.own(g.full).clone(), group=self.group, async_op=True))
        for w in works:
            w.wait()

    def zero_grad(self) -> None:
        for g in self.groups:
            if g.grad_full is not None:
                g.grad_full.zero_()
            else:
                g.shard_grad.zero_()

    # ------------------------------------------------------------------ state

    @property
    def owns_params(self) -> bool:
        """Stage 3: the parameters live here as shards, not in the module."""
        return self.stage == 3

    @property
    def separate_masters(self) -> bool:
        g = self.groups[0]
        return g.master is not (g.param_shard if self.stage == 3 else None) and \
            g.master.untyped_storage()._cdata != g.full.untyped_storage()._cdata

    def gather_params(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full parameter values by name (stage 3 gathers each unit; other stages already hold them)."""
        if self.stage != 3:
            return local
        names: dict[int, list[str]] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        out = dict(local)
        fp8, self.fp8_gather = self.fp8_gather, None  # the exact values, not their float8 rounding
        for g in self.groups:
            if fp8 is not None:  # held or arriving values may be the float8 ones: gather again
                self._wait_gather(g)
                self._release(g)
            self._wait_gather(g)
            for p in g.params:
                for n in names[id(p)]:
                    out[n] = p.detach().clone()
            self._release(g)
        self.fp8_gather = fp8
        return out

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        params: list[torch.Tensor] = [g.full for g in self.groups]
        if self.stage == 3:
            params += [g.param_shard for g in self.groups]
        grads: list[torch.Tensor] = [g.grad_full if g.grad_full is not None else g.shard_grad for g in self.groups]
        optim = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if self.separate_masters:  # fp32 masters count as optimizer state (ZeRO's K = 12 for mixed precision)
            optim += [g.master for g in self.groups]
        optim += [g.master_grad for g in self.groups if g.master_grad is not None]
        return {"params": params, "grads": grads, "optim": optim}

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        """Multiply this rank's gradient shards by `inv_scale`; a bool device tensor: whether any is inf or NaN."""
        shards = [g.shard_grad for g in self.groups]
        if inv_scale != 1.0:
            torch._foreach_mul_(shards, inv_scale)
        return ~torch.isfinite(squared_norm(shards, self.device))


def unit_list(module: nn.Module, units: Iterable[nn.Module] | None) -> list[nn.Module]:
    units = list(units) if units is not None else default_units(module)
    return units if module in units else [module, *units]


def unit_params(units: list[nn.Module], params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Each unit's own parameters: innermost units claim first, the root keeps what nobody else has."""
    owner: dict[int, nn.Module] = {}
    for u in reversed(units):
        for p in u.parameters():
            if p.requires_grad:
                owner.setdefault(id(p), u)
    return [[p for p in params if owner.get(id(p)) is u] for u in units]


def group_params(module: nn.Module, stage: int, bucket_mb: float, units=None,
                 params: list[nn.Parameter] | None = None) -> list[list[nn.Parameter]]:
    """The flat groups ZeroOptimizer builds (for `params`, all of the module's by default): buckets in reverse
    registration order (stages 1-2) or the units' own parameters (stage 3). Works on a meta-device model (used by
    the planner)."""
    params = [p for p in (params if params is not None else module.parameters()) if p.requires_grad]
    if stage == 3:
        return [g for g in unit_params(unit_list(module, units), params) if g]
    return bucket_params(list(reversed(params)), int(bucket_mb * 2**20))


def predict_bytes(module: nn.Module, stage: int, n: int, bucket_mb: float = 25.0, offload: str = "none",
                  units=None, optimizer: str = "adamw", beta1: bool = False, momentum: bool = False) -> dict[str, int]:
    """The fullest rank's bytes per category (each the max over ranks) of `predict_bytes_per_rank`."""
    ranks = predict_bytes_per_rank(module, stage, n, bucket_mb, offload, units, optimizer, beta1, momentum)
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def predict_bytes_per_rank(module: nn.Module, stage: int, n: int, bucket_mb: float = 25.0, offload: str = "none",
                           units=None, optimizer: str = "adamw", beta1: bool = False, momentum: bool = False,
                           params: list[nn.Parameter] | None = None) -> list[dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state that ZeroOptimizer holds on its fullest rank
    after a step, per category (each the max over ranks, as the trainer reports them), computed from the
    same grouping, padding and pieces as the optimizer. `module` may be on meta. `optimizer` is adamw
    (two moments per owned element and a step counter per piece) or adafactor / sm3 (their replicated
    factored statistics plus the owned elements of the element-wise states; `beta1` / `momentum` say
    whether the first moment exists)."""
    from scaletrain.parallel.zero_factored import state_sizes

    spec = optimizer_spec(optimizer)
    params = [p for p in (params if params is not None else module.parameters()) if p.requires_grad]
    elem = params[0].element_size()
    low = params[0].dtype in (torch.bfloat16, torch.float16)
    master_elem = 4 if low else elem
    grad_elem = 4 if low else elem
    step_bytes = 8 if torch.get_default_dtype() == torch.float64 else 4  # AdamW's scalar `step` per piece
    per_rank = []
    for rank in range(n):
        tot = {"params": 0, "grads": 0, "optim": 0}
        for group in group_params(module, stage, bucket_mb, units, params):
            numel = sum(p.numel() for p in group)
            shard = max(1, math.ceil(numel / n))
            lo, hi, off, pieces, piece_numel = rank * shard, (rank + 1) * shard, 0, 0, 0
            factored = 0
            for p in group:
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a < b:
                    pieces += 1
                    piece_numel += b - a
                if spec.factored:
                    shape = getattr(p, "_st_global_shape", tuple(p.shape))  # tp: statistics of the whole matrix
                    sizes = state_sizes(optimizer, shape, max(b - a, 0), beta1=beta1, momentum=momentum)
                    factored += sum(sizes.values())
                off += p.numel()
            tot["params"] += (shard if stage == 3 else shard * n) * elem
            tot["grads"] += (shard * n if stage == 1 else shard) * grad_elem
            if spec.factored:
                tot["optim"] += factored * master_elem
            else:
                tot["optim"] += state_elements(spec, piece_numel, momentum) * master_elem
                tot["optim"] += pieces * step_bytes if spec.step_tensor else 0
            if low or offload != "none":
                separate = not (stage == 3 and offload == "params" and not low)
                tot["optim"] += shard * master_elem * separate + (shard * master_elem if offload != "none" else 0)
        per_rank.append(tot)
    return per_rank


def default_units(module: nn.Module) -> list[nn.Module]:
    """ZeRO-3 units: the root module plus every element of every nn.ModuleList (transformer blocks), plus each module
    several of those share (model.share_blocks' attention and MLP, parallel/shared_blocks.py): a unit of its own,
    gathered for each block that calls it, its gradient (summed over the blocks) reduce-scattered once."""
    units: list[nn.Module] = [module]
    for m in module.modules():
        if isinstance(m, nn.ModuleList):
            units.extend(m)
    return units + shared_modules(units[1:])

