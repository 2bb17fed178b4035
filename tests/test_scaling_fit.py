"""Fitting scaling laws (scaletrain.scaling.fit): synthetic runs from known constants are fitted back.

The synthetic data follow L(N, D) = E + A/N^α + B/D^β exactly (or times log-normal noise): 6 IsoFLOP
budgets x 7 model sizes (1/8x to 8x the true optimum), each a training curve of 12 checkpoints. The
curves ignore the learning-rate-schedule effect of real runs, so approach 1 sees the same law.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from scaletrain.cli import main
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.scaling import fit as fitmod
from scaletrain.scaling.fit import Points, fit_all, fit_approach3, load_points, model_params
from scaletrain.scaling.laws import ParametricLaw

TRUE = ParametricLaw("true", E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
BUDGETS = (1e18, 3e18, 1e19, 3e19, 1e20, 3e20)


def synthetic(law: ParametricLaw = TRUE, sigma: float = 0.0, seed: int = 0, checkpoints: int = 12) -> Points:
    rng = np.random.default_rng(seed)
    rows = []
    for c in BUDGETS:
        n_opt = law.params_for_flops(c)
        for f in np.geomspace(1 / 8, 8, 7):
            n = n_opt * f
            d_final = c / (6 * n)
            for frac in np.geomspace(1 / 16, 1, checkpoints):
                d = d_final * frac
                loss = law.loss(n, d) * np.exp(rng.normal(0.0, sigma)) if sigma else law.loss(n, d)
                rows.append((f"C{c:g}-x{f:.3f}", n, d, 6 * n * d, loss))
    run, n, d, c, loss = zip(*rows)
    return Points(np.array(n), np.array(d), np.array(c), np.array(loss), np.array(run, dtype=object))


def write_csv(path, points: Points, with_run: bool = True) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow((["run"] if with_run else []) + ["params", "tokens", "flops", "loss"])
        for i in range(len(points)):
            row = [points.params[i], points.tokens[i], points.flops[i], points.loss[i]]
            w.writerow(([points.run[i]] if with_run else []) + [repr(float(x)) for x in row])


def test_noise_free_data_give_back_the_constants():
    """Approach 3 within 0.1 % on all five constants; approach 2 exponent within 0.002; approach 1 within
    0.01 (its envelope steps between the 7 discrete sizes of each budget)."""
    r = fit_all(synthetic(), bootstrap=0)
    p = r.approach3
    for got, want in ((p.E, 1.69), (p.A, 406.4), (p.B, 410.7), (p.alpha, 0.34), (p.beta, 0.28)):
        assert got == pytest.approx(want, rel=1e-3)
    assert r.approach2.a == pytest.approx(TRUE.a, abs=0.002)
    assert r.approach1.a == pytest.approx(TRUE.a, abs=0.01)
    assert r.approach2.b == pytest.approx(TRUE.b, abs=0.002)
    assert len(r.isoflop) == len(BUDGETS)


@pytest.mark.parametrize("law", [TRUE, ParametricLaw("epoch", 1.8172, 482.01, 2085.43, 0.3478, 0.3658)],
                         ids=["chinchilla", "epoch"])
def test_noisy_data_are_fitted_back_within_tolerance(law):
    """0.3 % log-normal noise on every loss. Approach 3: α, β within 0.02, E within 0.05, a = β/(α+β)
    within 0.015; approach 2: a within 0.01; approach 1: a within 0.025. Bootstrap 10-90 % intervals
    are reported and ordered."""
    r = fit_all(synthetic(law, sigma=0.003, seed=1), bootstrap=20, seed=0)
    p = r.approach3
    assert p.alpha == pytest.approx(law.alpha, abs=0.02)
    assert p.beta == pytest.approx(law.beta, abs=0.02)
    assert p.E == pytest.approx(law.E, abs=0.05)
    assert p.a == pytest.approx(law.a, abs=0.015)
    assert r.approach2.a == pytest.approx(law.a, abs=0.01)
    assert r.approach1.a == pytest.approx(law.a, abs=0.025)
    for lo, hi in (p.ci["a"], p.ci["alpha"], r.approach2.a_ci, r.approach1.a_ci):
        assert lo <= hi


def test_final_points_are_the_last_checkpoint_of_each_run():
    pts = synthetic()
    final = pts.final()
    assert len(final) == len(BUDGETS) * 7
    assert np.allclose(np.sort(final.flops), np.sort(np.repeat(BUDGETS, 7)), rtol=1e-12)


def test_csv_without_run_column_fits_approaches_2_and_3_and_skips_1(tmp_path):
    path = tmp_path / "final.csv"
    write_csv(path, synthetic().final(), with_run=False)
    r = fit_all(load_points(path), bootstrap=0)
    assert r.approach1 is None and "approach1" in r.skipped
    assert r.approach3.alpha == pytest.approx(0.34, rel=1e-3)
    assert r.approach2.a == pytest.approx(TRUE.a, abs=0.002)


def test_cli_fit_json_and_plots(tmp_path, capsys):
    path = tmp_path / "runs.csv"
    write_csv(path, synthetic(sigma=0.002, seed=3))
    assert main(["scaling", "fit", str(path), "--json", "--bootstrap", "10", "--plot", str(tmp_path / "p")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"points", "runs", "final_points", "approach1", "approach2", "approach3", "skipped"}
    assert out["runs"] == 42 and out["final_points"] == 42
    assert out["approach3"]["a"] == pytest.approx(TRUE.a, abs=0.02)
    for name in ("isoflop.png", "loss_vs_compute.png", "optimal_vs_compute.png"):
        assert (tmp_path / "p" / name).read_bytes()[:4] == b"\x89PNG"


def _cli_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_missing_column_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("params,tokens,loss\n1e6,1e8,3.0\n")
    assert "missing column(s) flops" in _cli_error(["scaling", "fit", str(path)], capsys)


def test_fewer_points_than_parameters_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "few.csv"
    write_csv(path, synthetic().final().subset(np.arange(5)), with_run=False)
    assert "needs more than 5 final points" in _cli_error(["scaling", "fit", str(path)], capsys)


@pytest.mark.parametrize("cell, message", [("abc", "is not a number"), ("-3", "must be positive"),
                                           ("nan", "must be positive")])
def test_bad_numbers_are_one_line_errors(tmp_path, capsys, cell, message):
    path = tmp_path / "bad.csv"
    path.write_text(f"params,tokens,flops,loss\n1e6,1e8,6e14,{cell}\n")
    assert message in _cli_error(["scaling", "fit", str(path)], capsys)


def test_requested_approach_that_the_data_cannot_support_is_an_error(tmp_path, capsys):
    path = tmp_path / "final.csv"
    write_csv(path, synthetic().final(), with_run=False)
    assert "approach 1 needs at least two training curves" in _cli_error(
        ["scaling", "fit", str(path), "--approach", "1"], capsys)
    assert "--approach must be" in _cli_error(["scaling", "fit", str(path), "--approach", "4"], capsys)


def test_flat_losses_are_a_degenerate_fit_error():
    pts = synthetic().final()
    pts.loss[:] = 3.0
    with pytest.raises(UserError, match="degenerate: alpha=0, beta=0"):
        fit_approach3(pts)


def test_non_convergence_is_a_user_error(monkeypatch):
    class Failed:
        x = np.full(5, np.nan)
        fun = np.nan
        success = False
        jac = np.full(5, np.nan)

    monkeypatch.setattr(fitmod, "minimize", lambda *a, **k: Failed())
    with pytest.raises(UserError, match="did not converge from any of 16 starting points"):
        fit_approach3(synthetic().final())


def test_run_folders_are_read_with_tokens_from_steps_and_params_from_the_model(tmp_path):
    """Two fake runs: tokens = step · global_batch · seq_len, params = the real GPT's count, C = 6ND."""
    for name, d_model in (("small", 32), ("large", 64)):
        run = tmp_path / name
        run.mkdir()
        cfg = Config()
        cfg.model.d_model, cfg.model.n_layers, cfg.model.seq_len = d_model, 2, 64
        cfg.train.global_batch = 8
        (run / "config.yaml").write_text(cfg.to_yaml())
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(1, 31):
                f.write(json.dumps({"step": step, "loss": 5.0 - d_model / 64 * np.log(step), "lr": 1e-3}) + "\n")
                if step % 10 == 0:
                    f.write(json.dumps({"step": step, "val_loss": 4.0}) + "\n")  # lines without loss are skipped
    pts = load_points(tmp_path)
    assert len(pts) == 60 and set(pts.run) == {"small", "large"}
    idx = pts.run_indices()["large"]
    cfg = Config()
    cfg.model.d_model, cfg.model.n_layers, cfg.model.seq_len = 64, 2, 64
    n = model_params(cfg.model)
    assert pts.params[idx[0]] == n
    assert np.array_equal(pts.tokens[idx], np.arange(1, 31) * 8 * 64)
    assert np.allclose(pts.flops[idx], 6 * n * pts.tokens[idx])


def test_missing_runs_path_is_an_error(tmp_path, capsys):
    assert "runs not found" in _cli_error(["scaling", "fit", str(tmp_path / "nope.csv")], capsys)
    assert "no run folders" in _cli_error(["scaling", "fit", str(tmp_path)], capsys)


def test_sweep_plan_fits_the_time_budget_and_the_limits():
    """Planning only (no training), with made-up speeds: the chosen grid's predicted time is within the
    budget, levels are 3x apart, and every run has 150+ steps and at most the token cap."""
    from scaletrain.scaling import sweep

    speed = {i: (1000 * 2**i, 2e5 / (1 + i)) for i in range(12)}  # (params, tokens/s)
    c0, runs = sweep.choose_budget(300.0, speed, 3, 5, max_tokens=5e6)
    assert sum(r.predicted_s for r in runs) <= 300.0
    assert {r.level for r in runs} == {1, 2, 3} and len(runs) >= 12
    for r in runs:
        assert r.flops == pytest.approx(c0 * 3 ** (r.level - 1), rel=0.01)
        assert 150 <= r.steps and r.tokens <= 5e6
    with pytest.raises(UserError, match="too small for a sweep"):
        sweep.choose_budget(0.01, speed, 3, 5)


@pytest.mark.slow
def test_sweep_trains_real_runs_and_fits_them(tmp_path, capsys):
    """A tiny fixed-budget sweep (2 budgets x 3 sizes, ~440 steps in all) with the real trainer: every run's
    metrics follow its plan and it learned; a second call reuses the plan and trains nothing. (The CLI's
    --minutes path only adds the timing of the ladder, which a busy machine would make slow here.)"""
    from scaletrain.scaling import sweep

    out = tmp_path / "sweep"
    lines: list[str] = []
    with sweep._torch_threads(1):
        summary = sweep.run_sweep(out, levels=2, sizes=3, flops=1.5e9, min_steps=20, log=lines.append)
    assert json.loads((out / "sweep.json").read_text()) == json.loads(json.dumps(summary))
    runs = summary["runs"]
    assert len(runs) == 6 and {r["level"] for r in runs} == {1, 2}
    pts = load_points(out / "runs")
    final = pts.final()
    for r in runs:
        idx = pts.run_indices()[r["name"]]
        assert pts.tokens[idx[-1]] == r["steps"] * 16 * 64
        assert pts.params[idx[0]] == r["params"]
        assert pts.loss[idx[-1]] < pts.loss[idx[0]]  # it learned
        assert not (out / "runs" / r["name"] / "checkpoints").exists()
    last = [json.loads((out / "runs" / r["name"] / "metrics.jsonl").read_text().splitlines()[-1]) for r in runs]
    assert all("val_loss" in x for x in last)  # one held-out evaluation at the end of every run
    assert np.all(final.loss < np.log(256))  # the final points use it: better than a uniform guess
    assert ("fit" in summary) != ("fit_error" in summary)
    if "fit" in summary:  # the sweep's page (docs/report.md); its runs write none of their own
        from scaletrain.report.page import figures_of

        assert "scaling-curves" in figures_of((out / "report.html").read_text())
    assert not any((out / "runs" / r["name"] / "report.html").exists() for r in runs)
    lines.clear()
    sweep.run_sweep(out, levels=2, sizes=3, flops=1.5e9, min_steps=20, log=lines.append)
    assert sum("already done" in x for x in lines) == 6
    capsys.readouterr()


def test_sweep_cli_rejects_bad_values(capsys):
    assert "--flops must be a positive" in _cli_error(["scaling", "sweep", "--flops", "0"], capsys)
    assert "--minutes must be positive" in _cli_error(["scaling", "sweep", "--minutes", "0"], capsys)
    assert "--levels must be >= 2" in _cli_error(["scaling", "sweep", "--levels", "1"], capsys)
