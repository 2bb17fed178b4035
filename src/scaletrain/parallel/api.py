"""The two entry points of `scaletrain.parallel` for your own `nn.Module` (the package re-exports them):

    import scaletrain.parallel as stp
    opt = stp.zero(model, stage=3, lr=3e-4, weight_decay=0.1)      # or stp.data_parallel(model, torch.optim.AdamW(...))
    for x, y in batches:                                            # this rank's share of the batch
        opt.begin_micro(0, 1)
        loss = loss_fn(model(x), y)                                 # a per-rank mean loss
        loss.backward()
        opt.finish_backward()                                       # wait for the gradient collectives
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()

Both average gradients over the group (reduce="mean"), the convention for per-rank mean losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.parallel.data_parallel import ReplicatedOptimizer
from scaletrain.parallel.zero import ZeroOptimizer


def data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None,
                  bucket_mb: float = 25.0) -> ReplicatedOptimizer:
    """Bucketed, backward-overlapped gradient averaging over `group` (default: the whole job) around
    `optimizer`. The model's replicas must start equal (same init or a broadcast)."""
    group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    params = [p for p in model.parameters() if p.requires_grad]
    return ReplicatedOptimizer(params, optimizer, group, bucket_mb, reduce="mean", world_norm=False)


def zero(model: nn.Module, stage: int, group: dist.ProcessGroup | None = None, *, lr: float = 1e-3,
         betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
         bucket_mb: float = 25.0, offload: str = "none", units=None,
         reshard_after_forward: bool = True) -> ZeroOptimizer:
    """ZeRO stage 1, 2 or 3 with AdamW over `group` (default: the whole job). Stage 3 shards by `units`
    (default: the root plus every element of every nn.ModuleList) and, with `reshard_after_forward=False`, keeps each
    unit gathered from its forward to the end of its backward (FSDP's option; docs/data_parallel.md)."""
    group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    return ZeroOptimizer(model, stage, group, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bucket_mb=bucket_mb, offload=offload, reduce="mean", units=units,
                         reshard_after_forward=reshard_after_forward)
