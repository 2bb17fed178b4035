"""Each optimizer at its defaults on the demo model (issue 13: defaults must train).

Runs the demo config (`src/scaletrain/configs/demo.yaml`) for a fixed number of steps with AdamW, Adafactor and
SM3 at their defaults, and SM3 at other `optim.lr_scale` values, and prints the mean loss of the last 10 steps.
Deterministic (same seed, same data); the result is a property of the loss landscape, not a timing.

    .venv/bin/python benchmarks/bench_optim_defaults.py --steps 120
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

from scaletrain.config import load_config, validate
from scaletrain.train.trainer import Trainer

RUNS = {
    "adamw (default)": [],
    "adafactor (default)": ["optim.name=adafactor"],
    "adafactor, relative_step=true": ["optim.name=adafactor", "optim.relative_step=true"],
    "sm3 (default, lr_scale 5)": ["optim.name=sm3"],
    "sm3, lr_scale 1": ["optim.name=sm3", "optim.lr_scale=1"],
    "sm3, lr_scale 2.5": ["optim.name=sm3", "optim.lr_scale=2.5"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    sets = [f"train.steps={args.steps}", "train.eval_every=0", "train.checkpoint_every=0",
            f"train.warmup_steps={max(1, args.steps // 10)}"]
    print(f"| optimizer | first loss | mean loss of steps {args.steps - 9}-{args.steps} | seconds |")
    print("|---|---|---|---|")
    with resources.as_file(resources.files("scaletrain").joinpath("configs/demo.yaml")) as path:
        for name, extra in RUNS.items():
            t0 = time.time()
            losses = Trainer(validate(load_config(path, sets + extra))).run().losses
            last = sum(losses[s] for s in range(args.steps - 9, args.steps + 1)) / 10
            print(f"| {name} | {losses[1]:.3f} | {last:.3f} | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
