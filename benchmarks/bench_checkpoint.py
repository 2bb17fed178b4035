"""Checkpoint cost of a ~50M-parameter GPT (issue 14): save and load time and bytes at 1, 2 and 4 ranks,
synchronous vs asynchronous saves (the stall of the training loop), the asynchronous save's staged host copy, and
resharding loads 4 -> 2 and 2 -> 4 ranks.

Each rank trains one step (so AdamW's moments exist) and then, `--repeats` times each, alternating: a synchronous
save (the loop is blocked for the whole write), an asynchronous save (the loop is blocked only while the state is
copied to host memory; `async write` is how long the background write then takes), and a load of the checkpoint
into the live engine. Layouts: one process; dp=2 and dp=4 with ZeRO-3 (every rank writes its shards; a replicated
tensor is written once). Times are the slowest rank's, median (min-max). Run on CPU with gloo; on a shared machine
the spread is large: compare medians of runs done side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint.py --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

MODEL = ["model.n_layers=10", "model.d_model=640", "model.n_heads=10", "model.seq_len=128", "train.micro_batch=1",
         "train.eval_every=0", "train.checkpoint_every=0", "train.steps=100", "train.warmup_steps=1",
         "train.report=false"]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _layout(world: int) -> list[str]:
    return [f"parallel.dp={world}", f"train.global_batch={world}"] + (["parallel.zero=3"] if world > 1 else [])


def _worker(rank: int, world: int, store: str, tasks: list, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=1800))
    from scaletrain.config import load_config, validate
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train import resume
    from scaletrain.train.trainer import Trainer

    out = {}
    for kind, arg in tasks:
        cfg = validate(load_config(None, MODEL + _layout(world)), world)
        if kind == "measure":
            repeats, root = arg
            t = Trainer(cfg, root, DistEnv(rank, world, 0, "bench") if world > 1 else None)
            t.run(stop_after=1)
            sync_saver = t.saver
            async_saver = ckpt.Saver(t.ckpt_root, rank, cfg.train.keep_checkpoints, True, cfg.parallel.timeout_s)
            rec = {"sync": [], "stall": [], "write": [], "load": [], "staged": 0, "rss": []}
            for _ in range(repeats):
                t.saver = sync_saver
                t.save()
                rec["sync"].append(sync_saver.last_stall_s)
                t.saver = async_saver
                rss0 = _rss_mib()
                t0 = time.perf_counter()
                t.save()
                rss1 = _rss_mib()
                async_saver.wait()
                rec["write"].append(time.perf_counter() - t0 - async_saver.last_stall_s)
                rec["stall"].append(async_saver.last_stall_s)
                rec["staged"] = async_saver.last_staged_bytes
                rec["rss"].append(rss1 - rss0)
                if world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                resume.load_engine(t.engine, ckpt.latest(t.ckpt_root))
                rec["load"].append(time.perf_counter() - t0)
            out["measure"] = rec
        else:  # load a checkpoint written by another world size into this layout
            from scaletrain.distributed.comm import CommStats
            from scaletrain.distributed.mesh import Mesh, ParallelDims
            from scaletrain.parallel.parallelize import build_engine

            p = cfg.parallel
            engine = build_engine(cfg, Mesh.build(ParallelDims(dp=p.dp), p.timeout_s), torch.device("cpu"),
                                  torch.float32, CommStats())
            times = []
            for _ in range(arg[0]):
                if world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                resume.load_engine(engine, ckpt.latest(Path(arg[1]) / "checkpoints"))
                times.append(time.perf_counter() - t0)
            out["reshard"] = times
    q.put((rank, out))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(world: int, tasks: list) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, f"{tmp}/store", tasks, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
    return [results[r] for r in range(world)]


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(vals) for vals in zip(*per_rank)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worlds", default="1,2,4")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    rows, reshard = [], {}
    for w in worlds:
        tasks = [("measure", (args.repeats, str(root / f"w{w}")))]
        if w == 4 and 2 in worlds:
            tasks.append(("reshard", (args.repeats, str(root / "w2"))))  # 2 -> 4
        res = run(w, tasks)
        m = [r["measure"] for r in res]
        files = sorted((root / f"w{w}" / "checkpoints").glob("step_*/*"))
        nbytes = sum(f.stat().st_size for f in files if f.suffix == ".distcp")
        rows.append((w, nbytes, _slowest([x["sync"] for x in m]), _slowest([x["stall"] for x in m]),
                     _slowest([x["write"] for x in m]), max(x["staged"] for x in m),
                     max(max(x["rss"]) for x in m), _slowest([x["load"] for x in m])))
        if "reshard" in res[0]:
            reshard["2 -> 4"] = _slowest([r["reshard"] for r in res])
    if 2 in worlds and 4 in worlds:
        reshard["4 -> 2"] = _slowest([r["reshard"] for r in run(2, [("reshard", (args.repeats, str(root / "w4")))])])
    import torch

    from scaletrain.config import load_config
    from scaletrain.model import build_gpt, count_params

    cfg = load_config(None, MODEL)
    with torch.device("meta"):
        n = count_params(build_gpt(cfg.model, 0, "meta", torch.float32))
    print(f"GPT {cfg.model.n_layers} layers, d_model {cfg.model.d_model}: {n / 1e6:.1f}M parameters, fp32, AdamW; "
          f"median (min-max) of {args.repeats}, slowest rank, seconds")
    print("| ranks | layout | checkpoint bytes | sync save | async stall | async write | staged copy MiB/rank | "
          "RSS growth at async save MiB | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w, nbytes, sync, stall, write, staged, rss, load in rows:
        lay = "single" if w == 1 else f"dp={w} ZeRO-3"
        print(f"| {w} | {lay} | {nbytes / 2**20:,.0f} MiB | {_fmt(sync)} | {_fmt(stall)} | {_fmt(write)} | "
              f"{staged / 2**20:,.0f} | {rss:,.0f} | {_fmt(load)} |")
    if reshard:
        print("\n| resharding load | seconds |\n|---|---|")
        for k, v in reshard.items():
            print(f"| dp ZeRO-3 {k} ranks | {_fmt(v)} |")


if __name__ == "__main__":
    main()
