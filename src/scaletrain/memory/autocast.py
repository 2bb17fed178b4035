"""`train.precision=autocast-bf16`: fp32 parameters, gradients and optimizer state; matmuls and attention in bf16.

Mixed precision the way most GPU users run it (`torch.autocast`): the parameters stay fp32, so there are no master
copies and the optimizer is the plain fp32 one; inside the forward, autocast casts the inputs of matmuls, linear
layers and `scaled_dot_product_attention` to bf16 (caching each weight's bf16 copy for the region), while
reductions such as the loss run in fp32. bf16 has fp32's exponent range, so no loss scaling is needed (Kalamkar et
al., "A Study of BFLOAT16 for Deep Learning Training", arXiv 1905.12322; mixed precision: Micikevicius et al.,
arXiv 1710.03740). Compared with `train.dtype=bf16` (bf16 parameters with fp32 masters, `memory/precision.py`)
it keeps 16 instead of 18 bytes of model state per parameter and never rounds the weights themselves, at the cost
of a bf16 copy of each weight per forward and fp32 gradients through the data-parallel reductions. The compute dtype
of a run is `device/dtypes.py`'s `autocast_dtype`; what train.precision is refused with, `memory/rules.py`.

`apply_autocast` wraps the entry points the engine calls (the model's `forward`, a pipeline stage's
`forward_chunk`), so every layout runs the same autocast region: one per micro-batch forward, backward outside it
(autograd runs each op's backward in the dtype its forward used). Custom autograd functions that multiply by
weights themselves (the sequence-parallel column layer) cast in their backward as autocast did in the forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

ENTRY_POINTS = ("forward", "forward_chunk")  # what the engine calls: a GPT, or a pipeline stage's chunks


def _under_autocast(fn: Callable, device_type: str, dtype: torch.dtype) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return fn(*args, **kwargs)

    run._st_autocast = dtype
    return run


def apply_autocast(module: torch.nn.Module, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """Run `module`'s engine entry points under torch.autocast(device.type, dtype); returns how many were wrapped."""
    n = 0
    for name in ENTRY_POINTS:
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, "_st_autocast", None) is not None:
            continue
        setattr(module, name, _under_autocast(fn, device.type, dtype))
        n += 1
    return n


def forward_compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts matmul inputs to where `x` lives, or None outside an autocast region (custom
    autograd functions record it in forward and use it in backward, which runs outside the region)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
