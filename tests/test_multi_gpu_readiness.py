"""Multi-GPU readiness on a CPU machine: the launch and mesh code in a fake two-GPU environment.

`torch.cuda` is replaced by a fake with two devices (it records `set_device` and answers `current_device`), and
`torch.distributed.init_process_group` / `new_group` record what NCCL would have been asked for before they set up
gloo underneath. Two real processes then run what a torchrun worker runs: the environment read (`detect_env`), the
device choice (`pick_device`), the process-group start (`distributed.init`) and `Mesh.build`. Each rank must get its
own GPU (cuda:LOCAL_RANK) and make it current before the group starts, the group must be NCCL bound to that device
with the run's timeout, every mesh group must carry the timeout, and the collectives' device must be that GPU.
(That every collective's tensors are created on that device is checked in test_autocast_layouts.py.)
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from scaletrain.errors import ConfigError


class FakeCuda:
    """Two CUDA devices as far as the launch code can tell; records the order of what it is asked."""

    def __init__(self, events: list):
        self.events, self.current = events, 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def set_device(self, device) -> None:
        self.current = torch.device(device).index
        self.events.append(("set_device", self.current))

    def current_device(self) -> int:
        return self.current


def _fake_environment(monkeypatch_like, events: list, store_path: str | None, local_rank: int, world: int):
    """Install the fakes (monkeypatch_like: an object with setattr / setenv)."""
    cuda = FakeCuda(events)
    for name in ("is_available", "device_count", "set_device", "current_device"):
        monkeypatch_like.setattr(torch.cuda, name, getattr(cuda, name))
    real_init, real_new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend, **kw):
        events.append(("init_process_group", backend, kw.get("timeout"), kw.get("device_id"), kw.get("rank")))
        if store_path is not None:  # gloo underneath, on a file store
            real_init("gloo", store=dist.FileStore(store_path, world), rank=kw["rank"], world_size=kw["world_size"],
                      timeout=kw["timeout"])

    def new_group(ranks, timeout=None, **kw):
        events.append(("new_group", tuple(ranks), timeout))
        return real_new_group(ranks, timeout=timeout, backend="gloo")

    monkeypatch_like.setattr(dist, "init_process_group", init_process_group)
    monkeypatch_like.setattr(dist, "new_group", new_group)
    monkeypatch_like.setattr(dist, "get_backend", lambda group=None: "nccl")
    for k, v in {"RANK": str(local_rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)}.items():
        monkeypatch_like.setenv(k, v)
    return cuda


class _Patch:
    """monkeypatch for a spawned process (no pytest fixture there); `undo()` puts everything back (the harness's
    ranks are reused: a fake left behind would be what the next test's run calls)."""

    def __init__(self):
        self.saved: list[tuple] = []

    def setattr(self, obj, name, value) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def setenv(self, key, value) -> None:
        os.environ[key] = value

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        self.saved.clear()


def _worker(rank: int, world: int, store_dir: str):
    from scaletrain.distributed import process_group as distributed
    from scaletrain.distributed.comm import collective_device
    from scaletrain.distributed.mesh import Mesh, ParallelDims

    dist.destroy_process_group()  # the harness's group: this rank starts its own the way a torchrun worker does
    events: list = []
    patch = _Patch()
    try:
        _fake_environment(patch, events, os.path.join(store_dir, "store"), rank, world)
        env = distributed.detect_env()
        device = distributed.pick_device("auto", env.local_rank)
        distributed.init(env, 123.0, device)
        mesh = Mesh.build(ParallelDims(dp=world), 123.0)
        # both ranks through the new group before either tears its connections down (gloo underneath; a rank that
        # returned at once could close the pair while the other still completed its connection)
        dist.all_reduce(torch.zeros(1), group=mesh.group("dp"))
        return {"env": env, "device": device, "events": events, "dp": mesh.members["dp"],
                "collective_device": collective_device(mesh.group("dp")), "world_device": collective_device()}
    finally:
        patch.undo()


def test_two_fake_gpus_each_rank_binds_its_own_before_the_group_starts():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_worker, 2, tmp, timeout=120)
    for rank, r in enumerate(results):
        gpu = torch.device("cuda", rank)
        assert (r["env"].local_rank, r["env"].launcher) == (rank, "torchrun")
        assert r["device"] == gpu
        kinds = [e[0] for e in r["events"]]
        assert kinds.index("set_device") < kinds.index("init_process_group"), r["events"]
        assert ("set_device", rank) in r["events"]
        init = next(e for e in r["events"] if e[0] == "init_process_group")
        assert init == ("init_process_group", "nccl", timedelta(seconds=123.0), gpu, rank)
        groups = [e for e in r["events"] if e[0] == "new_group"]
        assert groups and all(e[2] == timedelta(seconds=123.0) for e in groups), groups
        assert r["dp"] == [0, 1]
        assert r["collective_device"] == gpu and r["world_device"] == gpu


def test_a_local_rank_without_its_own_gpu_is_refused(monkeypatch):
    from scaletrain.distributed import process_group as distributed

    _fake_environment(monkeypatch, [], None, 2, 3)
    assert distributed.pick_device("auto", 1) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="local rank 2 has no GPU of its own: 2 CUDA device"):
        distributed.pick_device("auto", 2)
