"""Context parallelism (docs/context_parallel.md): the longest trainable sequence within a memory budget, and the step
time of ring attention (arXiv 2310.01889) and Ulysses (arXiv 2309.14509) against torch's own context parallelism.

`longest`: for cp = 1, 2, 4 (ring), the longest `model.seq_len` that `scaletrain train --nproc cp` trains for 2
steps within `memory.budget_gb` (the run is refused before launch when the planner's resident bytes exceed the
budget, and stopped at the first step whose measured resident bytes do): sequences grow by doubling from --start
until a run fails, then bisect to a multiple of --granularity. RoPE positions (learned ones would add a T x C table
on every rank). Context parallelism should let the sequence grow close to linearly in cp.

`speed`: one small GPT at --seq tokens, alternating rounds of (one process, ring at cp 2, Ulysses at cp 2), each
`scaletrain train` for --steps steps; the step time is the median `step_time_s` of the steps after the first
(metrics.jsonl); the table gives the median and spread (min-max) over rounds and the ratios of the medians. Each
run's cp bytes per step are checked against the planner's (`plan.analytic.context.step_bytes`). torch's own
`torch.distributed.tensor.experimental.context_parallel` is tried first on the same attention on CPU/gloo; when it
does not run there, its exact error is printed and the comparison is against the single-process step.

    .venv/bin/python benchmarks/bench_cp.py longest [--budget-gb 0.0625 --cps 1,2,4]
    .venv/bin/python benchmarks/bench_cp.py speed [--seq 2048 --rounds 5 --steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCALETRAIN = [sys.executable, "-m", "scaletrain"]


def _train(sets: dict, nproc: int, out: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    argv = [*SCALETRAIN, "train", "--nproc", str(nproc), "--out", str(out)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


# --------------------------------------------------------------------------- longest trainable sequence


def _fits(cp: int, seq: int, args) -> bool:
    sets = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
            "model.position": "rope", "model.seq_len": seq, "parallel.cp": cp, "train.global_batch": 1,
            "train.micro_batch": 1, "train.steps": 2, "train.eval_every": 0, "train.checkpoint_every": 0,
            "train.report": "false", "memory.budget_gb": args.budget_gb}
    with tempfile.TemporaryDirectory() as tmp:
        r = _train(sets, cp, Path(tmp) / "run")
    if r.returncode == 0:
        return True
    if "memory.budget_gb" in r.stderr:
        return False
    raise RuntimeError(f"cp {cp}, seq {seq}: exit {r.returncode}\n{r.stderr[-2000:]}")


def longest(args) -> None:
    g = args.granularity
    rows = []
    for cp in [int(c) for c in args.cps.split(",")]:
        lo, hi = 0, args.start
        while _fits(cp, hi, args):  # gallop
            lo, hi = hi, 2 * hi
            print(f"cp {cp}: {lo} fits", flush=True)
        while hi - lo > g:  # bisect on multiples of the granularity
            mid = (lo + hi) // 2 // g * g
            if _fits(cp, mid, args):
                lo = mid
            else:
                hi = mid
            print(f"cp {cp}: [{lo}, {hi})", flush=True)
        rows.append((cp, lo))
    base = rows[0][1] or 1
    print(f"\nlongest sequence within memory.budget_gb={args.budget_gb} (model {args.layers} layer(s), d_model "
          f"{args.d_model}, {args.heads} heads, RoPE, fp32, batch 1; granularity {g}):\n")
    print("| cp | longest seq_len | tokens per rank | vs cp 1 |")
    print("|---|---|---|---|")
    for cp, seq in rows:
        print(f"| {cp} | {seq} | {seq // cp} | {seq / base:.2f}x |")


# --------------------------------------------------------------------------- step time


TORCH_CP_PROBE = r"""
import os, torch, torch.distributed as dist, torch.nn.functional as F, torch.multiprocessing as mp
def main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    lin, x = torch.nn.Linear(64, 192), torch.randn(2, 64, 64)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            q, k, v = lin(x).view(2, x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        if rank == 0: print("OK")
    except Exception as e:
        if rank == 0: print(f"{type(e).__name__}: {e}")
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(main, args=(2, 29000 + os.getpid() % 1000), nprocs=2)
"""


def torch_context_parallel_on_cpu() -> str:
    """Run torch's context_parallel on a causal SDPA over gloo (2 processes); its outcome line."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(TORCH_CP_PROBE)
    try:
        r = subprocess.run([sys.executable, f.name], capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    return (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]


def _step_times(out: Path) -> tuple[float, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[1:]]
    return statistics.median(times), {k: v for k, v in rows[-1].items() if k.startswith("comm_cp")}


def speed(args) -> None:
    from scaletrain.config import load_config, validate
    from scaletrain.plan.analytic.context import step_bytes

    outcome = torch_context_parallel_on_cpu()
    print(f"torch.distributed.tensor.experimental.context_parallel on CPU/gloo: {outcome}", flush=True)
    base = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
            "model.position": "rope", "model.seq_len": args.seq, "train.global_batch": args.batch,
            "train.micro_batch": args.batch, "train.steps": args.steps, "train.eval_every": 0,
            "train.checkpoint_every": 0, "train.report": "false", "train.warmup_steps": 1}
    sides = {"one process": ({}, 1), "ring cp 2": ({"parallel.cp": 2}, 2),
             "ulysses cp 2": ({"parallel.cp": 2, "parallel.cp_mode": "ulysses"}, 2)}
    if outcome == "OK":
        print("(torch's context parallelism ran: extend this benchmark with its side)")
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rnd in range(args.rounds):
        for name, (extra, nproc) in sides.items():
            with tempfile.TemporaryDirectory() as tmp:
                r = _train({**base, **extra}, nproc, Path(tmp) / "run")
                if r.returncode:
                    raise RuntimeError(f"{name}: exit {r.returncode}\n{r.stderr[-2000:]}")
                t, comm = _step_times(Path(tmp) / "run")
            times[name].append(t)
            if extra:
                cfg = validate(load_config(None, [f"{k}={v}" for k, v in {**base, **extra}.items()]), nproc)
                want = step_bytes(cfg).as_metrics()
                assert comm == want, f"{name}: measured {comm}, planned {want}"
            print(f"round {rnd + 1} {name}: {t:.3f} s/step {comm or ''}", flush=True)
    one = statistics.median(times["one process"])
    print(f"\nstep time, {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {args.seq} tokens x "
          f"batch {args.batch}, fp32, {args.rounds} alternated rounds of {args.steps} steps:\n")
    print("| side | processes | median s/step | min-max | vs one process | tokens/s per process vs one process |")
    print("|---|---|---|---|---|---|")
    for name, (_, nproc) in sides.items():
        med = statistics.median(times[name])
        print(f"| {name} | {nproc} | {med:.3f} | {min(times[name]):.3f}-{max(times[name]):.3f} | "
              f"{med / one:.2f}x | {one / med / nproc:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    lo = sub.add_parser("longest")
    lo.add_argument("--budget-gb", type=float, default=0.0625)
    lo.add_argument("--cps", default="1,2,4")
    lo.add_argument("--start", type=int, default=2048)
    lo.add_argument("--granularity", type=int, default=512)
    sp = sub.add_parser("speed")
    sp.add_argument("--seq", type=int, default=2048)
    sp.add_argument("--batch", type=int, default=2)
    sp.add_argument("--rounds", type=int, default=5)
    sp.add_argument("--steps", type=int, default=4)
    for p in (lo, sp):
        p.add_argument("--layers", type=int, default=2 if p is sp else 1)
        p.add_argument("--d-model", type=int, default=64)
        p.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    (longest if args.what == "longest" else speed)(args)


if __name__ == "__main__":
    main()
