"""A run's corpus: the token streams of its source (or of each source of `data.mix`, with its weight) under its
tokenizer, from the token cache.

No paper. `load_corpus(cfg.data)` is what the trainer, the asynchronous runners and `scaletrain train`'s pre-launch
check call; `load_tokens(source)` is the byte-tokenized stream of one source (the harness and benchmarks' shortcut).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.config.schema import DataConfig
from scaletrain.data.cache import cache_dir, cached_stream
from scaletrain.data.sources import builtin_files, find_source
from scaletrain.data.stream import TokenStream, open_bin
from scaletrain.data.tokenizer import Tokenizer, load_tokenizer
from scaletrain.errors import DataError

__all__ = ["Corpus", "builtin_files", "cache_dir", "load_corpus", "load_tokens"]


@dataclass
class Corpus:
    streams: list[TokenStream]
    weights: list[float]  # normalised to sum 1
    tokenizer: Tokenizer | None = None

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.streams)

    @property
    def max_id(self) -> int:
        return max(s.max_id for s in self.streams)

    @classmethod
    def of_array(cls, tokens: np.ndarray) -> Corpus:
        return cls([TokenStream.of_array(tokens)], [1.0])


def load_corpus(data: DataConfig, progress: bool = False, verify: bool = False) -> Corpus:
    """The streams of `data.source` (or of each `data.mix` entry) under `data.tokenizer`, tokenized into the cache
    when needed (`progress`: a progress bar on stderr; `verify`: recompute cached streams' checksums)."""
    tok = load_tokenizer(data.tokenizer, data.eot_token)
    entries = [(m.source, m.weight, m.text_field or data.text_field) for m in data.mix] or \
        [(data.source, 1.0, data.text_field)]
    streams = []
    for spec, _, field in entries:
        path = Path(spec).expanduser()
        if spec != "builtin" and path.is_file() and path.suffix == ".bin":
            streams.append(open_bin(path, tok.digest, tok.vocab_size, spec))
        else:
            streams.append(cached_stream(find_source(spec, field), tok, cache_dir(data.cache_dir), progress, verify))
    total = sum(w for _, w, _ in entries)
    return Corpus(streams, [w / total for _, w, _ in entries], tok)


def load_tokens(source: str, cache: str = "") -> np.ndarray:
    """The byte-tokenized stream of one source (or a `.bin` file) as a read-only array. Raises DataError."""
    if not source.strip():
        raise DataError("data.source is empty")
    return load_corpus(DataConfig(source=source, cache_dir=cache)).streams[0].tokens
