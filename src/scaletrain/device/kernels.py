"""Optimizer kernels and host buffers for the device a run trains on.

AdamW (Loshchilov & Hutter, arXiv 1711.05101) is torch's `torch.optim.AdamW` wherever our optimizers use it: with
`fused=True` when every parameter it updates is on a CUDA device (one multi-tensor CUDA kernel per step, its step
counters on the device: no host read), and `foreach=True` elsewhere (CPU, or the host-side masters of ZeRO-Offload:
the `torch._foreach_*` multi-tensor ops instead of a Python loop over parameters). Both compute the same update as
the single-tensor loop; every layout of a run uses the same kernel, so the fp64 equivalence tests compare like with
like.

`pinned` gives a host buffer the CUDA driver can copy from asynchronously (`non_blocking=True` copies from pageable
memory are staged and synchronous with respect to the host).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def adamw_kernel(params: Iterable[torch.Tensor]) -> dict[str, Any]:
    """torch.optim.AdamW keywords: `fused=True` when all `params` are CUDA tensors, else `foreach=True`."""
    devices = {p.device.type for p in params}
    if devices == {"cuda"}:
        return {"fused": True}
    return {"foreach": True}


def param_list(param_groups: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of optimizer param groups (dicts with "params", or tensors)."""
    out: list[torch.Tensor] = []
    for g in param_groups:
        if isinstance(g, dict):
            out.extend(g["params"])
        else:
            out.append(g)
    return out


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) in page-locked memory when it will be copied to or from a CUDA `device`, else `t`."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        return t.pin_memory()
    return t
