"""`train.precision=autocast-bf16`: fp32 parameters, gradients and optimizer state; matmuls and attention in bf16.

Mixed precision the way most GPU users run it (`torch.autocast`): the parameters stay fp32, so there are no master
copies and the optimizer is the plain fp32 one; inside the forward, autocast casts the inputs of matmuls, linear
layers and `scaled_dot_product_attention` to bf16 (caching each weight's bf16 copy for the region), while
reductions such as the loss run in fp32. bf16 has fp32's exponent range, so no loss scaling is needed (Kalamkar et
al., "A Study of BFLOAT16 for Deep Learning Training", arXiv 1905.12322; mixed precision: Micikevicius et al.,
arXiv 1710.03740). Compared with `train.dtype=bf16` (bf16 parameters with fp32 masters, `memory/precision.py`)
it keeps 16 instead of 18 bytes of model state per parameter and never rounds the weights themselves, at the cost
of a bf16 copy of each weight per forward and fp32 gradients through the data-parallel reductions.

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

PRECISIONS = ("dtype", "autocast-bf16")
ENTRY_POINTS = ("forward", "forward_chunk")  # what the engine calls: a GPT, or a pipeline stage's chunks


def precision_errors(cfg: Any) -> list[str]:
    """Contradictions between train.precision and train.dtype (one line each, naming the values)."""
    t = cfg.train
    if t.precision != "autocast-bf16":
        return []
    errors = []
    if t.dtype != "fp32":
        errors.append(f"train.precision=autocast-bf16 keeps fp32 parameters and casts inside autocast: it needs "
                      f"train.dtype=fp32, got train.dtype={t.dtype}")
    untested = [f"{k}={v}" for k, v, default in (
        ("parallel.tp_mode", cfg.parallel.tp_mode, "1d"), ("model.reversible", cfg.model.reversible, False),
        ("memory.contiguous", cfg.memory.contiguous, False)) if v != default]
    if untested:
        errors.append(f"train.precision=autocast-bf16 with {', '.join(untested)} is not available: not proven equal "
                      "to the single-process run yet (use train.dtype=bf16)")
    if cfg.model.moe.experts:
        errors.append(f"train.precision=autocast-bf16 with model.moe.experts={cfg.model.moe.experts} is not "
                      "available: the MoE layer combines the experts' (bf16) outputs into a tensor of its input's "
                      "dtype and routes on logits autocast would round to bf16; use train.dtype=bf16")
    return errors


def autocast_dtype(cfg: Any) -> torch.dtype | None:
    """The autocast compute dtype of the run, or None when it computes in train.dtype."""
    return torch.bfloat16 if cfg.train.precision == "autocast-bf16" else None


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
