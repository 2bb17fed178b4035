"""ZeRO-Infinity (parallel.offload=nvme): equal to in-memory ZeRO-3 bit for bit and to the single-process run; its
I/O and resident bytes follow the formulas; kill and resume; the memory budget; bad input refused before launch.

Tolerances: fp64. nvme offload runs the same AdamW arithmetic on the same pieces as in-memory ZeRO-3, the gradient
accumulation in the same order and the clipping norm summed in the same order, so the two are compared with
torch.equal. Against the single-process run, rtol 1e-10 / atol 1e-12 as tests/test_zero.py (measured differences
~3e-15 on 2 ranks, ~7e-15 on 4, from the reduction order).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from harness import TINY, assert_same_run, make_config, train_parallel_many, train_reference

from scaletrain.cli import main
from scaletrain.memory.budget import BudgetExceeded
from scaletrain.plan.analytic.offload_costs import io_per_step
from scaletrain.plan.budget import check_budget
from scaletrain.plan.exact.run_memory import nvme_file_bytes
from scaletrain.train.trainer import Trainer

RTOL, ATOL = 1e-10, 1e-12
NVME = {"parallel.zero": 3, "parallel.offload": "nvme"}


SHORT = {"train.steps": 3}


@pytest.fixture(scope="module")
def reference():
    return train_reference(SHORT)


def _same_bits(a, b):
    assert a[0] == b[0], "losses differ"
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def test_nvme_on_2_ranks_equals_in_memory_zero3_bit_for_bit_and_the_single_process_run(reference):
    """dp 2 with two micro-batches (gradients accumulated in the files)."""
    base = {**SHORT, "parallel.dp": 2, "train.micro_batch": 2}
    nvme, memory = train_parallel_many([{**base, **NVME}, {**base, "parallel.zero": 3}], 2)
    _same_bits(nvme, memory)
    assert_same_run(reference, nvme, RTOL, ATOL)


def test_nvme_on_4_ranks_equals_in_memory_zero3_and_matches_the_single_process_run(reference):
    base = {**SHORT, "parallel.dp": 4, "train.micro_batch": 1}
    nvme, memory = train_parallel_many([{**base, **NVME}, {**base, "parallel.zero": 3}], 4)
    _same_bits(nvme, memory)
    assert_same_run(reference, nvme, RTOL, ATOL)


def _run(overrides, out=None, stop_after=None, reshard=False):
    t = Trainer(make_config({**TINY, **overrides}), out, reshard=reshard)
    rows = []
    step = t._train_step
    t._train_step = lambda s, drain=True: rows.append(step(s, drain)) or rows[-1]
    result = t.run(stop_after)
    return t, rows, (result.losses, t.full_state())


@pytest.mark.parametrize("extra", [
    {"model.dropout": 0.1, "train.eval_every": 1},
    {"parallel.nvme_grads": False, "memory.recompute": "full"},
    {"train.dtype": "fp16", "model.moe.experts": 2},
], ids=["grads-in-files-dropout-eval", "grads-in-memory-recompute", "fp16-masters-moe"])
def test_single_process_io_memory_and_files_follow_the_formulas(extra):
    """Every step reads and writes exactly `io_per_step`'s bytes; resident bytes per category equal the planner's;
    the files have the planned size; the run equals in-memory ZeRO-3 bit for bit (with dropout and evaluation,
    full recomputation, fp16 loss scaling with fp32 masters in files, MoE blocks)."""
    over = {**extra, "train.micro_batch": 4, "train.steps": 2}  # two micro-batches per step
    t, rows, nvme = _run({**over, **NVME})
    for row in (r for r in rows if not r.get("skipped")):  # (an fp16 overflow skips the step: no step I/O)
        assert (row["nvme_read_bytes"], row["nvme_write_bytes"]) == \
            (row["plan_nvme_read_bytes"], row["plan_nvme_write_bytes"]), row["step"]
    opt = t.engine.optimizer
    low = extra.get("train.dtype") == "fp16"
    e = 2 if low else 8
    assert rows[0]["plan_nvme_read_bytes"] == io_per_step(opt.shards, e, low, 4 if low else e, 2,
                                                          extra.get("parallel.nvme_grads", True))[0]
    for cat in ("params", "grads", "optim"):
        assert t.mem[f"mem_{cat}"] == t.mem[f"plan_mem_{cat}"], cat
    files = sum(t.mem[f"nvme_{c}"] for c in ("params", "grads", "optim"))
    assert files == nvme_file_bytes(t.cfg) == opt.files.total_bytes
    plain = {k: v for k, v in over.items() if not k.startswith("parallel.nvme")}
    _, _, memory = _run({**plain, "parallel.zero": 3})
    _same_bits(nvme, memory)


def test_checkpoints_move_between_nvme_and_in_memory_zero3(tmp_path):
    """An nvme checkpoint resumes in memory (and back) exactly (a change of `parallel.offload`: --reshard)."""
    over = {"train.steps": 2, "train.checkpoint_every": 1}
    _, _, straight = _run({**over, "parallel.zero": 3})
    _run({**over, **NVME}, tmp_path / "a", stop_after=1)
    _, _, resumed = _run({**over, "parallel.zero": 3}, tmp_path / "a", reshard=True)
    assert resumed[0] == {2: straight[0][2]}
    _same_bits(({}, straight[1]), ({}, resumed[1]))
    _run({**over, "parallel.zero": 3}, tmp_path / "b", stop_after=1)
    _, _, resumed = _run({**over, **NVME}, tmp_path / "b", reshard=True)
    _same_bits(({}, straight[1]), ({}, resumed[1]))


def _argv(out, steps):
    argv = [sys.executable, "-m", "scaletrain", "train", "--out", str(out)]
    for k, v in {**TINY, **NVME, "train.steps": steps, "train.checkpoint_every": 2, "train.keep_checkpoints": 10,
                 "train.dtype": "fp32", "parallel.offload_dir": str(out.parent / "scratch")}.items():
        argv += ["--set", f"{k}={v}"]
    return argv


def test_kill_and_resume_is_exact_with_nvme(tmp_path):
    """SIGKILL after the first checkpoint, the same command again: the losses and the final state of the
    uninterrupted run; a clean run leaves no scratch files."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    (tmp_path / "scratch").mkdir()
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run(_argv(ref, 10), check=True, env=env, capture_output=True, timeout=240)
    assert list((tmp_path / "scratch").iterdir()) == [], "scratch files left after a clean run"
    proc = subprocess.Popen(_argv(run, 10), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while not list((run / "checkpoints").glob("step_*/COMPLETE")):
        assert time.time() < deadline and proc.poll() is None, "no checkpoint appeared"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "step_00000010").exists(), "finished before the kill"
    subprocess.run(_argv(run, 10), check=True, env=env, capture_output=True, timeout=240)
    losses = lambda d: [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(run) == losses(ref) and len(losses(ref)) == 10
    from scaletrain.train import checkpoint as ckpt

    a, b = (ckpt.read_tensors(ckpt.latest(d / "checkpoints"), "") for d in (ref, run))
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    for name, v in a.items():
        assert torch.equal(v, b[name]), name


# ------------------------------------------------------------------------- the memory budget

DEMO = {"model.n_layers": 32, "model.d_model": 256, "model.n_heads": 4, "model.seq_len": 16, "train.global_batch": 1,
        "train.micro_batch": 1, "train.steps": 1, "train.eval_every": 0, "train.dtype": "fp32",
        "memory.budget_gb": 0.09}


def test_a_model_whose_states_are_3x_the_budget_trains_with_nvme_and_is_refused_without():
    """25M parameters: fp32 masters + AdamW = 12 bytes each = 3.2x the 0.09 GiB budget. Without offload the
    pre-launch check refuses it with the planner's numbers and points at nvme; with nvme the planner's resident
    bytes fit and so do the measured ones."""
    cfg = make_config({**DEMO, "parallel.zero": 3})
    with pytest.raises(Exception, match=r"planner puts this run at .* with parallel.zero=3 parallel.offload=nvme it "
                                        r"needs [0-9.]+ GiB and fits"):
        check_budget(cfg)
    nvme = {**DEMO, **NVME, "parallel.nvme_prefetch": 1}
    check_budget(make_config(nvme))
    t, rows, _ = _run(nvme)
    assert 12 * t.n_params > 3 * DEMO["memory.budget_gb"] * 2**30
    assert 0 < rows[-1]["mem_resident"] <= rows[-1]["mem_budget"]


def test_a_step_over_the_budget_stops_the_run():
    """A budget of 1 MiB (the API trainer has no pre-launch check): the first step, whose staging buffers alone
    are larger, stops with the numbers."""
    with pytest.raises(BudgetExceeded, match=r"step 1 held [0-9.]+ GiB resident \(peak RSS growth"):
        _run({**NVME, "model.d_model": 128, "train.steps": 1, "memory.budget_gb": 2**-10})


# ------------------------------------------------------------------------- bad input, before launch

def _cli(tmp_path, capsys, *sets):
    argv = ["train", "--out", str(tmp_path / "out")]
    for item in ({**TINY, **NVME}.items()):
        argv += ["--set", f"{item[0]}={item[1]}"]
    for item in sets:
        argv += ["--set", item]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("case", ["missing", "a file", "not writable", "too small", "zero 2", "tp 2", "budget"])
def test_bad_offload_input_is_one_line_exit_2_before_anything_starts(tmp_path, capsys, case):
    (tmp_path / "file").write_text("x")
    sets, expect = {
        "missing": ([f"parallel.offload_dir={tmp_path / 'nope'}"], "does not exist"),
        "a file": ([f"parallel.offload_dir={tmp_path / 'file'}"], "is not a folder"),
        "not writable": (["parallel.offload_dir=/proc/self"], "is not writable"),
        "too small": (["model.n_layers=64", "model.d_model=4096", "model.n_heads=32",
                       f"parallel.offload_dir={tmp_path}"], "GiB free; the offload files of 1 rank(s) need"),
        "zero 2": (["parallel.zero=2"], "parallel.offload=nvme needs parallel.zero=3, got parallel.zero=2"),
        "tp 2": (["parallel.tp=2", "parallel.zero=3"], "not available with parallel.tp (2) > 1"),
        "budget": (["parallel.offload=none", "parallel.zero=0", "memory.budget_gb=0.001"],
                   "with parallel.zero=3 parallel.offload=nvme it needs"),
    }[case]
    code, err = _cli(tmp_path, capsys, *sets)
    assert code == 2 and expect in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists(), "something was created before the check"


# ------------------------------------------------------------------------- the planner

def test_planners_put_nvme_state_on_disk_and_add_only_the_exposed_disk_time():
    """Catalog: an nvme layout keeps no model states on the GPU and pays disk time; the search falls back to nvme
    when even host offload does not fit. Run planner: nvme adds exactly `step_time`'s exposed I/O and the streamed
    step over the in-memory optimizer; with an infinitely fast disk only the AdamW arithmetic is left."""
    import math

    from scaletrain.parallel.zero_nvme import STEP_CHUNK
    from scaletrain.plan.analytic.estimate import estimate
    from scaletrain.plan.analytic.inputs import Layout, Training
    from scaletrain.plan.analytic.offload_costs import step_time
    from scaletrain.plan.catalog import get_model
    from scaletrain.plan.exact.probe import RunProfile
    from scaletrain.plan.exact.run_memory import nvme_shards
    from scaletrain.plan.exact.run_time import predict_step_time
    from scaletrain.plan.hardware import get_gpu
    from scaletrain.plan.search import search

    m, gpu, train = get_model("gpt3-175b"), get_gpu("a100-80gb"), Training(global_batch=32)
    est = estimate(m, gpu, train, Layout(dp=2, tp=8, zero=3, offload="nvme", recompute="full"))
    assert est.memory["params"] == est.memory["grads"] == est.memory["optimizer"] == 0 and est.fits
    assert est.time_breakdown["offload"] > 0
    best = search(m, gpu, 4, train).candidates[0]  # on 4 GPUs not even host offload fits
    assert best.layout.offload == "nvme" and best.fits

    cfg = make_config({**TINY, **NVME, "train.micro_batch": 4})
    prof = dict(block_f=0.01, block_b=0.02, embed_f=0.001, embed_b=0.002, head_f=0.003, head_b=0.004,
                optimizer=0.05, loader=0.001)
    plain = predict_step_time(make_config({**TINY, "parallel.zero": 3, "train.micro_batch": 4}), RunProfile(**prof))
    disk = predict_step_time(cfg, RunProfile(**prof, disk_read_bw=1e8, disk_write_bw=5e7))
    shards, e, low, ge = nvme_shards(cfg)
    exposed, streamed = step_time(shards, e, low, ge, 2, True, 1e8, 5e7, plain.breakdown["compute"], 0.05,
                                  STEP_CHUNK)
    assert math.isclose(disk.step_time_s - plain.step_time_s, exposed + streamed - 0.05, rel_tol=1e-12)
    assert disk.breakdown["nvme_io"] > 0
    fast = predict_step_time(cfg, RunProfile(**prof))
    assert math.isclose(fast.step_time_s, plain.step_time_s, rel_tol=1e-12)
