"""Single-process trainer: learning, determinism, exact kill-and-resume, LR schedule."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from harness import TINY, make_config

from scaletrain.config import TrainConfig
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import Trainer


def test_loss_goes_down_on_embedded_corpus():
    cfg = make_config({**TINY, "train.steps": 40, "train.dtype": "fp32", "train.lr": 1e-2,
                       "train.warmup_steps": 5})
    losses = Trainer(cfg).run().losses
    first = sum(losses[s] for s in range(1, 6)) / 5
    last = sum(losses[s] for s in range(36, 41)) / 5
    assert last < first - 1.0, (first, last)  # from ~5.5 (uniform over 256 bytes) to well below


def test_same_seed_is_bit_identical():
    cfg = make_config({**TINY, "train.dtype": "fp32", "model.dropout": 0.1})
    a, b = Trainer(cfg), Trainer(cfg)
    la, lb = a.run().losses, b.run().losses
    assert la == lb
    for (n, p), (_, q) in zip(a.full_state().items(), b.full_state().items()):
        assert torch.equal(p, q), n


def test_lr_schedule():
    t = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(5, t) == 0.5 and lr_at(10, t) == 1.0
    assert abs(lr_at(60, t) - 0.55) < 1e-12 and abs(lr_at(110, t) - 0.1) < 1e-12
    t.lr_schedule = "constant"
    assert lr_at(100, t) == 1.0


def _train_cmd(out: Path, steps: int) -> list[str]:
    sets = {**TINY, "train.steps": steps, "train.checkpoint_every": 3, "train.dtype": "fp32",
            "model.dropout": 0.1, "train.eval_every": 4}
    argv = [sys.executable, "-m", "scaletrain", "train", "--out", str(out)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    return argv


def _final_params(out: Path) -> dict:
    from scaletrain.train import checkpoint as ckpt

    return ckpt.read_tensors(ckpt.latest(out / "checkpoints"), "model/")


def test_kill_and_resume_is_exact(tmp_path):
    """SIGKILL after a checkpoint, run the same command again: same losses and parameters as no kill."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run(_train_cmd(ref, 12), check=True, env=env, capture_output=True)

    cmd = _train_cmd(run, 12) + ["--set", "train.steps=12"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step_00000006" / "COMPLETE").exists():
        assert time.time() < deadline and proc.poll() is None, "no checkpoint appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x)
    assert killed_at < 12, "the run finished before it was killed; the test proves nothing"

    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert "resumed from step" in out.stdout
    ref_rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    run_rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in run_rows] == list(range(1, 13))
    assert [r["loss"] for r in run_rows] == [r["loss"] for r in ref_rows]
    assert [r.get("val_loss") for r in run_rows] == [r.get("val_loss") for r in ref_rows]
    a, b = _final_params(ref), _final_params(run)
    for k in a:
        assert torch.equal(a[k], b[k]), k
