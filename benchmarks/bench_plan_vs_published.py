"""The planner's search against the layouts published runs chose (issue 31): for each published configuration of
tests/test_plan_published.py (held-out and development rows, up to 4,000 GPUs), the search's first pick for the same
model, GPUs, batch and precision next to the authors' own layout, evaluated by the same cost model, and whether the
predicted gain is beyond the planner's held-out error (`plan/trust.py`). Also the CPU time of the searches.

Not a throughput benchmark of ours against a baseline (the planner is analytic): a measurement of how far the search
departs from what practitioners ran, and how often it can vouch for the difference.

    .venv/bin/python benchmarks/bench_plan_vs_published.py [--max-gpus 4000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_plan_published import DEV_ROWS, HELD_OUT  # noqa: E402

from scaletrain.plan.analytic.estimate import estimate  # noqa: E402
from scaletrain.plan.analytic.inputs import Assumptions, Training  # noqa: E402
from scaletrain.plan.hardware import get_gpu  # noqa: E402
from scaletrain.plan.search import search  # noqa: E402
from scaletrain.plan.trust import TRUST  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gpus", type=int, default=4000)
    args = ap.parse_args()
    print("| rows | model | GPU | GPUs | published layout | fits | search's first pick | predicted gain | vouched |")
    print("|---|---|---|---|---|---|---|---|---|")
    seen, gains, cpu = set(), [], []
    for kind, rows in (("held-out", HELD_OUT), ("development", DEV_ROWS)):
        for r in rows:
            key = (r.model.name, r.gpu, r.gpus, r.global_batch, r.dtype)
            if key in seen or r.gpus > args.max_gpus:
                continue
            seen.add(key)
            train = Training(r.global_batch, r.dtype, r.attention, r.dp_overlap)
            a = Assumptions(tp_comm_overlap=r.tp_overlap)
            gpu = get_gpu(r.gpu)
            theirs = estimate(r.model, gpu, train, r.layout, a, n_gpus=r.gpus)
            t0 = time.process_time()
            best = next(c for c in search(r.model, gpu, r.gpus, train, a=a).candidates if c.fits)
            cpu.append(time.process_time() - t0)
            gain = theirs.step_time_s / best.step_time_s - 1
            gains.append(gain)
            fits = "yes" if theirs.fits else "no"
            print(f"| {kind} | {r.model.name} | {r.gpu} | {r.gpus} | {r.layout.short()} | {fits}"
                  f" | {best.layout.short()} | {gain:+.0%} | {'beyond ±' if gain > TRUST else 'inside ±'}{TRUST:.0%} |")
    beyond = sum(g > TRUST for g in gains)
    print(f"\n{len(gains)} configurations: predicted gain of the search's pick over the published layout median "
          f"{statistics.median(gains):+.0%}, max {max(gains):+.0%}; beyond the ±{TRUST:.0%} held-out error in {beyond}."
          f" Search CPU time per configuration: median {statistics.median(cpu):.2f} s, max {max(cpu):.2f} s.")


if __name__ == "__main__":
    main()
