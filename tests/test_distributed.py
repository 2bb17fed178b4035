"""Multi-process foundation: the harness, the mesh, identical initialisation, DP equality, the launcher."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from harness import TINY, assert_same_run, run_ranks, train_parallel, train_reference

from scaletrain.distributed.mesh import Mesh, ParallelDims


def _mesh_groups(rank, world):
    mesh = Mesh.build(ParallelDims(pp=1, dp=2, tp=2), timeout_s=30)
    out = {}
    for dim in ("pp", "dp", "tp"):
        t = torch.tensor([float(rank)])
        if mesh.group(dim) is not None:
            dist.all_reduce(t, group=mesh.group(dim))
        out[dim] = (mesh.members[dim], t.item())
    return out


def test_mesh_groups_follow_the_grid():
    outs = run_ranks(_mesh_groups, 4, timeout=60)
    # grid = arange(4).view(pp=1, dp=2, tp=2): tp groups {0,1},{2,3}; dp groups {0,2},{1,3}
    assert outs[0]["tp"] == ([0, 1], 1.0) and outs[3]["tp"] == ([2, 3], 5.0)
    assert outs[0]["dp"] == ([0, 2], 2.0) and outs[1]["dp"] == ([1, 3], 4.0)
    assert outs[2]["pp"] == ([2], 2.0)


def _init_checksum(rank, world):
    from scaletrain.config import ModelConfig
    from scaletrain.model import build_gpt

    torch.manual_seed(rank)  # a different global RNG on every rank must not matter
    m = build_gpt(ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16), seed=11)
    return {n: p.detach().double().sum().item() for n, p in m.named_parameters()}


def test_identical_initialisation_across_ranks():
    a, b = run_ranks(_init_checksum, 2, timeout=60)
    assert a == b


def _fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would hang here forever without the harness killing it


def test_harness_surfaces_failing_rank_quickly():
    t0 = time.time()
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*boom on rank 1"):
        run_ranks(_fails_on_rank_1, 2, timeout=60)
    assert time.time() - t0 < 30


@pytest.mark.parametrize("dp, micro", [(2, 2), (2, 4), (4, 1)])
def test_dp_matches_single_process(dp, micro):
    overrides = {"train.micro_batch": micro}
    ref = train_reference(overrides)
    par = train_parallel({**overrides, "parallel.dp": dp}, dp)
    # fp64: summation order differs (per-rank partial sums); measured differences ~1e-15 relative.
    assert_same_run(ref, par, rtol=1e-10, atol=1e-12)


def _launcher_argv(out, extra=()):
    argv = [sys.executable, "-m", "scaletrain", "train", "--nproc", "2", "--out", str(out)]
    for k, v in {**TINY, "parallel.dp": 2, "train.steps": 3, "train.dtype": "fp32"}.items():
        argv += ["--set", f"{k}={v}"]
    return argv + list(extra)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One `scaletrain train --nproc 2` run (its output folder and process), shared by the launcher tests."""
    out = tmp_path_factory.mktemp("launcher") / "o"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return out, subprocess.run(_launcher_argv(out), capture_output=True, text=True, env=env, timeout=180)


def test_launcher_runs_two_ranks(launched):
    out, p = launched
    assert p.returncode == 0, p.stderr + (out / "logs/launcher.log").read_text()
    assert "parameters" in p.stdout and (out / "metrics.jsonl").read_text().count("\n") == 3
    assert (out / "logs/rank1.log").exists()
    ck = sorted((out / "checkpoints").glob("step_*"))[-1]
    assert (ck / "__0_0.distcp").exists() and (ck / "__1_0.distcp").exists()  # each rank wrote its share


def test_launcher_stops_all_and_names_the_failing_rank(launched, tmp_path):
    """Corrupt what only rank 1 reads (its random stream): rank 1 fails at resume, rank 0 is stopped, exit 2 with
    rank 1 named (on a copy of the shared run's output)."""
    import json
    import shutil

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert launched[1].returncode == 0, launched[1].stderr
    out = tmp_path / "o"
    shutil.copytree(launched[0], out)
    ck = sorted((out / "checkpoints").glob("step_*"))[-1]
    chunk = json.loads((ck / "index.json").read_text())["tensors"]["rng/dropout/dp1/pp0/torch"]["chunks"][0]
    data = bytearray((ck / chunk["file"]).read_bytes())
    data[chunk["offset"] + chunk["length"] - 20] ^= 0xFF
    (ck / chunk["file"]).write_bytes(bytes(data))
    t0 = time.time()
    p = subprocess.run(_launcher_argv(out, ["--set", "train.steps=6"]), capture_output=True, text=True, env=env,
                       timeout=180)
    assert p.returncode == 2, p.stderr
    assert "rank 1" in p.stderr and "corrupted" in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1
    assert time.time() - t0 < 60
