"""A parameter-server job from the command line when a worker dies (SIGKILL from outside, at an arbitrary
moment): it is named and the job stops, or, with parallel.ps_tolerate_loss (ASP), the others finish the run
and the result still replays bit for bit from the version log. Assertions are on the logs, not on timing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SMALL = {"model.n_layers": 1, "model.d_model": 16, "model.n_heads": 2, "model.seq_len": 16, "train.global_batch": 4,
         "train.micro_batch": 2, "train.eval_every": 0, "train.dtype": "fp64", "parallel.sync": "ps"}


def _start(out: Path, nproc: int, **sets) -> subprocess.Popen:
    argv = [sys.executable, "-m", "scaletrain", "train", "--out", str(out), "--nproc", str(nproc)]
    for k, v in {**SMALL, **sets}.items():
        argv += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def _kill_worker_after(out: Path, proc: subprocess.Popen, rank: int, rows: int) -> int:
    """SIGKILL `rank` once `rows` metrics lines exist; returns the last step logged before the kill."""
    deadline = time.monotonic() + 240
    while len(_rows(out)) < rows:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the kill"
        time.sleep(0.02)
    ranks = json.loads((out / "logs" / "ranks.json").read_text())
    assert ranks[str(rank)]["role"].startswith("worker")
    os.kill(ranks[str(rank)]["pid"], signal.SIGKILL)
    return _rows(out)[-1]["step"]


def test_ps_tolerates_a_dead_worker_and_replays_bit_identically(tmp_path, capsys):
    from scaletrain.cli import main

    out, steps = tmp_path / "run", 100
    proc = _start(out, 3, **{"parallel.dp": 2, "parallel.staleness": -1, "parallel.ps_tolerate_loss": "true",
                             "train.steps": steps})
    killed_at = _kill_worker_after(out, proc, 2, 3)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    assert "worker 1 (rank 2) died (killed by SIGKILL); the job continues without it" in stderr
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert killed_at < steps and rows[-1]["workers"] == 1  # the kill landed during the run
    assert "worker 1 (rank 2) is gone" in (out / "logs" / "launcher.log").read_text()
    capsys.readouterr()
    code = main(["replay", "--out", str(out), "--json"])  # in this process, at the workers' thread count (1)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["bit_identical"] and doc["updates"] == steps and doc["staleness_max"] >= 0


def test_ps_stops_and_names_a_dead_worker(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, 2, **{"parallel.dp": 1, "train.steps": 400})
    killed_at = _kill_worker_after(out, proc, 1, 2)
    _, stderr = proc.communicate(timeout=240)
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert proc.returncode == 1 and killed_at < 400
    assert lines == ["scaletrain: error: worker 0 (rank 1) died (killed by SIGKILL); the job was stopped"], stderr
