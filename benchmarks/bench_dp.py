"""scaletrain data parallelism and ZeRO-3 against PyTorch's DDP and FSDP2 on 2 CPU processes (gloo).

Every side trains the same GPT (`build_gpt`, same (seed, name) initial weights) on the same batches (the
builtin corpus through `BatchLoader`; each rank takes its half of the global batch) with the same step:
forward, per-rank mean cross-entropy, backward, gradient averaging over the 2 ranks, global-norm clipping
at 1.0, AdamW (decay on matrices only), zero_grad. The sides:

- `scaletrain dp`: `scaletrain.parallel.data_parallel` (flat buckets all-reduced asynchronously from
  post-accumulate-grad hooks during backward);
- `torch DDP`: `torch.nn.parallel.DistributedDataParallel` with the same bucket size, `clip_grad_norm_`;
- `scaletrain dp, blocking`: the same buckets all-reduced one after the other after backward (hooks idle),
  to measure the all-reduce time and what overlapping saves;
- `scaletrain ZeRO-3`: `scaletrain.parallel.zero(model, stage=3)` (units: every block, then the root);
- `torch FSDP2`: `fully_shard` on every block, then the root (defaults: reshard after forward);
- `single process`: rank 0 alone trains its half of the batch (no process group, the other rank waits at
  a barrier), the denominator of scaling efficiency = tokens/s(dp, 2 ranks) / (2 x tokens/s(single)) by the
  wall clock, and tokens per CPU-second of dp / of the single process by CPU time.

Timing: after one untimed warm-up step per side, blocks of `--steps` steps of every side alternate
(round-robin, `--repeats` rounds) so all sides see the same machine noise; a block's time is the max over
ranks; tokens/s counts the tokens of all ranks. Reported: median, IQR and min-max over blocks, ratios of
medians and of each round's pair; the same by CPU time (`time.process_time` summed over both ranks, all
threads: what the work costs, less disturbed by other processes on a shared machine).

Overlap: `exposed` is the time scaletrain dp waits in `finish_backward` for all-reduces still running after
backward (`BucketedAllReduce.exposed_s`, per step); it also contains waiting for the slower rank's
backward, so it is reported a second time counted from the end of the last rank's backward (`perf_counter`
is CLOCK_MONOTONIC, one clock for all processes of the machine). `blocking` is the time of the same bucket
all-reduces run one after the other after backward (after a barrier, so it is communication only).
Hidden fraction = 1 - exposed / blocking.

Memory (ZeRO-3 vs FSDP2): the bytes each rank holds for parameters, gradients and optimizer state after
the optimizer step (before zero_grad), counted from tensor storages with `device.accounting.tensor_bytes`
(FSDP2: the local shards of its DTensors); and the peak RSS of fresh processes that train only that side
for a few steps, with the RSS at start (after imports and data loading) for reference.

`--phases N` instead times each phase of a step (forward, backward, comm, clip, step, zero_grad) of the
four compared sides, CPU and wall, to show where one side spends more than the other.

    OMP_NUM_THREADS=1 python benchmarks/bench_dp.py [--layers 8 --d-model 256 --heads 8 --seq 128
        --batch 2 --bucket-mb 4 --steps 2 --repeats 7]
    OMP_NUM_THREADS=1 python benchmarks/bench_dp.py --phases 20
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank: 2 ranks on 2 cores

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

WORLD = 2
LR = 1e-3
WD = 0.1
BETAS = (0.9, 0.95)
CLIP = 1.0
SIDES = ("single process", "scaletrain dp", "torch DDP", "scaletrain dp, blocking", "scaletrain ZeRO-3",
         "torch FSDP2")
PAIRS = (("scaletrain dp", "torch DDP"), ("scaletrain ZeRO-3", "torch FSDP2"))


def _model_config(args):
    from scaletrain.config import load_config

    sets = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": args.heads,
            "model.seq_len": args.seq}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()]).model


def _model(args):
    from scaletrain.model import build_gpt

    return build_gpt(_model_config(args), 1234, "cpu", torch.float32)


def _adamw(params):
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS)


def _batches(args, rank: int, count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's half of the global batches of steps 1..count (then cycled)."""
    from scaletrain.data import BatchLoader, load_tokens

    loader = BatchLoader(load_tokens("builtin"), args.seq, WORLD * args.batch, 1234)
    return [tuple(t[rank * args.batch: (rank + 1) * args.batch] for t in loader.global_batch_at(k))
            for k in range(1, count + 1)]


# --------------------------------------------------------------------------- the sides
# A side is its training step as named phases (forward, backward, comm, clip, step, zero_grad) sharing one
# state dict; `Side.step` runs them in order, `--phases` times them one by one.


@dataclass
class Side:
    phases: list[tuple[str, Callable[[], None]]]
    held: Callable[[], dict[str, int]]  # bytes of parameters / gradients / optimizer state held now
    state: dict = field(default_factory=dict)  # x, y, loss
    times: dict = field(default_factory=dict)  # side-specific per-step records
    buckets: int = 0

    def step(self, x, y, measure: bool = False) -> tuple[float, dict[str, int] | None]:
        """One training step; with `measure`, also the bytes held after the optimizer step (before zero_grad)."""
        self.state["x"], self.state["y"] = x, y
        held = None
        for name, fn in self.phases:
            if name == "zero_grad" and measure:
                held = self.held()
            fn()
        return float(self.state["loss"]), held


def _held(params, grads, optim) -> dict[str, int]:
    from scaletrain.device.accounting import tensor_bytes

    return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optim": tensor_bytes(optim)}


def _state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _forward(model, st: dict, before: Callable[[], None] | None = None) -> Callable[[], None]:
    def fn():
        if before is not None:
            before()
        logits = model(st["x"])
        st["loss"] = F.cross_entropy(logits.flatten(0, 1), st["y"].flatten())  # per-rank mean
    return fn


def _backward(st: dict) -> Callable[[], None]:
    def fn():
        st["loss"].backward()
        st["loss"] = st["loss"].detach()
    return fn


def _torch_side(model, params) -> Side:
    """forward, backward (DDP / FSDP2 communicate inside it), clip_grad_norm_, AdamW, zero_grad."""
    opt = _adamw(params)
    st: dict = {}

    def local(ts):  # FSDP2's DTensors -> their local shards
        return [t.to_local() if hasattr(t, "to_local") else t for t in ts if t is not None]

    return Side([("forward", _forward(model, st)), ("backward", _backward(st)),
                 ("clip", lambda: torch.nn.utils.clip_grad_norm_(params, CLIP)), ("step", opt.step),
                 ("zero_grad", opt.zero_grad)],
                lambda: _held(local(params), local(p.grad for p in params), local(_state_tensors(opt))), st)


def side_single(args) -> Side:
    # A plain loop: ReplicatedOptimizer with group=None would still all-reduce the gradient norm over the
    # world, since torch.distributed is initialised (data_parallel.py, global_grad_norm(world=True)).
    model = _model(args)
    return _torch_side(model, list(model.parameters()))


def side_ddp(args) -> Side:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(args), bucket_cap_mb=args.bucket_mb)
    return _torch_side(model, list(model.parameters()))


def side_fsdp2(args) -> Side:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(args)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _torch_side(model, list(model.parameters()))


def side_st_dp(args, blocking: bool = False) -> Side:
    import scaletrain.parallel as stp

    model = _model(args)
    opt = stp.data_parallel(model, _adamw(model.parameters()), group=dist.group.WORLD, bucket_mb=args.bucket_mb)
    reducer = opt.reducer
    st: dict = {}
    # per step: perf_counter (CLOCK_MONOTONIC, one clock for all processes of the machine) at the end of
    # backward and at the end of the gradient communication, and scaletrain's own exposed_s increment
    times: dict[str, list[float]] = {"backward_end": [], "comm_end": [], "exposed_s": [], "comm_s": []}

    def backward():
        st["loss"].backward()
        st["loss"] = st["loss"].detach()
        times["backward_end"].append(time.perf_counter())

    def overlapped():  # wait for the buckets launched during backward
        e0 = reducer.exposed_s
        opt.finish_backward()
        times["comm_end"].append(time.perf_counter())
        times["exposed_s"].append(reducer.exposed_s - e0)

    def after_backward():  # the same buckets, all-reduced one after the other now
        dist.barrier()  # so the timed part is communication, not waiting for the other rank's backward
        t0 = time.perf_counter()
        for b in reducer.buckets:
            dist.all_reduce(b.grad)
        times["comm_end"].append(time.perf_counter())
        times["comm_s"].append(times["comm_end"][-1] - t0)
        torch._foreach_div_([p.grad for p in opt.params], WORLD)

    # blocking: "not the last micro-batch" (begin_micro(0, 2)) so the hooks launch nothing
    before = (lambda: opt.begin_micro(0, 2)) if blocking else (lambda: opt.begin_micro(0, 1))
    return Side([("forward", _forward(model, st, before)), ("backward", backward),
                 ("comm", after_backward if blocking else overlapped), ("clip", lambda: opt.clip_grad_norm(CLIP)),
                 ("step", opt.step), ("zero_grad", opt.zero_grad)],
                lambda: _held(opt.params, reducer.grad_tensors(), _state_tensors(opt.opt)), st, times,
                len(reducer.buckets))


def side_st_zero3(args) -> Side:
    import scaletrain.parallel as stp

    model = _model(args)
    opt = stp.zero(model, stage=3, group=dist.group.WORLD, lr=LR, betas=BETAS, weight_decay=WD,
                   bucket_mb=args.bucket_mb)
    st: dict = {}

    def held():
        t = opt.memory_tensors()
        return _held(t["params"], t["grads"], t["optim"])

    return Side([("forward", _forward(model, st, lambda: opt.begin_micro(0, 1))), ("backward", _backward(st)),
                 ("comm", opt.finish_backward), ("clip", lambda: opt.clip_grad_norm(CLIP)), ("step", opt.step),
                 ("zero_grad", opt.zero_grad)], held, st)


BUILDERS = {"single process": side_single, "scaletrain dp": side_st_dp, "torch DDP": side_ddp,
            "scaletrain dp, blocking": lambda a: side_st_dp(a, blocking=True),
            "scaletrain ZeRO-3": side_st_zero3, "torch FSDP2": side_fsdp2}


# --------------------------------------------------------------------------- rank bodies


def _init(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=900))


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def timing_rank(rank: int, store: str, args, q) -> None:
    _init(rank, store)
    batches = _batches(args, rank)
    sides = {name: BUILDERS[name](args) for name in SIDES}
    first, held = {}, {}
    for name in SIDES:  # warm-up step, loss check, held bytes
        if name == "single process" and rank != 0:
            dist.barrier()
            continue
        first[name], held[name] = sides[name].step(*batches[0], measure=True)
        dist.barrier()
    rates: dict[str, list[float]] = {name: [] for name in SIDES}  # tokens per wall-clock second
    cpu_rates: dict[str, list[float]] = {name: [] for name in SIDES}  # tokens per CPU second (sum over ranks)
    k = 1
    for _ in range(args.repeats):
        for name in SIDES:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if name != "single process" or rank == 0:
                for i in range(args.steps):
                    sides[name].step(*batches[(k + i) % len(batches)])
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            dt, cpu = _max(dt), _sum(cpu)
            tokens = args.steps * (1 if name == "single process" else WORLD) * args.batch * args.seq
            rates[name].append(tokens / dt)
            cpu_rates[name].append(tokens / cpu)
        k += args.steps
    overlap = {name: {key: v[1:] for key, v in sides[name].times.items()}  # without the warm-up step
               for name in ("scaletrain dp", "scaletrain dp, blocking")}
    held_all = [None] * WORLD
    dist.all_gather_object(held_all, held)
    overlap_all = [None] * WORLD
    dist.all_gather_object(overlap_all, overlap)
    if rank == 0:
        q.put({"first": first, "rates": rates, "cpu_rates": cpu_rates, "held": held_all, "overlap": overlap_all,
               "buckets": sides["scaletrain dp"].buckets})
    dist.barrier()  # nobody tears down while a peer still talks (gloo aborts the peer)
    dist.destroy_process_group()


PHASE_SIDES = ("scaletrain dp", "torch DDP", "scaletrain ZeRO-3", "torch FSDP2")


def phases_rank(rank: int, store: str, args, q) -> None:
    """Per-phase CPU and wall time of the compared sides, one step of each in turn per round."""
    _init(rank, store)
    batches = _batches(args, rank)
    sides = {name: BUILDERS[name](args) for name in PHASE_SIDES}
    rec: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in PHASE_SIDES}
    for i in range(args.phases + 1):  # the first round is a warm-up
        for name, side in sides.items():
            side.state["x"], side.state["y"] = batches[i % len(batches)]
            dist.barrier()
            for phase, fn in side.phases:
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                if i:
                    rec[name].setdefault(phase, []).append((time.process_time() - c0, time.perf_counter() - t0))
    out = [None] * WORLD
    dist.all_gather_object(out, rec)
    if rank == 0:
        q.put(out)
    dist.barrier()  # nobody tears down while a peer still talks (gloo aborts the peer)
    dist.destroy_process_group()


def report_phases(args, recs) -> None:
    print(f"per-phase time of one step, ms per rank: median over {args.phases} steps x {WORLD} ranks "
          "(CPU = this process's CPU time, all threads; wall in parentheses)")
    names = ["forward", "backward", "comm", "clip", "step", "zero_grad"]
    print("| side | " + " | ".join(names) + " | total CPU |")
    print("|---|" + "---|" * (len(names) + 1))
    for side in PHASE_SIDES:
        cells, total = [], 0.0
        for ph in names:
            v = [x for r in recs for x in r[side].get(ph, [])]
            if not v:
                cells.append("-")
                continue
            cpu, wall = statistics.median(c for c, _ in v) * 1e3, statistics.median(w for _, w in v) * 1e3
            total += cpu
            cells.append(f"{cpu:.1f} ({wall:.1f})")
        print(f"| {side} | " + " | ".join(cells) + f" | {total:.1f} |")


def memory_rank(rank: int, store: str, args, q, name: str) -> None:
    _init(rank, store)
    batches = _batches(args, rank)
    rss0 = _rss_bytes()
    side = BUILDERS[name](args)
    for i in range(args.memory_steps):
        side.step(*batches[i % len(batches)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = [None] * WORLD
    dist.all_gather_object(out, {"rss_start": rss0, "peak_rss": peak})
    if rank == 0:
        q.put(out)
    dist.barrier()  # nobody tears down while a peer still talks (gloo aborts the peer)
    dist.destroy_process_group()


def _spawn(target, args, *extra):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, os.path.join(tmp, "store"), args, q, *extra))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        result = q.get()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"rank exited with {p.exitcode}")
    return result


# --------------------------------------------------------------------------- report

MiB = 2**20


def _iqr(v: list[float]) -> tuple[float, float]:
    if len(v) < 4:
        return min(v), max(v)
    q = statistics.quantiles(v, n=4)
    return q[0], q[2]


def _spread(v: list[float], fmt: str) -> str:
    lo, hi = _iqr(v)
    return f"{format(lo, fmt)}-{format(hi, fmt)} | {format(min(v), fmt)}-{format(max(v), fmt)}"


def _overlap_ms(res: dict) -> dict[str, list[float]]:
    """Per step and rank, in ms: scaletrain's exposed_s; the exposed time counted from the end of the
    *last* rank's backward (waiting for a slower rank is load imbalance, not communication); blocking."""
    out: dict[str, list[float]] = {"exposed_s": [], "exposed_after_last_backward": [], "blocking": []}
    for r in range(WORLD):
        dp, blk = res["overlap"][r]["scaletrain dp"], res["overlap"][r]["scaletrain dp, blocking"]
        out["exposed_s"] += [1e3 * x for x in dp["exposed_s"]]
        out["blocking"] += [1e3 * x for x in blk["comm_s"]]
        for i, end in enumerate(dp["comm_end"]):
            last = max(res["overlap"][q]["scaletrain dp"]["backward_end"][i] for q in range(WORLD))
            out["exposed_after_last_backward"].append(max(0.0, 1e3 * (end - last)))
    return out


def _rate_table(title: str, rates: dict[str, list[float]]) -> None:
    print(f"| side | {title} median | IQR | min-max |")
    print("|---|---|---|---|")
    for name in SIDES:
        print(f"| {name} | {statistics.median(rates[name]):,.0f} | {_spread(rates[name], ',.0f')} |")
    print()


def _ratio_rows(clock: str, rates: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in rates.items()}
    for a, b in PAIRS:
        pairs = [x / y for x, y in zip(rates[a], rates[b])]
        print(f"| {a} / {b} ({clock}) | {med[a] / med[b]:.3f} | {statistics.median(pairs):.3f} | "
              f"{_spread(pairs, '.3f')} | >= 1.0 |")
    # wall: tokens/s / (world x single tokens/s); CPU: tokens per CPU-second / single's (the CPU time already
    # counts both ranks, so perfect scaling is 1 in both)
    ideal = WORLD if clock == "wall" else 1
    for name in ("scaletrain dp", "torch DDP"):
        eff = [x / (ideal * y) for x, y in zip(rates[name], rates["single process"])]
        print(f"| scaling efficiency {name} ({clock}) | {med[name] / (ideal * med['single process']):.3f} | "
              f"{statistics.median(eff):.3f} | {_spread(eff, '.3f')} | |")


def report(args, res: dict, mem: dict) -> None:
    from scaletrain.model import count_params

    n_params = count_params(_model(args))
    rates, med = res["rates"], {k: statistics.median(v) for k, v in res["rates"].items()}
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, "
          f"{n_params / 1e6:.2f}M parameters (Ψ), fp32; {args.batch} sequences per rank per step; 2 gloo CPU "
          f"processes x 1 thread; buckets {args.bucket_mb} MB ({res['buckets']} scaletrain buckets); "
          f"{args.repeats} rounds of {args.steps}-step blocks")
    print("first-step loss (rank 0's half of the batch): "
          + ", ".join(f"{k} {v:.6f}" for k, v in res["first"].items()))
    print()
    _rate_table("tokens/s (wall)", rates)
    _rate_table("tokens per CPU-second (both ranks' CPU time)", res["cpu_rates"])
    print("| ratio | of medians | per round: median | IQR | min-max | target |")
    print("|---|---|---|---|---|---|")
    _ratio_rows("wall", rates)
    _ratio_rows("CPU", res["cpu_rates"])
    print()
    ov = _overlap_ms(res)
    print("| scaletrain dp gradient all-reduce, per step and rank | median ms | IQR ms | min-max ms |")
    print("|---|---|---|---|")
    labels = {"exposed_s": "exposed: BucketedAllReduce.exposed_s (waiting in finish)",
              "exposed_after_last_backward": "exposed after the last rank's backward ended",
              "blocking": "blocking: the same all-reduces after backward"}
    for key, label in labels.items():
        print(f"| {label} | {statistics.median(ov[key]):.1f} | {_spread(ov[key], '.1f')} |")
    mb = statistics.median(ov["blocking"])
    print(f"hidden fraction = 1 - exposed / blocking (medians): "
          f"{1 - statistics.median(ov['exposed_after_last_backward']) / mb:.2f} counted after the last backward, "
          f"{1 - statistics.median(ov['exposed_s']) / mb:.2f} with exposed_s as is; step-time view: "
          f"overlapped dp {med['scaletrain dp']:,.0f} tokens/s vs blocking {med['scaletrain dp, blocking']:,.0f}")
    print()
    print(f"memory held per rank after the optimizer step, MiB (ZeRO-3 formula 16Ψ/N = {16 * n_params / 2 / MiB:.1f}):")
    print("| side | rank | params | grads | optim | total | start RSS | peak RSS | peak - start |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("scaletrain ZeRO-3", "torch FSDP2", "scaletrain dp", "torch DDP"):
        for r in range(WORLD):
            h = res["held"][r][name]
            m = mem.get(name, [None] * WORLD)[r]
            rss = "- | - | -"
            if m:
                start, peak = m["rss_start"] / MiB, m["peak_rss"] / MiB
                rss = f"{start:.0f} | {peak:.0f} | {peak - start:.0f}"
            print(f"| {name} | {r} | {h['params'] / MiB:.1f} | {h['grads'] / MiB:.1f} | {h['optim'] / MiB:.1f} | "
                  f"{sum(h.values()) / MiB:.1f} | {rss} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size, scaletrain dp and DDP")
    ap.add_argument("--steps", type=int, default=2, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=7, help="rounds of blocks (every side once per round)")
    ap.add_argument("--memory-steps", type=int, default=3, help="steps of the fresh-process RSS runs")
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak-RSS runs")
    ap.add_argument("--phases", type=int, default=0, metavar="N",
                    help="instead: time each phase of N steps of dp, DDP, ZeRO-3 and FSDP2 (profile)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.phases:
        report_phases(args, _spawn(phases_rank, args))
        print(f"\n(wall time: {time.perf_counter() - t0:.0f} s)")
        return
    res = _spawn(timing_rank, args)
    mem = {} if args.no_rss else {name: _spawn(memory_rank, args, name)
                                  for name in ("scaletrain ZeRO-3", "torch FSDP2")}
    report(args, res, mem)
    print(f"\n(wall time of the whole benchmark: {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
