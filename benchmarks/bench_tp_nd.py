"""1D vs 2D vs 2.5D vs 3D tensor parallelism on the same GPT at world 4 and 8: tokens/s, activation memory and
bytes sent per rank; and, with --plan, the planner's per-layer comparison at cluster scale.

Measured: world 4 runs 1d (tp 4) and 2d (2 x 2); world 8 runs 1d (tp 8), 2.5d (2 x 2 x 2) and 3d (2 x 2 x 2), each
on gloo CPU processes of one thread, from the same (seed, name) weights. A step is the engine's forward, loss,
backward and AdamW on one micro-batch. The modes are timed in alternating blocks (1d, 2d, 1d, 2d, ...) so they see
the same machine load; the table gives the median over blocks of tokens/s with the range, the bytes autograd saves
per rank on the first forward (`mem_activations`), the parameter bytes per rank, and the bytes each rank sends per
step by collective (CommStats, ring conventions of distributed/comm.py: `tp.*` from the tensor-parallel layers, a
bare `all_reduce` the gradient reduction, which 2.5d runs over its depth). The first-step losses are printed: equal
across modes (they compute the same function).

    OMP_NUM_THREADS=1 python benchmarks/bench_tp_nd.py --world 4 8 [--layers 4 --d-model 256 --heads 8 --seq 128
        --batch 8 --steps 3 --repeats 5]
    python benchmarks/bench_tp_nd.py --plan          # the planner's table (no processes)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_tp import alternate

MODES = {4: [("1d", {"parallel.tp": 4}), ("2d", {"parallel.tp": 4, "parallel.tp_mode": "2d"})],
         8: [("1d", {"parallel.tp": 8}),
             ("2.5d", {"parallel.tp": 8, "parallel.tp_mode": "2.5d", "parallel.tp_depth": 2}),
             ("3d", {"parallel.tp": 8, "parallel.tp_mode": "3d"})]}


def _config(args, overrides: dict, world: int):
    from scaletrain.config import load_config, validate

    sets = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
            "model.seq_len": args.seq, "train.micro_batch": args.batch, "train.global_batch": args.batch,
            "train.dtype": "fp32", "train.device": "cpu", **overrides}
    return validate(load_config(None, [f"{k}={v}" for k, v in sets.items()]), world)


def _engine(cfg):
    from scaletrain.device.accounting import tensor_bytes
    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.parallel.parallelize import build_engine

    comm = CommStats()
    engine = build_engine(cfg, Mesh.build(ParallelDims.from_config(cfg.parallel), 600), torch.device("cpu"),
                          torch.float32, comm)
    scale = 1.0 / cfg.tokens_per_step

    def step(x, y):
        loss = engine.forward_backward([(x, y)], scale)
        engine.optimizer.step(cfg.train.lr)
        engine.optimizer.zero_grad()
        return float(loss)

    return step, engine, comm, tensor_bytes(engine.module.parameters())


def _rank(rank: int, world: int, store: str, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(2))
    sides, first, info = {}, {}, {}
    for name, overrides in MODES[world]:
        step, engine, comm, param_bytes = _engine(_config(args, overrides, world))
        comm.reset()
        first[name] = step(x, y)  # also the warm-up
        sent = dict(comm.bytes)  # one step
        acts = torch.tensor([float(engine.activation_bytes)])
        dist.all_reduce(acts, op=dist.ReduceOp.MAX)
        info[name] = (int(acts), param_bytes, sent)
        sides[name] = step
    rates = alternate(sides, x, y, args.repeats, args.steps)
    if rank == 0:
        out.put((first, info, rates))
    dist.destroy_process_group()


def measure(world: int, args) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), args, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        first, info, rates = q.get()
        for p in procs:
            p.join()
    print(f"\nworld {world}: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, "
          f"micro-batch {args.batch}, fp32, gloo CPU processes x 1 thread; {args.repeats} blocks of {args.steps} steps")
    print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
    print("| mode | tokens/s (median) | range | activations / rank | params / rank | sent / rank / step | by kind |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rates.items():
        acts, params, sent = info[name]
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(sent.items()))  # tp.*: the tp layers; else gradients
        print(f"| {name} | {statistics.median(r):,.0f} | {min(r):,.0f}-{max(r):,.0f} | {acts:,} | {params:,} | "
              f"{sum(sent.values()):,} | {kinds} |")


def plan_table() -> None:
    """The planner's per-layer tensor-parallel bytes and time, and step times, for Megatron's 310B model."""
    from scaletrain.plan import catalog, hardware
    from scaletrain.plan.analytic import tp_nd
    from scaletrain.plan.analytic.estimate import estimate
    from scaletrain.plan.analytic.inputs import DEFAULT_ASSUMPTIONS, Layout, Training

    gpu, a = hardware.get_gpu("a100-80gb"), DEFAULT_ASSUMPTIONS
    m = catalog.get_model("megatron-310b")
    print(f"\n{m.name} (h {m.d_model}, {m.n_heads} heads, seq {m.seq_len}), bf16, {gpu.name} nodes of "
          f"{gpu.gpus_per_node} (NVLink {gpu.intra_bw / 1e9:.0f} GB/s, {gpu.inter_bw / 1e9:.0f} GB/s per NIC): per "
          "layer and micro-batch, the bytes each rank sends and the time of the tensor-parallel collectives")
    print("| t | sequences / micro-batch | 1d | 2d | 3d |")
    print("|---|---|---|---|---|")
    for tp in (8, 16, 64):
        for mb in (4, 16, 64):
            cells = []
            for mode in ("1d", "2d", "3d"):
                try:
                    x = tp_nd.dims_of(m, mb, 2)
                    nbytes = sum(tp_nd.layer_comm_bytes(mode, tp, x).values())
                    seconds = sum(tp_nd.layer_comm_time(mode, tp, x, gpu, a))
                    cells.append(f"{nbytes / 1e9:.2f} GB, {seconds * 1e3:.1f} ms")
                except Exception as e:  # noqa: BLE001 - a grid this t does not form, or a micro-batch it cannot split
                    cells.append("-" if "is not q" in str(e) else "(micro-batch too small)")
            print(f"| {tp} | {mb} | " + " | ".join(cells) + " |")
    train = Training(8192, "bf16")
    print(f"\nstep time, t = 64 x dp 16 = 1024 GPUs, pp 1, full recomputation, ZeRO-1, global batch "
          f"{train.global_batch}")
    print("| sequences / micro-batch | 1d (+ sp) | 2d | 3d |")
    print("|---|---|---|---|")
    for mb in (16, 32, 64):
        cells = []
        for mode in ("1d", "2d", "3d"):
            lay = Layout(tp=64, dp=16, zero=1, micro_batch=mb, recompute="full", tp_mode=mode,
                         sequence_parallel=mode == "1d")
            est = estimate(m, gpu, train, lay, n_gpus=1024)
            fit = f"{est.memory['total'] / 2**30:.0f} GiB" + ("" if est.fits else " > 80")
            cells.append(f"{est.step_time_s:.1f} s, tp comm {est.time_breakdown['tp_comm']:.1f} s, {fit}")
        print(f"| {mb} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, nargs="*", default=[4, 8], choices=(4, 8))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per mode")
    ap.add_argument("--plan", action="store_true", help="print the planner's table instead of measuring")
    args = ap.parse_args()
    if args.plan:
        plan_table()
        return
    for world in args.world:
        measure(world, args)


if __name__ == "__main__":
    main()
