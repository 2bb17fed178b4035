"""Data parallelism: gradients summed over the data-parallel group in flat buckets, overlapped with backward.

Each parameter's `.grad` is a view into the flat gradient buffer of its bucket (PyTorch DDP's
`gradient_as_bucket_view`, Li et al., arXiv 2006.15704). Buckets follow the reverse order of parameter
registration, the approximate order in which backward produces gradients. A post-accumulate-grad hook
counts the parameters of a bucket that are ready; when the last one is, the bucket's all-reduce is
launched asynchronously, so communication overlaps the rest of backward. During gradient accumulation
only the last micro-batch communicates.

Loss normalisation is global (each micro-batch loss is divided by the token count of the whole global
batch), so the exact gradient of the single-process run is the *sum* of the ranks' gradients: the
buckets are all-reduced with SUM, not averaged.

`ReplicatedOptimizer` is the engine optimizer of plain data parallelism (ZeRO stage 0): the whole optimizer on every
rank over these buckets, with fp32 masters under bf16/fp16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import OptimConfig, ParallelConfig
from scaletrain.distributed.comm import CommStats, all_reduce, group_size
from scaletrain.distributed.mesh import Mesh
from scaletrain.optim import config_hyper, optimizer_spec
from scaletrain.parallel.engine import EngineOptimizer, weak_grad_hook
from scaletrain.parallel.norms import clip_coefficient, global_grad_norm, is_norm_owner, squared_norm


def bucket_params(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters grouped into buckets of at most `bucket_bytes` (a larger one stands alone)."""
    out: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [b for b in out if b]


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    grad: torch.Tensor  # flat buffer; each param's .grad is a view into it
    ready: int = 0
    work: object = None
    offsets: list[int] = field(default_factory=list)


class BucketedAllReduce:
    """Owns the gradients of `params` and sums them over `group` as buckets fill during backward."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, bucket_mb: float,
                 stats: CommStats | None = None, grad_dtype: torch.dtype | None = None):
        self.group, self.stats = group, stats
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        # Mixed precision: gradients accumulate and are reduced in `grad_dtype` (fp32) "main gradient"
        # buffers, each micro-batch's low-precision .grad being added in by the hook and then dropped.
        self.main_grads = grad_dtype is not None and grad_dtype != self.params[0].dtype
        self.views: dict[int, torch.Tensor] = {}  # param id -> its slice of the bucket buffer
        for plist in bucket_params(list(reversed(self.params)), int(bucket_mb * 2**20)):
            numel = sum(p.numel() for p in plist)
            flat = torch.zeros(numel, dtype=grad_dtype or plist[0].dtype, device=plist[0].device)
            bucket = Bucket(plist, flat)
            offset = 0
            for p in plist:
                bucket.offsets.append(offset)
                self.views[id(p)] = flat[offset: offset + p.numel()].view(p.shape)
                if not self.main_grads:
                    p.grad = self.views[id(p)]
                offset += p.numel()
                self._bucket_of[id(p)] = bucket
            self.buckets.append(bucket)
        self.sync = True
        self.exposed_s = 0.0  # time spent waiting for communication after backward (not hidden)
        # With several ranks, zero_grad drops .grad instead of zeroing the buckets: the first backward of a
        # step then writes a fresh gradient that the hook copies into the bucket (one pass over the memory
        # instead of a zeroing pass plus an accumulation), later micro-batches accumulate in place.
        self.copy_in = not self.main_grads and group_size(group) > 1
        if group_size(group) > 1 or self.main_grads:
            for p in self.params:
                p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad_ready))

    def begin_micro(self, index: int, count: int) -> None:
        """Called before each micro-batch's backward: communicate only after the last one."""
        self.sync = index == count - 1
        if self.sync:
            for b in self.buckets:
                b.ready, b.work = 0, None

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.main_grads:
            self.views[id(p)].add_(p.grad)
            p.grad = None
        elif self.copy_in and p.grad.data_ptr() != self.views[id(p)].data_ptr():
            self.views[id(p)].copy_(p.grad)
            p.grad = self.views[id(p)]
        if not self.sync or group_size(self.group) == 1:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = all_reduce(bucket.grad, self.group, stats=self.stats, async_op=True)

    def finish(self) -> None:
        """After the last backward: launch buckets whose parameters got no gradient, wait for all."""
        if group_size(self.group) == 1:
            return
        t0 = time.perf_counter()
        for b in self.buckets:
            if b.work is None:
                if self.copy_in:  # parameters that got no gradient this step contribute zeros
                    for q in b.params:
                        if q.grad is None:
                            self.views[id(q)].zero_()
                            q.grad = self.views[id(q)]
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
        self.exposed_s += time.perf_counter() - t0

    def zero_grad(self) -> None:
        if self.copy_in:
            for p in self.params:
                p.grad = None
            return
        for b in self.buckets:
            b.grad.zero_()

    def grad_tensors(self) -> list[torch.Tensor]:
        return [b.grad for b in self.buckets]

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The (reduced) gradient of `p`: its slice of the bucket buffer."""
        return self.views[id(p)]


class ReplicatedOptimizer(EngineOptimizer):
    """Plain data parallelism (ZeRO stage 0): the full optimizer on every rank, gradients bucket-all-reduced.

    With bf16/fp16 parameters pass `masters`: fp32 copies the optimizer updates (it must have been built
    over them); gradients then accumulate and are all-reduced in fp32, and the updated masters are copied
    back into the low-precision parameters after each step.
    """

    def __init__(self, params: list[nn.Parameter], opt: torch.optim.Optimizer | None,
                 group: dist.ProcessGroup | None, bucket_mb: float = 25.0, comm: CommStats | None = None,
                 reduce: str = "sum", masters: list[torch.Tensor] | None = None, world_norm: bool = True):
        self.params, self.opt, self.group, self.masters = params, opt, group, masters
        # world_norm: the norm's owners are spread over the world (tp shards, pp stages) and one all-reduce
        # sums them; False when the model is only replicated over `group`: every rank has the whole norm.
        self.world_norm = world_norm
        self.reducer = BucketedAllReduce(params, group, bucket_mb, comm,
                                         grad_dtype=masters[0].dtype if masters else None)
        self.grads = [self.reducer.grad_of(p) for p in params]
        for m, g in zip(masters or [], self.grads):
            m.grad = g
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        self.mean = reduce == "mean"

    @classmethod
    def from_config(cls, params: list[nn.Parameter], optim: OptimConfig, par: ParallelConfig, lr: float, mesh: Mesh,
                    comm: CommStats, dim: str = "dp") -> ReplicatedOptimizer:
        """`optim.name` at base learning rate `lr` over mesh's `dim` group: dp, or edp for expert parameters
        (parallel/experts.py)."""
        from scaletrain.optim import build_optimizer, decay_groups

        low = params[0].dtype in (torch.bfloat16, torch.float16)
        masters = [p.detach().float().clone().requires_grad_(True) for p in params] if low else None
        targets = masters or params
        # A factored optimizer (Adafactor / SM3) under tensor parallelism (or over a stack of experts split by expert
        # parallelism): a rank holds slices of the tensors, so their row / column statistics are combined over tp
        # (and ep) by ShardedFactored; otherwise the plain optimizer.
        experts = dim in ("edp", "edp_cp") and par.ep > 1
        sliced = optimizer_spec(optim.name).factored and (par.tp > 1 or experts)
        hyper = config_hyper(optim, lr)
        opt = None if sliced else build_optimizer(optim.name, decay_groups(targets, optim.weight_decay), **hyper)
        # The norm needs a world all-reduce only when its owners are spread over tp / pp / ep ranks.
        # PipeDream (arXiv 1806.03377) clips each stage by its own gradient's norm: no collective across stages.
        spread = (par.tp * par.pp * par.ep > 1 or dim != "dp") and par.schedule != "pipedream"
        out = cls(params, opt, mesh.group(dim), par.bucket_mb, comm, masters=masters, world_norm=spread)
        if sliced:
            from scaletrain.parallel.zero_factored import DEFAULTS, ShardedFactored, tp_pieces

            pieces = tp_pieces(params, targets, out.grads, mesh.group("tp"))
            groups = [mesh.group("tp"), mesh.group("ep") if experts else None]
            name = optimizer_spec(optim.name).name
            out.opt = ShardedFactored(name, pieces, groups, {**DEFAULTS[name], **hyper}, optim.weight_decay)
        return out

    def begin_micro(self, index: int, count: int) -> None:
        self.reducer.begin_micro(index, count)

    def finish_backward(self) -> None:
        self.reducer.finish()
        if self.mean and self.group is not None and self.reducer.sync:
            torch._foreach_div_(self.grads, dist.get_world_size(self.group))

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        """Multiply the gradients by `inv_scale`; a bool device tensor: whether any of this rank's is inf or NaN."""
        if inv_scale != 1.0:
            torch._foreach_mul_(self.grads, inv_scale)
        return ~torch.isfinite(squared_norm(self.grads, self.grads[0].device))

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: the replicas of its group count on group
        rank 0, the elements tensor or pipeline parallelism holds twice on their owner only."""
        owned = [g for p, g in zip(self.params, self.grads) if is_norm_owner(p)] if self.dp_rank == 0 else []
        return squared_norm(owned, self.params[0].device)

    def scale_grads_(self, coef: float | torch.Tensor) -> None:
        torch._foreach_mul_(self.grads, coef)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` by the global norm; returns the norm before clipping (0-dim device tensor)."""
        if self.world_norm:
            norm = global_grad_norm(self.local_grad_sq(), world=True)
        else:
            norm = squared_norm(self.grads, self.params[0].device).sqrt()
        if max_norm > 0:
            self.scale_grads_(clip_coefficient(norm, max_norm))
        return norm

    def step(self, lr: float | None = None) -> None:
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        self.opt.step()
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state and the fp32 masters (the asynchronous runners' per-worker checkpoints)."""
        return {"opt": self.opt.state_dict(), "masters": self.masters or []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["opt"])
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.masters, state["masters"])

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        states = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": list(self.params), "grads": self.reducer.grad_tensors(),
                "optim": states + list(self.masters or [])}
