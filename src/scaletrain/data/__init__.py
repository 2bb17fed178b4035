"""Data: byte tokenizer, token sources (embedded corpus, text, .bin) and the layout-independent loader.

The names below are loaded on first use (PEP 562), so importing `scaletrain.data.rules`, the torch-free validation
rules that scaletrain/__init__.py registers, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.data.corpus import load_tokens
    from scaletrain.data.loader import BatchLoader

_EXPORTS = {"load_tokens": "corpus", "BatchLoader": "loader"}
__all__ = ["BatchLoader", "load_tokens"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
