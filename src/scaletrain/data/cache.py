"""The token cache: each source is tokenized once, in parallel over the machine's cores, and kept as a token stream
(`NAME-KEY.bin` + its `NAME-KEY.bin.json` sidecar, data/stream.py) in the cache folder, keyed by the source's
identity (kind, text field, each file's path, size and modification time) and the tokenizer's digest, so every
rank and every resume reuses it.

No paper. Writing is atomic: tokens go to a temporary file, fsync'd and renamed, then the sidecar (the commit mark)
is written the same way; a build holds a file lock, so ranks that start together tokenize once. A cache is used only
when its sidecar parses, names this key, this tokenizer and this format version, and the file's size is
`tokens` x itemsize; with `verify` its CRC-32 is recomputed too (`scaletrain train` does this once before
it starts any process; ranks check the size). Anything else is a partial or corrupt cache: it is said in one line
and rebuilt, never used. The Hugging Face tokenizer encodes each chunk of `CHUNK_BYTES` of text with
`encode_batch_fast` on all cores (Rust threads) while a reader thread parses the next chunk.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from scaletrain.data.sources import Source
from scaletrain.data.stream import FORMAT, TokenStream, open_bin, sidecar
from scaletrain.data.tokenizer import ByteTokenizer, Tokenizer, dtype_for
from scaletrain.errors import DataError, disk_full, disk_full_error

VERSION = 1
CHUNK_BYTES = 4 << 20  # text per encode call
HASH_CHUNK = 16 << 20


def cache_dir(configured: str = "") -> Path:
    """The token cache folder (created): data.cache_dir, else $SCALETRAIN_CACHE, else ~/.cache/scaletrain."""
    env = os.environ.get("SCALETRAIN_CACHE")
    path = Path(configured or env or Path.home() / ".cache" / "scaletrain").expanduser()
    setting = "data.cache_dir" if configured else "SCALETRAIN_CACHE" if env else "the default cache folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{setting} {path} cannot be created ({e.strerror or e}); set data.cache_dir or "
                        "SCALETRAIN_CACHE to a writable folder") from None
    return path


def cache_key(source: Source, tok: Tokenizer) -> str:
    ident = json.dumps([FORMAT, VERSION, tok.digest, source.identity()])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def checksum(path: Path) -> str:
    """CRC-32 of the file (as gzip and zip check their data: it detects corruption, fast)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def cached_stream(source: Source, tok: Tokenizer, folder: Path, progress: bool = False,
                  verify: bool = False) -> TokenStream:
    """The token stream of `source` under `tok`, from the cache or tokenized into it now."""
    key = cache_key(source, tok)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[:60]
    target = folder / f"{safe}-{key}.bin"
    with _locked(folder / f".{safe}-{key}.lock"):
        problem = check_cache(target, key, tok, verify)
        if problem is not None:
            if problem != "missing" and progress:
                print(f"  token cache {target} {problem}; rebuilding it", file=sys.stderr, flush=True)
            build(source, tok, target, key, progress)
    return open_bin(target, tok.digest, tok.vocab_size, source.spec)


def check_cache(target: Path, key: str, tok: Tokenizer, verify: bool) -> str | None:
    """None when `target` is a complete cache of `key` under `tok`; else what is wrong with it."""
    side = sidecar(target)
    if not side.is_file():
        return "has no sidecar (an interrupted build)" if target.exists() else "missing"
    try:
        meta = json.loads(side.read_text())
        ok = (meta["format"], meta["version"], meta["key"], meta["tokenizer"]["digest"]) == (
            FORMAT, VERSION, key, tok.digest)
        expected = int(meta["tokens"]) * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return "has an unreadable sidecar"
    if not ok:
        return "was written for another source, tokenizer or format"
    size = target.stat().st_size if target.is_file() else -1
    if size != expected:
        return f"is truncated or overlong ({size:,} bytes, the sidecar says {expected:,})"
    if verify and checksum(target) != meta.get("checksum"):
        return "is corrupt (its checksum differs from the sidecar's)"
    return None


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _chunks(source: Source, as_bytes: bool) -> Iterator[tuple[list, int]]:
    """Documents in chunks of about CHUNK_BYTES of text, with the input bytes they consumed."""
    docs, size, read = [], 0, 0
    for doc, nbytes in source.documents(as_bytes):
        read += nbytes
        if doc is not None:
            docs.append(doc)
            size += len(doc)
        if size >= CHUNK_BYTES:
            yield docs, read
            docs, size, read = [], 0, 0
    if docs or read:
        yield docs, read


def _prefetched(items: Iterator) -> Iterator:
    """`items` produced by a reader thread, one chunk ahead of the consumer (the encoder releases the GIL)."""
    q: queue.Queue = queue.Queue(maxsize=2)
    done = object()

    def run():
        try:
            for item in items:
                q.put(item)
            q.put(done)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            q.put(e)

    threading.Thread(target=run, daemon=True).start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def build(source: Source, tok: Tokenizer, target: Path, key: str, progress: bool = False) -> dict:
    """Tokenize `source` into `target` and write its sidecar; returns the sidecar's content."""
    dtype = dtype_for(tok.vocab_size)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    crc = 0
    n = docs = 0
    top = -1
    bar = Progress(f"tokenizing {source.spec}", source.total_bytes, progress)
    try:
        with open(tmp, "wb") as out:
            for chunk, read in _prefetched(_chunks(source, isinstance(tok, ByteTokenizer))):
                if chunk:
                    ids = tok.encode_documents(chunk, dtype)
                    out.write(memoryview(ids).cast("B"))
                    crc = zlib.crc32(memoryview(ids).cast("B"), crc)
                    n, docs, top = n + len(ids), docs + len(chunk), max(top, int(ids.max()))
                bar.advance(read, n)
            out.flush()
            os.fsync(out.fileno())
        if n == 0:
            raise DataError(f"data.source {source.spec} has no text (every document is empty)")
        os.replace(tmp, target)
    except PermissionError as e:
        raise DataError(f"cannot write the token cache {target} ({e.strerror}); set data.cache_dir or "
                        "SCALETRAIN_CACHE to a writable folder") from None
    except OSError as e:
        if not disk_full(e):
            raise
        raise disk_full_error("the token cache", target, "; set data.cache_dir or SCALETRAIN_CACHE to a folder "
                              "with room (the cache's other files are intact)") from None
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"format": FORMAT, "version": VERSION, "key": key, "dtype": dtype.name, "tokens": n, "max_id": top,
            "documents": docs, "checksum": f"{crc:08x}", "source": source.spec, "kind": source.kind,
            "text_field": source.text_field if source.kind in ("jsonl", "parquet", "arrow") else None,
            "tokenizer": {"name": tok.name, "digest": tok.digest, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}}
    side_tmp = sidecar(tmp)
    try:
        side_tmp.write_text(json.dumps(meta, indent=1) + "\n")
    except OSError as e:  # no sidecar, no cache: the tokens without their commit mark are rebuilt next time
        side_tmp.unlink(missing_ok=True)
        target.unlink(missing_ok=True)
        if not disk_full(e):
            raise
        raise disk_full_error("the token cache", sidecar(target), "; set data.cache_dir or SCALETRAIN_CACHE to a "
                              "folder with room (the cache's other files are intact)") from None
    os.replace(side_tmp, sidecar(target))
    bar.finish(n)
    return meta


class Progress:
    """Tokenization progress on stderr: a line redrawn in place on a terminal, one line every 10 s in a log; only
    when the build takes longer than a second, and a closing line."""

    def __init__(self, what: str, total: int, enabled: bool):
        self.what, self.total, self.enabled = what, max(total, 1), enabled
        self.start = self.last = time.monotonic()
        self.done = 0
        self.tty = sys.stderr.isatty()
        self.shown = False

    def advance(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if not self.enabled or now - self.start < 1.0 or now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last, self.shown = now, True
        rate = self.done / (now - self.start)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        line = (f"  {self.what}: {min(100, 100 * self.done // self.total)}% ({self.done / 1e6:,.1f} of "
                f"{self.total / 1e6:,.1f} MB, {rate / 1e6:.1f} MB/s, {tokens:,} tokens, ETA {eta:.0f} s)")
        sys.stderr.write(f"\r{line}\033[K" if self.tty else line + "\n")
        sys.stderr.flush()

    def finish(self, tokens: int) -> None:
        if not self.enabled:
            return
        took = time.monotonic() - self.start
        line = (f"  {self.what}: {tokens:,} tokens from {self.total / 1e6:,.1f} MB in {took:.1f} s "
                f"({self.total / 1e6 / max(took, 1e-9):.1f} MB/s), cached")
        sys.stderr.write(f"\r{line}\033[K\n" if self.tty and self.shown else line + "\n")
        sys.stderr.flush()
