"""Pipeline schedules as data: action lists, static checks, simulation and drawing (no processes).

Closed forms come from the papers: bubble (p-1)/(m+p-1) for GPipe (arXiv 1811.06965) and 1F1B
(arXiv 2006.09503, 2104.04473 eq. 1), (p-1)/(v*m+p-1) for interleaved 1F1B (arXiv 2104.04473 section
2.2.2), idle time (p-1)(t_f+t_b-t_w) per rank for zero bubble H1 (arXiv 2401.10241 section 3.1).
Float comparisons use an absolute tolerance of 1e-9 unless stated.
"""

from __future__ import annotations

import json
import struct
from collections import Counter

import pytest

from scaletrain.parallel.pipeline.check import check_schedule, validate_pipeline
from scaletrain.parallel.pipeline.draw import draw_timeline, to_chrome_trace
from scaletrain.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Op,
    batches,
    build_schedule,
    message_key,
    rank_chunk_to_stage,
    stage_layout,
    stage_to_rank_chunk,
    unfold,
)
from scaletrain.parallel.pipeline.simulate import Event, simulate

TOL = 1e-9


def allowed_configs(name: str):
    """Every (p, m, v) with p in 1..8, m in 1..16 that the schedule accepts."""
    for p in range(1, 9):
        for m in range(1, 17):
            for v in (1, 2, 3) if name == "interleaved" else (2,) if name in ("zb-v", "dualpipev") else (1,):
                if name == "interleaved" and m % p:
                    continue
                if name == "2bw" and m < p or name == "pipedream" and m != 1:  # pipedream: one minibatch a step
                    continue
                if name == "zb-v" and m < 2 * p - 1 or name == "dualpipev" and m < 2 * p:
                    continue
                yield p, m, v


def compute_string(acts: list[Action]) -> str:
    return "".join(a.op.value for a in acts if a.op.is_compute)


# --------------------------------------------------------------------------- building and checking


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_passes_check_for_p_1_to_8_and_m_1_to_16(name):
    n = 0
    for p, m, v in allowed_configs(name):
        check_schedule(build_schedule(name, p, m, v), p, m, v, name)
        n += 1
    assert n >= (8 if name == "pipedream" else 24)  # interleaved has the fewest of the others: 3 * sum(16 // p)


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_microbatch_runs_forward_and_backward_once_per_chunk(name):
    for p, m, v in allowed_configs(name):
        actions = build_schedule(name, p, m, v)
        for acts in actions:
            counts = Counter((a.op, a.microbatch, a.chunk) for a in unfold(acts))
            for mb in range(m):
                for c in range(v):
                    assert counts[(Op.FORWARD, mb, c)] == 1
                    if name in ("zb-h1", "zb-v"):
                        assert counts[(Op.BACKWARD_INPUT, mb, c)] == counts[(Op.BACKWARD_WEIGHT, mb, c)] == 1
                        assert counts[(Op.BACKWARD, mb, c)] == 0
                    elif name == "dualpipev":  # DeepSeek's cool-down splits the second half of its backwards
                        split = counts[(Op.BACKWARD_INPUT, mb, c)]
                        assert counts[(Op.BACKWARD_WEIGHT, mb, c)] == split == 1 - counts[(Op.BACKWARD, mb, c)]
                    else:
                        assert counts[(Op.BACKWARD, mb, c)] == 1
        # one message per microbatch and stage boundary between ranks, each way; none when p == 1; the V's tip
        # (stages p-1 and p, both on rank p-1) hands over in memory
        per_op = Counter(a.op for acts in actions for a in acts)
        boundaries = (p * v - 1 - (name in ("zb-v", "dualpipev"))) if p > 1 else 0
        for op in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD):
            assert per_op[op] == m * boundaries, (name, p, m, v, op)


def test_gpipe_runs_all_forwards_then_all_backwards():
    for acts in build_schedule("gpipe", 4, 6):
        assert compute_string(acts) == "F" * 6 + "B" * 6


def test_1f1b_has_warmup_steady_and_cooldown_phases():
    p, m = 4, 8
    for r, acts in enumerate(build_schedule("1f1b", p, m)):
        w = p - r - 1
        assert compute_string(acts) == "F" * w + "FB" * (m - w) + "B" * w
        backward_order = [a.microbatch for a in acts if a.op is Op.BACKWARD]
        assert backward_order == list(range(m))


def test_2bw_uses_the_1f1b_order_of_operations():
    assert build_schedule("2bw", 4, 8) == build_schedule("1f1b", 4, 8)


def test_interleaved_follows_megatrons_microbatch_chunk_table():
    # p = 2, v = 2, m = 4: forwards go two microbatches through chunk 0, the same two through chunk 1,
    # then the next two; backwards walk the chunks in reverse (arXiv 2104.04473 figure 4).
    actions = build_schedule("interleaved", 2, 4, 2)
    for acts in actions:
        fwd = [(a.microbatch, a.chunk) for a in acts if a.op is Op.FORWARD]
        bwd = [(a.microbatch, a.chunk) for a in acts if a.op is Op.BACKWARD]
        assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
        assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    # warm-up forwards before the first backward: 2 (p - r - 1) + (v - 1) p
    assert compute_string(actions[0]).index("B") == 4 + 1
    assert compute_string(actions[1]).index("B") == 2 + 1


def test_interleaved_with_one_chunk_is_1f1b():
    assert build_schedule("interleaved", 4, 8, 1) == build_schedule("1f1b", 4, 8)


def test_zb_h1_delays_weight_passes_by_rank_index():
    p, m = 4, 8
    for r, acts in enumerate(build_schedule("zb-h1", p, m)):
        ops = [(a.op, a.microbatch) for a in acts if a.op.is_compute]
        first_w = ops.index((Op.BACKWARD_WEIGHT, 0))
        inputs_before = sum(1 for op, _ in ops[:first_w] if op is Op.BACKWARD_INPUT)
        assert inputs_before == r + 1


def test_chunk_c_on_rank_r_holds_model_chunk_c_times_p_plus_r():
    p, v = 4, 3
    layout = stage_layout(p, v)
    assert layout[:5] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1)]
    for s, (r, c) in enumerate(layout):
        assert s == c * p + r == rank_chunk_to_stage(r, c, p)
        assert stage_to_rank_chunk(s, p) == (r, c)


def test_send_and_receive_keys_agree_across_the_chunk_boundary():
    # p = 2, v = 2: stage 1 (rank 1, chunk 0) sends to stage 2 (rank 0, chunk 1)
    send = Action(Op.SEND_ACT, 3, 0, peer=0)
    recv = Action(Op.RECV_ACT, 3, 1, peer=1)
    assert message_key(1, send, 2) == message_key(0, recv, 2) == ("act", 3, 1, 2)
    grad_send = Action(Op.SEND_GRAD, 3, 1, peer=1)
    grad_recv = Action(Op.RECV_GRAD, 3, 0, peer=0)
    assert message_key(0, grad_send, 2) == message_key(1, grad_recv, 2) == ("grad", 3, 2, 1)


def test_every_receive_comes_before_its_compute_and_every_send_after():
    for name in SCHEDULES:
        v = 2 if name in ("interleaved", "zb-v", "dualpipev") else 1
        for acts in map(unfold, build_schedule(name, 4, 1 if name == "pipedream" else 8, v)):
            for i, a in enumerate(acts):
                if a.op.is_comm:
                    compute = Op.FORWARD if a.op in (Op.SEND_ACT, Op.RECV_ACT) else None
                    j = next(k for k, b in enumerate(acts) if b.microbatch == a.microbatch
                             and b.chunk == a.chunk and b.op.is_compute
                             and (b.op is compute if compute else b.op in (Op.BACKWARD, Op.BACKWARD_INPUT)))
                    assert (j > i) if a.op.is_recv else (j < i), (name, a)


@pytest.mark.parametrize(
    "name, p, m, v",
    [("bogus", 2, 2, 1), ("1f1b", 4, 8, 2), ("interleaved", 4, 6, 2), ("2bw", 4, 3, 1), ("gpipe", 0, 4, 1)],
)
def test_build_schedule_rejects_what_the_schedule_cannot_do(name, p, m, v):
    with pytest.raises(ValueError):
        build_schedule(name, p, m, v)


# --------------------------------------------------------------------------- the checker catches bugs


def without(actions, rank, pred):
    out = [list(a) for a in actions]
    out[rank] = [a for a in out[rank] if not pred(a)]
    return out


def test_checker_catches_a_missing_receive():
    actions = build_schedule("1f1b", 2, 2)
    broken = without(actions, 1, lambda a: a.op is Op.RECV_ACT and a.microbatch == 1)
    with pytest.raises(ValueError, match="no matching RECV_ACT on rank 1"):
        check_schedule(broken, 2, 2, 1)


def test_checker_catches_a_missing_send():
    actions = build_schedule("gpipe", 3, 2)
    broken = without(actions, 2, lambda a: a.op is Op.SEND_GRAD and a.microbatch == 0)
    with pytest.raises(ValueError, match="no matching SEND_GRAD on rank 2"):
        check_schedule(broken, 3, 2, 1)


def test_checker_catches_both_ranks_receiving_first():
    # rank 0 waits for a gradient before sending the activation rank 1 needs to make that gradient
    rank0 = [Action(Op.RECV_GRAD, 0, 0, 1), Action(Op.FORWARD, 0, 0), Action(Op.SEND_ACT, 0, 0, 1),
             Action(Op.BACKWARD, 0, 0)]
    rank1 = [Action(Op.RECV_ACT, 0, 0, 0), Action(Op.FORWARD, 0, 0), Action(Op.BACKWARD, 0, 0),
             Action(Op.SEND_GRAD, 0, 0, 0)]
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule([rank0, rank1], 2, 1, 1)


def two_rank_1f1b(swapped: bool) -> list[list[Action]]:
    """p = 2, m = 2 by hand. In the sound order each rank's middle batch exchanges two messages
    (rank 0: SEND_ACT 1 + RECV_GRAD 0; rank 1: SEND_GRAD 0 + RECV_ACT 1). Swapped, each rank first
    waits for a receive and only sends after a compute: each waits for the other's send."""
    F, B = Op.FORWARD, Op.BACKWARD
    if not swapped:
        r0 = [(F, 0), (Op.SEND_ACT, 0), (F, 1), (Op.SEND_ACT, 1), (Op.RECV_GRAD, 0), (B, 0),
              (Op.RECV_GRAD, 1), (B, 1)]
        r1 = [(Op.RECV_ACT, 0), (F, 0), (B, 0), (Op.SEND_GRAD, 0), (Op.RECV_ACT, 1), (F, 1), (B, 1),
              (Op.SEND_GRAD, 1)]
    else:
        r0 = [(F, 0), (Op.SEND_ACT, 0), (F, 1), (Op.RECV_GRAD, 0), (B, 0), (Op.SEND_ACT, 1),
              (Op.RECV_GRAD, 1), (B, 1)]
        r1 = [(Op.RECV_ACT, 0), (F, 0), (B, 0), (Op.RECV_ACT, 1), (F, 1), (Op.SEND_GRAD, 0), (B, 1),
              (Op.SEND_GRAD, 1)]
    return [[Action(op, mb, 0, None if op.is_compute else 1 - r) for op, mb in acts]
            for r, acts in enumerate((r0, r1))]


def test_checker_catches_a_swapped_order_that_deadlocks():
    check_schedule(two_rank_1f1b(swapped=False), 2, 2, 1)
    assert [len(b) for b in batches(two_rank_1f1b(False)[0])] == [1, 1, 1, 2, 1, 1, 1]
    with pytest.raises(ValueError, match="deadlock.*rank 0 waits in RECV_GRAD.*rank 1 waits in RECV_ACT"):
        check_schedule(two_rank_1f1b(swapped=True), 2, 2, 1)


def test_checker_catches_backward_before_forward():
    actions = build_schedule("1f1b", 2, 2)
    r1 = actions[1]
    i_f = r1.index(Action(Op.FORWARD, 1, 0))
    i_b = r1.index(Action(Op.BACKWARD, 1, 0))
    broken = [actions[0], list(r1)]
    broken[1][i_f], broken[1][i_b] = r1[i_b], r1[i_f]
    with pytest.raises(ValueError, match="before the forward"):
        check_schedule(broken, 2, 2, 1)


def test_checker_catches_wrong_counts():
    actions = build_schedule("zb-h1", 3, 4)
    missing_w = without(actions, 2, lambda a: a.op is Op.BACKWARD_WEIGHT and a.microbatch == 3)
    with pytest.raises(ValueError, match="0 BACKWARD_WEIGHT"):
        check_schedule(missing_w, 3, 4, 1)
    doubled = [list(a) for a in actions]
    doubled[0].append(Action(Op.FORWARD, 0, 0))
    with pytest.raises(ValueError, match="2 forwards"):
        check_schedule(doubled, 3, 4, 1)
    with pytest.raises(ValueError, match="rank lists"):
        check_schedule(actions[:2], 3, 4, 1)


def test_checker_catches_a_wrong_peer_and_out_of_order_messages():
    actions = build_schedule("gpipe", 3, 2)
    wrong_peer = [list(a) for a in actions]
    i = wrong_peer[0].index(Action(Op.SEND_ACT, 0, 0, 1))
    wrong_peer[0][i] = Action(Op.SEND_ACT, 0, 0, 2)
    with pytest.raises(ValueError, match="peer should be rank 1"):
        check_schedule(wrong_peer, 3, 2, 1)
    swapped = [list(a) for a in actions]  # rank 1 receives activation 1 before activation 0
    r1 = swapped[1]
    a0, a1 = r1.index(Action(Op.RECV_ACT, 0, 0, 0)), r1.index(Action(Op.RECV_ACT, 1, 0, 0))
    r1[a0], r1[a1] = r1[a1], r1[a0]
    with pytest.raises(ValueError, match="out of order"):
        check_schedule(swapped, 3, 2, 1)


# --------------------------------------------------------------------------- simulation


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "2bw"])
def test_bubble_equals_p_minus_1_over_m_plus_p_minus_1(name):
    # uniform stages, t_b = 2 t_f, t_w = 0: exact on every rank
    for p, m, _ in allowed_configs(name):
        sim = simulate(build_schedule(name, p, m), t_f=1.0, t_b=2.0)
        closed = (p - 1) / (m + p - 1)
        assert sim.bubble == pytest.approx(closed, abs=TOL)
        assert sim.bubble_per_rank == pytest.approx([closed] * p, abs=TOL)
        assert sim.makespan == pytest.approx(3.0 * (m + p - 1), abs=TOL)


def test_interleaved_bubble_is_that_of_1f1b_divided_by_v():
    # per-chunk times t_f / v, t_b / v so a rank does the same work as in 1F1B
    for p, m, v in allowed_configs("interleaved"):
        sim = simulate(build_schedule("interleaved", p, m, v), t_f=1.0 / v, t_b=2.0 / v)
        assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=TOL), (p, m, v)
        if p > 1 and v > 1:
            assert sim.bubble < (p - 1) / (m + p - 1)


def test_zb_h1_idle_time_is_a_third_of_1f1b_when_f_b_w_are_equal():
    for p in range(2, 9):
        for m in range(p, 17):
            zb = simulate(build_schedule("zb-h1", p, m), 1.0, 1.0, 1.0)
            ref = simulate(build_schedule("1f1b", p, m), 1.0, 1.0, 1.0)
            assert zb.idle == pytest.approx([p - 1.0] * p, abs=TOL)
            assert ref.idle == pytest.approx([3.0 * (p - 1)] * p, abs=TOL)
            assert zb.makespan == pytest.approx(3.0 * m + p - 1, abs=TOL)


@pytest.mark.parametrize(
    "t_f, t_b, t_w", [(1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.25)]
)
def test_zb_h1_idle_time_is_p_minus_1_times_f_plus_b_minus_w(t_f, t_b, t_w):
    for p, m in [(2, 4), (4, 8), (5, 5), (8, 16)]:
        sim = simulate(build_schedule("zb-h1", p, m), t_f, t_b, t_w)
        assert max(sim.idle) == pytest.approx((p - 1) * (t_f + t_b - t_w), abs=TOL)


def test_zb_h1_with_fewer_microbatches_than_stages_is_never_worse_than_1f1b():
    for p in range(2, 9):
        for m in range(1, p):
            zb = simulate(build_schedule("zb-h1", p, m), 1.0, 1.0, 1.0)
            ref = simulate(build_schedule("1f1b", p, m), 1.0, 1.0, 1.0)
            assert zb.makespan <= ref.makespan + TOL


def test_blocking_sends_cost_zb_h1_its_gain_but_not_1f1b():
    p, m = 4, 8
    zb = build_schedule("zb-h1", p, m)
    ref = build_schedule("1f1b", p, m)
    assert simulate(zb, 1, 1, 1, blocking_sends=True).makespan == pytest.approx(33.0)
    assert simulate(ref, 1, 1, 1, blocking_sends=True).makespan == pytest.approx(33.0)
    assert simulate(zb, 1, 1, 1).makespan == pytest.approx(27.0)


def test_peak_in_flight_is_m_for_gpipe_and_p_minus_rank_for_1f1b():
    for p in range(1, 9):
        for m in range(1, 17):
            gp = simulate(build_schedule("gpipe", p, m), 1, 2)
            ob = simulate(build_schedule("1f1b", p, m), 1, 2)
            zb = simulate(build_schedule("zb-h1", p, m), 1, 1, 1)
            assert gp.peak_in_flight == [m] * p
            assert ob.peak_in_flight == [min(p - r, m) for r in range(p)]
            assert max(zb.peak_in_flight) == max(ob.peak_in_flight) == min(p, m)


def test_interleaved_in_flight_is_counted_in_chunks_and_in_stage_units():
    p, m, v = 4, 8, 2
    sim = simulate(build_schedule("interleaved", p, m, v), 0.5, 1.0)
    # rank r: 2 (p - r - 1) + (v - 1) p warm-up forwards plus the first steady-state one
    assert sim.peak_in_flight == [2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]
    # rank 0 holds p (1 + (p - 1) / (p v)) stage-microbatches (arXiv 2104.04473 section 2.2.2)
    assert sim.peak_in_flight_stages[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_gpipe_with_unequal_stages_matches_the_flow_shop_formula():
    # identical jobs through stages in series: sum of stage times + (m - 1) * slowest stage, each way
    t_f = [1.0, 3.0, 2.0]
    t_b = {(0, 0): 2.0, (1, 0): 4.0, (2, 0): 5.0}
    m = 5
    sim = simulate(build_schedule("gpipe", 3, m), t_f=t_f, t_b=t_b)
    expected = sum(t_f) + (m - 1) * max(t_f) + sum(t_b.values()) + (m - 1) * max(t_b.values())
    assert sim.makespan == pytest.approx(expected, abs=TOL)
    assert sim.busy == pytest.approx([m * 3.0, m * 7.0, m * 7.0], abs=TOL)


def test_communication_time_adds_one_hop_per_boundary_each_way():
    p, m, c = 4, 6, 0.25
    sim = simulate(build_schedule("gpipe", p, m), 1.0, 2.0, t_comm=c)
    assert sim.makespan == pytest.approx(3.0 * (m + p - 1) + 2 * (p - 1) * c, abs=TOL)


def test_unsplit_backward_takes_t_b_plus_t_w():
    sim = simulate(build_schedule("1f1b", 1, 3), 1.0, 2.0, 0.5)
    assert [e.end_s - e.start_s for e in sim.events if e.name == "B"] == pytest.approx([2.5] * 3)


def test_simulation_reports_a_deadlock():
    rank0 = [Action(Op.RECV_GRAD, 0, 0, 1), Action(Op.FORWARD, 0, 0), Action(Op.SEND_ACT, 0, 0, 1),
             Action(Op.BACKWARD, 0, 0)]
    rank1 = [Action(Op.RECV_ACT, 0, 0, 0), Action(Op.FORWARD, 0, 0), Action(Op.BACKWARD, 0, 0),
             Action(Op.SEND_GRAD, 0, 0, 0)]
    with pytest.raises(ValueError, match="deadlock"):
        simulate([rank0, rank1], 1.0, 1.0)


# --------------------------------------------------------------------------- drawing and traces


def test_timeline_png_is_written_and_valid(tmp_path):
    sim = simulate(build_schedule("interleaved", 2, 4, 2), 0.5, 1.0)
    path = draw_timeline(sim, tmp_path / "timeline.png", title="interleaved p=2 m=4 v=2")
    data = (tmp_path / "timeline.png").read_bytes()
    assert path.endswith("timeline.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 200 and height > 100


def test_timeline_accepts_generic_event_lists(tmp_path):
    measured = [(0, "F", 0.0, 0.01, 0, 0), {"rank": 1, "name": "F", "start_s": 0.01, "end_s": 0.02},
                (0, "optimizer", 0.03, 0.04)]
    draw_timeline(measured, tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_chrome_trace_has_one_complete_event_per_compute_in_microseconds():
    sim = simulate(build_schedule("1f1b", 2, 3), 0.001, 0.002)
    trace = json.loads(json.dumps(to_chrome_trace(sim)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(sim.events) == 2 * 2 * 3
    for x, e in zip(xs, sim.events):
        assert x["pid"] == x["tid"] == e.rank
        assert x["ts"] == pytest.approx(e.start_s * 1e6)
        assert x["dur"] == pytest.approx((e.end_s - e.start_s) * 1e6)
        assert x["args"]["microbatch"] == e.microbatch
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0", "rank 1"}
    assert to_chrome_trace([Event(3, "F", 0.0, 1.0, 2, 0)])["traceEvents"][-1]["pid"] == 3


# --------------------------------------------------------------------------- config validation


def test_validate_pipeline_accepts_good_settings():
    assert validate_pipeline(n_layers=8, p=4, v=2, m=8, schedule="interleaved") == []
    assert validate_pipeline(n_layers=4, p=4, v=1, m=3, schedule="1f1b") == []
    assert validate_pipeline(n_layers=6, p=3, v=1, m=1, schedule="gpipe") == []


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((10, 4, 1, 8, "1f1b"),
         "model.n_layers (10) is not divisible into parallel.pp (4) x parallel.virtual_stages (1)"),
        ((16, 4, 2, 6, "interleaved"), "parallel.microbatches (6) divisible by parallel.pp (4)"),
        ((8, 4, 1, 3, "2bw"), "parallel.microbatches (3) < parallel.pp (4)"),
        ((8, 2, 2, 4, "1f1b"), "parallel.virtual_stages (2) > 1 needs parallel.schedule=interleaved"),
        ((8, 2, 1, 4, "dapple"), "parallel.schedule must be one of"),
        ((8, 2, 1, 4, "pipedream"), "parallel.microbatches (4) must be 1"),
        ((8, 2, 1, 0, "gpipe"), "parallel.microbatches must be at least 1, got 0"),
    ],
)
def test_validate_pipeline_names_the_values(args, fragment):
    errors = validate_pipeline(*args)
    assert any(fragment in e for e in errors), errors
