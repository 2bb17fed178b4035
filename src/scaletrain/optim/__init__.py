"""Optimizers: torch's AdamW and SGD and the memory-efficient Adafactor (arXiv 1804.04235) and SM3 (arXiv 1901.11150).

`registry.py` describes each optimizer once (torch-free: the planner and the validation rules read it); `build.py`
turns a name into an optimizer (`build_optimizer`) and counts its state (`state_bytes`). The torch-using names below
are loaded on first use (PEP 562), so importing `scaletrain.optim.rules`, the torch-free validation rules that
scaletrain/__init__.py registers, or the registry does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy
from scaletrain.optim.registry import (
    OPTIMIZERS,
    OptimizerSpec,
    config_hyper,
    lr_multiplier,
    optimizer_spec,
    state_elements,
)

if TYPE_CHECKING:
    from scaletrain.optim.adafactor import Adafactor, StateShard
    from scaletrain.optim.build import build_optimizer, decay_groups, optimizer_class, state_bytes
    from scaletrain.optim.sm3 import SM3

_EXPORTS = {"Adafactor": "adafactor", "StateShard": "adafactor", "SM3": "sm3", "build_optimizer": "build",
            "decay_groups": "build", "optimizer_class": "build", "state_bytes": "build"}
__all__ = ["OPTIMIZERS", "SM3", "Adafactor", "OptimizerSpec", "StateShard", "build_optimizer", "config_hyper",
           "decay_groups", "lr_multiplier", "optimizer_class", "optimizer_spec", "state_bytes", "state_elements"]

__getattr__ = lazy.exports(__name__, _EXPORTS)
