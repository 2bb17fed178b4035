"""Data: tokenizers (byte, Hugging Face), corpora (text, JSONL, Parquet, datasets folders, `.bin`), weighted mixtures,
the token cache and the layout-independent loader (docs/data.md).

The names below are loaded on first use (PEP 562), so importing `scaletrain.data.rules`, the torch-free validation
rules that scaletrain/__init__.py registers, does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.data.corpus import Corpus, load_corpus, load_tokens
    from scaletrain.data.loader import BatchLoader
    from scaletrain.data.tokenizer import load_tokenizer

_EXPORTS = {"load_tokens": "corpus", "load_corpus": "corpus", "Corpus": "corpus", "BatchLoader": "loader",
            "load_tokenizer": "tokenizer"}
__all__ = ["BatchLoader", "Corpus", "load_corpus", "load_tokenizer", "load_tokens"]

__getattr__ = lazy.exports(__name__, _EXPORTS)
