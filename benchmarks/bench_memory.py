"""Memory savers on a ~50M-parameter GPT on CPU, measured against the planner's formulas.

For each activation-recomputation mode (none, selective, full, every:k): the bytes saved for backward at
the end of the forward (`mem_activations`, saved-tensor hooks), the peak bytes of tensors allocated during
a training step (`device.accounting.TensorPeak`: saved activations, the recomputation's working set,
temporaries) and the median step time; next to them the planner's numbers from `plan.analytic`: stored
activations (`layer_activation_bytes` per layer plus the embedding / head terms of `estimate`), the
recomputation's working set (one layer for full, k layers for every:k) and the extra hardware FLOPs
(`step_flops`). For each optimizer: the state bytes (`mem_optim`) against AdamW's 2P·4 + step scalars
(`predict_run`) and Adafactor's / SM3's Σ(n + m). For each activation-compression mode: the measured
ratio, `mem_activations`, step time and the loss after the run against the uncompressed one.

Every run trains on the builtin corpus from the same initial weights and data; fp32; one micro-batch
per step; the configurations of a table take their timed steps in turn, after one warm-up step each
(the machine may be shared: times are medians of rounds, still noisy). Prints markdown tables;
`--json PATH` also writes the numbers.

    python benchmarks/bench_memory.py [--layers 8 --d-model 720 --heads 12 --seq 256 --batch 2 --steps 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from scaletrain.config import load_config, validate
from scaletrain.device.accounting import TensorPeak
from scaletrain.plan.analytic.estimate import estimate
from scaletrain.plan.analytic.flops import step_flops
from scaletrain.plan.analytic.inputs import Layout, Training
from scaletrain.plan.analytic.memory import layer_activation_bytes
from scaletrain.plan.catalog import from_model_config
from scaletrain.plan.exact.run_memory import predict_run
from scaletrain.plan.hardware import get_gpu
from scaletrain.train.trainer import Trainer

MiB = 2**20


def make_trainer(args, *sets: str) -> Trainer:
    base = [f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", f"model.n_heads={args.heads}",
            f"model.seq_len={args.seq}", f"train.global_batch={args.batch}", f"train.micro_batch={args.batch}",
            "train.dtype=fp32", "train.eval_every=0", "train.warmup_steps=1", f"train.steps={args.steps + 3}",
            "train.lr=1e-3"]
    return Trainer(validate(load_config(None, [*base, *sets])))


def run_all(args, configs: dict[str, list[str]]) -> dict[str, dict]:
    """Build one trainer per configuration, one warm-up step each, then `args.steps` rounds in which
    every configuration takes one timed step (so load changes on a shared machine hit all alike), then
    one step each under TensorPeak (slower, not timed). Same weights and data in every configuration."""
    trainers = {name: make_trainer(args, *sets) for name, sets in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    fb: dict[str, list[float]] = {name: [] for name in configs}
    for name, t in trainers.items():  # also time forward + backward alone (what step_flops counts)
        t.engine.forward_backward = _timed(t.engine.forward_backward, fb[name])
    last: dict[str, dict] = {}
    for step in range(1, args.steps + 2):
        for name, t in trainers.items():
            last[name] = t.train_step(step)
            if step > 1:
                times[name].append(last[name]["step_time_s"])
    out = {}
    for name, t in trainers.items():
        mem = t.memory()
        with TensorPeak() as peak:
            t.train_step(args.steps + 2)
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as flops:  # exact, load-independent
            t.train_step(args.steps + 3)
        out[name] = {"params": t.n_params, "step_time_s": statistics.median(times[name]),
                     "fwd_bwd_s": statistics.median(fb[name][1:args.steps + 1]),
                     "fwd_bwd_all": fb[name][1:args.steps + 1],
                     "loss": last[name]["loss"], "peak_step_bytes": peak.peak, "flops": flops.get_total_flops(), **mem,
                     "cfg": t.cfg, "model": t.model, "trainer": t}
    return out


def forward_time(t: Trainer, repeats: int = 3) -> float:
    """Median time of one forward of the model (no autograd), the cost one recomputation adds at most."""
    x, _ = t.loader.micro_batches(1, 0, 1, t.cfg.train.micro_batch)[0]
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            t.model(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# FlopCounterMode knows the CUDA attention kernels; the CPU flash kernel gets the same formulas (full T x T).
CPU_SDPA = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kw: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *args, out_shape=None, **kw: sdpa_backward_flop_count(g, q, k, v),
}


def _timed(fn, sink: list[float]):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - t0)
        return out

    return timed


# ----------------------------------------------------------------------------- planner formulas


def planner_activations(args, cfg, mode: str) -> dict:
    """(stored, working set) activation bytes per the planner's formulas (flash attention, fp32)."""
    m = from_model_config(cfg.model)
    tokens, e = args.batch * args.seq, 4
    layer = {r: layer_activation_bytes(m, tokens, 1, False, r, "flash", e) for r in ("none", "selective", "full")}
    if mode.startswith("every:"):
        k = int(mode.split(":")[1])
        stored_layers, working = math.ceil(args.layers / k) * layer["full"], k * layer["none"]
    else:
        stored_layers = args.layers * layer[mode]
        working = layer["none"] if mode == "full" else 0.0
    total = estimate(m, get_gpu("a100-80gb"), Training(global_batch=args.batch, dtype="fp32", attention="flash"),
                     Layout(micro_batch=args.batch, recompute="none"), memory_only=True).memory["activations"]
    outside = total - args.layers * layer["none"]  # embedding output, final norm / head inputs, fp32 logits
    return {"stored": stored_layers + outside, "working": working}


def planner_time_overhead(cfg, tokens: int, mode: str) -> float:
    m = from_model_config(cfg.model)
    rec = "full" if mode.startswith("every:") else mode  # every block is recomputed once
    model, hw = step_flops(m, tokens, rec)
    return hw / model - 1.0


def sum_of_dims_state(model: torch.nn.Module, bytes_per: int = 4) -> int:
    return bytes_per * sum(sum(p.shape) if p.dim() == 2 else p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- main


def section_recompute(args) -> dict:
    k_sqrt = max(2, round(math.sqrt(args.layers)))
    modes = list(dict.fromkeys(["none", "selective", "full", f"every:{k_sqrt}", "every:2"]))
    rec = run_all(args, {mode: [f"memory.recompute={mode}"] for mode in modes})
    cfg = rec["none"]["cfg"]
    print("## Activation recomputation\n")
    print("| mode | saved for backward | planner stored | peak in step | planner stored + working set "
          "| step time | fwd+bwd time | time overhead | FLOP overhead | planner FLOP overhead |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    t_none = rec["none"]["fwd_bwd_s"]
    out = {}
    for mode in modes:
        r, plan = rec[mode], planner_activations(args, cfg, mode)
        over = r["fwd_bwd_s"] / t_none - 1.0
        flop_over = r["flops"] / rec["none"]["flops"] - 1.0
        pred = planner_time_overhead(cfg, args.batch * args.seq, mode)
        print(f"| {mode} | {r['mem_activations'] / MiB:.1f} MiB | {plan['stored'] / MiB:.1f} MiB | "
              f"{r['peak_step_bytes'] / MiB:.1f} MiB | {(plan['stored'] + plan['working']) / MiB:.1f} MiB | "
              f"{r['step_time_s']:.2f} s | {r['fwd_bwd_s']:.2f} s | {over:+.0%} | {flop_over:+.1%} | {pred:+.1%} |")
        out[mode] = {"saved": r["mem_activations"], "planner_stored": plan["stored"], "peak_step": r["peak_step_bytes"],
                     "planner_working": plan["working"], "step_time_s": r["step_time_s"], "fwd_bwd_s": r["fwd_bwd_s"],
                     "overhead": over, "flops": r["flops"], "flop_overhead": flop_over, "planner_overhead": pred,
                     "loss": r["loss"]}
    same = len({rec[m]["loss"] for m in modes}) == 1
    fwd = forward_time(rec["none"]["trainer"])
    out["forward_s"] = fwd
    print(f"\nFinal losses identical across modes: {same} ({rec['none']['loss']:.6f}). One forward of the "
          f"whole model (no autograd) takes {fwd:.2f} s = {fwd / t_none:.0%} of forward + backward.\n")
    return out


def section_optim(args) -> dict:
    opt = run_all(args, {name: [f"optim.name={name}"] for name in ("adamw", "adafactor", "sm3")})
    cfg, model, p_bytes = opt["adamw"]["cfg"], opt["adamw"]["model"], opt["adamw"]["mem_params"]
    print("## Optimizer state\n")
    print("| optimizer | mem_optim | formula | × parameter bytes | step time |")
    print("|---|---|---|---|---|")
    out = {}
    for name, r in opt.items():
        formula = predict_run(cfg)["plan_mem_optim"] if name == "adamw" else sum_of_dims_state(model)
        print(f"| {name} | {r['mem_optim']:,} B | {formula:,} B | {r['mem_optim'] / p_bytes:.3f} | "
              f"{r['step_time_s']:.2f} s |")
        out[name] = {"mem_optim": r["mem_optim"], "formula": formula, "step_time_s": r["step_time_s"]}
    print()
    return out


def section_compress(args) -> dict:
    comp = run_all(args, {mode: [f"memory.compress={mode}"] for mode in ("none", "bf16", "int8")})
    none = comp["none"]
    print("## Activation compression (Gist)\n")
    print("| mode | ratio (model's saved tensors) | saved for backward | fwd+bwd time | overhead | "
          f"loss after {args.steps + 1} steps |")
    print("|---|---|---|---|---|---|")
    out = {}
    for mode, r in comp.items():
        ratio = r.get("compress_ratio", 1.0)
        over = r["fwd_bwd_s"] / none["fwd_bwd_s"] - 1.0
        print(f"| {mode} | {ratio:.2f} | {r['mem_activations'] / MiB:.1f} MiB | {r['fwd_bwd_s']:.2f} s | "
              f"{over:+.0%} | {r['loss']:.5f} ({r['loss'] - none['loss']:+.1e}) |")
        out[mode] = {"ratio": ratio, "saved": r["mem_activations"], "fwd_bwd_s": r["fwd_bwd_s"],
                     "overhead": over, "loss": r["loss"]}
    print("\n`relu-mask` applies to ReLU-family modules only; this GPT uses GELU, so it would swap nothing.\n")
    return out


SECTIONS = {"recompute": section_recompute, "optim": section_optim, "compress": section_compress}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=720)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is steadier on a shared machine)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of the tables to run")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = make_trainer(args).n_params
    print(f"# Memory savers: {params:,} parameters ({args.layers} layers, d_model {args.d_model}, {args.heads} "
          f"heads), seq {args.seq}, batch {args.batch}, fp32, {args.threads} thread(s), {args.steps} timed steps\n")
    out: dict = {"args": vars(args), "params": params}
    for name in args.sections.split(","):
        out[name] = SECTIONS[name.strip()](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
