"""ZeRO-3 with and without resharding after forward, next to PyTorch FSDP2's `fully_shard(reshard_after_forward=...)`.

Four sides on 2 gloo processes (CPU), the same GPT (fp32), batches and AdamW:

- `scaletrain ZeRO-3, reshard`: `scaletrain.parallel.zero(model, stage=3)` (units: the root and each block);
- `scaletrain ZeRO-3, keep`: the same with `reshard_after_forward=False` (parallel.reshard_after_forward=false);
- `torch FSDP2, reshard` / `torch FSDP2, keep`: `fully_shard` on every block, then the root, with
  `reshard_after_forward=True` / `False`.

Printed: seconds per step (median and interquartile range over `--repeats` rounds; the sides alternate inside each
round, each timing `--steps` steps between barriers, the max over ranks), each side's ratio to FSDP2 with the same
setting, the all-gather bytes per step scaletrain counts, its `mem_params_gathered` (the gathered-parameter peak)
next to the planner's prediction from the same units, and each side's peak RSS growth over its steps in a fresh pair
of processes (Linux `ru_maxrss`: includes activations and temporaries; the difference between reshard and keep is
the gathered parameters).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_reshard.py [--layers 8 --d-model 256 --repeats 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2
LR, WD, BETAS = 1e-3, 0.1, (0.9, 0.95)
SIDES = ("scaletrain ZeRO-3, reshard", "scaletrain ZeRO-3, keep", "torch FSDP2, reshard", "torch FSDP2, keep")


def _model(args):
    from scaletrain.config import load_config
    from scaletrain.model import build_gpt

    sets = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
            "model.seq_len": args.seq}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()]).model
    return build_gpt(cfg, 1234, "cpu", torch.float32)


def _batches(args, rank: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from scaletrain.data import BatchLoader, load_tokens

    loader = BatchLoader(load_tokens("builtin"), args.seq, WORLD * args.batch, 1234)
    return [tuple(t[rank * args.batch: (rank + 1) * args.batch] for t in loader.global_batch_at(k))
            for k in range(1, count + 1)]


class Side:
    """One training step: forward, loss (mean over the rank's tokens), backward, the optimizer's step."""

    def __init__(self, name: str, args):
        import torch.nn.functional as F

        self.name, self.F, self.opt, self.zero = name, F, None, None
        self.model = _model(args)
        keep = name.endswith("keep")
        if name.startswith("scaletrain"):
            import scaletrain.parallel as stp

            self.zero = stp.zero(self.model, stage=3, group=dist.group.WORLD, lr=LR, betas=BETAS, weight_decay=WD,
                                 reshard_after_forward=not keep)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
            fully_shard(self.model, mesh=mesh, reshard_after_forward=not keep)
            params = list(self.model.parameters())
            self.opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
                                          {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                         lr=LR, betas=BETAS)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.zero is not None:
            self.zero.begin_micro(0, 1)
        logits = self.model(x)
        loss = self.F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if self.zero is not None:
            self.zero.finish_backward()
            self.zero.step()
            self.zero.zero_grad()
        else:
            self.opt.step()
            self.opt.zero_grad()
        return float(loss.detach())


def _init(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=900))


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timing_rank(rank: int, store: str, args, q) -> None:
    _init(rank, store)
    batches = _batches(args, rank)
    sides = {name: Side(name, args) for name in SIDES}
    first = {name: side.step(*batches[0]) for name, side in sides.items()}  # warm-up, and the losses agree
    gathered, ag = {}, {}
    for name, side in sides.items():
        if side.zero is not None:
            side.zero.comm.reset()
            side.step(*batches[1])
            ag[name] = side.zero.comm.bytes["all_gather"]
            gathered[name] = side.zero.gathered.peak
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    for r in range(args.repeats):
        order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]  # rotate who goes first
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(args.steps):
                sides[name].step(*batches[(r + k) % len(batches)])
            dist.barrier()
            times[name].append(_max(time.perf_counter() - t0) / args.steps)
    if rank == 0:
        q.put(("timing", {"first": first, "times": times, "gathered": gathered, "all_gather": ag}))
    dist.destroy_process_group()


def memory_rank(rank: int, store: str, args, q, name: str) -> None:
    """A fresh pair of processes trains only `name`: peak RSS growth over its steps."""
    _init(rank, store)
    batches = _batches(args, rank)
    side = Side(name, args)
    dist.barrier()
    start = _rss()
    for k in range(args.steps + 1):
        side.step(*batches[k % len(batches)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    growth = _max(peak - start)
    if rank == 0:
        q.put(("memory", name, growth))
    dist.destroy_process_group()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _spawn(target, args, *extra) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, store, args, q, *extra)) for r in range(WORLD)]
        for p in procs:
            p.start()
        out = q.get(timeout=3600)
        for p in procs:
            p.join()
    return out


def _planned(args) -> dict[str, int]:
    """The planner's `plan_mem_params_gathered` for the same model, dp 2, ZeRO-3, each setting."""
    from scaletrain.config import load_config
    from scaletrain.plan import predict_run

    sets = [f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", f"model.n_heads={args.heads}",
            f"model.seq_len={args.seq}", "parallel.dp=2", "parallel.zero=3"]
    out = {}
    for name, keep in (("scaletrain ZeRO-3, reshard", "true"), ("scaletrain ZeRO-3, keep", "false")):
        cfg = load_config(None, [*sets, f"parallel.reshard_after_forward={keep}"])
        out[name] = predict_run(cfg)["plan_mem_params_gathered"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--steps", type=int, default=3, help="steps timed per side and round")
    ap.add_argument("--repeats", type=int, default=7, help="rounds")
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak-RSS runs")
    args = ap.parse_args()
    res = _spawn(timing_rank, args)[1]
    mem = {} if args.no_rss else {name: _spawn(memory_rank, args, name)[2] for name in SIDES}
    planned = _planned(args)
    MiB = 2**20
    print(f"model: {args.layers} layers, d_model {args.d_model}, seq {args.seq}, {args.batch} sequences per rank, "
          f"fp32, {WORLD} gloo processes; {args.repeats} rounds x {args.steps} steps")
    print("first-step losses: " + ", ".join(f"{k} {v:.6f}" for k, v in res["first"].items()))
    print("\n| side | s/step median | IQR | vs FSDP2 same setting | all-gather MiB/step | gathered peak MiB "
          "(plan) | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|---|")
    for name in SIDES:
        t = res["times"][name]
        q1, _, q3 = statistics.quantiles(t, n=4)
        twin = "torch FSDP2, " + name.split(", ")[1]
        ratio = statistics.median(t) / statistics.median(res["times"][twin])
        ag = f"{res['all_gather'][name] / MiB:.2f}" if name in res["all_gather"] else "-"
        g = f"{res['gathered'][name] / MiB:.2f} ({planned[name] / MiB:.2f})" if name in res["gathered"] else "-"
        rss = f"{mem[name] / MiB:.0f}" if name in mem else "-"
        print(f"| {name} | {statistics.median(t):.3f} | {q1:.3f}-{q3:.3f} | {ratio:.2f} | {ag} | {g} | {rss} |")


if __name__ == "__main__":
    main()
