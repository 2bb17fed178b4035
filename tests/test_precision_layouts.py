"""bf16 / fp16 layouts compute what the single-process run of the same precision computes — and the comparison
is tight enough that plausible bugs fail it.

Each layout below runs 8 steps on 2 processes and is compared with the single-process run in the same dtype on
three quantities: the loss of every step, the gradient norm of every step (before clipping) and all final
parameters (relative L2 norm of the difference over the whole model). Exact equality is not expected: a layout
sums in another order (tensor-parallel partial products, pipeline and ZeRO reductions, MoE routing decisions that
rounding can flip) and bf16/fp16 round what differs.

Tolerances come from measured rounding noise. Over seeds 1-3, every layout of this file and, for each, the single-
process run with another micro-batch split (same mathematics, another summation order) differed from the
reference by at most (loss, grad norm, parameters):
    bf16 dense   7.0e-5   1.5e-3   2.2e-3
    bf16 MoE     1.1e-4   8.7e-4   3.7e-3
    fp16         3.1e-5   1.6e-4   5.9e-4
The tolerances are 3x the largest of each precision. The recipe (weight decay 2.0, clip at 0.3 where the gradient
norm is 1.3-2.7) makes weight decay and clipping act strongly within 8 steps; with it every fault of `faults.py`
(grad clip x10, weight decay off, lr x1.1, one micro-batch's gradient dropped, fp16 unscale skipped) moves at
least one quantity by 1.9x to 10^7x its tolerance (the smallest margin: grad clip x10 under MoE, loss 6.1e-4), and
`test_each_fault_breaks_the_comparison` checks that every fault fails every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from faults import FAULTS, faulty_overrides, inject
from harness import TINY, make_config, run_ranks

RECIPE = {**TINY, "train.steps": 8, "train.lr": 3e-3, "train.warmup_steps": 2, "optim.weight_decay": 2.0,
          "train.grad_clip": 0.3}


@dataclass(frozen=True)
class Tol:
    loss: float  # max over steps of |loss - ref| / ref
    grad_norm: float  # max over steps of |norm - ref| / ref
    params: float  # ||params - ref||_2 / ||ref||_2 over all parameters


TOL = {"bf16": Tol(3.3e-4, 4.5e-3, 1.2e-2), "fp16": Tol(1.0e-4, 5.0e-4, 1.8e-3)}

LAYOUTS = {
    "bf16 dp2 accumulation 4": ("bf16", {"parallel.dp": 2, "train.micro_batch": 1}),
    "bf16 dp2 zero1 offload optimizer": ("bf16", {"parallel.dp": 2, "parallel.zero": 1,
                                                  "parallel.offload": "optimizer"}),
    "bf16 dp2 zero3 offload params": ("bf16", {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "params"}),
    "bf16 tp2 sequence parallel": ("bf16", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "bf16 pp2 1f1b": ("bf16", {"parallel.pp": 2}),
    "bf16 pp2 interleaved": ("bf16", {"parallel.pp": 2, "parallel.schedule": "interleaved",
                                      "parallel.virtual_stages": 2, "model.n_layers": 4}),
    "bf16 dp2 ep2 MoE": ("bf16", {"parallel.dp": 2, "parallel.ep": 2, "model.moe.experts": 4}),
    "fp16 dp2 zero2": ("fp16", {"parallel.dp": 2, "parallel.zero": 2}),
    "fp16 tp2": ("fp16", {"parallel.tp": 2}),
    "fp16 pp2 zb-h1": ("fp16", {"parallel.pp": 2, "parallel.schedule": "zb-h1"}),
}


def _run(rank: int, world: int, overrides: dict, fault: str | None):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    t = Trainer(make_config(faulty_overrides(overrides, fault)), None,
                DistEnv(rank, world, 0, "test") if world > 1 else None)
    inject(t, fault)
    losses, norms = {}, {}
    while t.step < t.cfg.train.steps:
        t.step += 1
        row = t.train_step(t.step)
        losses[t.step], norms[t.step] = row["loss"], row["grad_norm"]
    state = t.full_state()
    return losses, norms, {k: v.double() for k, v in state.items()} if rank == 0 else None


def _runs(rank: int, world: int, jobs: list):
    return [_run(rank, world, overrides, fault) for overrides, fault in jobs]


def differences(ref, got) -> Tol:
    loss = max(abs(got[0][s] - ref[0][s]) / ref[0][s] for s in ref[0])
    norm = max(abs(got[1][s] - ref[1][s]) / ref[1][s] for s in ref[1])
    num = sum(float((got[2][k] - ref[2][k]).square().sum()) for k in ref[2])
    den = sum(float(ref[2][k].square().sum()) for k in ref[2])
    return Tol(loss, norm, math.sqrt(num / den))


def within(d: Tol, tol: Tol) -> bool:
    return d.loss <= tol.loss and d.grad_norm <= tol.grad_norm and d.params <= tol.params


def _reference(dtype: str, layout: dict):
    single = {k: v for k, v in layout.items() if not k.startswith("parallel.")}  # model and batch keys stay
    return _run(0, 1, {**RECIPE, "train.dtype": dtype, **single}, None)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_runs(request):
    """(layout name, dtype, reference, {fault or None: the parallel run}) — every run of a layout in one set of
    processes."""
    dtype, layout = LAYOUTS[request.param]
    faults = [None, *(f for f in FAULTS if dtype == "fp16" or f != "skip unscale")]  # bf16 has no loss scale
    jobs = [({**RECIPE, "train.dtype": dtype, **layout}, f) for f in faults]
    outs = run_ranks(_runs, 2, jobs, timeout=300)[0]
    return request.param, dtype, _reference(dtype, layout), dict(zip(faults, outs))


def test_layout_matches_single_process_of_the_same_precision(layout_runs):
    name, dtype, ref, runs = layout_runs
    d = differences(ref, runs[None])
    assert within(d, TOL[dtype]), f"{name}: {d} exceeds {TOL[dtype]}"


def test_each_fault_breaks_the_comparison(layout_runs):
    name, dtype, ref, runs = layout_runs
    passed = [fault for fault, run in runs.items() if fault is not None and within(differences(ref, run), TOL[dtype])]
    assert not passed, f"{name}: the comparison does not catch {passed}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_tolerance_covers_another_summation_order_of_one_process(dtype):
    """The noise the tolerances were derived from, re-measured in the suite: one process, micro-batches of 2 vs 4."""
    ref = _reference(dtype, {})
    other = _reference(dtype, {"train.micro_batch": 4})
    d = differences(ref, other)
    assert within(d, TOL[dtype]) and d.params > 0, d
