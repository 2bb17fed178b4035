"""Cost of the run report and of TensorBoard logging (issue: "See the run").

1. Report generation for a 10k-step run: a real tiny run is trained once (config, run_info, per-rank memory),
   then its metrics.jsonl is replaced by 10,000 rows shaped like its own (dense; and MoE rows with the
   per-expert loads of a 2-block, 8-expert model); `write_report` is timed (median and spread of repeats),
   with the page's size and, where Debian's chromium and Playwright are present, the time until the browser
   has drawn every chart.
2. TensorBoard: the per-step cost of `TensorBoardLog.write` on a logged row (microbenchmark), and whole
   training steps of a small model with train.tensorboard on and off, alternated, same process.

    python benchmarks/bench_report.py [--repeats 5] [--out benchmarks/results_report.md]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def _train(out: Path, sets: list[str], steps: int) -> float:
    """Train; returns the seconds of Trainer.run (the loop, logging and the final checkpoint; not the setup)."""
    from scaletrain.config import load_config, validate
    from scaletrain.train.trainer import Trainer

    cfg = validate(load_config(None, [f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
                                      "train.device=cpu", *sets]))
    trainer = Trainer(cfg, out)
    t0 = time.perf_counter()
    trainer.run()
    return time.perf_counter() - t0


def _synthetic_rows(template: dict, n: int, moe: tuple[int, int] | None) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for step in range(1, n + 1):
        r = dict(template)
        r.update(step=step, loss=5.5 * math.exp(-step / 3000) + 1.2 + 0.05 * rng.random(),
                 lr=1e-3 * min(1, step / 200), grad_norm=1 + rng.random(),
                 tokens_per_s=20000 * (1 + 0.1 * rng.random()), step_time_s=0.1 * (1 + 0.1 * rng.random()))
        if step % 500 == 0:
            r["val_loss"] = r["loss"] + 0.02
        if moe is not None:
            layers, experts = moe
            loads = [[rng.random() for _ in range(experts)] for _ in range(layers)]
            r.update(moe_layers=list(range(1, 2 * layers, 2)), loss_aux=1.0 + 0.1 * rng.random(),
                     loss_z=0.5 * rng.random(), moe_load=[[round(x / sum(row), 6) for x in row] for row in loads],
                     moe_dropped_frac=[0.05 * rng.random() for _ in range(layers)], moe_all_to_all_s=0.004)
        rows.append(r)
    return rows


def bench_report(work: Path, repeats: int, steps: int) -> list[str]:
    from scaletrain.report.run_page import write_report

    lines = []
    for name, sets, moe in (("dense", [], None),
                            ("MoE", ["model.moe.experts=8", "model.moe.every=2", "train.micro_batch=8"], (2, 8))):
        out = work / name
        _train(out, sets, 2)
        template = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        rows = _synthetic_rows(template, steps, moe)
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        write_report(out)  # warm: imports, the planner's meta-device model
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            path = write_report(out)
            times.append(time.perf_counter() - t0)
        size = path.stat().st_size / 2**20
        draw = _browser_time(path, repeats)
        lines.append(f"| {name}, {steps:,} steps | {_stats(times)} | {size:.2f} | {draw} |")
    return lines


def _browser_time(path: Path, repeats: int) -> str:
    exe = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "no playwright"
    if exe is None:
        return "no chromium"
    times = []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu",
                                                         "--disable-background-networking", "--no-first-run"])
        for _ in range(repeats):
            page = b.new_page(viewport={"width": 1400, "height": 900})
            t0 = time.perf_counter()
            page.goto(path.resolve().as_uri())
            page.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=120_000)
            times.append(time.perf_counter() - t0)
            page.close()
        b.close()
    return _stats(times)


def bench_tensorboard(work: Path, repeats: int) -> list[str]:
    from scaletrain.report.tensorboard import TensorBoardLog, flatten

    lines = []
    for name, sets in (("dense", []), ("MoE", ["model.moe.experts=8", "model.moe.every=2", "train.micro_batch=8"])):
        out = work / f"tb-{name}"
        _train(out, sets, 2)
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        log = TensorBoardLog(out / "tb-bench", 1)
        per = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for step in range(1, 1001):
                log.write({**row, "step": step})
            per.append((time.perf_counter() - t0) / 1000 * 1e6)
        log.close()
        lines.append(f"| {name} row ({len(flatten(row))} scalars) | {_stats(per)} |")
    return lines


def bench_train_steps(work: Path, repeats: int, steps: int) -> list[str]:
    """Trainer.run wall time per step of a small model with and without TensorBoard, alternated (a row's
    `step_time_s` ends before the row is logged, so it cannot show the logging)."""
    on, off = [], []
    for i in range(repeats):
        for flag, bucket in (("true", on), ("false", off)) if i % 2 == 0 else (("false", off), ("true", on)):
            out = work / f"steps-{flag}-{i}"
            seconds = _train(out, [f"train.tensorboard={flag}", "train.report=false", "model.n_layers=2",
                                   "model.d_model=64", "model.seq_len=64", "train.global_batch=8",
                                   "train.micro_batch=8"], steps)
            bucket.append(seconds / steps * 1e3)
    return [f"| Trainer.run wall time per step, tensorboard off (ms) | {_stats(off)} |",
            f"| Trainer.run wall time per step, tensorboard on (ms) | {_stats(on)} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10_000, help="metrics rows of the synthetic long run")
    ap.add_argument("--train-steps", type=int, default=60, help="steps of each timed training run (tensorboard A/B)")
    ap.add_argument("--out", default="benchmarks/results_report.md")
    args = ap.parse_args()
    import os

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines = ["# Report and TensorBoard cost (benchmarks/bench_report.py)", "",
                 f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", "",
                 "| run | write_report s, median (min, max) | page MiB | browser: load + draw s |",
                 "|---|---|---|---|", *bench_report(work, args.repeats, args.steps), "",
                 "| TensorBoardLog.write | us per logged step, median (min, max) |", "|---|---|",
                 *bench_tensorboard(work, args.repeats), "",
                 "| training A/B (2 layers, d_model 64, 8 x 64 tokens) | median over runs (min, max) |", "|---|---|",
                 *bench_train_steps(work, args.repeats, args.train_steps), "",
                 f"load average at end {os.getloadavg()[0]:.1f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
