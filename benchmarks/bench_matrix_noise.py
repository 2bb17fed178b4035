"""Rounding noise of the layout matrix's low-precision rows on every instruction-set level of this CPU: how close to
their bounds (`scaletrain.verify.tolerances.stepwise_bound`, derived from the unit roundoff) the step-by-step
comparisons of `scaletrain verify --matrix` come (docs/verify.md, "Low precision").

Runs the stored covering set's fp32, bf16 and fp16 layouts (`--filter dtype=fp32|bf16|fp16`; with `--every-dtype`,
every layout of the set once in each of the three, `--dtype D`) under each kernel set of `--isa`:

- `native`: what torch picks on this CPU (here AVX-512, with AVX-512-BF16 matmuls through oneDNN);
- `avx2`: ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2 (any x86-64 CPU since 2013);
- `sse42`: ATEN_CPU_CAPABILITY=default, MKL_ENABLE_INSTRUCTIONS=SSE4_2, ONEDNN_MAX_CPU_ISA=SSE41 (the baseline
  every x86-64 CPU torch runs on has).

A CPU can only run the levels it has; the three together are the kernels torch's x86-64 builds dispatch to. Prints,
per level and dtype, the layouts that pass, and for each metric the largest value as a fraction of its bound with
the layout that reached it. `--json-dir` keeps every `verify --matrix` JSON file.

    .venv/bin/python benchmarks/bench_matrix_noise.py [--world 4] [--isa native,avx2,sse42] [--every-dtype]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = ("loss", "grad_norm", "params")
ISA = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "sse42": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def run(isa: str, world: int, dtype: str | None, out: Path) -> dict:
    cmd = [sys.executable, "-m", "scaletrain", "verify", "--matrix", "--world", str(world), "--json", str(out)]
    cmd += ["--dtype", dtype] if dtype else ["--filter", "dtype=fp32|bf16|fp16"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ISA[isa]})
    out.with_suffix(".txt").write_text(proc.stdout)
    if not out.exists():
        raise SystemExit(f"verify --matrix ({isa}, {dtype or 'own dtypes'}) failed (exit {proc.returncode}):\n"
                         f"{proc.stdout}{proc.stderr}")
    doc = json.loads(out.read_text())
    print(f"{isa} {dtype or 'own dtypes'}: {doc['passed']} of {doc['total']} layouts PASS ({time.time() - t0:.0f} s)",
          flush=True)
    return doc


def fractions(doc: dict) -> list[tuple[str, str, float, str, float]]:
    """(dtype, metric, largest value / bound, layout, routing disagreement) per dtype and metric."""
    from scaletrain.verify.tolerances import stepwise_bound

    rows = []
    for dtype in ("fp32", "bf16", "fp16"):
        mine = [r for r in doc["layouts"] if r["dtype"] == dtype and not r["error"]]
        for m in METRICS:
            scored = [(r[m] / getattr(stepwise_bound(dtype, r["values"]["compress"]), m), r) for r in mine]
            if scored:
                frac, worst = max(scored, key=lambda x: x[0])
                routed = [r["routing"] for r in mine if not math.isnan(r["routing"])]
                rows.append((dtype, m, frac, worst["layout"], max(routed, default=0.0)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--isa", default="native,avx2,sse42", help="comma list of native, avx2, sse42")
    ap.add_argument("--every-dtype", action="store_true", help="every layout in fp32, bf16 and fp16 (--dtype)")
    ap.add_argument("--json-dir", default=None, help="keep the verify --matrix JSON files here")
    args = ap.parse_args()
    levels = [x.strip() for x in args.isa.split(",") if x.strip()]
    bad = [x for x in levels if x not in ISA]
    if bad:
        raise SystemExit(f"--isa: unknown level(s) {', '.join(bad)} (known: {', '.join(ISA)})")
    keep = Path(args.json_dir) if args.json_dir else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        where = keep or Path(tmp)
        for isa in levels:
            for dtype in (("fp32", "bf16", "fp16") if args.every_dtype else (None,)):
                doc = run(isa, args.world, dtype, where / f"matrix_{isa}_{dtype or 'own'}.json")
                table += [(isa, *row) for row in fractions(doc)]
    print("\n| kernels | dtype | metric | largest / bound | worst layout | largest routing disagreement |")
    print("|---|---|---|---|---|---|")
    for isa, dtype, m, frac, layout, routing in table:
        print(f"| {isa} | {dtype} | {m} | {frac:.3f} | {layout} | {routing:.1%} |")


if __name__ == "__main__":
    main()
