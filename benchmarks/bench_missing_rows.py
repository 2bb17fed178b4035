"""The missing group's share of the batch (issue 35; docs/fault_tolerance.md): `parallel.missing_rows=skip` against
`reassign` on the same run and failure, alternated and repeated. 3 replica groups of one process (fp64); group 0 is
SIGKILLed when it joins step K, restarts (--restarts 1), heals from group 1 and rejoins.

Per mode: the median step time of the busiest live member (group 1, which takes over group 0's rows with `reassign`)
in steps with every group and in steps without group 0 (its own rows alone, or two groups' rows), the group-steps lost
or reassigned (membership log), the whole run's wall time, and how far the final parameters are from an
uninterrupted run of the same config (the same command without the kill): the price of `skip` is a different
optimisation, the price of `reassign` is step time while a group is out.

    nice -n 10 .venv/bin/python benchmarks/bench_missing_rows.py [--repeats 2] [--kill-step 3] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BASE = ["model.n_layers=4", "model.d_model=128", "model.n_heads=4", "model.seq_len=64", "train.global_batch=12",
        "train.micro_batch=2", "train.warmup_steps=2", "train.eval_every=0", "train.dtype=fp64", "train.log_every=1",
        "train.checkpoint_every=0", "train.report=false", "parallel.dp=3", "parallel.replicas=3",
        "parallel.heartbeat_s=2"]


def run(out: Path, steps: int, mode: str, fault: str) -> dict:
    env = {**os.environ, "SCALETRAIN_FT_FAULT": fault}
    sets = [*BASE, f"train.steps={steps}", f"parallel.missing_rows={mode}"]
    cmd = [sys.executable, "-m", "scaletrain", "train", "--out", str(out), *[a for s in sets for a in ("--set", s)],
           "--restarts", "1"]
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, capture_output=True, check=True)
    total = time.monotonic() - t0
    rows = [json.loads(x) for x in (out / "membership.jsonl").read_text().splitlines()]
    committed = [r for r in rows if r["committed"]]
    group1 = [json.loads(x) for x in (out / "replicas" / "group1.jsonl").read_text().splitlines()]
    full = [r["step_time_s"] for r in group1 if len(r["members"]) == 3 and r["step"] > 1]
    short = [r["step_time_s"] for r in group1 if len(r["members"]) < 3]
    params = torch.load(out / "replicas" / "final-group1.pt", weights_only=True)["params"]
    return {"total_s": total, "full_step_s": statistics.median(full) if full else float("nan"),
            "short_step_s": statistics.median(short) if short else float("nan"), "steps_without": len(short),
            "lost": sum(3 - len(r["members"]) - sum(len(v) - 1 for v in (r.get("rows") or {}).values())
                        for r in committed),
            "reassigned": sum(sum(len(v) - 1 for v in (r.get("rows") or {}).values()) for r in committed),
            "params": params}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"skip": [], "reassign": []}
    with tempfile.TemporaryDirectory() as tmp:
        clean = run(Path(tmp) / "clean", args.steps, "skip", "")["params"]  # no failure: both modes are this run
        for i in range(args.repeats):  # alternated
            for mode in res:
                r = run(Path(tmp) / f"{mode}{i}", args.steps, mode, f"kill:0:{args.kill_step}")
                r["diff"] = max(float((r["params"][k] - clean[k]).abs().max()) for k in clean)
                res[mode].append(r)
    print(f"{'mode':>9} | step s, 3 groups | step s, group 0 out | ratio | steps without it | group-steps lost | "
          "reassigned | whole run s | max |params - uninterrupted|")
    for mode, rows in res.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("full_step_s", "short_step_s", "steps_without",
                                                                   "lost", "reassigned", "total_s")}.__getitem__
        spread = f"{min(r['short_step_s'] for r in rows):.3f}-{max(r['short_step_s'] for r in rows):.3f}"
        print(f"{mode:>9} | {med('full_step_s'):.3f} | {med('short_step_s'):.3f} ({spread}) | "
              f"{med('short_step_s') / med('full_step_s'):.2f}x | {med('steps_without'):.0f} | {med('lost'):.0f} | "
              f"{med('reassigned'):.0f} | {med('total_s'):.1f} | {max(r['diff'] for r in rows):.2e}")


if __name__ == "__main__":
    main()
