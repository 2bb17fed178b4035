"""PipeDream (arXiv 1806.03377) with and without vertical sync against 1F1B and PipeDream-2BW, side by side.

At pp = 2 and pp = 4 (local gloo processes) every schedule trains the same small untied GPT on the same data for
the same number of steps with the same tokens per step: 1f1b and 2bw as `--microbatches` micro-batches of
global_batch / m sequences, pipedream as one minibatch of global_batch sequences (its unit). The schedules run
alternated, `--repeats` times, after one unrecorded 2-step warm-up run of each. Printed per schedule: tokens/s
(median and spread over the repeats, and the ratio to 1f1b); the weight bytes each stage holds beyond its live
weights (2bw: one older version; pipedream: the frozen copies the executor measured, `WeightStash.peak_copies`);
the activation bytes the first step saved for backward on stage 0 (`SavedTensorCounter`, the executor's
measurement); the validation loss after the last step.

    nice -n 10 .venv/bin/python benchmarks/bench_pipedream.py [--steps 30] [--repeats 3] [--pp 2 4]

`--steady` measures instead the steady step time (rank 0's median interval between the starts of consecutive steps,
steps 3 to steps - 1, nothing logged or evaluated before the end) of 1f1b, of pipedream, and of
`pipedream+barrier`: pipedream with the per-step synchronisation it had before it became barrier-free re-added in this
script only (the last stage's loss broadcast over the pipeline and a world all-reduce of a gradient norm, the two
collectives every step used to end with), alternated, `--repeats` times; median and spread per schedule and the ratio
to 1f1b.

    nice -n 10 .venv/bin/python benchmarks/bench_pipedream.py --steady [--steps 20] [--repeats 5] [--pp 2 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SCHEDULES = ["1f1b", "2bw", "pipedream", "pipedream+vsync"]


def _config(name: str, pp: int, steps: int, batch: int, m: int) -> dict:
    sched, vsync = (name.split("+")[0], "+vsync" in name)
    micro = batch if sched == "pipedream" else batch // m
    return {"model.n_layers": 4, "model.d_model": 128, "model.n_heads": 4, "model.seq_len": 64,
            "model.tie_embeddings": "false", "train.steps": steps, "train.global_batch": batch,
            "train.micro_batch": micro, "train.warmup_steps": 5, "train.eval_every": steps, "train.eval_batches": 4,
            "train.dtype": "fp32", "train.lr": 1e-3, "parallel.pp": pp, "parallel.schedule": sched,
            "parallel.vertical_sync": str(vsync).lower()}


def _rank(rank, world, steps, batch, m, repeats):
    from harness import make_config

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    out: dict[str, list[dict]] = {s: [] for s in SCHEDULES}
    for name in SCHEDULES:  # one short warm-up run of each (first-call costs), not recorded
        Trainer(make_config(_config(name, world, 2, batch, m)), None, DistEnv(rank, world, 0, "bench")).run()
    for _ in range(repeats):
        for name in SCHEDULES:  # alternated
            t = Trainer(make_config(_config(name, world, steps, batch, m)), None, DistEnv(rank, world, 0, "bench"))
            start = time.perf_counter()
            result = t.run()
            wall = time.perf_counter() - start
            ex = t.engine.pipeline
            stage_bytes = sum(p.numel() * p.element_size() for p in t.engine.module.parameters())
            extra = stage_bytes if name == "2bw" else (ex.stash.peak_copies * stage_bytes if ex.stash else 0)
            out[name].append({"tokens_s": steps * batch * 64 / wall, "extra_weights": extra,
                              "activations": ex.activation_bytes, "val": result.val_losses.get(steps)})
    return out


STEADY = ["1f1b", "pipedream+barrier", "pipedream"]


def _with_barrier(trainer) -> None:
    """Re-add, to this trainer only, the per-step collectives PipeDream's steps ended with before they became
    barrier-free: the last stage's loss broadcast to every pipeline rank and a world all-reduce of the squared norm."""
    import torch.distributed as dist

    ex, run = trainer.engine.pipeline, trainer.engine.runner

    def run_and_wait(engine, micro, scale):
        loss = run(engine, micro, scale)
        ex._share_loss(loss.clone())
        dist.all_reduce(torch.zeros((), dtype=torch.float64))
        return loss

    trainer.engine.runner = run_and_wait


def _steady_rank(rank, world, steps, batch, m, repeats):
    from harness import make_config

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    out: dict[str, list[float]] = {s: [] for s in STEADY}
    for rep in range(repeats + 1):  # the first round is a warm-up, not recorded
        for name in STEADY:  # alternated
            cfg = {**_config(name.split("+")[0], world, steps, batch, m), "train.eval_every": 0,
                   "train.log_every": steps}
            t = Trainer(make_config(cfg), None, DistEnv(rank, world, 0, "bench"))
            if name == "pipedream+barrier":
                _with_barrier(t)
            starts: list[float] = []
            lazy = t._lazy_step

            def timed(step, drain=True, lazy=lazy, starts=starts):
                starts.append(time.perf_counter())
                return lazy(step, drain)

            t._lazy_step = timed
            t.run()
            gaps = [b - a for a, b in zip(starts[2:-2], starts[3:-1])]  # steps 3 .. steps - 1
            if rep:
                out[name].append(statistics.median(gaps))
    return out


def steady(args) -> None:
    from harness import run_ranks

    print(f"steady step time: steps {args.steps}, {args.batch} x 64 tokens per step (1f1b m = {args.microbatches}, "
          f"pipedream one minibatch), {args.repeats} repeats alternated; d_model 128, 4 layers, fp32, gloo")
    for pp in args.pp:
        outs = run_ranks(_steady_rank, pp, args.steps, args.batch, args.microbatches, args.repeats, timeout=3000)
        times = outs[0]
        base = statistics.median(times["1f1b"])
        print(f"\npp = {pp}")
        print(f"{'schedule':<19} {'step ms median':>14} {'spread (ms)':>15} {'vs 1f1b':>8}")
        for name in STEADY:
            ms = [1e3 * x for x in times[name]]
            print(f"{name:<19} {statistics.median(ms):>14.1f} {min(ms):>7.1f}-{max(ms):<7.1f} "
                  f"{statistics.median(ms) / (1e3 * base):>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--microbatches", type=int, default=4, help="1f1b and 2bw micro-batches per step (>= pp)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steady", action="store_true", help="steady step time of 1f1b, pipedream with and without the "
                    "per-step barrier")
    args = ap.parse_args()
    if args.steady:
        steady(args)
        return
    from harness import run_ranks

    print(f"steps {args.steps}, {args.batch} x 64 tokens per step, 1f1b/2bw m = {args.microbatches}, "
          f"{args.repeats} repeats alternated; d_model 128, 4 layers, fp32, gloo")
    for pp in args.pp:
        outs = run_ranks(_rank, pp, args.steps, args.batch, args.microbatches, args.repeats, timeout=3000)
        base = statistics.median(r["tokens_s"] for r in outs[0]["1f1b"])
        print(f"\npp = {pp}")
        print(f"{'schedule':<17} {'tokens/s median':>15} {'spread':>15} {'vs 1f1b':>8} "
              f"{'extra weights/stage (MiB)':>26} {'stage-0 activations (MiB)':>26} {'val loss':>9}")
        for name in SCHEDULES:
            runs = outs[0][name]
            speeds = [r["tokens_s"] for r in runs]
            extra = " / ".join(f"{o[name][0]['extra_weights'] / 2**20:.2f}" for o in outs)
            vals = [r["val"] for r in runs]
            print(f"{name:<17} {statistics.median(speeds):>15.0f} {min(speeds):>7.0f}-{max(speeds):<7.0f} "
                  f"{statistics.median(speeds) / base:>8.2f} {extra:>26} "
                  f"{runs[0]['activations'] / 2**20:>26.2f} {statistics.median(vals):>9.4f}")


if __name__ == "__main__":
    main()
