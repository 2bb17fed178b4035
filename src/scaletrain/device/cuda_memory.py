"""CUDA memory beside our accounting: what the caching allocator saw, next to the planner's prediction.

`device/accounting.py` counts bytes by category (parameters, gradients, optimizer state, saved activations) from
tensor storages, on any device; the planner predicts the same categories (`plan_mem_*`). On CUDA a run also logs
the allocator's own numbers, maxed over ranks: `mem_cuda_max_allocated` (`torch.cuda.max_memory_allocated`: the
peak of live tensor bytes, the number to compare with the sum of the categories plus temporaries) and
`mem_cuda_max_reserved` (`torch.cuda.max_memory_reserved`: what the allocator held from the driver, including its
cached free blocks and fragmentation), and the planner's predicted total of the categories (`plan_mem_total`).
These are host-side allocator statistics: reading them does not synchronise with the device.
"""

from __future__ import annotations

from typing import Any

import torch

CATEGORIES = ("params", "grads", "optim", "activations")


def cuda_memory_fields(device: torch.device, cuda: Any = None) -> dict[str, int]:
    """This rank's allocator peaks on a CUDA `device` (empty on other devices). `cuda` replaces `torch.cuda`
    (tests pass a fake)."""
    if device.type != "cuda":
        return {}
    cuda = cuda if cuda is not None else torch.cuda
    return {"mem_cuda_max_allocated": int(cuda.max_memory_allocated(device)),
            "mem_cuda_max_reserved": int(cuda.max_memory_reserved(device))}


def planned_total(plan: dict[str, int]) -> dict[str, int]:
    """`plan_mem_total`: the planner's categories summed, when it predicts all of them."""
    keys = [f"plan_mem_{c}" for c in CATEGORIES]
    if all(k in plan for k in keys):
        return {"plan_mem_total": int(sum(plan[k] for k in keys))}
    return {}
