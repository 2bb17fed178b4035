"""Planner search and pipeline terms: speed, closed forms against the schedule simulator, ranking."""

from __future__ import annotations

import time

import pytest

from scaletrain.errors import UserError
from scaletrain.plan.analytic.estimate import estimate
from scaletrain.plan.analytic.inputs import Layout, Training
from scaletrain.plan.analytic.stages import inflight_count, pipeline_makespan
from scaletrain.plan.catalog import get_model
from scaletrain.plan.hardware import get_gpu
from scaletrain.plan.search import dedupe, parse_layout, search

CASES = [(name, p, m, v) for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "2bw")
         for p in (1, 2, 3, 4, 8) for m in (p, 2 * p, 2 * p + 1, 4 * p)
         for v in ((1, 2, 3) if name == "interleaved" else (1,))]
TIMES = [(1.0, 2.0, 0.0), (1.0, 1.0, 1.0), (1.0, 1.5, 0.7), (1.0, 1.0, 3.0), (0.5, 0.3, 0.9)]


def pipeline_time(name: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float = 0.0) -> float:
    """The planner's step for equal stages: t_f, t_b (input backward, or all of it when t_w = 0), t_w per rank."""
    return pipeline_makespan(name, p, m, v, [t_f + t_b + t_w] * p, [max(t_f + t_b - t_w, t_f)] * p)


def test_closed_forms_agree_with_schedule_simulator():
    from scaletrain.parallel.pipeline.schedules import build_schedule
    from scaletrain.parallel.pipeline.simulate import simulate

    checked = 0
    for name, p, m, v in CASES:
        try:
            actions = build_schedule(name, p, m, v)
        except ValueError:
            continue
        for t_f, t_b, t_w in TIMES:
            r = simulate(actions, t_f / v, t_b / v, t_w / v)  # the simulator takes per-chunk times
            closed = pipeline_time(name, p, m, v, t_f, t_b, t_w)
            if name == "2bw" and p > 1:  # one isolated step: fill and drain once (see pipeline_time)
                closed += (p - 1) * (t_f + t_b + t_w)
            assert r.makespan == pytest.approx(closed, rel=1e-9), (name, p, m, v, t_f, t_b, t_w)
            assert r.peak_in_flight == [inflight_count(name, p, m, v, rank) for rank in range(p)], (name, p, m, v)
            checked += 1
    assert checked > 300


def test_bubble_fraction_closed_forms():
    # GPipe/1F1B (p-1)/(m+p-1); interleaved (p-1)/(vm+p-1); ZB-H1 with t_f = t_b = t_w: a third of 1F1B's
    p, m = 4, 8
    for name in ("gpipe", "1f1b"):
        assert 1 - m * 3 / pipeline_time(name, p, m, 1, 1, 1, 1) == pytest.approx((p - 1) / (m + p - 1))
    assert 1 - m * 3 / pipeline_time("interleaved", p, m, 2, 1, 1, 1) == pytest.approx((p - 1) / (2 * m + p - 1))
    assert pipeline_time("zb-h1", p, m, 1, 1, 1, 1) - m * 3 == pytest.approx((pipeline_time("1f1b", p, m, 1, 1, 1, 1)
                                                                              - m * 3) / 3)


def test_interleaved_inflight_matches_korthikanti_factor():
    # first stage holds L(1 + (p-1)/(pv)) layers' activations (arXiv 2205.05198 Sec. 4.2.3)
    for p, v in ((4, 2), (8, 3), (16, 4)):
        chunks = inflight_count("interleaved", p, 4 * p, v, 0)  # a chunk holds L/(pv) layers
        assert chunks / (p * v) == pytest.approx(1 + (p - 1) / (p * v))


def test_search_1t_on_3072_gpus_in_seconds():
    """Issue 31 widened the search (any pp with enough layers, the partitions, the checkpointing policies, ZeRO-3
    without resharding): about 18,600 layouts for 1T on 3,072 GPUs, 2.6x those before. Measured here 1.1-1.3 s of
    CPU (process time, which the shared machine's load moves less than wall time); the bound catches a blow-up."""
    t0 = time.process_time()
    r = search(get_model("megatron-1t"), get_gpu("a100-80gb"), 3072, Training(3072))
    elapsed = time.process_time() - t0
    assert elapsed < 6.0, elapsed
    assert r.candidates[0].fits and 15000 < r.evaluated < 25000
    best = r.candidates[0].layout
    assert best.world == 3072 and best.tp * best.pp >= 64  # 1T cannot live on fewer than ~64 GPUs/replica


def test_readme_first_plan_ranks_no_unvalidated_layout_above_validated_ones_within_the_held_out_error():
    """The README's first command: ZeRO-3 over 256 data-parallel ranks is predicted fastest by 1%, but no published
    run checks ZeRO-3 that wide (the 2021 DeepSpeed runs ran 1.4-4x slower than predicted): it ranks as if 20% slower,
    behind the validated layouts it beats by less than that. Before issue 31 it came first at 71% MFU."""
    from scaletrain.plan.trust import TRUST, coverage_notes, rank_key

    r = search(get_model("gpt3-175b"), get_gpu("a100-80gb"), 1024, Training(1536))
    fits = [c for c in r.candidates if c.fits]
    best, fastest = fits[0], min(fits, key=lambda c: c.step_time_s)
    assert coverage_notes(fastest) and fastest.layout.zero == 3 and fastest.layout.dp == 256
    assert not coverage_notes(best) and best.step_time_s < fastest.step_time_s * (1 + TRUST)
    assert [rank_key(c) for c in fits] == sorted(rank_key(c) for c in fits)
    assert 0.55 < best.mfu < 0.65  # measured 62.9%: MPT-70B on A100 reaches 53% MFU with full recomputation


def test_search_ranks_fitting_layouts_by_step_time():
    r = search(get_model("gpt3-6.7b"), get_gpu("a100-80gb"), 64, Training(512))
    fits = [c for c in r.candidates if c.fits]
    assert fits and all(a.step_time_s <= b.step_time_s for a, b in zip(fits, fits[1:]))
    assert len(dedupe(r.candidates, 5)) == 5


def test_fixed_layout_fields_are_respected():
    fixed = parse_layout("tp=8,pp=8,zero=1,recompute=full,schedule=interleaved,v=2,sp=true")
    r = search(get_model("gpt3-175b"), get_gpu("a100-80gb"), 1024, Training(1536), fixed)
    for c in r.candidates:
        lay = c.layout
        assert (lay.tp, lay.pp, lay.dp, lay.zero, lay.recompute, lay.virtual_stages) == (8, 8, 16, 1, "full", 2)


def test_layout_errors_name_the_values():
    with pytest.raises(UserError, match="does not match --gpus"):
        search(get_model("gpt3-175b"), get_gpu("a100-80gb"), 1024, Training(1536), parse_layout("dp=2,tp=8,pp=8"))
    with pytest.raises(UserError, match=r"heads \(96\) is not divisible by tp \(5\)"):
        estimate(get_model("gpt3-175b"), get_gpu("a100-80gb"), Training(1536), Layout(dp=1, tp=5))
    with pytest.raises(UserError, match=r"layers \(96\) is not divisible by pp \(5\)"):
        estimate(get_model("gpt3-175b"), get_gpu("a100-80gb"), Training(1536), Layout(dp=1, pp=5))
    with pytest.raises(UserError, match="unknown field"):
        parse_layout("foo=3")


def test_more_memory_pressure_never_fits_better():
    # the same layout with full recompute uses less activation memory than without, and more time
    m, g, t = get_model("gpt3-175b"), get_gpu("a100-80gb"), Training(1536, attention="standard")
    base = dict(dp=16, tp=8, pp=8, micro_batch=1)
    none = estimate(m, g, t, Layout(**base))
    full = estimate(m, g, t, Layout(**base, recompute="full"))
    assert full.memory["activations"] < none.memory["activations"]
    assert full.step_time_s > none.step_time_s
    assert full.hardware_tflops_per_gpu / full.model_tflops_per_gpu == pytest.approx(4 / 3, rel=0.02)


def test_docs_state_the_zero_stages_the_search_tries_with_pipelining():
    """Issue 31: docs/planner.md said the search tries ZeRO 0-1 with pp > 1 while search.py tries 0-3."""
    from pathlib import Path

    from scaletrain.plan.search import enumerate_layouts

    layouts = enumerate_layouts(get_model("gpt3-6.7b"), get_gpu("a100-80gb"), 64, Training(512), {"tp": 8, "pp": 4})
    assert sorted({lay.zero for lay in layouts}) == [0, 1, 2, 3]
    doc = (Path(__file__).parents[1] / "docs" / "planner.md").read_text()
    start = doc.index("## The search")
    search_section = doc[start:doc.index("\n## ", start)]
    assert "ZeRO 0–3 with and without pp" in search_section and "0–1 with pp > 1" not in search_section
