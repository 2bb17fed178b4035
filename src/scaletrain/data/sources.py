"""Corpora: where documents come from, read one after another in a fixed order.

No paper. A source (`data.source`, or one entry of `data.mix`) is one of:
- `builtin`: the Python standard library sources of this interpreter (every `*.py` file under
  `sysconfig.get_paths()["stdlib"]`, sorted, skipping test folders and site-packages; ~12 MB on CPython 3.11);
- a text file (one document), or a folder of text files (each one document, sorted by path, hidden files skipped);
- a `.jsonl` / `.jsonl.gz` file (one JSON object per line, the text in `data.text_field`), or a folder holding such
  files (only they are read, sorted by path);
- a `.parquet` file, or a folder holding such files (only they are read), the text in column `data.text_field`;
- a folder written by `datasets.Dataset.save_to_disk` (`state.json` + Arrow stream files, read with pyarrow); a
  `DatasetDict` folder is refused naming its splits (give one split's folder);
- a `.bin` token file (data/stream.py).

Every text must be UTF-8; a row without the text field or whose value is not a string is refused naming the file
and line (or row); an empty text is skipped (counted in the cache's metadata). A source's identity, for the token
cache, is its kind, text field and each file's resolved path, size and modification time.
"""

from __future__ import annotations

import gzip
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import DataError

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
ROW_BATCH = 4096  # Parquet / Arrow rows read at a time


def builtin_files() -> list[Path]:
    """The standard-library source files that make up the embedded corpus, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


def _is_jsonl(p: Path) -> bool:
    return p.name.endswith((".jsonl", ".jsonl.gz"))


@dataclass(frozen=True)
class Source:
    spec: str  # as the user wrote it
    kind: str  # builtin, text, jsonl, parquet, arrow
    files: tuple[Path, ...]
    text_field: str = "text"

    @property
    def name(self) -> str:
        return "builtin" if self.kind == "builtin" else Path(self.spec.rstrip("/")).name or "corpus"

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def identity(self) -> list:
        """What the token cache is keyed by (with the tokenizer's digest)."""
        field = self.text_field if self.kind in ("jsonl", "parquet", "arrow") else ""
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in self.files]
        return [self.kind, field, stats]

    def documents(self, as_bytes: bool) -> Iterator[tuple[str | bytes | None, int]]:
        """(document, bytes of input read since the previous item) in order: str, or UTF-8 bytes when `as_bytes`;
        None for an empty document or an item that only reports progress."""
        read = {"builtin": _text, "text": _text, "jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[self.kind]
        for f in self.files:
            yield from read(f, self.text_field, as_bytes)


def find_source(spec: str, text_field: str = "text", what: str = "data.source") -> Source:
    """The source `spec` names (not a `.bin` file); DataError naming it when missing, empty or of mixed formats."""
    if spec == "builtin":
        files = builtin_files()
        if not files:
            raise DataError("the builtin corpus is empty: no standard-library sources found")
        return Source(spec, "builtin", tuple(files))
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"{what} not found: {spec}")
    if path.is_file():
        kind = "jsonl" if _is_jsonl(path) else "parquet" if path.suffix == ".parquet" else \
            "arrow" if path.suffix == ".arrow" else "text"
        files = [path]
    elif (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits")
        except (OSError, ValueError, AttributeError):
            splits = None
        raise DataError(f"{what} {spec} is a datasets DatasetDict (splits {splits}); give one split's folder, "
                        f"e.g. {path / (splits[0] if splits else 'train')}")
    elif (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        kind, files = "arrow", _arrow_files(path)
    else:
        found = [p for p in sorted(path.rglob("*")) if p.is_file()
                 and not any(s.startswith(".") for s in p.relative_to(path).parts)]
        jsonl = [p for p in found if _is_jsonl(p)]
        parquet = [p for p in found if p.suffix == ".parquet"]
        if jsonl and parquet:
            raise DataError(f"{what} {spec} holds both JSONL ({jsonl[0].name}) and Parquet ({parquet[0].name}) "
                            "files; give one folder per format, combined with data.mix")
        kind, files = ("jsonl", jsonl) if jsonl else ("parquet", parquet) if parquet else ("text", found)
    if not files or sum(f.stat().st_size for f in files) == 0:
        raise DataError(f"{what} {spec} has no data (no non-empty files)")
    return Source(spec, kind, tuple(files), text_field)


# ----------------------------------------------------------------------------- readers, one per format
# Each yields (text or None, input bytes read since the previous item): None items only carry progress.


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r})") from None


def _text(f: Path, field: str, as_bytes: bool) -> Iterator[tuple[str | bytes | None, int]]:
    data = f.read_bytes()
    text = _utf8(data, str(f))
    yield ((data if as_bytes else text) if data else None), len(data)


def _row_text(row: dict, where: str, field: str) -> str | None:
    if field not in row:
        raise DataError(f"{where} has no field '{field}' (fields: {', '.join(sorted(row)[:8])}); set data.text_field")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' is {'null' if value is None else type(value).__name__}, not text")
    return value or None


def _jsonl(f: Path, field: str, as_bytes: bool) -> Iterator[tuple[str | bytes | None, int]]:
    done = 0
    try:
        with open(f, "rb") as raw, (gzip.GzipFile(fileobj=raw) if f.name.endswith(".gz") else raw) as lines:
            for n, line in enumerate(lines, 1):
                now = raw.tell()
                read, done = now - done, now
                if not line.strip():
                    yield None, read
                    continue
                where = f"{f} line {n}"
                try:
                    row = json.loads(_utf8(line, where))
                except json.JSONDecodeError as e:
                    raise DataError(f"{where} is not JSON ({e.msg}); JSONL has one object per line") from None
                if not isinstance(row, dict):
                    raise DataError(f"{where} is a JSON {type(row).__name__}, not an object")
                text = _row_text(row, where, field)
                yield ((text.encode() if as_bytes else text) if text is not None else None), read
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{f} is not a complete gzip file ({e})") from None


def _texts(batch, where: str, field: str, first_row: int, as_bytes: bool) -> list[str | bytes | None]:
    """The texts of `field` in an Arrow record batch (None for an empty one); DataError for a null or non-text."""
    import pyarrow as pa

    column = batch.column(batch.schema.get_field_index(field))
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{where}: column '{field}' is {column.type}, not text")
    if column.null_count:
        nulls = column.is_null().to_pylist()
        raise DataError(f"{where}: column '{field}' is null at row {first_row + nulls.index(True)}")
    return [((t.encode() if as_bytes else t) if t else None) for t in column.to_pylist()]


def _check_column(where: str, field: str, names: list[str]) -> None:
    if field not in names:
        raise DataError(f"{where} has no column '{field}' (columns: {', '.join(names[:8])}); set data.text_field")


def _parquet(f: Path, field: str, as_bytes: bool) -> Iterator[tuple[str | bytes | None, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = f.stat().st_size
    try:
        pf = pq.ParquetFile(f)
        _check_column(str(f), field, pf.schema_arrow.names)
        rows, row, reported = max(1, pf.metadata.num_rows), 0, 0
        for batch in pf.iter_batches(batch_size=ROW_BATCH, columns=[field]):
            texts = _texts(batch, str(f), field, row, as_bytes)
            row += len(texts)
            now = size * row // rows  # progress in proportion to the rows read
            yield from ((t, 0) for t in texts)
            yield None, now - reported
            reported = now
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{f} is not a Parquet file ({str(e).splitlines()[0]})") from None


def _arrow_files(folder: Path) -> list[Path]:
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{folder / 'state.json'} is not a datasets state file (no _data_files)") from None
    files = [folder / n for n in names]
    for p in files:
        if p.parent != folder or not p.is_file():
            raise DataError(f"{folder / 'state.json'} names {p.name}, which is not a file in {folder}")
    return files


def _arrow(f: Path, field: str, as_bytes: bool) -> Iterator[tuple[str | bytes | None, int]]:
    import pyarrow as pa

    try:
        with pa.memory_map(str(f)) as src:
            reader = pa.ipc.open_stream(src)
            _check_column(str(f), field, reader.schema.names)
            row, reported = 0, 0
            for batch in reader:
                texts = _texts(batch, str(f), field, row, as_bytes)
                row += len(texts)
                yield from ((t, 0) for t in texts)
                yield None, src.tell() - reported
                reported = src.tell()
            yield None, f.stat().st_size - reported
    except pa.ArrowInvalid as e:
        raise DataError(f"{f} is not an Arrow stream file ({str(e).splitlines()[0]})") from None
