"""Pipeline parallelism throughput: scaletrain's executor vs torch.distributed.pipelining, 2 processes.

Same model (plain GPT, untied embeddings: torch.distributed.pipelining has no tied-weight support), same
two-stage split (stage 0: embeddings + first half of the blocks; stage 1: second half + ln_f + lm_head),
same microbatches, same loss (token cross-entropy sum / tokens of the step), same initial weights, on
CPU with gloo, one thread per process. One timed step is forward + backward of all microbatches (no
optimizer step, identical for both) and zeroing the gradients. The systems alternate step by step
(ABAB...) so that load from other jobs hits both alike; the table reports the median of the repeats.

    python benchmarks/bench_pp.py [--layers 8 --d-model 128 --heads 4 --seq 128 --micro-batch 4 --microbatches 8
                                   --repeats 15 --warmup 3]

Prints a markdown table (tokens/s and the ratio scaletrain / torch for gpipe and 1f1b: of the medians,
and the median of the ratios of each round, where both ran back to back) and writes it to --out
(default benchmarks/results_pp.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class TorchStage(nn.Module):
    """One of our PipelineStages behind the single-tensor forward torch.distributed.pipelining expects."""

    def __init__(self, stages):
        super().__init__()
        self.stages = stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages.forward_chunk(0, x)[0]


def _config(args, schedule: str):
    from scaletrain.config import load_config, validate

    sets = {
        "model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
        "model.seq_len": args.seq, "model.tie_embeddings": False, "train.micro_batch": args.micro_batch,
        "train.global_batch": args.micro_batch * args.microbatches, "train.dtype": "fp32",
        "parallel.pp": 2, "parallel.schedule": schedule, "train.steps": 1000,
    }
    return validate(load_config(None, [f"{k}={v}" for k, v in sets.items()]), 2)


def _worker(rank: int, world: int, store_path: str, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        queue.put((rank, _bench(rank, args)))
    finally:
        dist.destroy_process_group()


def _bench(rank: int, args) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.model import loss_sum
    from scaletrain.parallel.parallelize import build_engine

    g = torch.Generator().manual_seed(0)
    m, mb, T = args.microbatches, args.micro_batch, args.seq
    x = torch.randint(0, 256, (m * mb, T), generator=g)
    y = torch.randint(0, 256, (m * mb, T), generator=g)
    tokens = m * mb * T
    mesh = Mesh.build(ParallelDims(pp=2), 600)
    runners = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = _config(args, schedule)
        ours = build_engine(cfg, mesh, torch.device("cpu"), torch.float32, CommStats())
        micro = list(zip(x.split(mb), y.split(mb)))

        def run_ours(engine=ours, micro=micro):
            engine.forward_backward(micro, 1.0 / tokens)
            engine.optimizer.zero_grad()

        theirs = build_engine(cfg, mesh, torch.device("cpu"), torch.float32, CommStats())  # same init
        module = TorchStage(theirs.module)
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stage, m, loss_fn=lambda out, tgt: loss_sum(out, tgt) / tokens, scale_grads=False)

        def run_theirs(sched=sched, module=module):
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            module.zero_grad(set_to_none=False)

        runners[f"scaletrain {schedule}"] = run_ours
        runners[f"torch {schedule}"] = run_theirs
    times: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(args.warmup + args.repeats):
        for name, fn in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results_pp.md")))
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, 2, os.path.join(tmp, "store"), args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    # A step ends when both ranks are done: take the slower rank's time of each repeat.
    times = {k: [max(a, b) for a, b in zip(results[0]["times"][k], results[1]["times"][k])]
             for k in results[0]["times"]}
    tokens = results[0]["tokens"]
    cmd = "python benchmarks/bench_pp.py " + " ".join(sys.argv[1:]) if argv is None else "bench_pp.main()"
    lines = [
        f"Model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, vocab 256,"
        f" fp32; 2 pipeline stages (gloo, CPU, 1 thread per process); {args.microbatches} microbatches of"
        f" {args.micro_batch} sequences ({tokens} tokens per step); median of {args.repeats} steps after"
        f" {args.warmup} warm-up, systems alternating.",
        "",
        "| schedule | scaletrain tokens/s | torch.distributed.pipelining tokens/s | ratio of medians |"
        " median of per-round ratios (range) |",
        "|---|---|---|---|---|",
    ]
    for schedule in ("gpipe", "1f1b"):
        a, b = times[f"scaletrain {schedule}"], times[f"torch {schedule}"]
        ours, theirs = statistics.median(a), statistics.median(b)
        rounds = [y / x for x, y in zip(a, b)]  # same round: both ran back to back
        lines.append(f"| {schedule} | {tokens / ours:,.0f} | {tokens / theirs:,.0f} | {theirs / ours:.2f}x |"
                     f" {statistics.median(rounds):.2f}x ({min(rounds):.2f}-{max(rounds):.2f}) |")
    lines += ["", f"Command: `{cmd.strip()}`"]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
