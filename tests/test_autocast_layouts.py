"""train.precision=autocast-bf16 in every layout computes what the single-process autocast-bf16 run computes, its
matmuls run in bf16 on every rank, and every collective's tensors live on the rank's device.

The comparison is that of `test_precision_layouts.py` (8 steps, 2 processes; loss and gradient norm of every step,
all final parameters as a relative L2 distance; its recipe: weight decay 2.0 and clipping at 0.3, so both act).
Tolerances come from measured rounding noise: over seeds 1-3, the layouts below (and tp 2 without sequence
parallelism) and the single-process run with another micro-batch split differed from the reference by at most
    loss 3.5e-5   gradient norm 9.8e-4   parameters 2.1e-3
(tp 2 the largest: its row-parallel partial sums are rounded to bf16 before they are added; dp and pp reduce fp32
gradients and differ by < 2e-4). The tolerances are 3x those. Each of the faults of `faults.py` injected into the
noisiest layout (tp 2 with sequence parallelism) must break the comparison. Switching autocast off on the parallel
side does not break it reliably (fp32 differs from autocast-bf16 by 3e-5 / 1.5e-3 / 2.1e-3 here: about the noise,
which is bf16 rounding itself), so autocast is checked directly: the output dtype of every linear layer of every
rank, which is fp32 in that fault's run and must fail the check.

Collective placement (tests/placement.py): the same processes run every job with the check on, plus two short jobs
for the paths the layouts above do not reach (expert all-to-all and MoE statistics, the gradient noise scale,
evaluation, the fp16 skip flags, Adafactor's statistics under ZeRO-Offload, ZeRO-Infinity and the memory budget's
resident-bytes maximum).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from faults import faulty_overrides, inject
from harness import make_config, run_ranks
from placement import CollectivePlacement
from test_precision_layouts import RECIPE, Tol, differences, within

AC = {"train.precision": "autocast-bf16", "train.dtype": "fp32"}
TOL = Tol(1.1e-4, 2.9e-3, 6.4e-3)
LAYOUTS = {
    "dp2 accumulation 4": {"parallel.dp": 2, "train.micro_batch": 1},
    "dp2 zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "tp2 sequence parallel": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "pp2 1f1b": {"parallel.pp": 2},
}
FAULTED = "tp2 sequence parallel"
AUTOCAST_OFF = "autocast off"
FAULTS = ("grad_clip x10", "drop a micro-batch", AUTOCAST_OFF)  # the clip: the smallest margin of the bf16 proofs
CHECKED_STEPS = 2  # collective placement is checked in the first steps of each run (the same collectives follow)
PLACEMENT_ONLY = {
    "dp2 zero1 offload optimizer, autocast-bf16": {
        **AC, "parallel.dp": 2, "parallel.zero": 1, "parallel.offload": "optimizer", "train.steps": 2},
    "dp2 zero3 nvme offload, memory budget, on_nan=skip": {
        "parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "nvme", "memory.budget_gb": 64,
        "train.on_nan": "skip", "train.steps": 2},
    "dp2 ep2 MoE, noise scale, eval, on_nan=skip": {
        "parallel.dp": 2, "parallel.ep": 2, "model.moe.experts": 4, "train.log_noise_scale": True,
        "train.eval_every": 2, "train.on_nan": "skip", "train.steps": 2, "train.dtype": "bf16"},
    "dp2 zero1 offload optimizer, adafactor, fp16": {
        "train.dtype": "fp16", "parallel.dp": 2, "parallel.zero": 1, "parallel.offload": "optimizer",
        "optim.name": "adafactor", "train.steps": 2},
}


def _linear_dtypes(record: set):
    def hook(module, args, out):
        if "Linear" in type(module).__name__ or "VocabParallelHead" in type(module).__name__:
            record.add(out.dtype)
    return torch.nn.modules.module.register_module_forward_hook(hook)


def _run(rank: int, world: int, overrides: dict, fault: str | None, placement: CollectivePlacement | None = None):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    if fault == AUTOCAST_OFF:
        overrides = {**overrides, "train.precision": "dtype"}
    t = Trainer(make_config(faulty_overrides(overrides, fault)), None,
                DistEnv(rank, world, 0, "test") if world > 1 else None)
    inject(t, fault if fault != AUTOCAST_OFF else None)
    dtypes: set = set()
    handle = _linear_dtypes(dtypes)
    losses, norms = {}, {}
    try:
        while t.step < t.cfg.train.steps:
            t.step += 1
            with placement if placement is not None and t.step <= CHECKED_STEPS else nullcontext():
                row = t.train_step(t.step)
            losses[t.step], norms[t.step] = row["loss"], row["grad_norm"]
        with placement if placement is not None else nullcontext():
            if t.cfg.train.eval_every:
                t.evaluate()
            state = t.full_state()
    finally:
        handle.remove()
    return losses, norms, {k: v.double() for k, v in state.items()} if rank == 0 else None, dtypes


def _runs(rank: int, world: int, jobs: list):
    placement = CollectivePlacement("cpu")
    out = [_run(rank, world, overrides, fault, placement) for overrides, fault in jobs]
    return out, placement.violations, placement.collectives


@pytest.fixture(scope="module")
def runs():
    jobs = [({**RECIPE, **AC, **layout}, None) for layout in LAYOUTS.values()]
    jobs += [({**RECIPE, **AC, **LAYOUTS[FAULTED]}, f) for f in FAULTS]
    jobs += [({**RECIPE, **o}, None) for o in PLACEMENT_ONLY.values()]
    per_rank = run_ranks(_runs, 2, jobs, timeout=600)
    results, _, _ = per_rank[0]
    n = len(LAYOUTS)
    refs: dict = {}  # the single-process run of each layout's model and batch keys (micro-batch split included)
    ref_of = {}
    for name, layout in LAYOUTS.items():
        single = {k: v for k, v in layout.items() if not k.startswith("parallel.")}
        key = tuple(sorted(single.items()))
        if key not in refs:
            refs[key] = _run(0, 1, {**RECIPE, **AC, **single}, None)
        ref_of[name] = refs[key]
    return {"layouts": dict(zip(LAYOUTS, results[:n])), "faults": dict(zip(FAULTS, results[n:n + len(FAULTS)])),
            "refs": ref_of, "placement": [(r, v, c) for r, (_, v, c) in enumerate(per_rank)]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_autocast_bf16(runs, name):
    d = differences(runs["refs"][name][:3], runs["layouts"][name][:3])
    assert within(d, TOL), f"{name}: {d} exceeds {TOL}"


def test_each_fault_breaks_the_comparison(runs):
    ref = runs["refs"][FAULTED]
    passed = [f for f, run in runs["faults"].items()
              if f != AUTOCAST_OFF and within(differences(ref[:3], run[:3]), TOL)]
    assert not passed, f"{FAULTED}: the comparison does not catch {passed}"


def test_every_rank_computes_its_matmuls_in_bf16_and_the_check_sees_autocast_off(runs):
    for name, run in runs["layouts"].items():
        assert run[3] == {torch.bfloat16}, (name, run[3])
    assert runs["refs"][FAULTED][3] == {torch.bfloat16}
    assert torch.bfloat16 not in runs["faults"][AUTOCAST_OFF][3]  # the fault's run fails the check above


def test_every_collective_tensor_is_on_the_rank_device(runs):
    for rank, violations, checked in runs["placement"]:
        assert checked > 100, (rank, checked)  # the check saw the runs' collectives (about 2,000)
        assert not violations, (rank, violations[:5])
