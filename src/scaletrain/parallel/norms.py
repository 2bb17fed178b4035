"""The global gradient norm and clipping, shared by every engine optimizer (replicated, ZeRO, NVMe, experts).

Clipping uses the norm of the whole model's gradient (Pascanu et al., arXiv 1211.5063), the same number in every
layout: each rank adds the squares of the gradient elements it *owns* (its ZeRO shard, the dp group's rank 0 for
replicas, the owner of a tensor-parallel or pipeline copy: parameters marked `_st_norm_owner = False` do not count),
one all-reduce sums them, and the gradients are multiplied by `clip_coefficient` without reading the norm on the
host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_norm_owner(p: torch.Tensor) -> bool:
    """Whether this rank's copy of `p` counts in the global gradient norm (passes mark duplicates False)."""
    return getattr(p, "_st_norm_owner", True)


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squares of every element of `grads`, in float64 (a 0-dim tensor on `device`; 0 without grads)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads)
    return torch.stack([n.double() for n in norms]).square().sum()


def global_grad_norm(local_sq: torch.Tensor, world: bool) -> torch.Tensor:
    """sqrt of the sum over all ranks of their owned squared-gradient contributions (a 0-dim device tensor)."""
    if world and dist.is_initialized():
        dist.all_reduce(local_sq)
    return local_sq.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) as a device tensor: gradients are always multiplied by it (by exactly 1
    when the norm is within bounds), so clipping needs no host read of the norm (torch's clip_grad_norm_ does
    the same)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
