"""Dense vs mixture-of-experts at equal active parameters on CPU, and the all-to-all share of a step at ep 2.

Every run is a real `scaletrain train` (a subprocess) on the embedded corpus; numbers come from its
metrics.jsonl. The MoE models replace every second MLP by 4 experts of the dense MLP's size with top-1
routing (Switch, arXiv 2101.03961) or expert choice with c = 1 (arXiv 2202.09368), so each token passes
through as many parameters as in the dense model (plus the router); total parameters grow. Reported:
median tokens/s over the steps after the first, the final training cross-entropy (without the auxiliary
losses) and the validation loss at the end. Then the Switch model with dp 2 x ep 2 (two processes): the
time in the expert all-to-alls (forward and backward, mean over ranks) as a share of the step time.

    .venv/bin/python benchmarks/bench_moe.py --steps 100

`--planner` adds a second table: the planner's per-rank memory by category (`plan.exact.run_memory.predict_run`, which
the trainer also logs as `plan_mem_*`) and its step time (`plan.exact.run_calibrate.calibrate_run`: the run's blocks,
dense and MoE, profiled on this machine and composed, with the expert all-to-alls alpha-beta timed on the
measured gloo link) next to the measured `mem_*` (first step) and the median `step_time_s`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["model.n_layers=4", "model.d_model=128", "model.n_heads=4", "model.seq_len=128", "train.global_batch=8",
          "train.micro_batch=4", "train.warmup_steps=10", "train.dtype=fp32", "train.checkpoint_every=0",
          "train.eval_batches=4", "train.device=cpu"]
MOE = ["model.moe.experts=4", "model.moe.every=2", "model.moe.group_tokens=128", "model.moe.capacity_factor=1.25"]
VARIANTS = {
    "dense": ([], 1),
    "moe switch top-1": ([*MOE, "model.moe.router=switch"], 1),
    "moe expert-choice c=1": ([*MOE, "model.moe.router=expert_choice", "model.moe.top_k=1"], 1),
    "moe switch, dp 2 x ep 2": ([*MOE, "model.moe.router=switch", "parallel.dp=2", "parallel.ep=2"], 2),
}


def run(sets: list[str], nproc: int, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "scaletrain", "train", "--out", str(out), "--nproc", str(nproc)]
    for s in [*COMMON, f"train.steps={steps}", f"train.eval_every={steps}", *sets]:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def params(sets: list[str]) -> tuple[int, int]:
    """(total, active per token) parameters of the model, active counting top-1 experts once."""
    from scaletrain.config import load_config
    from scaletrain.model import build_gpt

    cfg = load_config(None, [*COMMON, *sets])
    model = build_gpt(cfg.model, 0, "meta")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - experts + experts // max(cfg.model.moe.experts, 1)


def planner_row(name: str, sets: list[str], nproc: int, m: list[dict]) -> str:
    """One table row: planned vs measured memory per category (MiB) and step time (s)."""
    from scaletrain.config import load_config, validate
    from scaletrain.plan.exact.run_calibrate import calibrate_run
    from scaletrain.plan.exact.run_memory import predict_run

    cfg = validate(load_config(None, [*COMMON, *sets]))
    pred = predict_run(cfg)
    step = calibrate_run(cfg)[0]
    first = m[0]
    mib = 1 / 2**20
    cells = []
    for k in ("params", "grads", "optim", "activations"):
        p, q = pred.get(f"plan_mem_{k}"), first[f"mem_{k}"]
        cells.append(f"{p * mib:.2f} / {q * mib:.2f}" if p is not None else f"- / {q * mib:.2f}")
    measured = statistics.median(r["step_time_s"] for r in m[1:])
    a2a = step.breakdown.get("ep_comm", 0.0)
    share = ""
    if nproc > 1 and "moe_all_to_all_s" in first:
        got = statistics.median(r["moe_all_to_all_s"] for r in m[1:])
        share = f"{a2a:.3f} / {got:.3f}"
    return (f"| {name} | {' | '.join(cells)} | {step.step_time_s:.3f} / {measured:.3f} "
            f"({100 * (step.step_time_s / measured - 1):+.0f}%) | {share or '-'} |\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results_moe.md")
    ap.add_argument("--planner", action="store_true",
                    help="also print the planner's predicted memory and step time next to the measured ones")
    args = ap.parse_args()
    rows, plan_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (sets, nproc)) in enumerate(VARIANTS.items()):
            t0 = time.perf_counter()
            m = run(sets, nproc, args.steps, Path(tmp) / str(i))
            last = m[-1]
            tps = statistics.median(r["tokens_per_s"] for r in m[1:])
            share = ""
            if "moe_all_to_all_s" in last and nproc > 1:
                share = statistics.median(r["moe_all_to_all_s"] / r["step_time_s"] for r in m[1:])
                share = f"{100 * share:.1f}%"
            total, active = params(sets)
            dropped = statistics.mean(sum(r["moe_dropped_frac"]) / len(r["moe_dropped_frac"]) for r in m) \
                if "moe_dropped_frac" in last else 0.0
            rows.append((name, total, active, tps, last.get("loss_ce", last["loss"]), last["val_loss"],
                         f"{100 * dropped:.1f}%", share))
            if args.planner:
                plan_rows.append(planner_row(name, sets, nproc, m))
            print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    head = ("| model | params total | active / token | tokens/s (median) | train CE at end | val loss at end "
            "| dropped (mean) | all-to-all share |\n|---|---|---|---|---|---|---|---|\n")
    table = head + "".join(f"| {n} | {t:,} | {a:,} | {s:,.0f} | {ce:.3f} | {v:.3f} | {d} | {sh or '-'} |\n"
                           for n, t, a, s, ce, v, d, sh in rows)
    text = f"steps {args.steps}, {' '.join(COMMON)}\n\n{table}"
    if args.planner:
        text += ("\nplanned / measured, per rank (max over ranks); memory in MiB (first step), step time in s "
                 "(median after the first step), expert all-to-all s per step\n\n"
                 "| model | params | grads | optimizer | activations | step time | all-to-all |\n"
                 "|---|---|---|---|---|---|---|\n" + "".join(plan_rows))
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
