"""The HTML report of one run (`OUT/report.html`): is it training, is it fast, where did memory and time go,
and did the plan hold?

Sections, in order (docs/report.md says where every number comes from): summary, loss, optimizer (learning
rate, gradient norm, loss scale and skipped steps), throughput (tokens/s, step time, MFU), memory (per rank,
measured next to the planner, and the peak), communication (bytes per collective kind, time where
measured), pipeline (measured and simulated timelines, bubble), mixture of experts (load, dropped tokens,
auxiliary losses), profiler traces, fault-tolerant replica groups (failures, steps and tokens lost, heals;
report/replicas.py), and the run itself (command, layout, devices, versions, config).
A section that does not apply to the run says so in one line, so every page has the same sections.
"""

from __future__ import annotations

import os
from pathlib import Path

from scaletrain.config.sizes import moe_layers
from scaletrain.parallel.pipeline.draw import OP_COLOURS, OP_LABELS
from scaletrain.parallel.pipeline.schedules import rank_chunk_to_stage
from scaletrain.report import page as pg
from scaletrain.report.page import Chart, Link, Section, Table, Text, finite_list, line_chart, series
from scaletrain.report.replicas import replicas_section
from scaletrain.report.run_data import (
    MEM_CATEGORIES,
    Peak,
    RunData,
    median,
    mfu,
    model_flops_per_token,
    planned_memory,
    rank_stage,
)

SECTIONS = ("summary", "loss", "optimizer", "throughput", "memory", "communication", "pipeline", "moe",
            "profile", "replicas", "run")
MiB = float(1 << 20)
REPORT_HTML = "report.html"


def build(run: RunData, peak: Peak | None, report_path: Path) -> pg.Page:
    flops = model_flops_per_token(run.cfg)
    sections = [
        summary(run, peak, flops), loss(run), optimizer(run), throughput(run, peak, flops), memory(run),
        communication(run), pipeline(run), moe(run), profile(run, report_path), replicas_section(run),
        run_section(run),
    ]
    c, p = run.cfg, run.cfg.parallel
    last = run.rows[-1]["step"] if run.rows else 0
    subtitle = (f"{run.out} - {last} of {c.train.steps} steps - {run.world_size} rank(s): dp={p.dp} tp={p.tp} "
                f"pp={p.pp} ep={p.ep} zero={p.zero} - {c.model.n_layers} layers x d_model {c.model.d_model}"
                f"{f', {c.model.moe.experts} experts' if c.model.moe.experts else ''} - {c.train.dtype}")
    return pg.Page(f"scaletrain run report: {run.out.name or run.out}", subtitle, sections)


# --------------------------------------------------------------------------- sections


def summary(run: RunData, peak: Peak | None, flops: float) -> Section:
    s = Section("summary", "Summary")
    if not run.rows:
        return s.add(Text("No metrics yet: metrics.jsonl has no complete line (the report is refreshed at each "
                          "checkpoint and at the end of the run).", "note"))
    first, last = run.rows[0], run.rows[-1]
    _, val = run.column("val_loss")
    _, tps = run.column("tokens_per_s")
    _, peaks = run.column("mem_peak")
    med_tps = median(tps)
    rows: list[list] = [
        ["steps", f"{last['step']} of {run.cfg.train.steps}"],
        ["training loss", f"{pg.fmt(first['loss'])} (step {first['step']}) -> {pg.fmt(last['loss'])} "
                          f"(step {last['step']})"],
        ["validation loss (last, best)", f"{pg.fmt(val[-1])}, {pg.fmt(min(val))}" if val else "not evaluated"],
        ["tokens seen", f"{last['step'] * run.tokens_per_step:,}"],
        ["tokens/s (median of logged steps)", f"{med_tps:,.0f}" if med_tps is not None else "-"],
        ["model FLOPs per token", pg.fmt(flops)],
    ]
    if peak is not None and med_tps is not None:
        rows.append(["MFU (median)", f"{mfu(med_tps, flops, run.world_size, peak):.2%}"])
    if peaks:
        rows.append(["peak memory per rank (max over ranks)", f"{max(peaks) / MiB:,.1f} MiB"])
    skipped = sum(1 for r in run.rows if r.get("skipped"))
    rows.append(["skipped steps (logged)", str(skipped)])
    fp8 = next((x["fp8"] for x in reversed(run.sessions()) if "fp8" in x), None)
    if fp8 is not None:  # train.precision=fp8: what ran in float8 (run_info.json, written by the ranks)
        from scaletrain.memory.fp8_layers import describe

        rows.append(["FP8 layers", f"{describe(fp8['layers'], run.cfg.model)} ({fp8['recipe']} scaling, "
                                   f"{fp8['gemm']} GEMMs); embeddings, output layer, norms and attention in bf16/fp32"])
    return s.add(Table(["", "value"], rows, id="summary-table"))


def loss(run: RunData) -> Section:
    s = Section("loss", "Loss")
    steps, train = run.column("loss")
    vsteps, val = run.column("val_loss")
    traces = [series(steps, train, "train")]
    if val:
        traces.append(series(vsteps, val, "validation", mode="lines+markers"))
    csteps, ce = run.column("loss_ce")
    if ce:
        traces.append(series(csteps, ce, "train cross-entropy (MoE: without aux/z losses)", visible="legendonly"))
    by_tokens = [dict(t, x=finite_list(run.tokens(t["x"]))) for t in traces]
    marks = run.resumes()
    s.add([line_chart("loss-step", "loss vs optimizer step", "step", "nats / token", traces,
                      **_resume_marks(marks, lambda k: k)),
           line_chart("loss-tokens", "loss vs tokens", "tokens", "nats / token", by_tokens,
                      **_resume_marks(marks, lambda k: k * run.tokens_per_step))])
    if not steps:
        s.add(Text("No metrics yet.", "note"))
    if marks:
        s.add(Text("Dashed lines: where the run resumed from a checkpoint (resumes.jsonl), with the settings that "
                   "invocation changed. " + "; ".join(f"step {m['from_step']}: {_changes(m)}" for m in marks) + ".",
                   "note"))
    return s


def _changes(mark: dict) -> str:
    changed = mark.get("changed") or {}
    layout = mark.get("layout")
    parts = [f"layout {layout.get('from')} -> {layout.get('to')}"] if isinstance(layout, dict) else []
    parts += [f"{k} {v[0]} -> {v[1]}" for k, v in changed.items() if isinstance(v, list) and len(v) == 2]
    return "resumed with " + ", ".join(parts) if parts else "resumed, same settings"


def _resume_marks(marks: list[dict], x_of) -> dict:
    """Plotly shapes and labels: one dashed vertical line per resume, labelled "resumed" or "layout changed"
    (the resume recorded a layout change, train/resume.py)."""
    shapes, notes = [], []
    for m in marks:
        x = x_of(m["from_step"])
        layout = "layout" in m or any(k.startswith("parallel.") for k in m.get("changed") or {})
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
                       "line": {"dash": "dash", "color": pg.COLOURS[3] if layout else "#555", "width": 1}})
        notes.append({"xref": "x", "yref": "paper", "x": x, "y": 1, "yanchor": "bottom", "showarrow": False,
                      "text": "layout changed" if layout else "resumed", "font": {"size": 10}})
    return {"shapes": shapes, "annotations": notes} if marks else {}


def optimizer(run: RunData) -> Section:
    s = Section("optimizer", "Optimizer: learning rate, gradient norm, loss scale, skipped steps")
    lsteps, lr = run.column("lr")
    gsteps, gn = run.column("grad_norm")
    charts = [line_chart("lr", "learning rate", "step", "lr", [series(lsteps, lr, "lr")]),
              line_chart("grad-norm", "gradient norm (before clipping)", "step", "global L2 norm",
                         [series(gsteps, gn, "grad norm")], log_y=True)]
    skipped = [r["step"] for r in run.rows if r.get("skipped")]
    ssteps, scale = run.column("loss_scale")
    if scale:
        traces = [series(ssteps, scale, "loss scale", line={"shape": "hv", "width": 1.5, "color": pg.COLOURS[0]})]
        at = {r["step"]: r.get("loss_scale") for r in run.rows}
        traces.append(series(skipped, [at[k] for k in skipped], "skipped step (overflow)", mode="markers",
                             marker={"color": pg.COLOURS[3], "size": 8, "symbol": "x"}))
        charts.append(line_chart("loss-scale", "fp16 dynamic loss scale and skipped steps", "step", "scale",
                                 traces, log_y=True))
    elif skipped:
        tsteps, total = run.column("skipped_total")
        charts.append(line_chart("skipped", "skipped steps (train.on_nan=skip)", "step", "skipped so far",
                                 [series(tsteps, total, "skipped so far", mode="lines+markers")]))
    s.add(charts)
    if not scale:
        s.add(Text(f"No loss scaling: it is used with train.dtype=fp16 only (this run: {run.cfg.train.dtype}). "
                   + (f"Skipped steps: {', '.join(map(str, skipped))}." if skipped else "No step was skipped."),
                   "note"))
    return s


def throughput(run: RunData, peak: Peak | None, flops: float) -> Section:
    s = Section("throughput", "Throughput: tokens/s, step time, MFU")
    steps, tps = run.column("tokens_per_s")
    tsteps, st = run.column("step_time_s")
    traces = [series(steps, tps, "tokens/s")]
    layout = {}
    if peak is not None:
        traces.append(series(steps, [mfu(x, flops, run.world_size, peak) for x in tps], "MFU", yaxis="y2"))
        layout["yaxis2"] = pg.fit_axis(pg.axis("MFU", overlaying="y", side="right", tickformat=".1%",
                                               hoverformat=".2%"), pg.y_values(traces, "y2"), zero=True)
    s.add([line_chart("tokens-per-s", "tokens/s per logged step" + (" and MFU" if peak else ""), "step",
                      "tokens / s", traces, zero=True, y_format=",.0f", **layout),
           line_chart("step-time", "step time", "step", "seconds", [series(tsteps, st, "step time")], zero=True,
                      y_format=".3~g")])
    if peak is not None:
        s.add(Text(f"MFU = tokens/s x {pg.fmt(flops)} model FLOPs per token (planner) / ({run.world_size} ranks x "
                   f"{pg.fmt(peak.flops)} FLOP/s); peak: {peak.source}.", "note"))
    else:
        s.add(Text("MFU needs the device's peak FLOP/s: for CPU runs give `scaletrain report run OUT --calibrate` "
                   "(measures this machine) or --peak-flops / --gpu.", "note"))
    return s


def memory(run: RunData) -> Section:
    s = Section("memory", "Memory per rank: measured vs planned")
    plan = planned_memory(run.cfg)
    ranks = run.memory_ranks
    if not ranks and run.rows and any(f"mem_{c}" in run.rows[-1] for c in MEM_CATEGORIES):
        last = next(r for r in reversed(run.rows) if "mem_params" in r)  # older runs: max over ranks only
        ranks = [{"rank": "max", **{k: v for k, v in last.items() if k.startswith("mem_")}}]
    if not ranks:
        return s.add(Text("No memory measured yet (it is measured after the first step).", "note"))
    xs_rank, xs_kind, per_cat = [], [], {c: [] for c in MEM_CATEGORIES}
    rows = []
    for r in ranks:
        label = f"rank {r['rank']}"
        if not plan.stages:
            planned: dict = {}
        elif isinstance(r["rank"], int):
            planned = plan.stages[rank_stage(run.cfg, r["rank"])]
        else:  # the max over ranks of each category, as the metrics hold it
            planned = {c: max(st[c] for st in plan.stages) for c in plan.stages[0]}
        xs_rank += [label, label]
        xs_kind += ["measured", "planned"]
        for c in MEM_CATEGORIES:
            per_cat[c] += [r.get(f"mem_{c}"), planned.get(c)]
            rows.append([label, c, _mib(r.get(f"mem_{c}")), _mib(planned.get(c))])
    traces = [{"type": "bar", "name": c, "x": [xs_rank, xs_kind], "y": [_mib_num(v) for v in per_cat[c]],
               "marker": {"color": pg.COLOURS[i]},
               "hovertemplate": f"{c}: %{{y:.3f}} MiB<extra>%{{x}}</extra>"} for i, c in enumerate(MEM_CATEGORIES)]
    s.add(Chart("memory-ranks", traces, {"title": {"text": "bytes per category, measured after the first step "
                                                   "next to the planner's prediction"},
                                         "barmode": "stack", "yaxis": pg.axis("MiB"), "margin": {"t": 40},
                                         "legend": {"orientation": "h", "y": -0.3}}, 380))
    psteps, peak = run.column("mem_peak")
    div, unit = pg.byte_unit(max((v for v in peak if pg.finite(v) is not None), default=None))
    s.add(line_chart("memory-peak", "peak memory (max over ranks)", "step", unit,
                     [series(psteps, pg.in_unit(peak, div), "peak")], zero=True, y_format=",.4~r"))
    s.add(Table(["rank", "category", "measured MiB", "planned MiB"], rows, id="memory-table"))
    notes = ["Measured: bytes of the tensors each rank holds per category after its first step "
             "(device/accounting.py); planned: plan.exact.run_memory for the rank's pipeline stage. Peak: "
             + ("torch.cuda.max_memory_allocated." if "cuda" in run.device_types() else
                "the process's maximum resident set size (ru_maxrss), which includes the Python interpreter "
                "and torch itself.")]
    if plan.error:
        notes.append(plan.error)
    elif plan.stages and "activations" not in plan.stages[0]:
        notes.append("The planner does not model activations for this run (activation compression, or MoE "
                     "router noise / random routing / expert dropout).")
    return s.add(Text(" ".join(notes), "note"))


def communication(run: RunData) -> Section:
    s = Section("communication", "Communication: bytes per collective kind, time where measured")
    kinds = run.comm_kinds()
    charts = []
    if kinds:
        columns = [run.column(k) for k in kinds]
        div, unit = pg.byte_unit(max((v for _, vs in columns for v in vs if pg.finite(v) is not None), default=None))
        traces = [series(steps, pg.in_unit(v, div), k.removeprefix("comm_").removesuffix("_bytes"))
                  for k, (steps, v) in zip(kinds, columns)]
        charts.append(line_chart("comm-bytes", "bytes sent by rank 0 per step, per collective kind", "step",
                                 unit, traces, zero=True, y_format=",.4~r"))
    timed = []
    asteps, a2a = run.column("moe_all_to_all_s")
    if a2a:
        timed.append(series(asteps, a2a, "expert all-to-all (mean over ranks)"))
    if timed:
        charts.append(line_chart("comm-time", "time in communication per step", "step", "seconds", timed))
    if charts:
        s.add(charts)
    if kinds:
        s.add(Table(["collective kind", "bytes per step (median)", "bytes per step (last)"],
                    [[k.removeprefix("comm_").removesuffix("_bytes"), pg.fmt(median(run.column(k)[1]) or 0.0),
                      f"{run.column(k)[1][-1]:,}"] for k in kinds], id="comm-table"))
    else:
        s.add(Text("No collective moved bytes: a single-rank layout (or no metrics yet).", "note"))
    notes = ["Bytes are counted by scaletrain.distributed.comm with the ring algorithm's factors, as sent by rank 0."]
    if not timed:
        notes.append("Time in communication is measured for the expert all-to-all only (MoE with ep > 1); "
                     "this run has none.")
    if run.trace is not None:
        notes.append(f"Pipeline messages: median {run.trace.message_latency() * 1e3:.3f} ms from the end of the "
                     "producing op to the start of a waiting consumer (measured step).")
    return s.add(Text(" ".join(notes), "note"))


def _gantt(id: str, title: str, events, p: int, time_scale: float = 1e3, schedule: str | None = None) -> Chart:
    """Horizontal bars, one trace per op kind, rank 0 on top; hover: op, micro-batch, stage, duration."""
    by_op: dict[str, list] = {}
    for e in events:
        by_op.setdefault(e.name, []).append(e)
    traces = []
    for op, evs in by_op.items():
        traces.append({
            "type": "bar", "orientation": "h", "name": OP_LABELS.get(op, op),
            "y": [f"rank {e.rank}" for e in evs],
            "base": [e.start_s * time_scale for e in evs],
            "x": [(e.end_s - e.start_s) * time_scale for e in evs],
            "customdata": [[OP_LABELS.get(op, op), e.microbatch, rank_chunk_to_stage(e.rank, e.chunk, p, schedule),
                            e.chunk, (e.end_s - e.start_s) * time_scale] for e in evs],
            "hovertemplate": "%{customdata[0]}<br>micro-batch %{customdata[1]}<br>stage %{customdata[2]} "
                             "(chunk %{customdata[3]})<br>%{customdata[4]:.3f} ms<extra>%{y}</extra>",
            "marker": {"color": OP_COLOURS.get(op, pg.COLOURS[len(traces) % len(pg.COLOURS)]),
                       "line": {"color": "#222", "width": 0.5}},
        })
    layout = {"title": {"text": title}, "barmode": "overlay", "xaxis": pg.axis("ms from the step's first op"),
              "yaxis": {"autorange": "reversed", "categoryorder": "array",
                        "categoryarray": [f"rank {r}" for r in range(p)]},
              "legend": {"orientation": "h", "y": -0.3}, "margin": {"t": 40}, "hovermode": "closest"}
    return Chart(id, traces, layout, 120 + 45 * p)


def pipeline(run: RunData) -> Section:
    s = Section("pipeline", "Pipeline: measured timeline, simulated timeline, bubble")
    p = run.cfg.parallel
    if p.pp == 1:
        return s.add(Text("This run has no pipeline parallelism (parallel.pp = 1).", "note"))
    if run.trace is None:
        return s.add(Text(run.trace_error or "The measured timeline (pipeline_trace.json, one traced step) is "
                          "written at the end of the run.", "note"))
    tr = run.trace
    pred = tr.predicted()
    measured = tr.shifted()
    s.add(_gantt("pp-measured", f"measured: {tr.schedule}, pp={tr.p}, micro-batches={tr.m}"
                 f"{f', virtual stages={tr.v}' if tr.v > 1 else ''}", measured, tr.p, schedule=tr.schedule))
    s.add(_gantt("pp-simulated", "simulated from the measured per-op times (parallel/pipeline/simulate.py)",
                 pred.events, tr.p, schedule=tr.schedule))
    bm, bp = tr.bubble_per_rank(), pred.bubble_per_rank
    labels = [f"rank {r}" for r in range(tr.p)]
    s.add(Chart("pp-bubble", [{"type": "bar", "name": "measured", "x": labels, "y": finite_list(bm),
                               "marker": {"color": pg.COLOURS[0]}},
                              {"type": "bar", "name": "simulated", "x": labels, "y": finite_list(bp),
                               "marker": {"color": pg.COLOURS[1]}}],
                {"title": {"text": "bubble per rank: 1 - busy / makespan"}, "barmode": "group",
                 "yaxis": pg.axis("bubble fraction", tickformat=".0%"), "margin": {"t": 40}}, 300))
    t_f, t_b, t_w = tr.op_times()
    rows = [[f"rank {r}", f"{bm[r]:.4f}", f"{bp[r]:.4f}",
             ", ".join(f"{x * 1e3:.3f}" for x in t_f[r]), ", ".join(f"{x * 1e3:.3f}" for x in t_b[r]),
             ", ".join(f"{x * 1e3:.3f}" for x in t_w[r])] for r in range(tr.p)]
    s.add(Table(["rank", "bubble measured", "bubble simulated", "F ms (per chunk)", "B ms", "W ms"], rows,
                id="pp-table"))
    return s.add(Text(f"Step makespan {tr.makespan * 1e3:.3f} ms measured, {pred.makespan * 1e3:.3f} ms simulated; "
                      f"mean bubble {tr.bubble:.4f} measured, {pred.bubble:.4f} simulated. The traced step is the "
                      "executor's second (the first pays one-off costs).", "note"))


def moe(run: RunData) -> Section:
    s = Section("moe", "Mixture of experts: expert load, dropped tokens, auxiliary losses")
    if not run.cfg.model.moe.experts:
        return s.add(Text("This run has no mixture-of-experts layers (model.moe.experts = 0).", "note"))
    rows = [r for r in run.rows if r.get("moe_load")]
    if not rows:
        return s.add(Text("No MoE statistics logged yet.", "note"))
    steps = [r["step"] for r in rows]
    layers = moe_layers(run.cfg.model)  # the block index of each MoE layer, in the order metrics list them
    charts = []
    for li, layer in enumerate(layers):
        n = len(rows[0]["moe_load"][li])
        traces = [series(steps, [r["moe_load"][li][e] for r in rows], f"expert {e}") for e in range(n)]
        traces.append(series([steps[0], steps[-1]], [1 / n, 1 / n], "uniform 1/E",
                             line={"dash": "dot", "color": "#000", "width": 1}))
        charts.append(line_chart(f"moe-load-{li}", f"block {layer}: fraction of routed tokens per expert", "step",
                                 "fraction", traces))
    charts.append(line_chart("moe-dropped", "dropped fraction (over capacity) per MoE block", "step",
                             "fraction of assignments",
                             [series(steps, [r["moe_dropped_frac"][li] for r in rows], f"block {layer}")
                              for li, layer in enumerate(layers)]))
    aux = [series(*run.column(k), k) for k in ("loss_aux", "loss_z") if run.column(k)[1]]
    if aux:
        charts.append(line_chart("moe-losses", "router losses (unweighted)", "step", "value", aux))
    s.add(charts)
    w = run.cfg.model.moe
    return s.add(Text(f"Load: fraction of the step's routing assignments each expert received, before capacity "
                      f"(router {w.router}, top_k {w.top_k}, capacity factor {w.capacity_factor}); dropped: "
                      "assignments over an expert's capacity. Both summed over all ranks.", "note"))


def profile(run: RunData, report_path: Path) -> Section:
    s = Section("profile", "Profiler traces")
    if not run.profiles:
        return s.add(Text("No profiler traces: set train.profile_steps=a:b to record torch.profiler traces of "
                          "steps a..b on every rank into OUT/profile/.", "note"))
    base = report_path.resolve().parent
    rows = [[Link(Path(os.path.relpath(p.resolve(), base)).as_posix(), p.name), f"{p.stat().st_size / MiB:.2f}"]
            for p in run.profiles]
    s.add(Table(["trace (Chrome / Perfetto JSON)", "MiB"], rows, id="profile-table"))
    return s.add(Text("Open a trace in ui.perfetto.dev or chrome://tracing (the file stays on your machine).",
                      "note"))


def run_section(run: RunData) -> Section:
    s = Section("run", "The run: command, layout, devices, versions, config")
    c, p = run.cfg, run.cfg.parallel
    layout = [["world size", run.world_size], ["dp", p.dp], ["tp", p.tp], ["pp", p.pp], ["ep", p.ep],
              ["zero", p.zero], ["sequence parallel", p.sequence_parallel]]
    if p.cp > 1:  # context parallelism (docs/context_parallel.md)
        layout += [["cp", p.cp], ["cp mode", p.cp_mode]]
    if p.pp > 1:
        layout += [["schedule", p.schedule], ["micro-batches", p.microbatches or c.grad_accum],
                   ["virtual stages", p.virtual_stages]]
    layout += [["global batch x seq len", f"{c.train.global_batch} x {c.model.seq_len}"],
               ["micro batch", c.train.micro_batch], ["dtype", c.train.dtype], ["output", str(run.out)]]
    s.add(Table(["layout", ""], layout, id="layout-table"))
    sessions = run.sessions()
    if sessions:
        s.add(Table(["started", "command", "world size", "launcher"],
                    [[x.get("started", ""), x.get("command", ""), x.get("world_size", ""), x.get("launcher", "")]
                     for x in sessions], id="sessions-table"))
        last = sessions[-1]
        s.add(Table(["rank", "host", "device", "device name", "pipeline stage"],
                    [[r.get("rank"), r.get("host", ""), r.get("device", ""), r.get("device_name", ""),
                      rank_stage(c, int(r.get("rank", 0)))] for r in last.get("ranks", [])], id="devices-table"))
        s.add(Table(["package", "version"], [[k, v] for k, v in last.get("versions", {}).items()],
                    id="versions-table"))
    else:
        s.add(Text("run_info.json is missing (a run from an older scaletrain): no command, devices or versions.",
                   "note"))
    if run.tb_dir is not None:
        s.add(Text(f"TensorBoard event files: {run.tb_dir} (tensorboard --logdir {run.tb_dir})."))
    return s.add(Text(c.to_yaml(), "pre"))


def _mib(v) -> str:
    return "-" if v is None else f"{v / MiB:,.3f}"


def _mib_num(v) -> float | None:
    return None if v is None else pg.finite(v / MiB)


def write_report(out: str | os.PathLike, to: str | os.PathLike | None = None, peak_flops: float | None = None,
                 gpu: str | None = None, calibrate: bool = False) -> Path:
    """Write the run report of the run in `out` to `to` (default OUT/report.html); returns the path."""
    from scaletrain.report.run_data import load_run, resolve_peak

    run = load_run(out)
    path = Path(to) if to is not None else run.out / REPORT_HTML
    peak = resolve_peak(run, peak_flops, gpu, calibrate)
    return pg.write(build(run, peak, path), path)
