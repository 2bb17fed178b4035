"""PipeDream-2BW as asynchronous 1F1B (arXiv 2006.09503): consecutive steps overlap.

Step t's lists (`build_2bw_step`) run batch t+1's warm-up forwards during batch t's cool-down; they read
W(t) while batch t's backwards read W(t-1). Claims checked here:

- the lists are sound over a run of steps (static checker: matching, no deadlock, every message inside
  one step, at most two weight versions, p - r microbatches in flight), and the isolated step is the
  one-step `build_schedule("2bw")`;
- the simulated steady-state step takes m(t_f+t_b) + (p-1)t_b instead of 1F1B's (m+p-1)(t_f+t_b);
- executed on 2 processes, the overlapped run computes exactly what the flushed run computes (bitwise:
  the same operations on the same weights, only started earlier), which equals the single-process
  reference of the 2BW rule (`reference_2bw` in test_pipeline_exec.py, rtol 1e-10), and a run killed after
  an overlapped step and resumed from the last (drained) checkpoint equals the uninterrupted run bitwise,
  also with dropout (each rank draws its masks in microbatch stream order either way).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from harness import make_config, run_ranks
from test_pipeline_exec import _cfg, assert_matches, reference_2bw

from scaletrain.parallel.pipeline.check import check_2bw, check_2bw_steps, two_bw_phases
from scaletrain.parallel.pipeline.schedules import Action, Op, build_2bw_step, build_schedule
from scaletrain.parallel.pipeline.simulate import simulate, simulate_2bw, steady_2bw_makespan

TOL = 1e-9


def _compute(acts: list[Action]) -> str:
    return "".join(a.op.value for a in acts if a.op.is_compute)


# --------------------------------------------------------------------------- lists, checker, simulator


def test_isolated_2bw_step_is_the_one_step_1f1b_schedule():
    for p in range(1, 9):
        for m in range(p, 17):
            assert build_2bw_step(p, m, True, True) == build_schedule("2bw", p, m)


def test_cross_step_lists_pass_the_static_checker_for_p_1_to_8_and_m_p_to_16():
    for p in range(1, 9):
        for m in range(p, 17):
            check_2bw(p, m, n_steps=3)


def test_steps_have_warmup_once_steady_pairs_and_drain_once():
    p, m = 4, 8
    for r in range(p):
        w = p - r - 1
        first, steady, last = (build_2bw_step(p, m, f, la)[r] for f, la in ((True, False), (False, False),
                                                                             (False, True)))
        assert _compute(first) == "F" * w + "FB" * m
        assert _compute(steady) == "FB" * m
        assert _compute(last) == "FB" * (m - w) + "B" * w
        nxt = [a.microbatch for a in steady if a.op is Op.FORWARD and a.batch == 1]
        assert nxt == list(range(w))  # the next batch's warm-up, during this batch's cool-down
        assert [a.microbatch for a in steady if a.op is Op.BACKWARD] == list(range(m))
        assert all(a.batch == 0 for a in last)


def test_checker_rejects_a_message_crossing_a_step_boundary():
    p, m = 2, 4
    steps = [build_2bw_step(p, m, f, la) for f, la in two_bw_phases(3)]
    carried = Action(Op.RECV_ACT, 0, 0, 0, 1)
    assert steps[0][1][-1] == carried
    steps[0][1].pop()  # receive the next batch's first activation only in the next step
    steps[1][1].insert(0, Action(Op.RECV_ACT, 0, 0, 0))
    with pytest.raises(ValueError, match="step 0: rank 0 SEND_ACT.*no matching RECV_ACT"):
        check_2bw_steps(steps, p, m)


def test_checker_rejects_a_next_batch_forward_whose_activation_is_never_sent():
    p, m = 2, 4
    steps = [build_2bw_step(p, m, f, la) for f, la in two_bw_phases(3)]
    steps[0][0].remove(Action(Op.SEND_ACT, 0, 0, 1, 1))  # each step alone still matches and cannot deadlock
    steps[0][1].remove(Action(Op.RECV_ACT, 0, 0, 0, 1))
    with pytest.raises(ValueError, match="rank 0 batch 1 microbatch 0: no SEND_ACT"):
        check_2bw_steps(steps, p, m)


@pytest.mark.parametrize("t_f, t_b", [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_steady_state_step_loses_only_the_backward_chain(t_f, t_b):
    for p in range(2, 9):
        for m in range(p, 17):
            steady = simulate(build_2bw_step(p, m, False, False), t_f, t_b)
            assert steady.makespan == pytest.approx(steady_2bw_makespan(p, m, t_f, t_b), abs=TOL)
            assert steady.busy == pytest.approx([m * (t_f + t_b)] * p, abs=TOL)
            one = simulate(build_schedule("1f1b", p, m), t_f, t_b)
            assert one.makespan - steady.makespan == pytest.approx((p - 1) * t_f, abs=TOL)


def test_run_of_steps_keeps_p_minus_r_in_flight_and_beats_1f1b():
    p, m, n = 4, 8, 6
    run = simulate_2bw(p, m, n, 1.0, 2.0)
    assert run.window.peak_in_flight == [p - r for r in range(p)]
    assert run.step_makespans[1:-1] == pytest.approx([m * 3.0 + (p - 1) * 2.0] * (n - 2), abs=TOL)
    one = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    assert run.bubble < one.bubble  # 0.216 vs 0.273
    assert sum(run.step_makespans) < n * one.makespan


# --------------------------------------------------------------------------- executed on 2 processes


def _ov(m: int, **extra) -> dict:
    base = {k: v for k, v in _cfg(2, "2bw", m, 2, 4).items() if k != "train.eval_batches"}  # no evaluation here
    return {**base, "train.steps": 4, "train.eval_every": 0, **extra}


CONFIGS = {"m2": _ov(2), "m3": _ov(3), "m2-dropout": _ov(2, **{"model.dropout": 0.1})}


def _steps(t, n: int, drain_every: bool) -> dict:
    """Run steps 1..n by hand; returns losses, per-step events (pipeline rank) and the final state."""
    ex, losses, events = t.engine.pipeline, {}, []
    for step in range(1, n + 1):
        row = t.train_step(step, drain=drain_every or step == n)
        losses[step] = row["loss"]
        events.append([(e.name, e.microbatch) for e in ex.last_events])
    return {"losses": losses, "events": events, "state": t.full_state()}


def _rank(rank, world, configs):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    env = DistEnv(rank, world, 0, "test")
    out = {}
    for name, ov in configs.items():
        cfg = make_config(ov)
        n = cfg.train.steps
        res = {"overlapped": _steps(Trainer(cfg, None, env), n, False),
               "flushed": _steps(Trainer(cfg, None, env), n, True)}
        # kill after step 3 (overlapped into step 4, never checkpointed), resume from step 2's checkpoint
        ck = make_config({**ov, "train.checkpoint_every": 2})
        dirs = [tempfile.mkdtemp(), tempfile.mkdtemp()] if rank == 0 else [None, None]
        torch.distributed.broadcast_object_list(dirs, src=0)
        whole = Trainer(ck, dirs[0], env)
        whole_losses = whole.run().losses
        killed = Trainer(ck, dirs[1], env)
        ex = killed.engine.pipeline
        for step in (1, 2, 3):  # what run() does, but the process "dies" with step 4's forwards in flight
            killed.step = step
            killed.train_step(step, drain=step == 2)
            if step == 2:
                killed.save()
        in_flight = ex.carry is not None
        resumed = Trainer(ck, dirs[1], env)
        res["resume"] = {"whole": whole_losses, "whole_state": whole.full_state(), "in_flight": in_flight,
                         "resumed_from": resumed.step, "resumed": resumed.run().losses,
                         "resumed_state": resumed.full_state()}
        res["pp_rank"] = killed.mesh.local_rank("pp")
        out[name] = res
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_rank, 2, CONFIGS, timeout=300)


_REF: dict = {}


def _reference(name: str) -> dict:
    if name not in _REF:
        _REF[name] = reference_2bw(CONFIGS[name])
    return _REF[name]


def _by_pp_rank(runs, name):
    return {o[name]["pp_rank"]: o[name] for o in runs}


@pytest.mark.parametrize("name", ["m2", "m3"])
def test_overlapped_run_matches_the_2bw_reference(runs, name):
    got = runs[0][name]["overlapped"]
    assert_matches(got, _reference(name), check_val=False)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_overlapped_run_equals_the_flushed_run_bitwise(runs, name):
    for o in runs:
        a, b = o[name]["overlapped"], o[name]["flushed"]
        assert a["losses"] == b["losses"]
    a, b = runs[0][name]["overlapped"]["state"], runs[0][name]["flushed"]["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["m2", "m3"])
def test_executed_steps_follow_the_cross_step_lists(runs, name):
    m = CONFIGS[name]["train.global_batch"] // CONFIGS[name]["train.micro_batch"]
    n = CONFIGS[name]["train.steps"]
    for r, res in _by_pp_rank(runs, name).items():
        for t, got in enumerate(res["overlapped"]["events"]):
            want = build_2bw_step(2, m, t == 0, t == n - 1)[r]
            assert got == [(a.op.value, a.microbatch + a.batch * m) for a in want if a.op.is_compute], (r, t)
        if r == 0:  # stage 0 really started the next batch in steps 1..n-1: forwards of microbatch m
            assert all(("F", m) in ev for ev in res["overlapped"]["events"][:-1])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_killed_during_overlap_and_resumed_equals_the_uninterrupted_run(runs, name):
    for o in runs:
        res = o[name]["resume"]
        assert res["in_flight"] and res["resumed_from"] == 2
        assert list(res["resumed"]) == [3, 4]
        assert {k: res["whole"][k] for k in (3, 4)} == res["resumed"]
    res = runs[0][name]["resume"]
    a, b = res["whole_state"], res["resumed_state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if name != "m2-dropout":
        assert_matches({"losses": res["whole"], "state": a}, _reference(name), check_val=False)
