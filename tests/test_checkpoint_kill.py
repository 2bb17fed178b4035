"""A kill during a checkpoint save, synchronous or asynchronous, leaves the previous checkpoint valid, and the
resumed run continues exactly (bitwise: same layout) like the run that was never killed.

A run checkpoints every step; the save of step 2 is held inside the storage writer (the test patches
`ChecksummedWriter.write_data` in the workers to wait) and the processes are killed with SIGKILL while it is held:
- synchronous (one process, torch's dropout, whose random stream the checkpoint carries): the training loop is
  inside the save;
- asynchronous (`train.checkpoint_async`, two ranks, dp=2, ZeRO-1, fp16 with its loss scaler and fp32 masters):
  the loop goes on to step 3 while step 2 is being written (checked from metrics.jsonl) and then waits for it in
  step 3's save.
Then step_00000002.tmp exists, step 1 is the newest complete checkpoint and verifies, and running the same
training again resumes from step 1 and reproduces the uninterrupted run's losses and parameters bitwise.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from harness import TINY, _child, make_config, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {**TINY, "train.steps": 4, "train.checkpoint_every": 1, "train.report": False}
SYNC = {**BASE, "model.dropout": 0.1, "model.dropout_impl": "torch"}
ASYNC = {**BASE, "parallel.dp": 2, "parallel.zero": 1, "train.checkpoint_async": True, "train.dtype": "fp16",
         "train.loss_scale": 1024.0}


def _held_run(rank, world, overrides, out, held_step):
    """Train, holding the write of step `held_step`'s checkpoint forever (until the test kills us)."""
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train import dcp_io
    from scaletrain.train.trainer import Trainer

    write = dcp_io.ChecksummedWriter.write_data

    def held(self, plan, planner):
        if Path(self.path).name == f"step_{held_step:08d}.tmp":
            (Path(out) / f"held{rank}").touch()
            time.sleep(3600)
        return write(self, plan, planner)

    dcp_io.ChecksummedWriter.write_data = held
    Trainer(make_config(overrides), out, DistEnv(rank, world, 0, "test") if world > 1 else None).run()


def _kill_during_save(overrides: dict, out: Path, wait_for_step: int, world: int) -> None:
    ctx = mp.get_context("spawn")
    store = str(out.parent / f"{out.name}.store")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(_held_run, r, world, store, 120, 1, (overrides, str(out), 2), q),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 180
    try:
        while True:
            assert time.monotonic() < deadline, "the held save was never reached"
            assert all(p.exitcode is None for p in procs), [p.exitcode for p in procs]
            held = all((out / f"held{r}").exists() for r in range(world))
            metrics = out / "metrics.jsonl"
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x] if metrics.exists() else []
            if held and max(steps, default=0) >= wait_for_step:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
    assert all(p.exitcode == -signal.SIGKILL for p in procs)


def _train(rank, world, jobs):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for overrides, d in jobs:
        t = Trainer(make_config(overrides), d, DistEnv(rank, world, 0, "test") if world > 1 else None)
        r = t.run()
        state = t.full_state()  # collective (ZeRO-3 gathers)
        out.append((r.resumed_from, r.losses, state) if rank == 0 else None)
    return out


def test_kill_during_sync_and_async_saves_then_resume_exactly(tmp_path):
    from scaletrain.train import checkpoint as ckpt

    runs = {"sync": (SYNC, 2, 1), "async": (ASYNC, 3, 2)}  # async: training reached step 3 while step 2 was held
    for name, (overrides, step, world) in runs.items():
        out = tmp_path / name
        _kill_during_save(overrides, out, step, world)
        root = out / "checkpoints"
        assert (root / "step_00000002.tmp").is_dir() and not (root / "step_00000002").exists(), name
        assert ckpt.latest(root) == root / "step_00000001"
        assert ckpt.read_meta(root / "step_00000001")["step"] == 1
        assert not ckpt.verify(root / "step_00000001").bad
    sync_ref, sync_run = _train(0, 1, [(SYNC, str(tmp_path / "sync-ref")), (SYNC, str(tmp_path / "sync"))])
    jobs = [(ASYNC, str(tmp_path / "async-ref")), (ASYNC, str(tmp_path / "async"))]
    async_ref, async_run = run_ranks(_train, 2, jobs, timeout=240)[0]
    for ref, run in ((sync_ref, sync_run), (async_ref, async_run)):
        assert run[0] == 1 and ref[0] == 0  # resumed from the checkpoint of step 1
        assert run[1] == {s: ref[1][s] for s in (2, 3, 4)}
        for k, v in ref[2].items():
            assert torch.equal(run[2][k], v), k
    rows = [json.loads(x) for x in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all("loss_scale" in r for r in rows)
    for name in runs:  # the resumed runs finished their checkpoints; the killed save left nothing behind
        root = tmp_path / name / "checkpoints"
        assert [d.name for d in sorted(root.iterdir())] == ["step_00000003", "step_00000004"]
