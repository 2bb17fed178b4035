"""V schedules' throughput, ZB-V (arXiv 2401.10241 section 6) and DualPipeV (arXiv 2412.19437): scaletrain's 1f1b,
zb-h1, zb-v and dualpipev vs torch.distributed.pipelining's Schedule1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV,
2 processes (gloo, CPU, one thread each).

Same model (plain GPT, untied embeddings), same initial weights, same microbatches and loss (token cross-entropy
sum / tokens of the step). 1f1b and zb-h1 cut the blocks into 2 stages; the V schedules (ours and torch's) into 4
chunks in a V (rank 0: stages 0 and 3, rank 1: stages 1 and 2). One timed step is forward + backward of all
microbatches and zeroing the gradients (no optimizer step). `--schedules` picks ours (default 1f1b,zb-h1,zb-v); each
V schedule brings torch's beside it. The runners alternate step by step, so load from other jobs hits
them alike; the table gives tokens/s at the median step (slower rank of each step), the spread (min-max tokens/s)
and each runner's ratio to scaletrain 1f1b.

    python benchmarks/bench_zbv.py [--layers 8 --d-model 128 --heads 4 --seq 128 --micro-batch 2 --microbatches 8
                                    --repeats 11 --warmup 2 --schedules 1f1b,zb-v,dualpipev]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class TorchChunk(nn.Module):
    """Local chunk c of our PipelineStages behind the single-tensor forward torch.distributed.pipelining expects."""

    def __init__(self, stages, c: int):
        super().__init__()
        self.stages, self.c = stages, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages.forward_chunk(self.c, x)[0]


def _config(args, schedule: str):
    from scaletrain.config import load_config, validate

    sets = {
        "model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
        "model.seq_len": args.seq, "model.tie_embeddings": False, "train.micro_batch": args.micro_batch,
        "train.global_batch": args.micro_batch * args.microbatches, "train.dtype": "fp32",
        "parallel.pp": 2, "parallel.schedule": schedule, "train.steps": 1000,
        "parallel.virtual_stages": 2 if schedule in ("zb-v", "dualpipev") else 1,
    }
    return validate(load_config(None, [f"{k}={v}" for k, v in sets.items()]), 2)


def _worker(rank: int, world: int, store_path: str, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    try:
        queue.put((rank, _bench(rank, args)))
    finally:
        dist.destroy_process_group()


def _bench(rank: int, args) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.model import loss_sum
    from scaletrain.parallel.parallelize import build_engine
    from scaletrain.parallel.pipeline.schedules import rank_chunk_to_stage

    g = torch.Generator().manual_seed(0)
    m, mb, T = args.microbatches, args.micro_batch, args.seq
    x = torch.randint(0, 256, (m * mb, T), generator=g)
    y = torch.randint(0, 256, (m * mb, T), generator=g)
    tokens = m * mb * T
    micro = list(zip(x.split(mb), y.split(mb)))
    mesh = Mesh.build(ParallelDims(pp=2), 900)
    runners = {}

    def loss(out, tgt):
        return loss_sum(out, tgt) / tokens

    ours = args.schedules.split(",")
    for schedule in ours:
        engine = build_engine(_config(args, schedule), mesh, torch.device("cpu"), torch.float32, CommStats())

        def run_ours(engine=engine):
            engine.forward_backward(micro, 1.0 / tokens)
            engine.optimizer.zero_grad()

        runners[f"scaletrain {schedule}"] = run_ours
    for schedule in [s for s in ("1f1b", "zb-v", "dualpipev") if s in ours]:
        theirs = build_engine(_config(args, schedule), mesh, torch.device("cpu"), torch.float32, CommStats())
        if schedule == "1f1b":
            mods = [TorchChunk(theirs.module, 0)]
            sched = Schedule1F1B(PipelineStage(mods[0], rank, 2, torch.device("cpu")), m, loss_fn=loss,
                                 scale_grads=False)
            first, last = rank == 0, rank == 1
        else:  # the V: this rank's two chunks are stages r and 3 - r of 4
            mods = [TorchChunk(theirs.module, c) for c in range(2)]
            stages = [PipelineStage(mods[c], rank_chunk_to_stage(rank, c, 2, "zb-v"), 4, torch.device("cpu"))
                      for c in range(2)]
            kind = ScheduleZBVZeroBubble if schedule == "zb-v" else ScheduleDualPipeV
            sched = kind(stages, m, loss_fn=loss, scale_grads=False)
            first = last = rank == 0

        def run_theirs(sched=sched, mods=mods, first=first, last=last):
            kwargs = {"target": y, "losses": []} if last else {}
            sched.step(*([x] if first else []), **kwargs)
            for mod in mods:
                mod.zero_grad(set_to_none=False)

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
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", default="1f1b,zb-h1,zb-v", help="ours, comma-separated (1f1b first: the base)")
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
    times = {k: [max(a, b) for a, b in zip(results[0]["times"][k], results[1]["times"][k])]
             for k in results[0]["times"]}
    tokens = results[0]["tokens"]
    base = statistics.median(times["scaletrain 1f1b"])
    cmd = "python benchmarks/bench_zbv.py " + " ".join(sys.argv[1:]) if argv is None else "bench_zbv.main()"
    lines = [f"Model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, vocab 256,"
             f" fp32, untied; 2 processes (gloo, CPU, 1 thread each); {args.microbatches} microbatches of"
             f" {args.micro_batch} sequences ({tokens} tokens per step); {args.repeats} steps after {args.warmup}"
             " warm-up, runners alternating.", "",
             "| runner | tokens/s (median step) | spread (min-max tokens/s) | median step / scaletrain 1f1b's |",
             "|---|---|---|---|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {tokens / med:,.0f} | {tokens / max(ts):,.0f}-{tokens / min(ts):,.0f} |"
                     f" {med / base:.2f} |")
    lines += ["", f"Command: `{cmd.strip()}`"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
