"""The HTML page of scaling-law fits, in the run report's style: `scaletrain scaling sweep` writes it to
`OUT/report.html`, `scaletrain scaling fit RUNS --html FILE` anywhere.

It shows what `scaling/plots.py` draws as PNGs, interactively: every run's loss against compute (the
training curves of approach 1), the IsoFLOP profiles with their parabolas and minima (approach 2), N_opt and
D_opt against compute for our fits beside the published laws, the fitted constants, and (for a sweep) the
table of runs. Figures are built from the same `Points` and `FitReport` the text output prints.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scaletrain.report import page as pg
from scaletrain.report.page import Chart, Section, Table, Text

if TYPE_CHECKING:  # importing scaling.fit pulls scipy; the page needs only the objects it is given
    from scaletrain.scaling.fit import FitReport, Points


def _log_axis(title: str) -> dict:
    return pg.axis(title, log=True)


def build(points: Points, report: FitReport, title: str, runs: list[dict[str, Any]] | None = None) -> pg.Page:
    from scaletrain.scaling.laws import LAWS

    sections = [_fits(report)]
    if runs:
        sections.append(Section("runs", "Runs of the sweep").add(Table(
            ["name", "level", "layers x d_model", "params N", "steps", "tokens D", "compute C"],
            [[r["name"], r["level"], f"{r['n_layers']} x {r['d_model']}", f"{r['params']:,}", r["steps"],
              f"{r['tokens']:,}", f"{r['flops']:.3g}"] for r in runs], id="runs-table")))

    curves = Section("curves", "Loss against compute (approach 1: training curves and their envelope)")
    traces = []
    for i, (name, idx) in enumerate(points.run_indices().items()):
        traces.append({"type": "scatter", "mode": "lines+markers" if len(idx) > 1 else "markers", "name": str(name),
                       "x": pg.finite_list(points.flops[idx]), "y": pg.finite_list(points.loss[idx]),
                       "line": {"width": 1, "color": pg.COLOURS[i % len(pg.COLOURS)]}, "marker": {"size": 4},
                       "hovertemplate": f"{name}<br>N={points.params[idx[0]]:.3g}<br>C=%{{x:.3g}}<br>"
                                        "loss %{y:.4f}<extra></extra>"})
    from scaletrain.scaling.fit import ApproachSkipped, envelope

    try:
        env_c, _, env_loss = envelope(points)
        traces.append({"type": "scatter", "mode": "lines", "name": "lower envelope (approach 1)",
                       "x": pg.finite_list(env_c), "y": pg.finite_list(env_loss),
                       "line": {"color": "#000", "width": 3}})
    except ApproachSkipped:  # single points per run: nothing to take an envelope of
        pass
    if report.approach3 is not None:
        law = report.approach3.law()
        c = np.geomspace(points.flops.min(), points.flops.max(), 60)
        n = np.array([law.params_for_flops(x) for x in c])
        traces.append({"type": "scatter", "mode": "lines", "name": "approach 3 frontier L(N_opt, D_opt)",
                       "x": pg.finite_list(c), "y": pg.finite_list(law.loss(n, c / (6 * n))),
                       "line": {"dash": "dash", "color": "#c44e52", "width": 2}})
    curves.add(Chart("scaling-curves", traces, {"title": {"text": "loss vs compute C = 6ND, one line per run"},
                                                "xaxis": _log_axis("compute (FLOPs)"), "yaxis": pg.axis("loss"),
                                                "hovermode": "closest", "showlegend": len(traces) <= 20,
                                                "margin": {"t": 40}}, 420))
    sections.append(curves)

    iso = Section("isoflop", "IsoFLOP profiles (approach 2)")
    if report.isoflop:
        traces = []
        for i, curve in enumerate(report.isoflop):
            colour = pg.COLOURS[i % len(pg.COLOURS)]
            traces.append({"type": "scatter", "mode": "markers", "name": f"C = {curve.flops:.3g}",
                           "x": pg.finite_list(curve.params), "y": pg.finite_list(curve.loss),
                           "marker": {"color": colour, "size": 7}, "legendgroup": str(i)})
            x = np.linspace(np.log(curve.params.min()), np.log(curve.params.max()), 60)
            traces.append({"type": "scatter", "mode": "lines", "name": f"parabola C = {curve.flops:.3g}",
                           "x": pg.finite_list(np.exp(x)), "y": pg.finite_list(np.polyval(curve.coef, x)),
                           "line": {"color": colour, "width": 1}, "showlegend": False, "legendgroup": str(i)})
            if curve.n_opt is not None:
                traces.append({"type": "scatter", "mode": "markers", "name": f"minimum C = {curve.flops:.3g}",
                               "x": [pg.finite(curve.n_opt)],
                               "y": [pg.finite(float(np.polyval(curve.coef, math.log(curve.n_opt))))],
                               "marker": {"symbol": "star", "size": 13, "color": colour,
                                          "line": {"color": "#000", "width": 1}},
                               "showlegend": False, "legendgroup": str(i)})
        iso.add(Chart("scaling-isoflop", traces, {"title": {"text": "final loss vs N at fixed compute; star = "
                                                            "parabola minimum"},
                                                  "xaxis": _log_axis("parameters N"), "yaxis": pg.axis("final loss"),
                                                  "hovermode": "closest", "margin": {"t": 40}}, 420))
    else:
        iso.add(Text(report.skipped.get("approach2", "No IsoFLOP groups in these runs."), "note"))
    sections.append(iso)

    opt = Section("optimal", "Compute-optimal N and D: our fits and the published laws")
    c = np.geomspace(float(points.flops.min()), float(points.flops.max()), 50)
    n_tr, d_tr = [], []
    fits = [(f"fit approach {f.approach}", f.law()) for f in (report.approach1, report.approach2) if f is not None]
    if report.approach3 is not None:
        fits.append(("fit approach 3", report.approach3.law()))
    for i, (label, law) in enumerate([(f"published {k}", v) for k, v in LAWS.items()] + fits):
        published = label.startswith("published")
        n = np.array([law.params_for_flops(x) for x in c])
        style = {"dash": "dot" if published else "solid", "width": 1 if published else 2.5,
                 "color": pg.COLOURS[i % len(pg.COLOURS)]}
        n_tr.append({"type": "scatter", "mode": "lines", "name": label, "x": pg.finite_list(c),
                     "y": pg.finite_list(n), "line": style, "legendgroup": label})
        d_tr.append({"type": "scatter", "mode": "lines", "name": label, "x": pg.finite_list(c),
                     "y": pg.finite_list(c / (6 * n)), "line": style, "legendgroup": label, "showlegend": False})
    opt.add([Chart("scaling-n-opt", n_tr, {"title": {"text": "N_opt(C)"}, "xaxis": _log_axis("compute (FLOPs)"),
                                           "yaxis": _log_axis("parameters"), "margin": {"t": 40}}, 420),
             Chart("scaling-d-opt", d_tr, {"title": {"text": "D_opt(C)"}, "xaxis": _log_axis("compute (FLOPs)"),
                                           "yaxis": _log_axis("tokens"), "margin": {"t": 40}}, 420)])
    sections.append(opt)
    subtitle = (f"{report.points} points, {report.runs} runs, {report.final_points} final points; compute "
                f"{points.flops.min():.3g} to {points.flops.max():.3g} FLOPs")
    return pg.Page(title, subtitle, sections)


def _fits(report: FitReport) -> Section:
    s = Section("fits", "Fitted laws")
    rows = []
    p = report.approach3
    if p is not None:
        law = f"L = {p.E:.4g} + {p.A:.4g}/N^{p.alpha:.4f} + {p.B:.4g}/D^{p.beta:.4f}"
        rows.append(["approach 3 (parametric)", law, f"{p.a:.3f}", f"{p.b:.3f}"])
    for f, what in ((report.approach2, "approach 2 (IsoFLOP parabolas)"),
                    (report.approach1, "approach 1 (training-curve envelope)")):
        if f is not None:
            rows.append([what, f"N_opt = {f.k:.4g} C^{f.a:.3f}, D_opt = {f.kd:.4g} C^{f.b:.3f}", f"{f.a:.3f}",
                         f"{f.b:.3f}"])
    s.add(Table(["fit", "law", "a (N_opt ~ C^a)", "b (D_opt ~ C^b)"], rows, id="fits-table"))
    for k, reason in report.skipped.items():
        s.add(Text(f"{k.replace('approach', 'approach ')} skipped: {reason}", "note"))
    return s


def write_scaling_page(points: Points, report: FitReport, path: str | os.PathLike, title: str,
                       runs: list[dict[str, Any]] | None = None) -> Path:
    return pg.write(build(points, report, title, runs), path)
