"""`scaletrain plan --flops-budget`: the law's N_opt, a shape of that size, the planner's best layout, and
days = C / (GPUs x achieved FLOP/s of the best layout)."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.cli import main
from scaletrain.plan import hardware
from scaletrain.plan.analytic.flops import step_flops
from scaletrain.plan.analytic.inputs import Training
from scaletrain.plan.analytic.params import param_counts, total_params
from scaletrain.plan.search import search
from scaletrain.scaling.budget import PARAMS_TOLERANCE, default_global_batch, plan_budget, shape_for_params
from scaletrain.scaling.laws import LAWS


@pytest.mark.parametrize("law", list(LAWS))
@pytest.mark.parametrize("flops", [1e20, 1e22, 5.76e23, 1e25])
def test_chosen_shape_has_the_laws_compute_optimal_size(law, flops):
    n_opt = LAWS[law].params_for_flops(flops)
    m = shape_for_params(n_opt, law)
    c = param_counts(m)
    counted = total_params(m) - (c.embedding + c.position + c.head if law == "kaplan" else 0)
    assert counted == pytest.approx(n_opt, rel=PARAMS_TOLERANCE)  # the rule's stated tolerance, 5 %
    assert 128 / 8 <= m.d_model / m.n_layers <= 128 * 8
    assert m.d_model % m.n_heads == 0 and (m.d_model < 512 or m.n_heads % 8 == 0)
    assert m.n_layers <= 16 or m.n_layers % 4 == 0


def test_days_are_the_budget_over_gpus_times_the_best_layouts_achieved_flops():
    gpu = hardware.get_gpu("h100-80gb")
    p = plan_budget(1e22, 64, gpu, "epoch")
    assert p.optimum.params == pytest.approx(LAWS["epoch"].params_for_flops(1e22), rel=1e-12)
    # the best layout, found again here: the fastest fitting candidate of the planner's search
    again = search(p.model, gpu, 64, Training(p.global_batch, "bf16", "flash", True))
    fitting = [c for c in again.candidates if c.fits]
    best = min(fitting, key=lambda c: c.step_time_s)
    assert p.best.layout == best.layout
    achieved = best.model_tflops_per_gpu * 1e12
    assert p.days == pytest.approx(1e22 / (64 * achieved) / 86400, rel=1e-12)
    # achieved FLOP/s are the planner's model FLOPs per step over the step time
    model_flops, _ = step_flops(p.model, p.global_batch * p.model.seq_len, best.layout.recompute)
    assert achieved == pytest.approx(model_flops / best.step_time_s / 64, rel=1e-9)
    assert p.tokens == pytest.approx(1e22 / (6 * p.params), rel=1e-12)


def test_default_global_batch_is_kaplans_critical_batch_rounded_to_a_power_of_two():
    # Kaplan et al.: L(C) = (3.1e8 / C_PF-days)^0.050, B_crit = 2e8 / L^(1/0.21) tokens
    for flops, seq in ((5.76e23, 2048), (1e21, 2048), (1e25, 4096)):
        loss = (3.1e8 / (flops / 8.64e19)) ** 0.05
        seqs = 2e8 / loss ** (1 / 0.21) / seq
        assert default_global_batch(flops, seq) == 2 ** round(math.log2(seqs))
    assert default_global_batch(5.76e23, 2048) == 8192  # 1.55e7 tokens


def test_plan_flops_budget_json(capsys):
    argv = ["plan", "--flops-budget", "5.76e23", "--gpus", "1024", "--gpu", "a100-80gb", "--law", "epoch", "--json",
            "--top", "2"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    b = doc["budget"]
    assert b["law"] == "epoch" and b["gpus"] == 1024
    assert b["params_optimal"] == pytest.approx(7.22e10, rel=0.01)  # docs/scaling.md table, epoch at Gopher's budget
    assert b["params"] == doc["model"]["params"]
    best = doc["candidates"][0]
    assert b["days"] == pytest.approx(5.76e23 / (1024 * best["model_tflops_per_gpu"] * 1e12) / 86400, rel=1e-12)


def test_plan_flops_budget_text(capsys):
    assert main(["plan", "--flops-budget", "1e21", "--gpus", "8", "--gpu", "h100", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "chinchilla-3" in out and "days" in out and "best layout" in out


@pytest.mark.parametrize("argv, words", [
    (["--flops-budget=0", "--gpus", "8"], "positive"),
    (["--flops-budget=-1e21", "--gpus", "8"], "positive"),
    (["--flops-budget", "lots", "--gpus", "8"], "a number"),
    (["--flops-budget", "1e21", "--gpus", "8", "--law", "moore"], "unknown scaling law"),
    (["--flops-budget", "1e21"], "--gpus is required"),
    (["--flops-budget", "1e21", "--gpus", "0"], "--gpus must be >= 1"),
    (["--flops-budget", "1e21", "--gpus", "8", "--model", "gpt2"], "do not also give --model"),
    (["--flops-budget", "1e21", "--gpus", "8", "--global-batch", "0"], "--global-batch"),
    (["--flops-budget", "1e30", "--gpus", "8"], "no layout"),
])
def test_plan_flops_budget_bad_input_exits_2(argv, words, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
