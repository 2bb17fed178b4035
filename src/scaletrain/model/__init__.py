"""The plain model (no distributed code) and its layout-independent initialisation.

The names below are loaded on first use (PEP 562), so importing `scaletrain.model.rules`, the torch-free validation
rules that scaletrain/__init__.py registers, does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.model.gpt import GPT, build_gpt, count_params, loss_sum

_EXPORTS = {"GPT": "gpt", "count_params": "gpt", "loss_sum": "gpt", "build_gpt": "gpt"}
__all__ = ["GPT", "build_gpt", "count_params", "loss_sum"]

__getattr__ = lazy.exports(__name__, _EXPORTS)
