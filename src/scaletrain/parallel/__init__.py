"""Parallelism on torch.distributed: data parallel (bucketed, overlapped), ZeRO 1-3 with offload, and the
passes that apply tensor and pipeline parallelism to the plain model.

For your own `nn.Module`, two small entry points (`api.py`):

    import scaletrain.parallel as stp
    opt = stp.zero(model, stage=3, lr=3e-4, weight_decay=0.1)      # or stp.data_parallel(model, torch.optim.AdamW(...))

The names are loaded on first use, so importing `scaletrain.parallel.rules` (and the pipeline's and the asynchronous
modes' rules), the torch-free validation rules that scaletrain/__init__.py registers, does not import torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.parallel.api import data_parallel, zero
    from scaletrain.parallel.parallelize import ReplicatedOptimizer
    from scaletrain.parallel.zero import ZeroOptimizer

_EXPORTS = {"ReplicatedOptimizer": "parallelize", "ZeroOptimizer": "zero"}
__all__ = ["ReplicatedOptimizer", "ZeroOptimizer", "data_parallel", "zero"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _entry_point(name: str) -> property:
    """`zero` and `data_parallel` name both an entry point of api.py and a submodule (zero.py, data_parallel.py).
    Importing a submodule binds it on its package; this property keeps the name the entry point and ignores that
    binding (the submodules stay in sys.modules, where imports find them)."""

    def get(module: types.ModuleType) -> Any:
        return getattr(importlib.import_module(f"{__name__}.api"), name)

    return property(get, lambda module, value: None)


class _Package(types.ModuleType):
    data_parallel = _entry_point("data_parallel")
    zero = _entry_point("zero")


sys.modules[__name__].__class__ = _Package
