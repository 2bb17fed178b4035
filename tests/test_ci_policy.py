"""A skip is not a pass: under CI (CI=true) a skipping test fails with its reason, except tests marked gpu; outside
CI a skip stays a skip and `make test` prints its reason (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PROBE = '''
import pytest

def test_skips():
    pytest.skip("no frobnicator here")

@pytest.mark.gpu
def test_gpu_only():
    pytest.skip("needs a CUDA device")

def test_runs():
    assert True
'''


def _run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o",
                           "markers=gpu: gpu", str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)


def test_under_ci_an_undeclared_skip_fails_and_a_gpu_test_may_skip(tmp_path):
    p = _run(tmp_path, ci=True)
    assert p.returncode == 1, p.stdout
    assert "1 failed, 1 passed, 1 skipped" in p.stdout, p.stdout
    assert "skipped under CI, where only tests marked gpu may skip" in p.stdout
    assert "no frobnicator here" in p.stdout


def test_outside_ci_a_skip_is_a_skip_with_its_reason(tmp_path):
    p = _run(tmp_path, ci=False)
    assert p.returncode == 0, p.stdout
    assert "1 passed, 2 skipped" in p.stdout and "no frobnicator here" in p.stdout, p.stdout
