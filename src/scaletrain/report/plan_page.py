"""The HTML page of `scaletrain plan ... --html FILE`, in the run report's style.

Built from the planner's `--json` document (`plan.report.to_json`, plus the budget or run-prediction fields
that `plan --flops-budget` and `plan --config` add), so the page and the JSON always show the same numbers:
the model, cluster and training settings; the ranked layouts as a table; memory per GPU by category as
stacked bars with the GPU's capacity; the step time broken into its parts; bytes moved per step by each
parallel dimension; and why the best layout beats the runner-up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from scaletrain.report import page as pg
from scaletrain.report.page import Chart, Section, Table, Text

GiB = float(1 << 30)
MEM_KEYS = ("params", "grads", "optimizer", "activations", "buffers")


def _layout(c: dict[str, Any]):
    from scaletrain.plan.analytic.inputs import Layout

    fields = Layout.__dataclass_fields__
    return Layout(**{k: v for k, v in c["layout"].items() if k in fields})


def layout_label(c: dict[str, Any]) -> str:
    """A candidate's layout in the console table's notation (`Estimate.label`: `dp8 tp2 pp4 z1 mb2 none 1f1b`,
    with the blocks per stage when they differ), so that the page and `scaletrain plan` read alike."""
    from scaletrain.plan.analytic.stages import run_length

    blocks = tuple(c.get("blocks_per_stage") or ())
    text = _layout(c).short()
    return text + f" [{run_length(blocks)}]" if len(set(blocks)) > 1 else text


def legend(cands: list[dict[str, Any]]) -> str:
    """The legend of the notation of `layout_label` (the console table's, plan/report.layout_legend)."""
    from scaletrain.plan.report import layout_legend

    return layout_legend([_layout(c) for c in cands], any(len(set(c.get("blocks_per_stage") or ())) > 1
                                                          for c in cands))


def build(doc: dict[str, Any], explanation: str = "", command: str = "") -> pg.Page:
    from scaletrain.plan.report import sig

    model, cluster, cands = doc.get("model", {}), doc.get("cluster", {}), doc.get("candidates", [])
    gpu = cluster.get("gpu", {})
    # bars are labelled by rank (#1, #2, ...) with the layout in the hover and in the table above: long layout
    # labels on a category axis get rotated and cut off
    labels = [f"#{i}" for i in range(1, len(cands) + 1)]
    hover = [layout_label(c) for c in cands]
    sections = [_setting(doc, command)]

    ranked = Section("layouts", "Layouts, best first")
    has_time = any("step_time_s" in c for c in cands)
    header = ["#", "layout", "fits"] + [f"{k} GiB" for k in MEM_KEYS] + ["total GiB"]
    if has_time:
        header += ["step s", "tokens/s", "MFU", "bubble", "dominant cost"]
    rows = []
    for i, c in enumerate(cands, 1):
        mem = c["memory_bytes"]
        row = [i, layout_label(c), "yes" if c["fits"] else "no"]
        row += [f"{mem.get(k, 0) / GiB:.3f}" for k in MEM_KEYS] + [f"{mem['total'] / GiB:.3f}"]
        if has_time:
            row += [sig(c["step_time_s"]), f"{c['tokens_per_s']:,.0f}", f"{c['mfu']:.1%}",
                    f"{c['bubble_fraction']:.1%}", c.get("dominant_cost", "")]
        rows.append(row)
    ranked.add(Table(header, rows, id="layouts-table"))
    if cands:
        ranked.add(Text(legend(cands)))
    if explanation:
        ranked.add(Text(explanation))
    sections.append(ranked)

    mem = Section("memory", "Memory per GPU by category")
    traces = [{"type": "bar", "name": k, "x": labels,
               "y": [pg.finite(c["memory_bytes"].get(k, 0) / GiB) for c in cands],
               "marker": {"color": pg.COLOURS[i]}, **_hover(hover, k, "%{y:,.3f} GiB")}
              for i, k in enumerate(MEM_KEYS)]
    layout = {"title": {"text": "planned bytes per GPU (GiB)"}, "barmode": "stack",
              "xaxis": pg.axis("layout (# in the table above)", type="category"),
              "yaxis": pg.axis("GiB", rangemode="tozero"),
              "margin": {"t": 40}, "legend": {"orientation": "h", "y": -0.35}}
    if gpu.get("memory_bytes"):
        cap = gpu["memory_bytes"] / GiB
        layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": cap, "y1": cap,
                             "line": {"dash": "dash", "color": "#000", "width": 1}}]
        layout["annotations"] = [{"xref": "paper", "x": 1, "y": cap, "text": f"{gpu.get('name', 'GPU')} memory "
                                  f"{cap:.1f} GiB", "showarrow": False, "yanchor": "bottom", "xanchor": "right"}]
    mem.add(Chart("plan-memory", traces, layout, 400))
    sections.append(mem)

    if has_time:
        time_s = Section("time", "Step time and communication")
        parts: list[str] = []
        for c in cands:
            parts += [k for k in c.get("time_breakdown_s", {}) if k not in parts]
        t_traces = [{"type": "bar", "name": k, "x": labels,
                     "y": [pg.finite(c.get("time_breakdown_s", {}).get(k, 0.0)) for c in cands],
                     "marker": {"color": pg.COLOURS[i % len(pg.COLOURS)]}, **_hover(hover, k, "%{y:.4~g} s")}
                    for i, k in enumerate(parts)]
        dims: list[str] = []
        for c in cands:
            dims += [k for k in c.get("comm_bytes_per_step", {}) if k not in dims]
        div, unit = pg.byte_unit(max((c.get("comm_bytes_per_step", {}).get(k, 0) for c in cands for k in dims),
                                     default=None))
        c_traces = [{"type": "bar", "name": k, "x": labels,
                     "y": pg.in_unit([c.get("comm_bytes_per_step", {}).get(k, 0) for c in cands], div),
                     "marker": {"color": pg.COLOURS[i % len(pg.COLOURS)]}, **_hover(hover, k, f"%{{y:,.4~r}} {unit}")}
                    for i, k in enumerate(dims)]
        x_axis = pg.axis("layout (# in the table above)", type="category")
        time_s.add([Chart("plan-time", t_traces, {"title": {"text": "step time by part (seconds)"},
                                                  "barmode": "stack", "xaxis": x_axis,
                                                  "yaxis": pg.axis("s", rangemode="tozero"), "margin": {"t": 40},
                                                  "legend": {"orientation": "h", "y": -0.35}}, 400),
                    Chart("plan-comm", c_traces, {"title": {"text": f"{unit} per GPU per step, by dimension"},
                                                  "barmode": "group", "xaxis": x_axis,
                                                  "yaxis": pg.axis(unit, rangemode="tozero"), "margin": {"t": 40},
                                                  "legend": {"orientation": "h", "y": -0.35}}, 400)])
        time_s.add(Text("The parts overlap where the planner says they do (e.g. data-parallel communication with "
                        "the backward); the bars show each part's own time. docs/planner.md has the formulas.",
                        "note"))
        sections.append(time_s)
    if "budget" in doc:
        sections.append(Section("budget", "Compute budget").add(
            Table(["", "value"], [[k, _value(v)] for k, v in doc["budget"].items()], id="budget-table")))
    if "run_prediction" in doc:
        rows = [[k, f"{v:,}"] for k, v in doc["run_prediction"].items()]
        if "run_step_time_s" in doc:
            rows.append(["run_step_time_s", f"{doc['run_step_time_s']:.4g}"])
        sections.append(Section("run", "This run, as the trainer will measure it").add(
            Table(["field", "bytes"], rows, id="run-table")))
    name = model.get("name", "model")
    n = model.get("params")
    size = f"{n / 1e9:,.2f}B params" if n and n >= 1e9 else (f"{n / 1e6:,.2f}M params" if n else "")
    subtitle = f"{name} {size} on {cluster.get('gpus', '?')} x {gpu.get('name', '?')}"
    return pg.Page(f"scaletrain plan: {name}", subtitle, sections)


def _hover(layouts: list[str], part: str, value: str) -> dict:
    """A bar's hover: the layout it stands for, the part, the value with its unit."""
    return {"customdata": layouts, "hovertemplate": f"%{{x}} %{{customdata}}<br>{part}: {value}<extra></extra>"}


def _setting(doc: dict[str, Any], command: str) -> Section:
    s = Section("setting", "Model, cluster, training")
    model, cluster, train = doc.get("model", {}), doc.get("cluster", {}), doc.get("training", {})
    rows = [[f"model.{k}", _value(v)] for k, v in model.items() if k != "source"]
    rows += [[f"cluster.{k}", _value(v)] for k, v in cluster.items() if k != "gpu"]
    rows += [[f"gpu.{k}", _value(v)] for k, v in cluster.get("gpu", {}).items()]
    rows += [[f"training.{k}", _value(v)] for k, v in train.items()]
    s.add(Table(["", "value"], rows, id="setting-table"))
    if command:
        s.add(Text(command, "pre"))
    return s


def _value(v: Any) -> str:
    if isinstance(v, float):
        return pg.fmt(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def write_plan_page(doc: dict[str, Any], path: str | os.PathLike, explanation: str = "", command: str = "") -> Path:
    return pg.write(build(doc, explanation, command), path)
