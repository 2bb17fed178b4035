"""`scaletrain verify`: PASS for a correct layout, FAIL (exit 1) when a parameter or loss differs."""

import os
import subprocess
import sys

import torch

from scaletrain.verify.run import report


def test_verify_command_passes_for_zero3_dp2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "scaletrain", "verify", "--small", "--set", "parallel.dp=2",
                        "--set", "parallel.zero=3", "--set", "train.steps=3"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout and "dp=2 tp=1 pp=1 zero=3" in p.stdout


def test_report_fails_on_any_difference(capsys):
    losses = {1: 5.0, 2: 4.0}
    state = {"w": torch.ones(3, dtype=torch.float64)}
    assert report(losses, state, dict(losses), {"w": state["w"].clone()}, 1e-9, 1e-11) == 0
    bad = {"w": state["w"].clone()}
    bad["w"][1] += 1e-6
    assert report(losses, state, dict(losses), bad, 1e-9, 1e-11) == 1
    assert report(losses, state, {1: 5.0, 2: 4.0 + 1e-6}, state, 1e-9, 1e-11) == 1
    assert "FAIL" in capsys.readouterr().out
