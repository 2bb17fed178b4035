"""Data: byte tokenizer, token sources (embedded corpus, text, .bin) and the layout-independent loader.

The names below are loaded on first use (PEP 562), so importing `scaletrain.data.rules`, the torch-free validation
rules that scaletrain/__init__.py registers, does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.data.corpus import load_tokens
    from scaletrain.data.loader import BatchLoader

_EXPORTS = {"load_tokens": "corpus", "BatchLoader": "loader"}
__all__ = ["BatchLoader", "load_tokens"]

__getattr__ = lazy.exports(__name__, _EXPORTS)
