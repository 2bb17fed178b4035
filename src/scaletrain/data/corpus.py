"""Token sources: the embedded default corpus, text files or folders, and nanoGPT `.bin` token files.

`builtin` is the source code of the Python standard library of the running interpreter: every `*.py`
file under `sysconfig.get_paths()["stdlib"]`, in sorted path order, skipping test directories
(`test`, `tests`, `idle_test`), `site-packages` and `__pycache__`. It is about 12 MB of text on
CPython 3.11, present on every machine that runs scaletrain, and needs no download. Its exact content
depends on the Python version, so losses are comparable between machines with the same interpreter.

Text sources are tokenized once with the byte tokenizer and cached as a uint16 memory-mapped file
(nanoGPT's layout) in the cache directory, keyed by the source's paths, sizes and modification times.
Documents are separated by a NUL byte (token 0).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from scaletrain.data.tokenizer import encode
from scaletrain.errors import DataError

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
SEPARATOR = b"\x00"


def cache_dir(configured: str = "") -> Path:
    """The token cache folder (created): data.cache_dir, else $SCALETRAIN_CACHE, else ~/.cache/scaletrain."""
    env = os.environ.get("SCALETRAIN_CACHE")
    path = Path(configured or env or Path.home() / ".cache" / "scaletrain")
    setting = "data.cache_dir" if configured else "SCALETRAIN_CACHE" if env else "the default cache folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{setting} {path} cannot be created ({e.strerror or e}); set data.cache_dir or "
                        "SCALETRAIN_CACHE to a writable folder") from None
    return path


def builtin_files() -> list[Path]:
    """The standard-library source files that make up the embedded corpus, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


def text_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    files = [p for p in sorted(source.rglob("*")) if p.is_file() and not any(s.startswith(".") for s in p.parts)]
    return files


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _tokenize_to_cache(files: list[Path], target: Path) -> None:
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for f in files:
            data = f.read_bytes()
            if data:
                out.write(encode(data + SEPARATOR).tobytes())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)  # atomic: concurrent ranks may race, both write the same bytes


def load_tokens(source: str, cache: str = "") -> np.ndarray:
    """The token stream of `source` as a read-only uint16 memmap. Raises DataError when unusable."""
    if source == "builtin":
        files = builtin_files()
        if not files:
            raise DataError("the builtin corpus is empty: no standard-library sources found")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data.source not found: {source}")
        if path.is_file() and path.suffix == ".bin":
            if path.stat().st_size < 4:
                raise DataError(f"data.source {source} is empty (a .bin file needs uint16 tokens)")
            if path.stat().st_size % 2:
                raise DataError(f"data.source {source} has an odd byte count; .bin files hold uint16 tokens")
            return np.memmap(path, dtype=np.uint16, mode="r")
        files = text_files(path)
        if not files or sum(f.stat().st_size for f in files) == 0:
            raise DataError(f"data.source {source} has no data (no non-empty files)")
    target = cache_dir(cache) / f"{'builtin' if source == 'builtin' else Path(source).name}-{_fingerprint(files)}.bin"
    if not target.exists():
        try:
            _tokenize_to_cache(files, target)
        except PermissionError as e:
            raise DataError(f"cannot write the token cache {target} ({e.strerror}); set data.cache_dir or "
                            "SCALETRAIN_CACHE to a writable folder") from None
    return np.memmap(target, dtype=np.uint16, mode="r")
