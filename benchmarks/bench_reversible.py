"""Reversible blocks and contiguous buffers (issue 16) on CPU, measured, next to the planner.

1. Depth sweep: for standard blocks, full recomputation and reversible blocks (`model.reversible`, RevNet arXiv
   1707.04585 / Reformer arXiv 2001.04451) at 2..16 layers: the bytes saved for backward (`mem_activations`) and
   the planner's prediction (`plan_mem_activations`, `plan.run_memory`), the peak bytes of tensors allocated
   during a step (`device.accounting.TensorPeak`, gradients already allocated), and the median step time. The
   reversible model is a different architecture (attention and MLP of width d_model/2 on two halves of the
   stream); the standard model of width d_model/2 has about the same block parameters and is shown beside it.
2. Reconstruction: how far the input rebuilt from the output of a stack of reversible blocks is from the true
   input, in fp64, fp32 and bf16, and the relative error of the custom backward's gradients in fp32 against the
   fp64 autograd gradients of the same model.
3. Contiguous buffers (`memory.contiguous`, ZeRO-R arXiv 1910.02054 Sec. 6.3): allocator calls of a steady-state
   step (`memory.count_allocations`: the profiler's memory events on CPU), the arena's bytes, and the median step
   time, with and without, for the modes that keep checkpoints or transient gradient buffers.

Every configuration trains on the builtin corpus from the same weights and data, fp32, one micro-batch per step
(sweep 3: two); the configurations of a table take their timed steps in turn after two warm-up steps each; step
times are reported as process CPU time (steadier on a shared machine) and wall time. Prints markdown tables;
`--json PATH` also writes the numbers.

    python benchmarks/bench_reversible.py [--d-model 256 --heads 8 --seq 128 --batch 4 --depths 2,4,8,16 --steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from scaletrain.config import load_config, validate
from scaletrain.device.accounting import TensorPeak
from scaletrain.model import build_gpt, loss_sum
from scaletrain.model.reversible import reversible_blocks
from scaletrain.train.trainer import Trainer

MiB = 2**20


def make_trainer(args, layers: int, *sets: str, micro: int = 1) -> Trainer:
    base = [f"model.n_layers={layers}", f"model.d_model={args.d_model}", f"model.n_heads={args.heads}",
            f"model.seq_len={args.seq}", f"train.global_batch={args.batch * micro}",
            f"train.micro_batch={args.batch}", "train.dtype=fp32", "train.eval_every=0", "train.warmup_steps=1",
            f"train.steps={args.steps + 4}", "train.lr=1e-3"]
    return Trainer(validate(load_config(None, [*base, *sets])))


def run_round_robin(trainers: dict[str, Trainer], steps: int, peak: bool) -> dict[str, dict]:
    """Two warm-up steps each (the second is the one `memory.count_allocations` profiles), then `steps` rounds of
    one timed step per trainer; then (optionally) one step each under TensorPeak. Returns per trainer:
    median/min/max step time, its memory fields, the peak."""
    times: dict[str, list[float]] = {n: [] for n in trainers}
    cpu: dict[str, list[float]] = {n: [] for n in trainers}
    rows: dict[str, dict] = {}
    for name, t in trainers.items():
        for _ in range(2):
            t.step += 1
            rows[name] = {**t.train_step(t.step), **t.memory()}
    for _ in range(steps):
        for name, t in trainers.items():
            t.step += 1
            t0, c0 = time.perf_counter(), time.process_time()
            t.train_step(t.step)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            rows[name].update(t.memory())
    out = {}
    for name, t in trainers.items():
        res = {"median_s": statistics.median(times[name]), "min_s": min(times[name]), "max_s": max(times[name]),
               "cpu_median_s": statistics.median(cpu[name]), "cpu_min_s": min(cpu[name]),
               "cpu_max_s": max(cpu[name]),
               "params": t.n_params, **{k: v for k, v in rows[name].items() if k.startswith(("mem_", "plan_mem_"))}}
        if peak:
            with TensorPeak() as tp:
                t.step += 1
                t.train_step(t.step)
            res["peak"] = tp.peak
        out[name] = res
    return out


def _span(r: dict, prefix: str) -> str:
    return f"{r[prefix + 'median_s']:.3f} [{r[prefix + 'min_s']:.3f}, {r[prefix + 'max_s']:.3f}]"


def depth_sweep(args) -> dict:
    modes = {
        "standard": [],
        "full recompute": ["memory.recompute=full"],
        "reversible": ["model.reversible=true"],
        f"standard d{args.d_model // 2}": [f"model.d_model={args.d_model // 2}"],
    }
    results = {}
    for layers in args.depths:
        trainers = {m: make_trainer(args, layers, *sets) for m, sets in modes.items()}
        results[layers] = run_round_robin(trainers, args.steps, peak=True)
    print(f"\n### Activation memory and step time vs depth (d_model {args.d_model}, {args.heads} heads, seq "
          f"{args.seq}, batch {args.batch}, fp32, {torch.get_num_threads()} thread(s); times: median of "
          f"{args.steps} [min, max])\n")
    print("| layers | blocks | params | saved for backward (MiB) | planner (MiB) | peak of a step (MiB) | "
          "step CPU time (s) | step wall time (s) |")
    print("|---:|---|---:|---:|---:|---:|---|---|")
    for layers, res in results.items():
        for m, r in res.items():
            plan = r.get("plan_mem_activations")
            plan_s = f"{plan / MiB:.3f}" if plan is not None else "-"
            print(f"| {layers} | {m} | {r['params']:,} | {r['mem_activations'] / MiB:.3f} | {plan_s} | "
                  f"{r['peak'] / MiB:.2f} | {_span(r, 'cpu_')} | {_span(r, '')} |")
    return results


def reconstruction(args) -> dict:
    """Relative error of the stack input rebuilt from its output, per dtype; fp32 gradient error vs fp64."""
    layers = max(args.depths)
    cfg = validate(load_config(None, [f"model.n_layers={layers}", f"model.d_model={args.d_model}",
                                      f"model.n_heads={args.heads}", f"model.seq_len={args.seq}",
                                      "model.reversible=true"]))
    out: dict = {}
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(args.batch, args.seq, args.d_model, generator=g, dtype=torch.float64)
    for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = build_gpt(cfg.model, 1, "cpu", dtype)
        x = x64.to(dtype)
        with torch.no_grad():
            y = x
            for b in model.blocks:
                y = b(y)
            for b in reversed(model.blocks):
                y = b.inverse(y)
        out[name] = float((y.double() - x.double()).abs().max() / x.double().abs().max())
    idx = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g)

    def grads(dtype, custom: bool) -> dict:
        model = build_gpt(cfg.model, 1, "cpu", dtype)
        for b in reversible_blocks(model):
            b.custom_backward = custom
        loss_sum(model(idx), idx).backward()
        return {n: p.grad.double() for n, p in model.named_parameters()}

    ref = grads(torch.float64, False)
    for custom in (False, True):
        got = grads(torch.float32, custom)
        err = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in ref)
        out[f"fp32 grads, {'custom backward' if custom else 'autograd'}"] = err
    print(f"\n### Reconstruction through {layers} reversible blocks (d_model {args.d_model})\n")
    print("| quantity | max relative error |")
    print("|---|---:|")
    for k, v in out.items():
        print(f"| {k if 'grads' in k else 'rebuilt input, ' + k} | {v:.2e} |")
    return out


def contiguous_sweep(args) -> dict:
    layers = max(args.depths) // 2
    modes = {
        "recompute full": ["memory.recompute=full"],
        "recompute full + offload": ["memory.recompute=full", "memory.offload_activations=true"],
        "recompute selective": ["memory.recompute=selective"],
        "ZeRO-2 (dp 1)": ["parallel.zero=2"],
        "ZeRO-3 + full (dp 1)": ["parallel.zero=3", "memory.recompute=full"],
    }
    trainers = {}
    for m, sets in modes.items():
        for on in ("false", "true"):
            trainers[(m, on)] = make_trainer(args, layers, *sets, f"memory.contiguous={on}",
                                             "memory.count_allocations=true", micro=2)
    res = run_round_robin(trainers, args.steps, peak=False)
    print(f"\n### Contiguous buffers: allocations of a steady-state step ({layers} layers, d_model {args.d_model}, "
          f"2 micro-batches of {args.batch}, fp32, {torch.get_num_threads()} thread(s); times: median of "
          f"{args.steps} [min, max])\n")
    print("| mode | contiguous | allocations / step | allocated MiB / step | arena MiB | step CPU time (s) | "
          "step wall time (s) |")
    print("|---|---|---:|---:|---:|---|---|")
    for (m, on), r in res.items():
        arena = r.get("mem_arena_bytes")
        print(f"| {m} | {on} | {r['mem_alloc_count']:,} | {r['mem_alloc_bytes'] / MiB:.2f} | "
              f"{arena / MiB if arena is not None else 0:.2f} | {_span(r, 'cpu_')} | {_span(r, '')} |")
    return {f"{m} / {on}": r for (m, on), r in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--depths", default="2,4,8,16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", choices=("depth", "reconstruction", "contiguous"), default=None)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier on a shared machine)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.depths = [int(x) for x in args.depths.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = {}
    if args.only in (None, "depth"):
        out["depth"] = depth_sweep(args)
    if args.only in (None, "reconstruction"):
        out["reconstruction"] = reconstruction(args)
    if args.only in (None, "contiguous"):
        out["contiguous"] = contiguous_sweep(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
