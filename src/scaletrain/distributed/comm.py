"""Collectives on an optional group, with byte accounting.

A group of None means "this dimension has size 1": every collective is then the identity, so single- and
multi-process runs share one code path. `CommStats` counts the bytes each rank sends per collective kind
with the ring algorithm's factors (all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n of the full
buffer), the counts the ZeRO paper (arXiv 1910.02054, section 7) uses for its volume comparison.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    bytes: Counter = field(default_factory=Counter)  # kind -> bytes sent by this rank
    calls: Counter = field(default_factory=Counter)

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.10) have only the old names. Every module
# takes them from here: (output, input, group=, async_op=) -> work, as torch's own.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM,
               stats: CommStats | None = None, async_op: bool = False):
    """In-place all-reduce; returns the work handle when async_op (None when the group is trivial)."""
    n = group_size(group)
    if n == 1:
        return None
    if stats is not None:
        stats.add("all_reduce", 2 * (n - 1) / n * t.numel() * t.element_size())
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors must live for `group`'s backend (the default group's when None): the current
    CUDA device under NCCL (set by `distributed.init` before any allocation), else the CPU (gloo)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max_list(values: list[float] | torch.Tensor, group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise max over the group (the whole world when group is None and initialised) of numbers or a
    tensor, in one collective on the backend's device and one host read."""
    if not (dist.is_initialized() and (group is None or group_size(group) > 1)):
        return values.tolist() if isinstance(values, torch.Tensor) else list(values)
    device = collective_device(group)
    if isinstance(values, torch.Tensor):
        t = values.to(device, torch.float64, copy=True)
    else:
        t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
