"""Rounding noise of the layout matrix, per dtype: where the tolerances of `scaletrain verify --matrix` come from.

Runs the stored covering set (`scaletrain.verify.layouts.stored_covering(4)`) once in fp64 — every layout must pass at
rtol 1e-9, so each one is proven to compute what one process computes up to summation order — and then in fp32,
bf16 and fp16 (`verify --matrix --dtype D`: every layout in that dtype instead of its own). In those dtypes the
remaining differences from the same-dtype single-process run are rounding noise (a different summation order,
amplified by three optimizer steps). Prints, per dtype and metric, the median, 90th percentile and maximum over
the layouts, and the tolerance `scaletrain.verify.tolerances.TOLERANCE` uses: 3x the maximum, rounded up to two
significant digits. `--json-dir` keeps the four `verify --matrix` JSON files and printed tables.

    .venv/bin/python benchmarks/bench_matrix_noise.py [--world 4] [--jobs 1] [--json-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = ("loss", "grad_norm", "params")


def round_up(x: float, digits: int = 2) -> float:
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - digits + 1
    return math.ceil(x / 10**e - 1e-9) * 10**e


def run(dtype: str, world: int, jobs: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "scaletrain", "verify", "--matrix", "--world", str(world), "--jobs", str(jobs),
           "--dtype", dtype, "--json", str(out)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out.with_suffix(".txt").write_text(proc.stdout)  # the table verify --matrix printed
    if not out.exists():
        raise SystemExit(f"verify --matrix --dtype {dtype} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout}{proc.stderr}")
    doc = json.loads(out.read_text())
    print(f"{dtype}: {doc['passed']} of {doc['total']} layouts pass the current tolerance ({time.time() - t0:.0f} s)",
          flush=True)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json-dir", default=None, help="keep the verify --matrix JSON files here")
    args = ap.parse_args()
    keep = Path(args.json_dir) if args.json_dir else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        where = keep or Path(tmp)
        exact = run("fp64", args.world, args.jobs, where / "matrix_fp64.json")
        if exact["passed"] != exact["total"]:
            bad = [r["layout"] for r in exact["layouts"] if not r["ok"]]
            raise SystemExit(f"{len(bad)} layouts differ from one process in fp64 (a bug, not noise): {bad}")
        docs = {d: run(d, args.world, args.jobs, where / f"matrix_{d}.json") for d in ("fp32", "bf16", "fp16")}
    print(f"\n{exact['total']} layouts (world <= {args.world}), {exact['steps']} steps each; all exact in fp64 "
          f"(worst loss {max(r['loss'] for r in exact['layouts']):.1e}, gradient norm "
          f"{max(r['grad_norm'] for r in exact['layouts']):.1e})\n")
    print("| dtype | metric | median | p90 | max | tolerance (3x max) | worst layout |")
    print("|---|---|---|---|---|---|---|")
    derived = {}
    for dtype, doc in docs.items():
        rows = [r for r in doc["layouts"] if not r["error"]]
        derived[dtype] = {}
        for m in METRICS:
            values = sorted(r[m] for r in rows)
            worst = max(rows, key=lambda r: r[m])
            p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
            derived[dtype][m] = round_up(3 * values[-1])
            print(f"| {dtype} | {m} | {statistics.median(values):.1e} | {p90:.1e} | {values[-1]:.2e} | "
                  f"{derived[dtype][m]:.2g} | {worst['layout']} |")
        errors = [r["layout"] for r in doc["layouts"] if r["error"]]
        if errors:
            print(f"{dtype}: {len(errors)} layouts did not run: {errors}")
    print("\nTOLERANCE = {  # scaletrain/verify/tolerances.py")
    for dtype, t in derived.items():
        print(f'    "{dtype}": Tolerance(loss={t["loss"]:.2g}, grad_norm={t["grad_norm"]:.2g}, '
              f'params={t["params"]:.2g}),')
    print("}")


if __name__ == "__main__":
    main()
