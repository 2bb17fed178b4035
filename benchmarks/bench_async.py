"""Synchronous vs asynchronous data parallelism at a fixed token budget (issue 20; docs/async.md).

4 workers train the same small GPT on the embedded corpus for the same number of global batches (the same
tokens) in each mode, without and with one straggler (`parallel.slow_ranks=1:0.5`: worker 1 takes 50% longer
per step): bsp, ps with staleness 1 and 4 and unbounded (ASP; 1 server), hogwild (lock-free), local SGD with
H = 4 and 16, DiLoCo with H = 16. Each run goes through `scaletrain train --nproc` (the real launcher) and is
read back from its metrics.jsonl. Printed: final validation loss, training time (sum of the logged step
times: wall time between updates at the coordinator for ps, per step for bsp, per round for local, per quiet
segment for hogwild), tokens/s, staleness, lost updates; written: a PNG of loss against time and against step
(hardware efficiency vs statistical efficiency) and a JSON of every curve.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async.py --steps 100 --out runs/bench_async

On a shared 2-core machine the 5 processes of a ps run share the cores with everything else: compare the
modes of one invocation with each other, and repeat (`--repeats`) before trusting a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODEL = {"model.n_layers": 3, "model.d_model": 96, "model.n_heads": 4, "model.seq_len": 64,
         "train.global_batch": 16, "train.micro_batch": 4, "train.lr": 3e-3, "train.warmup_steps": 5,
         "train.dtype": "fp32", "train.checkpoint_every": 0, "train.eval_batches": 4, "parallel.dp": 4}
MODES = {
    "bsp": {},
    "ps ssp k=1": {"parallel.sync": "ps", "parallel.staleness": 1},
    "ps ssp k=4": {"parallel.sync": "ps", "parallel.staleness": 4},
    "ps asp": {"parallel.sync": "ps", "parallel.staleness": -1},
    "hogwild": {"parallel.sync": "hogwild"},
    "local H=4": {"parallel.sync": "local", "parallel.local_steps": 4},
    "local H=16": {"parallel.sync": "local", "parallel.local_steps": 16},
    "diloco H=16": {"parallel.sync": "local", "parallel.local_steps": 16, "parallel.outer": "diloco"},
}
STRAGGLER = {"parallel.slow_ranks": "1:0.5"}


def run(name: str, sets: dict, out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    nproc = 4 + (1 if sets.get("parallel.sync") == "ps" else 0)
    argv = [sys.executable, "-m", "scaletrain", "train", "--out", str(out), "--nproc", str(nproc)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times, acc = [], 0.0
    for r in rows:
        acc += r["step_time_s"]
        times.append(acc)
    st_max = max((r.get("staleness_max", 0) for r in rows), default=0)
    st_mean = sum(r.get("staleness_mean", 0.0) for r in rows) / len(rows)
    return {"name": name, "steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows], "time": times,
            "val_loss": rows[-1].get("val_loss"), "train_s": acc, "job_wall_s": wall,
            "tokens_per_s": len(rows) * sets["train.global_batch"] * sets["model.seq_len"] / acc,
            "staleness_max": st_max, "staleness_mean": st_mean,
            "lost_updates": sum(r.get("lost_updates", 0) for r in rows)}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharey=True)
    for col, slow in enumerate((False, True)):
        for r in (r for r in results if r["straggler"] == slow):
            smooth = _smooth(r["loss"])
            axes[0, col].plot(r["time"], smooth, label=r["mode"])
            axes[1, col].plot(r["steps"], smooth, label=r["mode"])
        where = "one 50% straggler" if slow else "no straggler"
        axes[0, col].set_title(f"loss vs training time ({where})", fontsize=10)
        axes[1, col].set_title(f"loss vs step: global batches seen ({where})", fontsize=10)
        axes[0, col].set_xlabel("seconds")
        axes[1, col].set_xlabel("step")
    for ax in axes.flat:
        ax.set_ylabel("training loss (5-step mean)")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("4 workers, same tokens: hardware efficiency (left/top) vs statistical efficiency (bottom)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1): i + 1]) / len(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="global batches (the token budget)")
    ap.add_argument("--out", default="runs/bench_async")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of modes to run")
    ap.add_argument("--repeats", type=int, default=1, help="repeat the whole sweep, alternating the order")
    args = ap.parse_args()
    out = Path(args.out)
    modes = [m.strip() for m in args.modes.split(",")]
    results = []
    for rep in range(args.repeats):
        order = modes if rep % 2 == 0 else modes[::-1]
        for mode in order:
            for slow in (False, True):
                sets = {**MODEL, "train.steps": args.steps, "train.eval_every": args.steps, **MODES[mode],
                        **(STRAGGLER if slow else {})}
                tag = f"{mode.replace(' ', '_').replace('=', '')}{'_slow' if slow else ''}_{rep}"
                r = run(mode, sets, out / tag)
                r.update(mode=mode, straggler=slow, repeat=rep)
                results.append(r)
                print(f"{mode:12s} straggler={slow!s:5s} val {r['val_loss']:.4f} train {r['train_s']:.1f} s "
                      f"(job {r['job_wall_s']:.0f} s)", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot([r for r in results if r["repeat"] == 0], out / "loss_vs_time_and_step.png")
    print(f"\n{args.steps} steps x 16 sequences x 64 tokens, 4 workers; {args.repeats} repeat(s), median train time")
    print("| mode | straggler | final val loss | train time s | tokens/s | staleness max / mean | lost updates |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        for slow in (False, True):
            rs = [r for r in results if r["mode"] == mode and r["straggler"] == slow]
            times = sorted(r["train_s"] for r in rs)
            med = times[len(times) // 2]
            spread = f" ({times[0]:.1f}-{times[-1]:.1f})" if len(times) > 1 else ""
            r = rs[0]
            vals = "/".join(f"{x['val_loss']:.4f}" for x in rs)
            lost = "/".join(str(x["lost_updates"]) for x in rs) if mode == "hogwild" else "-"
            st = f"{max(x['staleness_max'] for x in rs)} / {r['staleness_mean']:.2f}" if mode != "bsp" and \
                not mode.startswith(("local", "diloco")) else "-"
            print(f"| {mode} | {'1 x 50%' if slow else 'none'} | {vals} | {med:.1f}{spread} | "
                  f"{len(r['steps']) * 16 * 64 / med:,.0f} | {st} | {lost} |")
    print(f"\nPNG: {out / 'loss_vs_time_and_step.png'}; curves: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
