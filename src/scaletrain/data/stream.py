"""Token streams on disk: a flat file of token ids, memory-mapped, and the `.bin.json` sidecar that describes it.

No paper; the `.bin` layout is nanoGPT's (a flat array of little-endian uint16 token ids). The rule that tells a
uint32 `.bin` apart, documented in docs/data.md and checked, never guessed:

1. `X.bin` with a sidecar `X.bin.json` is read with the sidecar's `dtype` (`uint16` or `uint32`); the file's size
   must be a whole number of tokens, and equal `tokens` x itemsize when the sidecar gives `tokens`. When the sidecar
   names a tokenizer (`tokenizer.digest`), it must be the run's: a stream written by another tokenizer is refused.
2. `X.bin` without a sidecar is nanoGPT's uint16. It is refused when the run's tokenizer has more than 65,536 ids
   (uint16 cannot hold them), and when its first 2^20 values show the signature of uint32 ids read as uint16 (every
   odd value 0, some even value not): both say to write the sidecar `{"dtype": "uint32"}`.

Streams are mapped read-only with `MADV_RANDOM` (the loader reads short windows at random offsets: no read-ahead),
and the loader calls `release()` after each batch of a stream over `RELEASE_BYTES`, which drops this process's page
mappings (`MADV_DONTNEED`; the kernel's page cache keeps the data, shared by every rank), so a multi-GB stream costs
a rank the pages of one batch, not its size.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scaletrain.errors import DataError

FORMAT = "scaletrain-tokens"
DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
RELEASE_BYTES = 256 << 20
PROBE_TOKENS = 1 << 20
SCAN_CHUNK = 1 << 24  # tokens per read when a stream's largest id is counted


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


@dataclass
class TokenStream:
    """One source's token ids: a memory-mapped file (or an array given in memory)."""

    name: str
    tokens: np.ndarray
    max_id: int
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    _map: mmap.mmap | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def dtype(self) -> np.dtype:
        return self.tokens.dtype

    def release(self) -> None:
        """Drop this process's mappings of the stream's pages (the page cache keeps them); large streams only."""
        if self._map is not None and self.tokens.nbytes > RELEASE_BYTES:
            self._map.madvise(mmap.MADV_DONTNEED)

    @classmethod
    def of_array(cls, tokens: np.ndarray, name: str = "array") -> TokenStream:
        return cls(name, tokens, int(tokens.max()) if len(tokens) else -1)


def read_meta(path: Path) -> dict | None:
    """The sidecar of `path` as a dict, None when there is none; DataError when it does not parse."""
    side = sidecar(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError):
        raise DataError(f"{side} is not valid JSON (the sidecar of {path.name}: {{\"dtype\": \"uint16\" or "
                        "\"uint32\"}})") from None
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES:
        got = meta.get("dtype") if isinstance(meta, dict) else meta
        raise DataError(f"{side} must say \"dtype\": \"uint16\" or \"uint32\"; got {got!r}")
    return meta


def mapped(path: Path, dtype: np.dtype) -> tuple[np.ndarray, mmap.mmap]:
    """`path` as a read-only array of `dtype` over a private mapping (random access advised)."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        m.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(m, dtype=dtype), m


def largest_id(path: Path, dtype: np.dtype) -> int:
    """The largest id in a token file, read in chunks (not mapped: counting touches no resident pages)."""
    top = -1
    with open(path, "rb") as f:
        while True:
            chunk = np.fromfile(f, dtype=dtype, count=SCAN_CHUNK)
            if not len(chunk):
                return top
            top = max(top, int(chunk.max()))


def open_bin(path: Path, tokenizer_digest: str, vocab: int, spec: str) -> TokenStream:
    """A `.bin` token file by the rule above; DataError naming the file when it breaks it."""
    size = path.stat().st_size
    meta = read_meta(path)
    if meta is None:
        dtype = DTYPES["uint16"]
        if vocab > 1 << 16:
            raise DataError(f"data.source {spec} has no {sidecar(path).name}, so it is read as nanoGPT's uint16, "
                            f"which cannot hold the ids of data.tokenizer ({vocab:,} tokens); if it holds uint32 ids "
                            f"write {sidecar(path).name} with {{\"dtype\": \"uint32\"}}")
    else:
        dtype = DTYPES[meta["dtype"]]
        digest = (meta.get("tokenizer") or {}).get("digest") if isinstance(meta.get("tokenizer"), dict) else None
        if digest is not None and digest != tokenizer_digest:
            made = meta["tokenizer"].get("name", "another tokenizer")
            raise DataError(f"data.source {spec} was tokenized by {made} (digest {digest}) but data.tokenizer is "
                            f"another (digest {tokenizer_digest}); set data.tokenizer to the one that wrote it")
    if size < 2 * dtype.itemsize:
        raise DataError(f"data.source {spec} is empty (a .bin file needs {dtype.name} tokens)")
    if size % dtype.itemsize:
        raise DataError(f"data.source {spec} has {size} bytes, not a whole number of {dtype.name} tokens")
    if meta is not None and meta.get("tokens") is not None and meta["tokens"] * dtype.itemsize != size:
        raise DataError(f"data.source {spec} has {size // dtype.itemsize:,} tokens but {sidecar(path).name} says "
                        f"{meta['tokens']:,} (a partial copy?)")
    tokens, m = mapped(path, dtype)
    if meta is None:
        head = np.asarray(tokens[:PROBE_TOKENS])
        if len(head) >= 64 and not head[1::2].any() and head[0::2].any():
            raise DataError(f"data.source {spec} read as uint16 has every second token 0, the signature of uint32 "
                            f"ids; if it holds uint32 ids write {sidecar(path).name} with {{\"dtype\": \"uint32\"}}")
    ours = meta is not None and meta.get("format") == FORMAT  # our own sidecars carry the largest id
    top = int(meta["max_id"]) if ours and isinstance(meta.get("max_id"), int) else largest_id(path, dtype)
    return TokenStream(spec, tokens, top, path, meta or {}, m)
