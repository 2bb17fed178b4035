"""Optimizers: torch's AdamW and SGD and the memory-efficient Adafactor (arXiv 1804.04235) and SM3 (arXiv 1901.11150).

`registry` describes each optimizer once (torch-free: the planner and the checks read it); `build` turns a name into
an optimizer (`build_optimizer`) and counts its state (`state_bytes`). This package root imports no torch: the
torch-using names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from scaletrain.optim.registry import (
    OPTIMIZERS,
    OptimizerSpec,
    config_hyper,
    lr_multiplier,
    optimizer_spec,
    state_elements,
)

_LAZY = {"build_optimizer": "build", "decay_groups": "build", "optimizer_class": "build", "state_bytes": "build",
         "Adafactor": "adafactor", "StateShard": "adafactor", "SM3": "sm3"}

__all__ = ["OPTIMIZERS", "SM3", "Adafactor", "OptimizerSpec", "StateShard", "build_optimizer", "config_hyper",
           "decay_groups", "lr_multiplier", "optimizer_class", "optimizer_spec", "state_bytes",
           "state_elements"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"scaletrain.optim.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'scaletrain.optim' has no attribute {name!r}")
