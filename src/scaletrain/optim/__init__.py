"""Optimizers: torch's AdamW and SGD and the memory-efficient Adafactor (arXiv 1804.04235) and SM3 (arXiv 1901.11150);
`build.py` maps `optim.name` to a class and holds the run's optimizer settings.

The names below are loaded on first use (PEP 562), so importing `scaletrain.optim.rules`, the torch-free validation
rules that scaletrain/__init__.py registers, does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.optim.adafactor import Adafactor, StateShard
    from scaletrain.optim.build import OPTIMIZERS, build_optimizer, config_hyper, lr_multiplier, state_bytes
    from scaletrain.optim.sm3 import SM3

_EXPORTS = {"Adafactor": "adafactor", "StateShard": "adafactor", "SM3": "sm3", "OPTIMIZERS": "build",
            "build_optimizer": "build", "config_hyper": "build", "lr_multiplier": "build", "state_bytes": "build"}
__all__ = ["OPTIMIZERS", "SM3", "Adafactor", "StateShard", "build_optimizer", "config_hyper", "lr_multiplier",
           "state_bytes"]

__getattr__ = lazy.exports(__name__, _EXPORTS)
