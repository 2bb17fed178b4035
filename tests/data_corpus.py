"""Small corpora for the data tests: the same documents written as text files, JSONL, JSONL.gz, Parquet and a
`datasets.Dataset.save_to_disk` folder, and a byte-level BPE tokenizer trained on them (no downloads)."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path


def documents(n: int = 40, size: int = 3000) -> list[str]:
    """`n` UTF-8 documents (standard-library sources, cut to `size` characters) with one empty one and non-ASCII."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:n]
    docs = [f.read_text(encoding="utf-8")[:size] for f in files]
    docs[3] = ""  # an empty row: skipped
    docs[5] = "déjà vu — ünïcödé ✓ " * 20
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text", gz: bool = False) -> Path:
    lines = "".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)).encode()
    path.write_bytes(gzip.compress(lines) if gz else lines)
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text", row_group: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group)
    return path


def write_datasets(path: Path, docs: list[str], field: str = "text") -> Path:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({field: docs, "n": list(range(len(docs)))}).save_to_disk(str(path))
    return path


def write_text_folder(path: Path, docs: list[str]) -> Path:
    path.mkdir()
    for i, d in enumerate(docs):
        (path / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    return path


def train_tokenizer(folder: Path, docs: list[str], vocab: int = 400) -> Path:
    from scaletrain.data.sources import find_source
    from scaletrain.data.train_tokenizer import train_bpe

    corpus = write_jsonl(folder.parent / f"{folder.name}-train.jsonl", docs)
    train_bpe(find_source(str(corpus)), vocab, folder)
    return folder
