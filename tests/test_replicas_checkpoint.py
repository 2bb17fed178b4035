"""Checkpoints of fault-tolerant replica runs (parallel.replicas; docs/fault_tolerance.md): the lowest member of a
step's quorum writes the run's checkpoint through train/checkpoint.py (here in the background,
train.checkpoint_async; the synchronous final checkpoint is checked in test_replicas.py); a whole-job SIGKILL after
a checkpoint is resumed by the same command from the newest one, and the final parameters equal the uninterrupted
single-process run (fp64) and the replay of the membership log; the checkpoint is a plain one: `--reshard` resumes
it with replicas=1 to the same parameters.

The job is stalled at a known step by the `hold` drill (group 1 sleeps on joining step 6's quorum, its heartbeat
going on) and then every process of it (launcher, lighthouse, torchrun agents, groups) is SIGKILLed at once."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.multinode.replicas import effective_rows
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.replica_replay import TOLERANCE, load_log, replay_rounds
from scaletrain.train.trainer import Trainer
from tests.harness import TINY, train_reference
from tests.test_replicas import _tree

RUN = {**TINY, "train.steps": 8, "train.checkpoint_every": 2, "train.checkpoint_async": True, "parallel.dp": 2,
       "parallel.replicas": 2, "parallel.heartbeat_s": 2.0, "train.report": False}
EQUAL = 1e-12  # fp64: the replica arithmetic vs the one-process Trainer differs by summation order (measured ~1e-16)


def _sets(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "scaletrain", "train", "--out", str(out), *_sets(RUN)]


def _kill_job_after_checkpoint(out: Path) -> None:
    env = {**os.environ, "SCALETRAIN_FT_FAULT": "hold:1:6"}
    p = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    try:
        while not ((out / "replicas" / "held-group1").exists()
                   and (out / "checkpoints" / "step_00000004" / "COMPLETE").exists()):  # saved in the background
            assert p.poll() is None and time.monotonic() < deadline, "the run ended before it was held"
            time.sleep(0.1)
    finally:
        for pid in _tree(p.pid):  # the whole job at once, as when its machine goes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.communicate()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _ckpt_diff(directory: Path, ref: dict) -> float:
    """Largest difference of a checkpoint's model tensors from `ref` (tied embeddings: no lm_head stored)."""
    saved = ckpt.read_tensors(directory)
    assert set(saved) <= set(ref) and "wte.weight" in saved
    return max(float((saved[k] - ref[k]).abs().max()) for k in saved)


def test_whole_job_kill_resumes_from_the_newest_checkpoint_and_equals_the_uninterrupted_run(tmp_path, capsys):
    out = tmp_path / "run"
    _kill_job_after_checkpoint(out)
    newest = ckpt.latest(out / "checkpoints")
    assert newest is not None and newest.name == "step_00000004"  # step 6 was never committed
    meta = ckpt.read_meta(newest)
    assert meta["replicas"]["writer"] == 0 and meta["replicas"]["members"] == [0, 1] and meta["world_size"] == 2
    killed = load_log(out)
    assert max(r["step"] for r in killed if r["committed"]) == 5  # step 5 was computed and is recomputed
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)  # the same checkpoint, resumed below with replicas=1

    p = subprocess.run(_cmd(out), capture_output=True, text=True, timeout=180)  # the same command resumes
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step 4: resumed from its checkpoint" in p.stdout
    rows = load_log(out)
    assert [r.get("resumed_from") for r in rows[len(killed):]][0] == 4
    assert [r["step"] for r in effective_rows(rows)] == list(range(1, 9))
    metrics = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics == list(range(1, 9))  # step 5's row of the killed launch was trimmed at the resume
    history = [json.loads(x) for x in (out / "resumes.jsonl").read_text().splitlines()]
    assert [h["from_step"] for h in history] == [4]  # one whole-job resume, written once
    assert [c.name for c in ckpt.checkpoint_dirs.complete_checkpoints(out / "checkpoints")][-2:] == \
        ["step_00000006", "step_00000008"]

    finals = {f.stem: torch.load(f, weights_only=True)["params"] for f in (out / "replicas").glob("final-*.pt")}
    assert sorted(finals) == ["final-group0", "final-group1"]
    assert _max_diff(finals["final-group0"], finals["final-group1"]) == 0.0
    _, ref = train_reference({k: v for k, v in RUN.items() if not k.startswith("parallel.")})  # uninterrupted
    assert _max_diff(finals["final-group0"], ref) <= EQUAL
    assert _max_diff(replay_rounds(load_config(out / "config.yaml"), rows), finals["final-group0"]) <= TOLERANCE
    assert _ckpt_diff(ckpt.latest(out / "checkpoints"), ref) <= EQUAL  # the final checkpoint

    # another number of groups is another layout: refused in one line, and --reshard of a replica run's own folder too
    four = {**RUN, "parallel.dp": 4, "parallel.replicas": 4}
    for extra, message in (([], "add --reshard"), (["--reshard"], "a replica run's own folder is resumed without it")):
        assert main(["train", "--out", str(out), *_sets(four), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1

    # a replica checkpoint is a plain one: one process resumes it under replicas=1 with --reshard (`scaletrain
    # train --reshard`'s Trainer; the launcher's own checks of a resume are the plain runs' and tested there)
    one = load_config(None, [f"{k}={v}" for k, v in {**RUN, "parallel.dp": 1, "parallel.replicas": 1}.items()])
    trainer = Trainer(one, plain, reshard=True)
    assert trainer.step == 4
    trainer.run()
    assert _max_diff(trainer.full_state(), ref) <= EQUAL


def test_a_replica_run_without_a_checkpoint_is_not_resumed_and_nothing_is_touched(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "membership.jsonl").write_text('{"round": 0}\n')
    assert main(["train", "--out", str(out), *_sets(RUN)]) == 2
    err = capsys.readouterr().err
    assert "without a complete checkpoint to resume from" in err and len(err.strip().splitlines()) == 1
    assert (out / "membership.jsonl").read_text() == '{"round": 0}\n'
