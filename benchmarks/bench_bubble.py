"""Pipeline bubble: measured per rank from executed traces vs the simulator vs the closed forms.

For each schedule, trains a small GPT with pp=2 on 2 local processes (gloo), traces `--steps` steps and
takes the least disturbed one (smallest makespan). It prints, per rank: the measured bubble (idle / makespan),
the simulator's prediction for that step's median forward / backward / weight times and message latency,
the simulator's replay of every action's own measured duration (a lower bound), and the closed form
((p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved; zero-bubble's depends on the times).
Also the peak number of in-flight microbatches per stage the executor measured.

Runs of steps, 1f1b vs 2bw (PipeDream-2BW, arXiv 2006.09503, whose steps overlap): both train `--steps`
steps untraced (no barriers), the executor's events are put on the wall clock, and over the window of the
steady steps 2..steps-1 the bubble per rank is 1 - busy / window (the window includes the optimizer step
and the trainer's collectives between steps, the same for both). Beside it: the simulator's prediction
for one steady step (`simulate` of `build_schedule("1f1b")` or `build_2bw_step(first=False, last=False)`)
with the measured median F / B times, plus the measured time between steps.

    .venv/bin/python benchmarks/bench_bubble.py [--steps 6] [--microbatches 4]
        [--schedules gpipe,1f1b,interleaved,zb-h1] [--no-window]

The V schedules (`--schedules 1f1b,zb-v,dualpipev --microbatches 4 --no-window`) run two chunks per rank
(virtual_stages 2); DualPipeV's overlapped slots run their halves one after the other, as the executor does on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]


def _rank(rank, world, steps, m, schedules=None):
    from harness import TINY, make_config

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for sched in schedules or SCHEDULES:
        v = 2 if sched in ("interleaved", "zb-v", "dualpipev") else 1
        cfg = make_config({**TINY, "model.n_layers": 4, "model.d_model": 128, "model.n_heads": 4,
                           "model.seq_len": 64, "train.micro_batch": 4, "train.global_batch": 4 * m,
                           "train.dtype": "fp32", "train.steps": steps, "train.eval_every": 0,
                           "parallel.pp": 2, "parallel.schedule": sched, "parallel.virtual_stages": v})
        t = Trainer(cfg, None, DistEnv(rank, world, 0, "bench"))
        ex, traces, peaks = t.engine.pipeline, [], []
        for step in range(1, steps + 1):
            ex.trace_call = ex.calls + 1
            t.train_step(step)
            traces.append(ex.trace)
            peaks.append(ex.last_peak_in_flight)
        out[sched] = (traces[1:], max(peaks))
    return out


def _window_rank(rank, world, steps, m):
    """1f1b and 2bw, steps 1..steps untraced; every compute event on the wall clock, tagged by step."""
    from harness import TINY, make_config

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for sched in ("1f1b", "2bw"):
        cfg = make_config({**TINY, "model.n_layers": 4, "model.d_model": 128, "model.n_heads": 4,
                           "model.seq_len": 64, "train.micro_batch": 4, "train.global_batch": 4 * m,
                           "train.dtype": "fp32", "train.steps": steps, "train.eval_every": 0,
                           "parallel.pp": 2, "parallel.schedule": sched})
        t = Trainer(cfg, None, DistEnv(rank, world, 0, "bench"))
        ex, events = t.engine.pipeline, []
        ex.trace_call = -1  # no barrier before any step
        for step in range(1, steps + 1):
            t.train_step(step, drain=step == steps)
            events += [(step, e.name, ex.last_wall0 + e.start_s, ex.last_wall0 + e.end_s) for e in ex.last_events]
        out[sched] = events
    return out


def window_table(outs: list, steps: int, m: int) -> list[str]:
    from scaletrain.parallel.pipeline.schedules import build_2bw_step, build_schedule
    from scaletrain.parallel.pipeline.simulate import simulate

    p = len(outs)
    rows = [f"| schedule | rank | measured bubble, steps 2..{steps - 1} | step time (s) | time between steps (s) |"
            " simulated steady-step bubble (+ time between steps) |", "|---|---|---|---|---|---|"]
    for sched in ("1f1b", "2bw"):
        ev = [[e for e in outs[r][sched] if 2 <= e[0] <= steps - 1] for r in range(p)]
        t0 = min(e[2] for r in range(p) for e in ev[r])
        t1 = max(e[3] for r in range(p) for e in ev[r])
        span = t1 - t0
        gaps = []  # from the last compute of step k (any rank) to the first of step k+1 (any rank)
        for k in range(2, steps - 1):
            end = max(e[3] for r in range(p) for e in outs[r][sched] if e[0] == k)
            start = min(e[2] for r in range(p) for e in outs[r][sched] if e[0] == k + 1)
            gaps.append(start - end)
        gap = statistics.median(gaps) if gaps else 0.0
        t_f = [statistics.median(e[3] - e[2] for e in ev[r] if e[1] == "F") for r in range(p)]
        t_b = [statistics.median(e[3] - e[2] for e in ev[r] if e[1] == "B") for r in range(p)]
        lists = build_schedule(sched, p, m) if sched == "1f1b" else build_2bw_step(p, m, False, False)
        sim = simulate(lists, t_f, t_b)
        for r in range(p):
            busy = sum(e[3] - e[2] for e in ev[r])
            pred = 1 - sim.busy[r] / (sim.makespan + gap)
            rows.append(f"| {sched} | {r} | {1 - busy / span:.3f} | {span / (steps - 2):.4f} | {gap:.4f} |"
                        f" {sim.bubble_per_rank[r]:.3f} ({pred:.3f}) |")
    return rows


def closed_form(schedule: str, p: int, m: int, v: int) -> str:
    if schedule in ("gpipe", "1f1b"):
        return f"{(p - 1) / (m + p - 1):.3f}"
    if schedule == "interleaved":
        return f"{(p - 1) / (v * m + p - 1):.3f}"
    return "depends on t_w"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)  # >= 4 for the window of steady steps
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated parallel.schedule values")
    ap.add_argument("--no-window", action="store_true", help="skip the 1f1b vs 2bw runs of steps")
    args = ap.parse_args()
    schedules = args.schedules.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from harness import run_ranks

    outs = run_ranks(_rank, 2, args.steps, args.microbatches, schedules, timeout=600)
    print("| schedule | rank | measured | simulated (median op times) | replay (own durations) | closed form |"
          " peak in flight |")
    print("|---|---|---|---|---|---|---|")
    for sched in schedules:
        traces, _ = outs[0][sched]
        trace = min(traces, key=lambda t: t.makespan)
        lat = trace.message_latency()
        meas, pred, rep = trace.bubble_per_rank(), trace.predicted(lat).bubble_per_rank, \
            trace.replay(lat).bubble_per_rank
        v = 2 if sched in ("interleaved", "zb-v", "dualpipev") else 1
        for r in range(2):
            print(f"| {sched} | {r} | {meas[r]:.3f} | {pred[r]:.3f} | {rep[r]:.3f} | "
                  f"{closed_form(sched, 2, args.microbatches, v)} | {outs[r][sched][1]} |")
    if args.no_window:
        return
    print()
    windows = run_ranks(_window_rank, 2, args.steps, args.microbatches, timeout=600)
    print("\n".join(window_table(windows, args.steps, args.microbatches)))


if __name__ == "__main__":
    main()
