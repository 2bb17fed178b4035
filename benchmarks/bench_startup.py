"""Start-up time of commands that need no torch (issue 13): wall-clock seconds from process start to exit.

Runs each command `--repeats` times, interleaved (one of each per round), and prints the median and the spread
(min-max) of the wall-clock time and of the CPU time (user + system) of the process: on a machine shared with
other jobs the wall clock mostly measures the queue for a core, the CPU time what start-up costs (it is what the
wall clock is on an idle core, for these single-threaded start-ups). `python -c "import torch"` is the yardstick
of what lazy imports save.

    .venv/bin/python benchmarks/bench_startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "scaletrain --help": ["-m", "scaletrain", "--help"],
    "scaletrain plan --help": ["-m", "scaletrain", "plan", "--help"],
    "plan --model megatron-1.7b --gpus 64 --global-batch 512": [
        "-m", "scaletrain", "plan", "--model", "megatron-1.7b", "--gpus", "64", "--global-batch", "512"],
    "plan --layers 24 --hidden 2304 ... --json": [
        "-m", "scaletrain", "plan", "--layers", "24", "--hidden", "2304", "--heads", "24", "--vocab", "51200",
        "--seq-len", "2048", "--gpus", "64", "--global-batch", "512", "--json"],
    "plan --params 7.5e9 --gpus 64": ["-m", "scaletrain", "plan", "--params", "7.5e9", "--gpus", "64"],
    "scaling optimal --flops 5.76e23": ["-m", "scaletrain", "scaling", "optimal", "--flops", "5.76e23"],
    'python -c "import torch" (for comparison)': ["-c", "import torch"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    wall: dict[str, list[float]] = {k: [] for k in COMMANDS}
    cpu: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *argv], check=True, capture_output=True)
            wall[name].append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    print("| command | CPU s, median (min-max) | wall s, median (min-max) |")
    print("|---|---|---|")
    for name in COMMANDS:
        c, w = cpu[name], wall[name]
        print(f"| `{name}` | {statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f}) | "
              f"{statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) |")


if __name__ == "__main__":
    main()
