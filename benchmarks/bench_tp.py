"""scaletrain tensor parallelism (tp=2) against PyTorch DTensor `parallelize_module` on the same GPT.

Both sides start from the same plain GPT (same (seed, name) initial weights), split it the same way over 2
processes (gloo, CPU, one thread each) and run the same training step: forward, vocab-parallel loss,
backward, AdamW. scaletrain uses its Engine (`apply_tp`: ColumnParallelLinear / RowParallelLinear /
vocab-parallel embedding, head and cross-entropy). DTensor uses ColwiseParallel on qkv and fc,
RowwiseParallel on the projections, RowwiseParallel on the embedding and ColwiseParallel with Shard(-1)
logits under `loss_parallel()` on the tied head (torchtitan's recipe); the qkv rows are permuted first so
that DTensor's contiguous split gives each rank its own heads (without it the DTensor model is a
different function). The first-step losses of the two are printed as a check that they compute the same thing.

Steps are timed in alternating blocks (scaletrain, DTensor, scaletrain, ...) so both see the same machine
load; the table reports the median over blocks of tokens/s, the ratio of the medians and the median of the
ratios of adjacent blocks (robust to load that changes during the run).

    python benchmarks/bench_tp.py [--layers 4 --d-model 256 --heads 8 --seq 128 --batch 8 --steps 5 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _config(args):
    from scaletrain.config import load_config, validate

    sets = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
            "model.seq_len": args.seq, "train.micro_batch": args.batch, "train.global_batch": args.batch,
            "parallel.tp": 2, "train.dtype": "fp32", "train.device": "cpu"}
    return validate(load_config(None, [f"{k}={v}" for k, v in sets.items()]), 2)


def _scaletrain(cfg):
    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.parallel.parallelize import build_engine

    engine = build_engine(cfg, Mesh.build(ParallelDims(tp=2)), torch.device("cpu"), torch.float32, CommStats())
    scale = 1.0 / cfg.tokens_per_step

    def step(x, y):
        loss = engine.forward_backward([(x, y)], scale)
        engine.optimizer.step(cfg.train.lr)
        engine.optimizer.zero_grad()
        return float(loss)  # the mean token loss

    return step


def _dtensor(cfg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    from scaletrain.model import build_gpt
    from scaletrain.optim import decay_groups

    model = build_gpt(cfg.model, cfg.train.seed, "cpu", torch.float32)
    n = 2
    with torch.no_grad():  # rows [q; k; v] -> [q_0; k_0; v_0; q_1; k_1; v_1] so Shard(0) gives each rank its heads
        for block in model.blocks:
            for t in (block.attn.qkv.weight, block.attn.qkv.bias):
                if t is not None:
                    parts = [p.chunk(n, 0) for p in t.chunk(3, 0)]
                    t.copy_(torch.cat([parts[j][r] for r in range(n) for j in range(3)], 0))
    mesh = init_device_mesh("cpu", (n,))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
            "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # re-tie: both are Shard(0) over the vocabulary
    params = list(model.parameters())
    o = cfg.optim
    opt = torch.optim.AdamW(decay_groups(params, o.weight_decay), lr=cfg.train.lr, betas=(o.beta1, o.beta2),
                            eps=o.eps)
    scale = 1.0 / cfg.tokens_per_step

    def step(x, y):
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") * scale
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    return step


def _rank(rank: int, store: str, args, out):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    cfg = _config(args)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g) for _ in range(2))
    sides = {"scaletrain": _scaletrain(cfg), "dtensor": _dtensor(cfg)}
    first = {name: step(x, y) for name, step in sides.items()}  # also the warm-up
    for step in sides.values():
        step(x, y)
    rates = alternate(sides, x, y, args.repeats, args.steps)
    if rank == 0:
        out.put((first, rates))
    dist.destroy_process_group()


def alternate(sides: dict, x: torch.Tensor, y: torch.Tensor, repeats: int, steps: int) -> dict[str, list[float]]:
    """Tokens/s of each side's `step(x, y)`: `repeats` rounds in which the sides take turns at a block of `steps`
    steps, each block timed by the slowest rank (also used by bench_tp_nd.py)."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, step in sides.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            rates[name].append(steps * x.numel() / float(dt))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per side")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), args, q)) for r in range(2)]
        for p in procs:
            p.start()
        first, rates = q.get()
        for p in procs:
            p.join()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, "
          f"batch {args.batch}, fp32, tp=2 on 2 gloo CPU processes x {args.threads} thread(s)")
    print(f"first-step loss: scaletrain {first['scaletrain']:.6f}, DTensor {first['dtensor']:.6f}")
    print("| implementation | tokens/s (median) | blocks |")
    print("|---|---|---|")
    for k in rates:
        print(f"| {k} | {med[k]:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[k])} |")
    paired = [a / b for a, b in zip(rates["scaletrain"], rates["dtensor"])]  # adjacent blocks, same load
    print(f"ratio scaletrain / DTensor: {med['scaletrain'] / med['dtensor']:.3f} (medians); "
          f"{statistics.median(paired):.3f} (median of adjacent-block ratios, range "
          f"{min(paired):.2f}-{max(paired):.2f})")


if __name__ == "__main__":
    main()
