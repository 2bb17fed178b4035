"""Real data (issue 28): tokenization throughput against the `tokenizers` library's own `encode_batch`, and resident
memory per rank for a multi-GB token stream under dp 2.

1. `throughput`: the same documents (standard-library sources, repeated to `--mb` MB) in a JSONL file; a byte-level
   BPE tokenizer trained on them (`--vocab`). Ours: `scaletrain.data.cache.build` (read the JSONL, parse, encode with
   `encode_batch_fast` on all cores, write the uint16 stream, checksum, sidecar), from the file to the cached
   stream. Theirs: `Tokenizer.encode_batch(texts, add_special_tokens=False)` on the texts already in memory (and
   `encode_batch_fast`, the library's no-offsets variant). Alternated, `--repeats` times; MB/s of text, tokens/s,
   median and spread, ratio ours / theirs. Also the byte tokenizer (ours only).
2. `memory`: a `--gb` GB uint16 `.bin` (nanoGPT's layout, no sidecar) and a small one (8 MB) of random ids; the
   same tiny GPT trained `--steps` steps with `scaletrain train --nproc 2 --set parallel.dp=2` on each, alternated;
   each rank's resident memory (VmRSS, and its file-backed part RssFile) sampled every 0.1 s; peak per rank and
   the difference big - small.

    .venv/bin/python benchmarks/bench_data.py throughput --mb 8 --repeats 5
    .venv/bin/python benchmarks/bench_data.py memory --gb 3 --steps 200 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def corpus_texts(mb: float) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts, size = [], 0
    while size < mb * 1e6:
        for f in files:
            t = f.read_text(encoding="utf-8", errors="replace")
            if not t:
                continue  # an empty document has no tokens (ours skips it; so does the reference count)
            texts.append(t)
            size += len(t.encode())
            if size >= mb * 1e6:
                break
    return texts


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def throughput(args) -> None:
    from tokenizers import Tokenizer

    from scaletrain.data.cache import build
    from scaletrain.data.sources import find_source
    from scaletrain.data.tokenizer import ByteTokenizer, load_tokenizer
    from scaletrain.data.train_tokenizer import train_bpe

    tmp = Path(tempfile.mkdtemp(prefix="bench_data_"))
    texts = corpus_texts(args.mb)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    jsonl = tmp / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_bpe(find_source(str(jsonl)), args.vocab, tmp / "tok")
    ours_tok = load_tokenizer(str(tmp / "tok"))
    lib = Tokenizer.from_file(str(tmp / "tok" / "tokenizer.json"))
    source = find_source(str(jsonl))
    print(f"{len(texts):,} documents, {mb:.1f} MB of text; byte-level BPE of {args.vocab:,} tokens; "
          f"{os.cpu_count()} CPU cores; {args.repeats} alternated repeats")
    runs: dict[str, list[float]] = {"ours (JSONL file -> cached stream)": [], "tokenizers encode_batch": [],
                                    "tokenizers encode_batch_fast": [], "ours, byte tokenizer": []}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
        start = time.perf_counter()
        meta = build(source, ours_tok, tmp / f"ours{r}.bin", "bench")
        runs["ours (JSONL file -> cached stream)"].append(time.perf_counter() - start)
        tokens["ours (JSONL file -> cached stream)"] = meta["tokens"]
        for name, fn in (("tokenizers encode_batch", lib.encode_batch),
                         ("tokenizers encode_batch_fast", lib.encode_batch_fast)):
            start = time.perf_counter()
            enc = fn(texts, add_special_tokens=False)
            runs[name].append(time.perf_counter() - start)
            tokens[name] = sum(len(e.ids) + 1 for e in enc)  # + the end-of-text token ours adds per document
        start = time.perf_counter()
        meta = build(source, ByteTokenizer(), tmp / f"byte{r}.bin", "bench")
        runs["ours, byte tokenizer"].append(time.perf_counter() - start)
        tokens["ours, byte tokenizer"] = meta["tokens"]
        for p in tmp.glob("*.bin*"):
            p.unlink()
    assert tokens["ours (JSONL file -> cached stream)"] == tokens["tokenizers encode_batch"], tokens
    base = statistics.median(runs["tokenizers encode_batch"])
    print("\n| run | seconds: median [min, max] | MB/s | tokens/s | encode_batch time / this time |")
    print("|---|---|---|---|---|")
    for name, times in runs.items():
        med = statistics.median(times)
        print(f"| {name} | {spread(times)} | {mb / med:.2f} | {tokens[name] / med:,.0f} | {base / med:.2f} |")


def rank_memory(pids: list[int]) -> dict[int, dict[str, int]]:
    out = {}
    for pid in pids:
        try:
            fields = {ln.split(":")[0]: int(ln.split()[1]) for ln in open(f"/proc/{pid}/status")
                      if ln.startswith(("VmRSS", "RssFile", "RssAnon"))}
        except (OSError, ValueError, IndexError):
            continue
        out[pid] = fields
    return out


def ranks_of(launcher: int) -> list[int]:
    import psutil

    try:
        kids = psutil.Process(launcher).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for k in kids:
        try:
            argv = k.cmdline()
        except psutil.Error:  # exited meanwhile
            continue
        if any("train" in a for a in argv) and "--nproc" not in argv:
            pids.append(k.pid)
    return pids


def one_run(source: Path, out: Path, steps: int) -> dict[str, float]:
    cmd = [str(ROOT / ".venv" / "bin" / "scaletrain"), "train", "--nproc", "2", "--set", "parallel.dp=2",
           "--set", f"data.source={source}", "--set", f"train.steps={steps}", "--set", "train.eval_every=0",
           "--set", "train.checkpoint_every=0", "--set", "model.n_layers=2", "--set", "model.d_model=64",
           "--set", "model.seq_len=128", "--set", "train.global_batch=32", "--set", "train.micro_batch=16",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak: dict[int, dict[str, int]] = {}
    while proc.poll() is None:
        for pid, m in rank_memory(ranks_of(proc.pid)).items():
            p = peak.setdefault(pid, {k: 0 for k in m})
            for k, v in m.items():
                p[k] = max(p.get(k, 0), v)
        time.sleep(0.1)
    text = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"training failed:\n{text[-2000:]}")
    ranks = sorted(peak.values(), key=lambda m: -m.get("VmRSS", 0))[:2]
    return {"rss": max(m["VmRSS"] for m in ranks) / 1024, "file": max(m.get("RssFile", 0) for m in ranks) / 1024,
            "anon": max(m.get("RssAnon", 0) for m in ranks) / 1024, "ranks": len(peak)}


def write_stream(path: Path, tokens: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = tokens
        while left:
            n = min(left, 1 << 26)
            rng.integers(0, 256, size=n, dtype=np.uint16).tofile(f)
            left -= n


def memory(args) -> None:
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_data_mem_"))
    tmp.mkdir(parents=True, exist_ok=True)
    big, small = tmp / "big.bin", tmp / "small.bin"
    start = time.perf_counter()
    for path, tokens in ((big, int(args.gb * 1e9) // 2), (small, 4_000_000)):
        if not path.is_file() or path.stat().st_size != 2 * tokens:  # kept from an earlier run in --dir
            write_stream(path, tokens)
    print(f"streams written in {time.perf_counter() - start:.0f} s: {big.stat().st_size / 1e9:.2f} GB and "
          f"{small.stat().st_size / 1e6:.0f} MB (uint16, no sidecar); {args.steps} steps of 32 x 128 tokens, dp 2")
    rows: dict[str, list[dict]] = {"small": [], "big": []}
    for r in range(args.repeats):
        for name, path in (("small", small), ("big", big)):
            rows[name].append(one_run(path, tmp / f"run-{name}-{r}", args.steps))
    print("\n| stream | peak VmRSS per rank, MB: median [min, max] | of which file-backed (RssFile) | anonymous |")
    print("|---|---|---|---|")
    for name, rs in rows.items():
        print(f"| {name} | {spread([x['rss'] for x in rs])} | {spread([x['file'] for x in rs])} | "
              f"{spread([x['anon'] for x in rs])} |")
    diff = statistics.median(x["rss"] for x in rows["big"]) - statistics.median(x["rss"] for x in rows["small"])
    print(f"\nbig - small, median peak VmRSS per rank: {diff:+.1f} MB (the stream is {args.gb:.1f} GB)")
    if not args.dir:
        for p in tmp.rglob("*.bin"):
            p.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--mb", type=float, default=8)
    t.add_argument("--vocab", type=int, default=8192)
    t.add_argument("--repeats", type=int, default=5)
    m = sub.add_parser("memory")
    m.add_argument("--gb", type=float, default=3)
    m.add_argument("--steps", type=int, default=200)
    m.add_argument("--repeats", type=int, default=2)
    m.add_argument("--dir", default=None, help="where the streams are written and kept (default: a temporary folder, "
                   "removed after)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    throughput(args) if args.what == "throughput" else memory(args)


if __name__ == "__main__":
    main()
