"""Cost of layout-independent dropout (model/dropout.py) against torch's dropout (issue 13).

Two measurements, alternated side by side and repeated (median and range):
1. the dropout op alone, forward + backward on a (batch, seq, d_model) activation: `GlobalDropout` (a 32-bit
   counter hash of every element's global index) vs `torch.nn.Dropout` (Philox / MT stream);
2. a whole training step of the demo model with `model.dropout=0.1`: `model.dropout_impl=global` (the hash, and
   attention run unfused so the probability mask can be a function of global indices) vs `torch` (SDPA's own
   dropout).

    .venv/bin/python benchmarks/bench_dropout.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib import resources

import torch

from scaletrain.config import load_config, validate
from scaletrain.model.dropout import DropoutContext, GlobalDropout
from scaletrain.train.trainer import Trainer


def time_op(module: torch.nn.Module, shape: tuple[int, ...], iters: int) -> float:
    x = torch.randn(shape, requires_grad=True)
    module.train()
    t0 = time.perf_counter()
    for _ in range(iters):
        module(x).sum().backward()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4, help="training steps per timed block")
    args = ap.parse_args()
    shape = (16, 128, 768)
    glob = GlobalDropout(0.1, DropoutContext(seed=1, step=1), ("seq", "feature"))
    glob.site = "bench"
    ops = {"global": [], "torch": []}
    for _ in range(args.repeats):
        ops["global"].append(time_op(glob, shape, 5))
        ops["torch"].append(time_op(torch.nn.Dropout(0.1), shape, 5))
    print(f"dropout op, forward + backward on {shape} fp32, median of {args.repeats} (range):")
    print("| implementation | ms | ratio to torch |\n|---|---|---|")
    base = statistics.median(ops["torch"])
    for k, v in ops.items():
        print(f"| {k} | {1e3 * statistics.median(v):.1f} ({1e3 * min(v):.1f}-{1e3 * max(v):.1f}) | "
              f"{statistics.median(v) / base:.2f} |")

    steps = {"global": [], "torch": []}
    with resources.as_file(resources.files("scaletrain").joinpath("configs/demo.yaml")) as path:
        trainers = {impl: Trainer(validate(load_config(path, ["model.dropout=0.1", f"model.dropout_impl={impl}",
                                                               "train.eval_every=0"])))
                    for impl in steps}
        for t in trainers.values():
            t.train_step(1)  # warm-up
        for r in range(args.repeats):
            for impl in (("global", "torch") if r % 2 == 0 else ("torch", "global")):
                t = trainers[impl]
                times = [t.train_step(s)["step_time_s"] for s in range(2, 2 + args.steps)]
                steps[impl].append(statistics.median(times))
    print(f"\ndemo model training step with model.dropout=0.1, median of {args.repeats} alternated blocks (range):")
    print("| model.dropout_impl | step s | ratio to torch |\n|---|---|---|")
    base = statistics.median(steps["torch"])
    for k, v in steps.items():
        print(f"| {k} | {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}) | {statistics.median(v) / base:.2f} |")


if __name__ == "__main__":
    main()
