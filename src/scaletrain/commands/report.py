"""Subcommand `report`: pictures of a plan or a run.

`scaletrain report run OUT [--to FILE]` writes the self-contained HTML report of a run (report/run_page.py;
the trainer writes the same page to OUT/report.html at each checkpoint and at the end). `--calibrate`,
`--peak-flops` or `--gpu` give the peak FLOP/s per rank for MFU (CUDA runs find it from the device name).

`scaletrain report timeline` draws a pipeline schedule as a Gantt chart (one row per rank, white gaps are
the bubble), either as planned (`--schedule --pp --microbatches [--virtual-stages] [--t-f --t-b --t-w]`,
simulated by `scaletrain.parallel.pipeline.simulate`) or as measured in a run (`--run DIR`, from the
`pipeline_trace.json` the trainer writes when parallel.pp > 1). It prints the bubble per rank and the
peak in-flight microbatches; for a run, the measured bubble next to the simulator's prediction for the
measured per-op times. `--trace FILE` also writes the Chrome/Perfetto trace JSON of a planned schedule.
"""

from __future__ import annotations

import json
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.guards import (
    MAX_TIMELINE_OPS,
    MAX_TIMELINE_STAGES,
    bounded_int,
    check_output_file,
    check_path,
    nonneg_float,
    positive_float,
    read_input,
)


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="pictures of a plan or a run (HTML run report, pipeline timeline)")
    rsub = p.add_subparsers(dest="report_command", metavar="WHAT", parser_class=type(p))
    r = rsub.add_parser("run", help="the self-contained HTML report of a run (loss, throughput, memory, ...)")
    r.add_argument("out", metavar="OUT", help="the run's output directory (its --out)")
    r.add_argument("--to", default=None, help="HTML file to write (default OUT/report.html)")
    peak = r.add_mutually_exclusive_group()
    peak.add_argument("--calibrate", action="store_true",
                      help="MFU against this machine's measured matmul FLOP/s (for CPU runs)")
    peak.add_argument("--peak-flops", type=float, default=None, metavar="F", help="MFU against F FLOP/s per rank")
    peak.add_argument("--gpu", default=None, help="MFU against a catalog GPU's peak (scaletrain plan's names)")
    r.set_defaults(func=cmd_run)
    t = rsub.add_parser("timeline", help="pipeline schedule as a Gantt chart: planned, or measured in a run")
    t.add_argument("--run", default=None, help="a run directory (or its pipeline_trace.json): draw what was measured")
    t.add_argument("--schedule", default="1f1b", help="planned: gpipe, 1f1b, interleaved, zb-h1, 2bw, zb-v, dualpipev")
    t.add_argument("--pp", type=bounded_int(1, MAX_TIMELINE_STAGES), default=4,
                   help=f"planned: pipeline stages (ranks), at most {MAX_TIMELINE_STAGES}")
    t.add_argument("--microbatches", type=bounded_int(1), default=8, help="planned: microbatches per step")
    t.add_argument("--virtual-stages", type=bounded_int(1), default=1,
                   help="planned: model chunks per rank (interleaved; 2 for zb-v and dualpipev)")
    t.add_argument("--t-f", type=positive_float, default=1.0,
                   help="planned: forward time of one microbatch on one stage (any unit; the chart shows it)")
    t.add_argument("--t-b", type=positive_float, default=2.0,
                   help="planned: backward time (the input-gradient part when --t-w > 0)")
    t.add_argument("--t-w", type=nonneg_float, default=0.0, help="planned: weight-gradient time (split backward)")
    t.add_argument("--out", default=None,
                   help="PNG to write (default: timeline.png, or the run's pipeline_timeline.png)")
    t.add_argument("--trace", default=None, help="also write the Chrome/Perfetto trace JSON here")
    t.set_defaults(func=cmd_timeline)


def cmd_run(args) -> int:
    from scaletrain.report.run_page import write_report

    check_path(args.out, "the run")  # long parts, link loops, dangling links: one line
    if args.to is not None:
        check_path(args.to, "--to")
    if args.to is not None and not Path(args.to).is_dir():  # a folder: write_report says so itself
        check_output_file(args.to, "--to")
    path = write_report(args.out, args.to, args.peak_flops, args.gpu, args.calibrate)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def cmd_timeline(args) -> int:
    if args.run is not None:
        return _measured(args)
    return _planned(args)


def _planned(args) -> int:
    from scaletrain.parallel.pipeline.draw import draw_timeline, to_chrome_trace
    from scaletrain.parallel.pipeline.schedules import build_schedule, schedule_constraints
    from scaletrain.parallel.pipeline.simulate import simulate

    p, m, v = args.pp, args.microbatches, args.virtual_stages
    if p * m * v > MAX_TIMELINE_OPS:
        raise UserError(f"--pp ({p}) x --microbatches ({m}) x --virtual-stages ({v}) = {p * m * v:,} is above the "
                        f"limit of {MAX_TIMELINE_OPS:,} (one bar per microbatch per stage)")
    out = check_output_file(args.out if args.out is not None else "timeline.png", "--out", (".png",))
    if args.trace:
        check_output_file(args.trace, "--trace", (".json",))
    problems = schedule_constraints(args.schedule, p, m, v)
    problems += [f"--{k} must be >= 0, got {x}" for k, x in (("t-f", args.t_f), ("t-b", args.t_b), ("t-w", args.t_w))
                 if x < 0]
    if problems:
        raise UserError("; ".join(problems).replace("parallel.microbatches", "--microbatches")
                        .replace("parallel.virtual_stages", "--virtual-stages").replace("parallel.pp", "--pp")
                        .replace("parallel.schedule", "--schedule"))
    # Per-chunk times: a chunk holds 1/v of a stage, so every rank does the same work for any v.
    sim = simulate(build_schedule(args.schedule, p, m, v), args.t_f / v, args.t_b / v, args.t_w / v)
    title = (f"{args.schedule}: pp={p}, microbatches={m}{f', virtual stages={v}' if v > 1 else ''};"
             f" bubble {sim.bubble:.3f}")
    draw_timeline(sim, out, title=title, time_unit="units of --t-f")
    if args.trace:
        Path(args.trace).write_text(json.dumps(to_chrome_trace(sim)))
    print(f"schedule        {args.schedule} (pp={p}, microbatches={m}, virtual stages={v}; "
          f"t_f={args.t_f:g}, t_b={args.t_b:g}, t_w={args.t_w:g} per stage)")
    print(f"bubble          {sim.bubble:.4f} overall; per rank " + ", ".join(f"{b:.3f}" for b in sim.bubble_per_rank))
    unit = "(microbatch, chunk) pairs" if v > 1 else "microbatches"
    print("peak in flight  " + ", ".join(str(k) for k in sim.peak_in_flight) + f" {unit} per rank")
    print(f"wrote           {out}" + (f", {args.trace}" if args.trace else ""))
    return 0


def check_trace(trace) -> None:
    """A loaded trace is drawable: stages and ops within the timeline limits, ranks in range, finite times
    (ValueError otherwise)."""
    import math

    if not 1 <= trace.p <= MAX_TIMELINE_STAGES or not 1 <= trace.m or not 1 <= trace.v:
        raise ValueError(f"pp={trace.p}, microbatches={trace.m}, virtual stages={trace.v} out of range")
    if trace.p * trace.m * trace.v > MAX_TIMELINE_OPS or len(trace.events) > 3 * MAX_TIMELINE_OPS:
        raise ValueError(f"{trace.p * trace.m * trace.v:,} ops, above the limit of {MAX_TIMELINE_OPS:,}")
    for ev in trace.events:
        if not 0 <= ev.rank < trace.p or not (math.isfinite(ev.start_s) and math.isfinite(ev.end_s)):
            raise ValueError(f"an event of rank {ev.rank} at {ev.start_s}..{ev.end_s} s is out of range")


def _measured(args) -> int:
    from scaletrain.parallel.pipeline import trace as tr

    path = check_path(args.run, "--run")
    js = path / tr.TRACE_JSON if path.is_dir() else path
    if not js.exists():
        raise UserError(f"no pipeline trace at {js} (runs with parallel.pp > 1 write {tr.TRACE_JSON})")
    read_input(js, "--run", "pipeline trace")  # guards.py: a folder, FIFO, device, not UTF-8, too large
    try:
        trace = tr.load(js)
        check_trace(trace)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError) as e:
        reason = str(e).splitlines()[0][:120] if str(e) else e.__class__.__name__
        raise UserError(f"{js} is not a scaletrain pipeline trace ({reason})") from None
    out = check_output_file(args.out if args.out is not None else js.parent / tr.TRACE_PNG, "--out", (".png",))
    trace.draw(out)
    pred = trace.predicted()
    t_f, t_b, t_w = trace.op_times()
    ms = lambda rows: "; ".join(", ".join(f"{x * 1e3:.2f}" for x in row) for row in rows)  # noqa: E731
    print(f"schedule        {trace.schedule} (pp={trace.p}, microbatches={trace.m}, virtual stages={trace.v})")
    print(f"step            {trace.makespan * 1e3:.1f} ms measured, {pred.makespan * 1e3:.1f} ms predicted "
          "from the measured op times")
    print("bubble measured " + ", ".join(f"{b:.3f}" for b in trace.bubble_per_rank()) + " per rank")
    print("bubble predicted" + " " + ", ".join(f"{b:.3f}" for b in pred.bubble_per_rank))
    print(f"op times (ms)   F {ms(t_f)} | B {ms(t_b)}" + (f" | W {ms(t_w)}" if any(any(r) for r in t_w) else ""))
    print(f"wrote           {out}")
    return 0
