"""DualPipeV, the V-shaped single-direction form of DeepSeek-V3's DualPipe (arXiv 2412.19437 section 3.2.1): the
schedule as data.

Equivalence with one process (pp 2 tied, pp 4, dp 2 x pp 2 untied; fp64, loss of every step and every final
parameter) runs in tests/test_pipeline_exec.py's shared process pools (configs `dualpipev-*`, `pp2-dp2-dualpipev-*`);
check.py's checks of the lists (dependencies, matching, no deadlock, the stated peak) for p <= 8, m <= 16 in
tests/test_pipeline_schedules.py. Here: the compute order, overlapped slots included, op for op against
torch.distributed.pipelining's own ScheduleDualPipeV (its per-rank `pipeline_order`, computed without running), what
the checker catches, the simulated bubble and activation peak beside zb-v and 1F1B, the planner against the
simulator, and what validate() refuses.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from harness import TINY

from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError, UserError
from scaletrain.parallel.pipeline.check import check_schedule
from scaletrain.parallel.pipeline.schedules import (
    Action,
    Op,
    build_schedule,
    rank_chunk_to_stage,
    stage_layout,
    stated_peak,
    unfold,
)
from scaletrain.parallel.pipeline.simulate import simulate

TORCH_OP = {"F": Op.FORWARD, "I": Op.BACKWARD_INPUT, "W": Op.BACKWARD_WEIGHT, "B": Op.BACKWARD}


def _torch_order(p: int, m: int, r: int) -> list[tuple]:
    """torch's DualPipeV compute order of rank r: (op, microbatch, global stage), an overlapped slot as ("FB", its
    forward, its backward). Its own schedule code, called on a stand-in with the fields it reads: nothing runs."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    def one(a) -> tuple:
        return TORCH_OP[a.computation_type.value], a.microbatch_index, a.stage_index

    me = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    out = []
    for a in ScheduleDualPipeV._calculate_single_rank_operations(me, r):
        if a is not None:
            out.append(("FB", *map(one, a.sub_actions)) if a.sub_actions else one(a))
    return out


def _our_order(p: int, m: int, r: int) -> list[tuple]:
    def one(a: Action) -> tuple:
        return a.op, a.microbatch, rank_chunk_to_stage(r, a.chunk, p, "dualpipev")

    acts = build_schedule("dualpipev", p, m, 2)[r]
    return [("FB", *map(one, a.pair)) if a.op is Op.OVERLAP_F_B else one(a) for a in acts if a.op.is_compute]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_compute_order_is_torch_pipelinings_dualpipev_order_op_for_op(p):
    """Every compute action and every overlapped (forward, backward) slot, in order, for m from 2p to 2p + 8 (p <= 4;
    2p, 2p + 1, 3p and 4p + 1 above)."""
    for m in range(2 * p, 2 * p + 9) if p <= 4 else (2 * p, 2 * p + 1, 3 * p, 4 * p + 1):
        for r in range(p):
            assert _our_order(p, m, r) == _torch_order(p, m, r), (p, m, r)
    assert any(a.op is Op.OVERLAP_F_B for a in build_schedule("dualpipev", p, 2 * p + 2, 2)[0])


def test_dualpipev_uses_the_v_placement_of_zbv():
    assert stage_layout(4, 2, "dualpipev") == stage_layout(4, 2, "zb-v")


def test_check_rejects_a_same_chunk_overlap_and_a_peak_other_than_the_stated_one():
    """Two plausible bugs: an overlapped slot whose halves are on one chunk, and the slots run backward first (one
    pair fewer in flight than the stated 2p + 1: the lists no longer are the schedule whose memory is stated)."""
    p, m = 2, 6
    acts = build_schedule("dualpipev", p, m, 2)
    check_schedule(acts, p, m, 2, "dualpipev")
    r0 = list(acts[0])
    i = next(i for i, a in enumerate(r0) if a.op is Op.OVERLAP_F_B)
    f, b = r0[i].pair
    r0[i] = replace(r0[i], pair=(f, replace(b, chunk=f.chunk, stage=f.stage)))
    with pytest.raises(ValueError, match="forward and a full backward of the other chunk"):
        check_schedule([r0, acts[1]], p, m, 2, "dualpipev")
    backward_first = [[h for a in rank for h in ((a.pair[1], a.pair[0]) if a.pair else (a,))] for rank in acts]
    with pytest.raises(ValueError, match=r"holds 4 microbatch-chunks at its peak; dualpipev states 5"):
        check_schedule(backward_first, p, m, 2, "dualpipev")


@pytest.mark.parametrize("p", [2, 3, 4])
def test_dualpipev_holds_2p_plus_1_microbatch_chunks_on_every_rank(p):
    """The stated peak: the 2p forwards of the warm-up and one more, since an overlapped slot starts its forward
    before its backward frees a pair; one chunk more than zb-v (2p), i.e. p + 1/2 microbatches of a full stage.
    (check.py holds every list of p <= 8, m <= 16 to it: tests/test_pipeline_schedules.py.)"""
    for m in (2 * p, 3 * p, 4 * p + 1):
        sim = simulate(build_schedule("dualpipev", p, m, 2), 1.0, 1.0, 1.0)
        assert sim.peak_in_flight == [stated_peak("dualpipev", p)] * p == [2 * p + 1] * p
        assert sim.peak_in_flight_stages == [p + 0.5] * p


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_simulated_dualpipev_bubble_lies_between_zbv_and_1f1b_at_equal_microbatches(p, m):
    """Equal work per model (a chunk is half a 1F1B stage: t_f = t_b = t_w = 0.5 vs 1, 2). Bound set before
    measuring: below 1F1B, above zb-v. The simulator runs an overlapped slot's halves one after the other, which is
    what CPU/gloo does: DualPipe's gain, hiding one microbatch's communication behind another's compute on GPU
    streams, is not in it. Idle time per rank is 2(p - 1) chunk-passes here, twice zb-v's and a third of 1F1B's."""
    dpv = simulate(build_schedule("dualpipev", p, m, 2), 0.5, 0.5, 0.5)
    zbv = simulate(build_schedule("zb-v", p, m, 2), 0.5, 0.5, 0.5)
    f1b = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    assert zbv.bubble < dpv.bubble < f1b.bubble, (zbv.bubble, dpv.bubble, f1b.bubble)
    for r in range(p):
        assert dpv.idle[r] == pytest.approx(p - 1, abs=1e-9)


def test_an_overlapped_slot_runs_its_forward_then_its_backward():
    acts = build_schedule("dualpipev", 2, 4, 2)[1]
    fb = next(a for a in acts if a.op is Op.OVERLAP_F_B)
    assert (fb.microbatch, fb.chunk) == (fb.pair[0].microbatch, fb.pair[0].chunk)
    assert [h.op for h in fb.pair] == [Op.FORWARD, Op.BACKWARD] and fb.pair[0].chunk != fb.pair[1].chunk
    flat = unfold(acts)
    i = flat.index(fb.pair[0])
    assert flat[i + 1] == fb.pair[1] and Op.OVERLAP_F_B not in {a.op for a in flat}


# --------------------------------------------------------------------------- validate()


def _validate(**over):
    cfg = {**TINY, "model.n_layers": 4, "parallel.pp": 2, "parallel.schedule": "dualpipev",
           "parallel.virtual_stages": 2, "train.micro_batch": 1, "train.global_batch": 4, **over}
    world = cfg["parallel.pp"] * cfg.get("parallel.dp", 1) * cfg.get("parallel.tp", 1)
    validate(load_config(None, [f"{k}={v}" for k, v in cfg.items()]), world)


@pytest.mark.parametrize("over, message", [
    ({"train.global_batch": 3}, r"dualpipev needs parallel.microbatches >= 2 x parallel.pp = 4 .*, got 3"),
    ({"parallel.virtual_stages": 1}, r"dualpipev places two chunks per rank in a V: it needs "
                                     r"parallel.virtual_stages=2, got 1"),
    ({"train.device": "cuda"}, r"parallel.schedule=dualpipev runs on CPU \(gloo\) only"),
    ({"memory.recompute": "ops:matmul"}, r"memory.recompute=ops:matmul with parallel.schedule=dualpipev"),
    ({"model.reversible": "true"}, r"parallel.schedule=dualpipev with model.reversible"),
    ({"model.n_layers": 6}, r"model.n_layers \(6\) is not divisible into parallel.pp \(2\) x"),
], ids=["microbatches", "virtual-stages", "cuda", "selective-recompute", "reversible", "layers"])
def test_validate_refuses_what_dualpipev_does_not_run_naming_values(over, message):
    with pytest.raises(ConfigError, match=message):
        _validate(**over)


def test_validate_accepts_dualpipev_with_uneven_partition_dp_zero_and_tp():
    _validate(**{"parallel.partition": "1,2,1,2", "model.n_layers": 6})
    _validate(**{"parallel.dp": 2, "train.global_batch": 8, "parallel.zero": 1})
    _validate(**{"parallel.tp": 2})


# --------------------------------------------------------------------------- the planner


def _planned_vs_simulated(p: int, m: int, blocks: int, head: float) -> tuple[float, float]:
    """(simulated makespan per chunk, the planner's) for 2p equal stages of `blocks` blocks in the V (forward 1,
    input gradient 1, weight gradient 1 per block) and a head of `head` blocks on the last stage (rank 0's chunk 1).
    The planner knows each rank's totals only and splits them evenly over its two chunks."""
    from scaletrain.parallel.pipeline.schedules import stage_to_rank_chunk
    from scaletrain.plan.analytic.stages import v_makespan

    tf, tb, tw = ([[0.0, 0.0] for _ in range(p)] for _ in range(3))
    for s in range(2 * p):
        r, c = stage_to_rank_chunk(s, p, "dualpipev")
        extra = head if s == 2 * p - 1 else 0.0
        tf[r][c], tb[r][c], tw[r][c] = blocks + extra, blocks + extra, blocks
    t_sim = simulate(build_schedule("dualpipev", p, m, 2), tf, tb, tw).makespan
    planned = v_makespan("dualpipev", p, m, *(tuple(sum(t[r]) for r in range(p)) for t in (tf, tb, tw)))
    return t_sim, planned


def test_planned_dualpipev_step_equals_the_simulator_on_equal_stages_and_is_close_with_a_head():
    """Equal stages: the same lists simulated, so equal. A head of one block on rank 0's chunk 1, which the planner
    spreads over both chunks: the plan is slower by +0.16%..+1.82% over these cases (measured, deterministic),
    bound 2%."""
    for p, blocks in ((2, 3), (4, 3), (8, 12)):
        for m in (2 * p, 4 * p):
            t_sim, planned = _planned_vs_simulated(p, m, blocks, 0.0)
            assert planned == pytest.approx(t_sim, rel=1e-12)
            t_sim, planned = _planned_vs_simulated(p, m, blocks, 1.0)
            assert abs(planned / t_sim - 1) < 0.02, (p, m, planned / t_sim - 1)


def test_planner_prices_dualpipev_between_zbv_and_1f1b_and_its_activations_one_chunk_above_zbv():
    """GPT-3 1.3B on 8 H100s, dp 2 x pp 4, 16 microbatches: bubble zb-v < dualpipev < 1f1b; rank 0 holds one
    microbatch-chunk more than under zb-v (2p + 1 vs 2p); too few microbatches are refused naming the bound."""
    from scaletrain.plan.analytic.estimate import estimate
    from scaletrain.plan.analytic.inputs import Layout, Training
    from scaletrain.plan.catalog import get_model
    from scaletrain.plan.hardware import get_gpu

    m, gpu, train = get_model("gpt3-1.3b"), get_gpu("h100-80gb"), Training(64)
    est = {s: estimate(m, gpu, train, Layout(dp=2, pp=4, micro_batch=1, schedule=s, virtual_stages=v))
           for s, v in (("1f1b", 1), ("zb-v", 2), ("dualpipev", 2))}
    assert est["zb-v"].bubble_fraction < est["dualpipev"].bubble_fraction < est["1f1b"].bubble_fraction
    ratio = est["dualpipev"].memory["activations"] / est["zb-v"].memory["activations"]
    assert 1.0 < ratio <= 9 / 8 + 1e-9, ratio  # 2p + 1 over 2p chunks, less where rank 0's ends add the same bytes
    with pytest.raises(UserError, match=r"dualpipev needs microbatches >= 2 x pp = 8 \(rank 0's warm-up\), got 7"):
        estimate(m, gpu, Training(14), Layout(dp=2, pp=4, micro_batch=1, schedule="dualpipev", virtual_stages=2))
