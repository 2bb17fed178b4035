"""The GPU catalog, FP8, the tensor-parallel overlap model and the GPU-speed stragglers of the planner (issue 31)."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.cli import main
from scaletrain.plan.analytic.comm import allreduce_time, group_link
from scaletrain.plan.analytic.estimate import estimate
from scaletrain.plan.analytic.inputs import Assumptions, Layout, Training
from scaletrain.plan.analytic.step_time import layer_times, straggler_factor
from scaletrain.plan.catalog import get_model
from scaletrain.plan.hardware import CATALOG, get_gpu

H100 = get_gpu("h100-80gb")


def test_catalog_has_todays_gpus_each_with_its_source():
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h100-nvl", "h100-96gb", "h200", "b200",
                 "gb200", "mi300x"):
        g = CATALOG[name]
        assert g.source and g.peak_flops > 0 and g.memory_bytes > 0 and g.hbm_bandwidth > 0 and g.intra_bw > 0
        assert 0 < g.gemm_efficiency <= 0.8 and 0 <= g.flash_efficiency < 1
    # dense peaks: FP8 twice bf16 where a GPU has it (datasheets list both with sparsity, half of that dense)
    assert all(g.fp8_flops == 0 or 1.99 < g.fp8_flops / g.peak_flops < 2.01 for g in CATALOG.values())
    assert not CATALOG["a100-80gb"].fp8_flops and CATALOG["gb200"].gpus_per_node == 72
    assert get_gpu("H100-SXM").name == "h100-80gb" and get_gpu("mi300x-192gb").name == "mi300x"


def test_cluster_file_without_the_new_fields_still_loads(tmp_path):
    from scaletrain.plan.hardware import load_cluster

    f = tmp_path / "c.yaml"
    f.write_text("gpu:\n  name: x\n  peak_flops: 312e12\n  memory_bytes: 80e9\n  hbm_bandwidth: 2.0e12\n"
                 "  gpus_per_node: 8\n  intra_bw: 300e9\n  inter_bw: 25e9\ngpus: 64\n")
    gpu, n = load_cluster(f)
    assert n == 64 and gpu.fp8_flops == 0 and gpu.flash_efficiency == 0


def test_flash_attention_runs_at_the_kernels_efficiency_on_its_causal_work():
    m = get_model("llama3-8b")
    lay, train = Layout(dp=8, micro_batch=1), Training(64)
    lt = layer_times(m, H100, train, lay, Assumptions())
    attn_flops = 4 * m.seq_len * m.width * m.seq_len  # one microbatch, the full square, forward
    # half the square is executed, 1 forward + 2.5 backward of it over the 3 passes counted, at 35% of peak
    assert lt.attn == pytest.approx(attn_flops * 1.75 / 3 / (H100.peak_flops * 0.35))
    plain = layer_times(m, dataclasses.replace(H100, flash_efficiency=0.0), train, lay, Assumptions())
    assert plain.attn == pytest.approx(attn_flops / (H100.peak_flops * lt.eff))


def test_fp8_runs_the_block_linears_at_the_fp8_peak_and_pays_its_casts_and_scales():
    m = get_model("llama2-70b")
    lay = Layout(dp=8, tp=8, micro_batch=1, sequence_parallel=True)
    bf16, fp8 = (layer_times(m, H100, Training(64, d), lay, Assumptions()) for d in ("bf16", "fp8"))
    ratio = (H100.fp8_flops * H100.fp8_gemm_efficiency) / (H100.peak_flops * H100.gemm_efficiency)
    assert bf16.gemm / fp8.gemm == pytest.approx(ratio)  # a dense model: every block GEMM in FP8
    assert fp8.mem > bf16.mem  # the casts
    link = group_link(H100, 8, 1, Assumptions())
    assert fp8.tp_f - bf16.tp_f == pytest.approx(6 * allreduce_time(4, 8, link))  # the scales' all-reduces
    # ZeRO-3 gathers the linear weights in FP8: fewer bytes than bf16's
    z3 = Layout(dp=64, zero=3, micro_batch=1)
    b, f = (estimate(get_model("llama3-8b"), H100, Training(64, d), z3) for d in ("bf16", "fp8"))
    assert 0.5 < f.comm_bytes["dp"] / b.comm_bytes["dp"] < 0.75
    assert any("FP8" in n for n in f.notes) and f.step_time_s < b.step_time_s


def test_fp8_on_a_gpu_without_it_is_one_line_exit_2(capsys):
    code = main(["plan", "--model", "llama3-8b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "64",
                 "--dtype", "fp8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--dtype fp8 needs FP8 tensor cores: a100-80gb has none" in err and "\n" not in err


def test_tp_overlap_hides_all_but_one_chunk_of_a_collective_its_gemm_outlasts():
    m = get_model("gpt3-175b")
    lay, train = Layout(dp=8, tp=2, micro_batch=1, sequence_parallel=True), Training(64)
    off = layer_times(m, H100, train, lay, Assumptions())
    on = layer_times(m, H100, train, lay, Assumptions(tp_comm_overlap=True))
    assert off.tp_f == off.tp_raw and on.tp_raw == off.tp_raw
    # at tp 2, 175B's GEMMs outlast their collectives several times: one chunk of 2 of each stays exposed
    assert on.tp_f == pytest.approx(off.tp_f / 2)
    est = estimate(m, H100, train, lay, Assumptions(tp_comm_overlap=True))
    assert any("communication 50% exposed" in n for n in est.notes), est.notes
    # at tp 8 a collective outlasts the projection's GEMM: more than one chunk of 8 stays exposed
    lay8 = dataclasses.replace(lay, tp=8)
    on8, off8 = (layer_times(m, H100, train, lay8, Assumptions(tp_comm_overlap=x)) for x in (True, False))
    assert off8.tp_f / 8 < on8.tp_f < off8.tp_f
    plain = estimate(m, H100, train, lay)
    assert any("assumed fully exposed (--tp-overlap" in n for n in plain.notes)
    no_sp = estimate(m, H100, train, dataclasses.replace(lay, sequence_parallel=False), Assumptions(
        tp_comm_overlap=True))
    assert any("all-reduces assumed fully exposed" in n for n in no_sp.notes)
    grid = estimate(get_model("llama3-8b"), H100, Training(64), Layout(dp=2, tp=4, tp_mode="2d", micro_batch=2),
                    Assumptions(tp_comm_overlap=True))
    assert any(n.startswith("2D tensor-parallel collectives assumed fully exposed (--tp-overlap models 1D")
               for n in grid.notes), grid.notes


def test_the_slowest_of_n_gpus_sets_the_step():
    assert straggler_factor(1, 0.05) == 1.0 and straggler_factor(8, 0.0) == 1.0
    assert straggler_factor(8, 0.05) == pytest.approx(1.025)  # E[max of 8] is half E[range of 8]
    assert straggler_factor(16384, 0.05) == pytest.approx(1.069, abs=1e-3)
    lay = Layout(dp=64, micro_batch=1)
    slow, even = (estimate(get_model("gpt3-6.7b"), H100, Training(64), lay, Assumptions(gpu_speed_spread=s))
                  for s in (0.05, 0.0))
    assert slow.time_breakdown["stragglers"] > 0 and slow.step_time_s > even.step_time_s


def test_baseline_says_whether_the_search_beats_it_beyond_the_held_out_error(capsys):
    import json

    argv = ["plan", "--model", "gpt3-6.7b", "--gpus", "64", "--global-batch", "512", "--top", "3",
            "--layout", "zero=1,recompute=full,mb=1", "--baseline", "dp=2,tp=8,pp=4,recompute=full"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Your layout dp2 tp8 pp4 z0 mb1 full 1f1b:" in out and "held-out error of ±20%" in out
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["held_out_error"] == 0.20 and doc["baseline"]["layout"]["pp"] == 4
    assert doc["baseline"]["faster"] and all("beyond_held_out_error" in f for f in doc["baseline"]["faster"])
    assert main(argv[:-1] + ["dp=16,tp=8"]) == 2
    assert "--baseline names a whole layout: it needs pp" in capsys.readouterr().err
