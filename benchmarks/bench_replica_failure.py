"""What one failure costs (issue 35; docs/fault_tolerance.md): replica groups (parallel.replicas=3, the killed group
restarts and heals while the others go on) against today's heartbeat + whole-job restart + resume from the newest
checkpoint (parallel.dp=3, --restarts 1), on the same model, data and step of the kill, alternated and repeated.

Replicas: one process (group 1) is SIGKILLed when it joins step K (SCALETRAIN_FT_FAULT); wall time lost = the stall
of the others (the failed round's start to the next committed step), steps recomputed = 0, group-steps lost (a
third of a step's batch each) from the membership log. Restart: rank 1 is SIGKILLed from here when metrics.jsonl
shows step K; wall time lost = kill to the first step logged after the restart minus the time the lost steps took
before it, steps recomputed = K - the checkpoint it resumed from.

    nice -n 10 .venv/bin/python benchmarks/bench_replica_failure.py [--repeats 2] [--kill-step 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=32", "train.global_batch=6",
        "train.micro_batch=2", "train.warmup_steps=2", "train.eval_every=0", "train.dtype=fp64", "train.log_every=1",
        "parallel.dp=3", "parallel.heartbeat_s=1"]


def _cmd(out: Path, sets: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain", "train", "--out", str(out), *[a for s in sets for a in ("--set", s)],
            *extra]


def replicas(out: Path, steps: int, k: int) -> dict:
    env = {**os.environ, "SCALETRAIN_FT_FAULT": f"kill:1:{k}"}
    sets = [*BASE, f"train.steps={steps}", "train.checkpoint_every=0", "parallel.replicas=3"]
    t0 = time.monotonic()
    subprocess.run(_cmd(out, sets, "--restarts", "1"), env=env, capture_output=True, check=True)
    total = time.monotonic() - t0
    rows = [json.loads(x) for x in (out / "membership.jsonl").read_text().splitlines()]
    failed = next(r for r in rows if not r["committed"])
    after = next(r for r in rows if r["committed"] and r["step"] == failed["step"])
    return {"wall_lost_s": after["time"] - failed["time"], "steps_recomputed": 0, "total_s": total,
            "group_steps_lost": sum(3 - len(r["members"]) for r in rows if r["committed"])}


def _descendants(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
    return kids + [d for c in kids for d in _descendants(c)]


def restart(out: Path, steps: int, k: int, every: int) -> dict:
    sets = [*BASE, f"train.steps={steps}", f"train.checkpoint_every={every}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(_cmd(out, sets, "--restarts", "1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    step_times: dict[int, float] = {}
    while proc.poll() is None:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                step_times.setdefault(json.loads(line)["step"], time.monotonic())
        if max(step_times, default=0) >= k:
            break
        time.sleep(0.01)
    killed_at = time.monotonic()
    ranks = [p for p in _descendants(proc.pid) if b"scaletrain" in Path(f"/proc/{p}/cmdline").read_bytes()
             and b"RANK=1" in Path(f"/proc/{p}/environ").read_bytes().replace(b"\0", b" ") + b" "]
    os.kill(ranks[-1], signal.SIGKILL)
    seen = len(metrics.read_text().splitlines())
    while proc.poll() is None and len(metrics.read_text().splitlines()) <= seen:
        time.sleep(0.01)
    first_after = time.monotonic()
    proc.wait()
    total = time.monotonic() - t0
    resumed = (k // every) * every
    redo = sum(step_times[s] - step_times[s - 1] for s in range(resumed + 1, k + 1) if s - 1 in step_times)
    return {"wall_lost_s": first_after - killed_at + redo, "steps_recomputed": k - resumed, "total_s": total,
            "group_steps_lost": 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=8)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"replicas": [], "restart": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # alternated
            res["replicas"].append(replicas(Path(tmp) / f"ft{i}", args.steps, args.kill_step))
            res["restart"].append(restart(Path(tmp) / f"rs{i}", args.steps, args.kill_step, args.checkpoint_every))
    for name, rows in res.items():
        w = [r["wall_lost_s"] for r in rows]
        print(f"{name:>9}: wall time lost per failure {statistics.median(w):.2f} s (min {min(w):.2f}, max "
              f"{max(w):.2f}); steps recomputed {rows[0]['steps_recomputed']}; group-steps lost "
              f"{rows[0]['group_steps_lost']}; whole run {statistics.median([r['total_s'] for r in rows]):.1f} s")
    ratio = statistics.median([r["wall_lost_s"] for r in res["restart"]]) / statistics.median(
        [r["wall_lost_s"] for r in res["replicas"]])
    print(f"restart / replicas wall time lost: {ratio:.1f}x")


if __name__ == "__main__":
    main()
