"""Cost of the multi-node supervision (issue 17): the flight recorder per collective, heartbeat + recorder per step.

1. The recorder's wrapper alone: a wrapped no-op against the bare no-op, in one process (ns per call).
2. Per collective, one process: the real `dist.all_reduce` path on a group of one, with and without the recorder.
   Per collective, 2 gloo processes run blocks of `--calls` all_reduces (one float, and 256 KiB) with the
   recorder installed and not, alternating blocks; median microseconds per call of each, and their ratio.
3. Per training step, in one pair of processes: a dp=2 Trainer runs blocks of `--steps` steps cycling through
   nothing / recorder / heartbeat (heartbeat_s=5: a store round trip pair every 0.625 s per rank) / both.
4. Whole runs: `scaletrain train --nproc 2` with the defaults against `parallel.heartbeat_s=0
   parallel.flight_recorder=0`, alternating; median `step_time_s` of each run, then over runs (noisier).

    .venv/bin/python benchmarks/bench_multinode.py [--blocks 9 --calls 400 --steps 20 --runs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def wrapper_cost(n: int = 200_000) -> tuple[float, float]:
    from scaletrain.multinode.flight import SPECS, FlightRecorder

    def noop(tensor, op=None, group=None, async_op=False):
        return None

    rec = FlightRecorder(256)
    wrapped = rec._wrap("all_reduce", noop, SPECS["all_reduce"])
    t = torch.zeros(1)
    out = []
    for fn in (noop, wrapped, noop, wrapped):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(t)
        out.append((time.perf_counter() - t0) / n * 1e9)
    return min(out[0], out[2]), min(out[1], out[3])


def one_process_cost(blocks: int = 40, calls: int = 1000) -> dict[str, list[float]]:
    """The real `dist.all_reduce` call path (torch's decorators, gloo's dispatch) on a group of one process:
    no peer to wait for, so what the recorder adds is not hidden behind network time; blocks alternate."""
    from scaletrain.multinode.flight import FlightRecorder

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        res: dict[str, list[float]] = {}
        for size, label in ((1, "1 float"), (65536, "256 KiB")):
            t = torch.ones(size)
            for _ in range(200):
                dist.all_reduce(t)
            for b in range(2 * blocks):
                on = b % 2 == 1
                rec = FlightRecorder(256).install() if on else None
                t0 = time.perf_counter()
                for _ in range(calls):
                    dist.all_reduce(t)
                res.setdefault(f"{label} {'on' if on else 'off'}", []).append((time.perf_counter() - t0) / calls * 1e6)
                if rec is not None:
                    rec.uninstall()
        dist.destroy_process_group()
    return res


def _collectives(rank: int, world: int, store_path: str, blocks: int, calls: int, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    from scaletrain.multinode.flight import FlightRecorder

    results: dict[str, list[float]] = {}
    for size, label in ((1, "1 float"), (65536, "256 KiB")):
        t = torch.ones(size)
        for _ in range(20):
            dist.all_reduce(t)
        for b in range(2 * blocks):
            on = b % 2 == 1
            rec = FlightRecorder(256, rank).install() if on else None
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t)
            dt = (time.perf_counter() - t0) / calls * 1e6
            if rec is not None:
                rec.uninstall()
            results.setdefault(f"{label} {'on' if on else 'off'}", []).append(dt)
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def collective_cost(blocks: int, calls: int) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_collectives, args=(r, 2, os.path.join(tmp, "s"), blocks, calls, q))
                 for r in range(2)]
        for p in procs:
            p.start()
        out = q.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    return out


TINY = {"parallel.dp": 2, "model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": 32,
        "train.global_batch": 8, "train.micro_batch": 2, "train.eval_every": 0, "train.checkpoint_every": 0}
MODES = ("off", "recorder", "heartbeat", "both")


def _steps(rank: int, world: int, store_path: str, port: int, blocks: int, steps: int, q) -> None:
    """One rank: a dp=2 Trainer; blocks of `steps` steps cycle through MODES (the supervision pieces started
    and stopped around each block, exactly as scaletrain.multinode.job starts them)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    from scaletrain.config import load_config, validate
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.multinode.flight import FlightRecorder
    from scaletrain.multinode.heartbeat import ABORT, HANG, Heartbeat, hb_key
    from scaletrain.train.trainer import Trainer

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    if rank == 0:
        store.set(ABORT, "")
        store.set(HANG, "")
    store.add(hb_key(rank), 1)
    dist.barrier()
    cfg = validate(load_config(None, [f"{k}={v}" for k, v in {**TINY, "train.steps": 10**6}.items()]))
    t = Trainer(cfg, None, DistEnv(rank, world, 0, "bench"))
    for _ in range(3):
        t.step += 1
        t.train_step(t.step)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # process CPU time: all threads, no waiting counted
    calls = 0
    for b in range(blocks * len(MODES)):
        mode = MODES[b % len(MODES)]
        rec = FlightRecorder(256, rank).install() if mode in ("recorder", "both") else None
        if rec is not None:
            rec.stepper = t
        hb = None
        if mode in ("heartbeat", "both"):
            def client():
                return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60),
                                     wait_for_workers=False)

            hb = Heartbeat(client, rank, world, ["h"] * world, 5.0, lambda v: None, watch_parent=False).start()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            t.step += 1
            t.train_step(t.step)
        times[mode].append((time.perf_counter() - t0) / steps * 1e3)
        cpu[mode].append((time.process_time() - c0) / steps * 1e3)
        if rec is not None:
            calls = rec.n // steps
            rec.uninstall()
        if hb is not None:
            hb.stop(clean=False)
    if rank == 0:
        q.put((times, cpu, calls))
    dist.barrier()
    dist.destroy_process_group()


def step_cost(blocks: int, steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    from scaletrain.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_steps, args=(r, 2, os.path.join(tmp, "s"), port, blocks, steps, q))
                 for r in range(2)]
        for p in procs:
            p.start()
        out = q.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
    return out


def cli_cost(runs: int, steps: int) -> dict[str, list[float]]:
    """`scaletrain train --nproc 2` with the defaults against heartbeat and recorder off, runs alternating."""
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2 * runs):
            on = (i + i // 2) % 2 == 0  # on, off, off, on, on, off, ...: neither side always goes first
            sets = {**TINY, "train.steps": steps}
            if not on:
                sets.update({"parallel.heartbeat_s": 0, "parallel.flight_recorder": 0})
            argv = [sys.executable, "-m", "scaletrain", "train", "--nproc", "2", "--out", f"{tmp}/r{i}"]
            for k, v in sets.items():
                argv += ["--set", f"{k}={v}"]
            p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if p.returncode:
                raise SystemExit(p.stderr)
            rows = [json.loads(x) for x in Path(f"{tmp}/r{i}/metrics.jsonl").read_text().splitlines()]
            out.setdefault("on" if on else "off", []).append(statistics.median(r["step_time_s"] for r in rows[2:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--runs", type=int, default=4, help="whole `train --nproc 2` runs per side (0: skip)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    bare, wrapped = wrapper_cost()
    print(f"load average {load:.1f}; torch {torch.__version__}\n")
    print("| recorder wrapper around a no-op | ns per call |\n|---|---|")
    print(f"| bare no-op | {bare:.0f} |\n| wrapped (entry written, step read, time taken) | {wrapped:.0f} |")
    print(f"| added by the recorder | {wrapped - bare:.0f} |\n")
    one = one_process_cost()
    print("| gloo all_reduce on a group of 1 (40 alternating blocks of 1000 calls) | off: us/call min, median | "
          "on | added (min, median) |\n|---|---|---|---|")
    for label in ("1 float", "256 KiB"):
        off, on = one[f"{label} off"], one[f"{label} on"]
        print(f"| {label} | {min(off):.2f}, {statistics.median(off):.2f} | {min(on):.2f}, {statistics.median(on):.2f} "
              f"| {min(on) - min(off):+.2f}, {statistics.median(on) - statistics.median(off):+.2f} |")
    print()
    res = collective_cost(args.blocks, args.calls)
    print(f"| gloo all_reduce, 2 processes | recorder off, us/call (median of {args.blocks} blocks, spread) "
          "| recorder on | ratio of medians on/off | ratio of minima |\n|---|---|---|---|---|")
    for label in ("1 float", "256 KiB"):
        off, on = res[f"{label} off"], res[f"{label} on"]
        mo, mn = statistics.median(off), statistics.median(on)
        print(f"| {label} | {mo:.1f} ({min(off):.1f}-{max(off):.1f}) | {mn:.1f} ({min(on):.1f}-{max(on):.1f}) "
              f"| {mn / mo:.3f} | {min(on) / min(off):.3f} |")
    times, cpu, calls = step_cost(args.blocks, args.steps)
    base = statistics.median(times["off"])
    low = min(times["off"])
    print(f"\n| dp=2 training step, tiny model, 2 processes ({calls} recorded calls per step) | ms per step (median "
          f"of {args.blocks} blocks of {args.steps} steps, spread) | ratio of medians to off | ratio of minima |"
          "\n|---|---|---|---|")
    for m in MODES:
        v = times[m]
        print(f"| {m} | {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) | {statistics.median(v) / base:.3f} "
              f"| {min(v) / low:.3f} |")
    cbase = statistics.median(cpu["off"])
    print("\n| same blocks: rank 0's process CPU time per step (all its threads; waiting is free) | ms (median, "
          "spread) | ratio of medians to off |\n|---|---|---|")
    for m in MODES:
        v = cpu[m]
        print(f"| {m} | {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}) | {statistics.median(v) / cbase:.3f} |")
    if args.runs:
        st = cli_cost(args.runs, args.steps)
        off, on = st["off"], st["on"]
        print(f"\n| `scaletrain train --nproc 2`, whole runs | median step_time_s over {args.runs} runs (spread) |"
              "\n|---|---|")
        print(f"| heartbeat_s=0, flight_recorder=0 | {statistics.median(off) * 1e3:.2f} ms "
              f"({min(off) * 1e3:.2f}-{max(off) * 1e3:.2f}) |")
        print(f"| defaults (heartbeat_s=5, flight_recorder=256) | {statistics.median(on) * 1e3:.2f} ms "
              f"({min(on) * 1e3:.2f}-{max(on) * 1e3:.2f}) |")
        print(f"| ratio | {statistics.median(on) / statistics.median(off):.3f} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
