"""Scaling laws on the command line: compute-optimal sizes, fits to runs, and a sweep of tiny GPTs.

`scaletrain scaling optimal` evaluates a published law (Kaplan et al. arXiv 2001.08361; Hoffmann et al.
arXiv 2203.15556; Besiroglu et al. arXiv 2404.10102), `scaling fit` fits the three Chinchilla approaches
to runs (`scaling/fit.py`), `scaling sweep` trains a grid of tiny GPTs and fits them (`scaling/sweep.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from scaletrain.errors import UserError
from scaletrain.guards import parse_positive
from scaletrain.scaling.laws import LAWS, Optimum, get_law


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}"


def _print_optimum(o: Optimum, reference: str) -> None:
    loss = "n/a (this law has no loss)" if o.loss is None else f"{o.loss:.4f} nats/token (the paper's data)"
    rows = (
        ("law", f"{o.law}  ({reference})"),
        ("compute", f"{o.flops:.3e} FLOPs"),
        ("parameters", f"{o.params:.3e}  ({_si(o.params)})"),
        ("tokens", f"{o.tokens:.3e}  ({_si(o.tokens)})"),
        ("tokens/param", f"{o.tokens_per_param:.2f}"),
        ("loss", loss),
    )
    for key, value in rows:
        print(f"{key:<14}{value}")


def run_optimal(args: argparse.Namespace) -> int:
    given = [(k, v) for k, v in (("flops", args.flops), ("params", args.params), ("tokens", args.tokens))
             if v is not None]
    if len(given) != 1:
        names = ", ".join(f"--{k}" for k, _ in given) or "none"
        raise UserError(f"give exactly one of --flops, --params, --tokens (got {names})")
    key, raw = given[0]
    value = parse_positive(raw, f"--{key}")
    law = get_law(args.law)
    o = law.optimum(**{key: value})
    if args.json:
        print(json.dumps(o.to_dict()))
    else:
        _print_optimum(o, law.reference)
    return 0


def _parse_approaches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise UserError(f"--approach must be a comma-separated list of 1, 2, 3, got {text!r}") from None
    if not out or any(k not in (1, 2, 3) for k in out):
        raise UserError(f"--approach must be a comma-separated list of 1, 2, 3, got {text!r}")
    return out


def run_fit(args: argparse.Namespace) -> int:
    from scaletrain.scaling.fit import fit_all, load_points, print_fit_report

    if args.bootstrap < 0:
        raise UserError(f"--bootstrap must be >= 0, got {args.bootstrap}")
    approaches = _parse_approaches(args.approach) if args.approach else (1, 2, 3)
    required = approaches if args.approach else (3,)
    from scaletrain.guards import check_output_dir, check_output_file

    if args.plot is not None:
        check_output_dir(args.plot, "--plot")  # before the fit: a bad folder must not cost the minute of fitting
    if args.html is not None:
        check_output_file(args.html, "--html")
    points = load_points(args.runs)
    start = time.monotonic()

    def progress(text: str) -> None:
        print(f"fitting {text} ... ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    progress_fn = progress if sys.stderr.isatty() else None  # a person watching: say what the minute is spent on
    report = fit_all(points, approaches, bootstrap=args.bootstrap, seed=args.seed, required=required,
                     progress=progress_fn)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print_fit_report(report)
    if args.html:
        from scaletrain.scaling.page import write_scaling_page

        write_scaling_page(points, report, args.html, f"scaletrain scaling fit: {args.runs}")
        print(f"page: {args.html}", file=sys.stderr if args.json else sys.stdout)
    if args.plot:
        from scaletrain.scaling.plots import plot_report

        paths = plot_report(points, report, args.plot)
        print("plots: " + ", ".join(str(p) for p in paths), file=sys.stderr if args.json else sys.stdout)
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from scaletrain.scaling.sweep import run_sweep_command

    return run_sweep_command(args)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "scaling", help="compute-optimal model size from scaling laws; fit laws to runs; run a sweep",
        description=__doc__.splitlines()[0],
    )
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    sub = p.add_subparsers(dest="scaling_command", metavar="COMMAND", parser_class=type(p))

    o = sub.add_parser("optimal", help="compute-optimal parameters and tokens for a budget, size or data",
                       description="Compute-optimal N, D (C = 6ND) and predicted loss under a published law.")
    o.add_argument("--flops", metavar="C", help="training compute budget in FLOPs, e.g. 5.76e23")
    o.add_argument("--params", metavar="N", help="model size: the budget and tokens for which it is optimal")
    o.add_argument("--tokens", metavar="D", help="token count: the budget and size for which it is optimal")
    o.add_argument("--law", default="chinchilla-3", metavar="LAW",
                   help=f"one of {', '.join(LAWS)} (default chinchilla-3)")
    o.add_argument("--json", action="store_true",
                   help='print {"law", "flops", "params", "tokens", "tokens_per_param", "loss"}')
    o.set_defaults(func=run_optimal)

    f = sub.add_parser("fit", help="fit scaling laws (Chinchilla approaches 1-3) to runs",
                       description="Fit scaling laws to a CSV (params, tokens, flops, loss[, run]) or "
                                   "a folder of scaletrain runs.")
    f.add_argument("runs", metavar="RUNS", help="CSV file or folder of run outputs")
    f.add_argument("--json", action="store_true", help="print the fits as JSON")
    f.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR")
    f.add_argument("--html", metavar="FILE", help="write the fits as a self-contained HTML page (docs/report.md)")
    f.add_argument("--approach", metavar="LIST",
                   help="approaches to run, e.g. 3 or 1,2,3 (default: all the data allow; 3 is required)")
    f.add_argument("--bootstrap", type=int, default=100, metavar="K",
                   help="bootstrap rounds on 80%% subsets for 10-90%% intervals (default 100, 0 = none)")
    f.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    f.set_defaults(func=run_fit)

    s = sub.add_parser("sweep", help="train a grid of tiny GPTs on CPU, then fit and report",
                       description="Train tiny GPTs at several sizes and budgets, then fit scaling laws.")
    s.add_argument("--out", default="runs/scaling-sweep", metavar="DIR",
                   help="output folder (default runs/scaling-sweep)")
    s.add_argument("--minutes", type=float, default=10.0, metavar="M",
                   help="about how long the sweep takes in total; sets the compute scale (default 10)")
    s.add_argument("--flops", metavar="C0",
                   help="fix the smallest compute level (FLOPs) instead of deriving it from --minutes")
    s.add_argument("--levels", type=int, default=3, metavar="K", help="compute levels, 3x apart (default 3)")
    s.add_argument("--sizes", type=int, default=5, metavar="S", help="model sizes per level (default 5)")
    s.add_argument("--seed", type=int, default=1234, help="training seed of every run (default 1234)")
    s.set_defaults(func=run_sweep)

    from scaletrain.scaling.batch import add_parser as add_batch_size_parser

    add_batch_size_parser(subparsers)  # `scaletrain batch-size --max` (its own top-level command)
