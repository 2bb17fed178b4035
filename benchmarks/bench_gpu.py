"""Single-device throughput of GPT-3-style models: the scaletrain Trainer against a minimal torch loop, with the
planner's prediction beside every row (issue 19).

Models (Brown et al., arXiv 2005.14165, Table 2.1; vocabulary 50,304 = GPT-2's padded to a multiple of 64):
125M (12 layers, d 768, 12 heads), 350M (24, 1024, 16), 1.3B (24, 2048, 16), sequence 2048. `--small` runs two
tiny models instead, to prove the script end to end on a CPU.

Each row is one variant of a model: train.precision=autocast-bf16 (fp32 parameters and AdamW, bf16 matmuls and
attention), with and without train.compile, with memory.recompute none / selective / full. Both sides train the
same model (`build_gpt`, same initial weights) on the same batches (`BatchLoader`, step k's global batch) with the
same recipe: micro-batches, loss = token cross-entropy summed / tokens of the global batch, global-norm clipping,
AdamW with decay on matrices (fused on CUDA, foreach elsewhere), warm-up + cosine learning rate; the plain loop
wraps its forward in the same autocast, checkpoints / compiles its blocks the same way, and calls `.item()` on the
loss once per step. After a warm-up block per side, blocks of `--steps` steps alternate (trainer, plain, ...);
tokens/s is the median over blocks (wall clock, the device synchronised at each block's end), the ratio is
trainer / plain. MFU = model FLOPs per token (6N + attention, `model.gpt.model_flops_per_token`, recomputation not
counted) x tokens/s / the device's peak bf16 FLOP/s (`plan.hardware`; on a CPU only with --peak-tflops).
Peak memory: `torch.cuda.max_memory_allocated` over the variant on CUDA, the peak of live tensor bytes over one
trainer step (`device.accounting.TensorPeak`) on CPU. The trainer's measured bytes per category are compared with
the planner's run-exact prediction (`plan_mem_*`, what `scaletrain plan --config` prints as run_prediction), and
the planner's predicted step time and memory total come from `scaletrain plan --config FILE --gpu GPU --json`.

    python benchmarks/bench_gpu.py                       # on a GPU: 125M, 350M, 1.3B
    python benchmarks/bench_gpu.py --small --steps 2 --repeats 3    # on a CPU, end to end

`--fp8` (issue 33) measures train.precision=fp8 against autocast-bf16 instead, on a ~1B GPT (GPT-3 XL, sequence
2048) and a ~1B Llama-shaped model (16 layers, d 2048, SwiGLU, RoPE, RMSNorm, no biases, sequence 4096), both
compiled: for each recipe (tensorwise, rowwise) a bf16 trainer and an FP8 trainer alternate blocks (tokens/s,
speed-up, MFU against the device's bf16 dense peak for both, `max_memory_allocated` per side), then the FP8
trainer alternates with torchtitan's recipe written as a plain loop (`torchao.float8.convert_to_float8_training` on
the blocks' linear layers, torch.compile per block; ratio ours / torchao). The first block's losses of each pair
are printed side by side (the same model, data and recipe). Two trainers are alive at once (~60 GB for 1.3B on
an 80 GB H100); `--sizes` runs one model per call.

    python benchmarks/bench_gpu.py --fp8 --json results_fp8.json              # on an FP8 GPU (H100, H200, L4, ...)
    python benchmarks/bench_gpu.py --fp8 --small --steps 2 --repeats 3       # on a CPU: emulated, eager, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scaletrain.config import load_config, validate
from scaletrain.data import BatchLoader, load_tokens
from scaletrain.device.accounting import TensorPeak
from scaletrain.device.kernels import adamw_kernel
from scaletrain.model import build_gpt
from scaletrain.model.gpt import model_flops_per_token
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import Trainer

SIZES = {  # name: (layers, d_model, heads, seq_len, vocab, micro_batch, global_batch)
    "125m": (12, 768, 12, 2048, 50304, 8, 8),
    "350m": (24, 1024, 16, 2048, 50304, 4, 8),
    "1.3b": (24, 2048, 16, 2048, 50304, 2, 8),
}
SMALL = {
    "tiny-a": (2, 64, 4, 64, 512, 4, 8),
    "tiny-b": (2, 128, 4, 128, 512, 4, 8),
}
VARIANTS = {  # name: config overrides
    "eager": {},
    "eager selective": {"memory.recompute": "selective"},
    "eager full": {"memory.recompute": "full"},
    "compile": {"train.compile": True},
    "compile selective": {"train.compile": True, "memory.recompute": "selective"},
    "compile full": {"train.compile": True, "memory.recompute": "full"},
}
FP8_SIZES = {  # name: (layers, d_model, heads, seq_len, vocab, micro_batch, global_batch, extra model keys)
    "gpt-1.3b": (24, 2048, 16, 2048, 50304, 2, 8, {}),
    "llama-1b": (16, 2048, 32, 4096, 50304, 1, 8, {"model.mlp": "swiglu", "model.position": "rope",
                                                   "model.norm": "rmsnorm", "model.bias": False, "model.d_ff": 8192,
                                                   "model.tie_embeddings": False}),
}
FP8_SMALL = {"tiny-gpt": (2, 64, 4, 64, 512, 4, 8, {}),
             "tiny-llama": (2, 64, 4, 128, 512, 4, 8, {"model.mlp": "swiglu", "model.position": "rope",
                                                       "model.norm": "rmsnorm", "model.bias": False})}
GPU_NAMES = (("H100", "h100-80gb"), ("H200", "h200"), ("A100", "a100-80gb"), ("B200", "b200"))


def config_sets(size: tuple, steps: int, device: str, variant: dict) -> list[str]:
    layers, d, heads, seq, vocab, micro, batch = size
    sets = {"model.n_layers": layers, "model.d_model": d, "model.n_heads": heads, "model.seq_len": seq,
            "model.vocab_size": vocab, "train.micro_batch": micro, "train.global_batch": batch,
            "train.steps": steps, "train.warmup_steps": 2, "train.eval_every": 0, "train.checkpoint_every": 0,
            "train.log_every": steps, "train.precision": "autocast-bf16", "train.device": device, **variant}
    return [f"{k}={v}" for k, v in sets.items()]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(cfg, device: torch.device, convert=None):
    """The minimal hand-written loop: returns run(first_step, n_steps) -> list of losses. `convert(model)` swaps
    layers before the blocks are wrapped (torchao's FP8 conversion, `torchao_loop`)."""
    t, o, m = cfg.train, cfg.optim, cfg.model
    model = build_gpt(m, t.seed, device, torch.float32)
    if convert is not None:
        model = convert(model)
    for block in model.blocks:
        if cfg.memory.recompute == "full":
            forward = block.forward
            block.forward = lambda *a, _f=forward: torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False)
        elif cfg.memory.recompute == "selective":
            core = block.attn.attn_core
            block.attn.attn_core = lambda *a, _f=core: torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False)
        if t.compile:
            block.forward = torch.compile(block.forward)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps, **adamw_kernel(params))
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), m.seq_len, t.global_batch, t.seed,
                         cfg.data.val_fraction)
    norm = 1.0 / (t.global_batch * m.seq_len)

    def run(first: int, n: int) -> list[float]:
        losses = []
        for step in range(first, first + n):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, t)
            x, y = loader.global_batch_at(step)
            total = torch.zeros((), device=device)
            for xm, ym in zip(x.split(t.micro_batch), y.split(t.micro_batch)):
                xm, ym = xm.to(device, non_blocking=True), ym.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    logits = model(xm)
                loss = F.cross_entropy(logits.float().flatten(0, 1), ym.flatten(), reduction="sum") * norm
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total.item())
        return losses

    return run


def trainer_loop(trainer: Trainer):
    def run(first: int, n: int) -> list[float]:
        result = trainer.run(stop_after=first + n - 1)
        return [result.losses[s] for s in range(first, first + n)]

    return run


def planner(sets: list[str], gpu: str) -> dict:
    """`scaletrain plan --config FILE --gpu GPU --json` for the variant (the config as a file, as a user runs it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        cfg = load_config(None, sets)
        path.write_text(cfg.to_yaml())
        out = subprocess.run([sys.executable, "-m", "scaletrain", "plan", "--config", str(path), "--gpu", gpu,
                              "--json"], capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    doc = json.loads(out.stdout)
    cand = doc["candidates"][0]
    return {"step_time_s": cand["step_time_s"], "memory_total": cand["memory_bytes"]["total"],
            "run_prediction": doc.get("run_prediction", {})}


def measure(name: str, size: tuple, variant_name: str, args, device: torch.device, gpu: str, peak: float | None):
    steps = (args.repeats + 1) * args.steps * 2 + 2
    sets = config_sets(size, steps, str(device.type), VARIANTS[variant_name])
    cfg = validate(load_config(None, sets), 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(cfg)
    sides = {"trainer": trainer_loop(trainer), "plain": plain_loop(cfg, device)}
    first = {}
    for side, run in sides.items():  # warm-up (compiles), also the check that both compute the same
        first[side] = run(1, args.steps)
        sync(device)
    rates: dict[str, list[float]] = {s: [] for s in sides}
    step = 1 + args.steps
    for _ in range(args.repeats):
        for side, run in sides.items():
            t0 = time.perf_counter()
            run(step, args.steps)
            sync(device)
            rates[side].append(args.steps * cfg.tokens_per_step / (time.perf_counter() - t0))
        step += args.steps
    if device.type == "cuda":
        mem_peak = int(torch.cuda.max_memory_allocated(device))
    else:  # live tensor bytes over one more trainer step
        with TensorPeak() as tp:
            trainer.run(stop_after=trainer.step + 1)
        mem_peak = tp.peak
    measured = {k: trainer.mem.get(k) for k in ("mem_params", "mem_grads", "mem_optim", "mem_activations")}
    plan = planner(sets, gpu)
    pred = plan.get("run_prediction", {})
    exact = [k.removeprefix("mem_") for k, v in measured.items() if pred.get(f"plan_{k}") == v]
    tps = {s: statistics.median(v) for s, v in rates.items()}
    flops = model_flops_per_token(cfg.model)
    row = {
        "model": name, "params": trainer.n_params, "variant": variant_name, "seq_len": cfg.model.seq_len,
        "micro_batch": cfg.train.micro_batch, "global_batch": cfg.train.global_batch,
        "tokens_per_s_trainer": tps["trainer"], "tokens_per_s_plain": tps["plain"],
        "ratio": tps["trainer"] / tps["plain"],
        "ratio_spread": [min(a / b for a, b in zip(rates["trainer"], rates["plain"])),
                         max(a / b for a, b in zip(rates["trainer"], rates["plain"]))],
        "mfu": flops * tps["trainer"] / peak if peak else None,
        "step_time_s": cfg.tokens_per_step / tps["trainer"],
        "mem_peak": mem_peak, "measured": measured, "exact_categories": exact,
        "first_losses_max_diff": max(abs(a - b) for a, b in zip(first["trainer"], first["plain"])),
        "plan_gpu": gpu, "plan_step_time_s": plan.get("step_time_s"), "plan_memory_total": plan.get("memory_total"),
        "plan_error": plan.get("error"), "attention": trainer.attention.backend,
    }
    del trainer, sides
    return row


def device_gpu(device: torch.device, override: str | None) -> tuple[str, float | None, str]:
    """(catalog GPU for the planner, peak bf16 FLOP/s of this device or None, device name)."""
    from scaletrain.plan import hardware

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = override or next((k for tag, k in GPU_NAMES if tag in name), "h100-80gb")
        return key, hardware.get_gpu(key).peak_flops, name
    from scaletrain.report.runinfo import device_name

    return override or "h100-80gb", None, device_name(device)


def fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def fp8_sets(size: tuple, steps: int, device: str, precision: dict, compile_: bool) -> list[str]:
    *shape, extra = size
    sets = config_sets(tuple(shape), steps, device, {"train.compile": compile_, **extra, **precision})
    return sets


def torchao_loop(cfg, device: torch.device, recipe: str):
    """torchtitan's FP8 recipe as a plain loop: the plain model, torchao's Float8Linear on the blocks' linear layers
    (the output layer stays bf16), each block compiled, autocast-bf16 around; the same recipe as `plain_loop`."""
    from scaletrain.memory.fp8 import torchao_float8

    f8 = torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    return plain_loop(cfg, device, lambda model: f8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, name: name.startswith("blocks.")))


def _alternate(sides: dict, args, device: torch.device, tokens_per_step: int) -> tuple[dict, dict, dict]:
    """Warm up each side (compiles; the first losses), then `repeats` alternated timed blocks: (first losses,
    tokens/s per block, peak bytes per side)."""
    first, rates, peaks = {}, {s: [] for s in sides}, {s: 0 for s in sides}
    for side, run in sides.items():
        first[side] = run(1, args.steps)
        sync(device)
    step = 1 + args.steps
    for _ in range(args.repeats):
        for side, run in sides.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            run(step, args.steps)
            sync(device)
            rates[side].append(args.steps * tokens_per_step / (time.perf_counter() - t0))
            if device.type == "cuda":
                peaks[side] = max(peaks[side], int(torch.cuda.max_memory_allocated(device)))
        step += args.steps
    return first, rates, peaks


def measure_fp8(name: str, size: tuple, args, device: torch.device, peak: float | None) -> list[dict]:
    """The FP8 rows of one model: per recipe, bf16 vs FP8 trainers alternated; then FP8 vs torchao's loop."""
    steps = (args.repeats + 1) * args.steps * 2 + 2
    compile_ = device.type == "cuda"  # on a CPU (--small) eager, emulated: the script's paths, not a speed
    rows = []
    for recipe, against in (("tensorwise", "bf16"), ("rowwise", "bf16"), ("tensorwise", "torchao")):
        fp8 = {"train.precision": "fp8", "train.fp8_recipe": recipe}
        cfg = validate(load_config(None, fp8_sets(size, steps, device.type, fp8, compile_)), 1)
        sides = {"fp8": trainer_loop(Trainer(cfg))}
        if against == "bf16":
            base = validate(load_config(None, fp8_sets(size, steps, device.type, {}, compile_)), 1)
            sides = {"bf16": trainer_loop(Trainer(base)), **sides}
        else:
            sides["torchao"] = torchao_loop(cfg, device, recipe)
        first, rates, peaks = _alternate(sides, args, device, cfg.tokens_per_step)
        tps = {s: statistics.median(v) for s, v in rates.items()}
        a, b = list(sides)
        flops = model_flops_per_token(cfg.model)
        rows.append({
            "model": name, "recipe": recipe, "against": against, "seq_len": cfg.model.seq_len,
            "tokens_per_s": tps, "ratio": tps["fp8"] / tps[against],
            "ratio_spread": [min(x / y for x, y in zip(rates["fp8"], rates[against])),
                             max(x / y for x, y in zip(rates["fp8"], rates[against]))],
            "mfu": {s: flops * v / peak for s, v in tps.items()} if peak else None, "peak_bytes": peaks,
            "first_losses": {s: first[s] for s in (a, b)}, "compiled": compile_,
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del sides
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def fp8_table(rows: list[dict]) -> None:
    print("| model | seq | recipe | against | tokens/s FP8 | tokens/s against | FP8 / against (min-max) | MFU FP8 | "
          "MFU against | peak GiB FP8 | peak GiB against | first-block losses FP8 vs against |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, t = r["against"], r["tokens_per_s"]
        mfu = (f"{100 * r['mfu']['fp8']:.1f}%", f"{100 * r['mfu'][o]:.1f}%") if r["mfu"] else ("n/a", "n/a")
        peak = (fmt_bytes(r["peak_bytes"]["fp8"] or None), fmt_bytes(r["peak_bytes"][o] or None))
        losses = f"{r['first_losses']['fp8'][-1]:.4f} vs {r['first_losses'][o][-1]:.4f}"
        print(f"| {r['model']} | {r['seq_len']} | {r['recipe']} | {o} | {t['fp8']:,.0f} | {t[o]:,.0f} | "
              f"{r['ratio']:.3f} ({r['ratio_spread'][0]:.2f}-{r['ratio_spread'][1]:.2f}) | {mfu[0]} | {mfu[1]} | "
              f"{peak[0]} | {peak[1]} | {losses} |")


def plan_table(table: dict, sizes: list[str], variants: list[str], args, gpu: str) -> None:
    """The planner's side of every row, without training: `scaletrain plan --config FILE --gpu GPU --json`."""
    print(f"planner --gpu {gpu}; train.precision=autocast-bf16; predictions only (nothing trained)")
    print("| model | variant | planned step s | planned tokens/s | planned total GiB | params | grads | optim | "
          "activations (GiB, run-exact) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        if size not in table:
            raise SystemExit(f"unknown size {size!r} (known: {', '.join(table)})")
        for v in variants:
            sets = config_sets(table[size], args.steps, "cuda", VARIANTS[v])
            cfg = validate(load_config(None, sets), 1)
            plan = planner(sets, gpu)
            if "error" in plan:
                print(f"| {size} | {v} | {plan['error']} | | | | | | |")
                continue
            pred = plan["run_prediction"]
            cats = [fmt_bytes(pred.get(f"plan_mem_{k}")) for k in ("params", "grads", "optim", "activations")]
            print(f"| {size} | {v} | {plan['step_time_s']:.3f} | {cfg.tokens_per_step / plan['step_time_s']:,.0f} | "
                  f"{fmt_bytes(plan['memory_total'])} | {' | '.join(cats)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="two tiny models (CPU end-to-end check)")
    ap.add_argument("--sizes", default=None, help=f"comma list of {', '.join(SIZES)} (default all)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per timed block")
    ap.add_argument("--repeats", type=int, default=3, help="timed blocks per side")
    ap.add_argument("--gpu", default=None, help="planner GPU (default: detected, else h100-80gb)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak TFLOP/s for MFU on a device not in the catalog")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--plan-only", action="store_true",
                    help="print only the planner's predictions for the rows (no training; runs anywhere)")
    ap.add_argument("--fp8", action="store_true", help="train.precision=fp8 against autocast-bf16 and torchao")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    gpu, peak, name = device_gpu(device, args.gpu)
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    if args.fp8:
        return main_fp8(args, device, name, peak)
    table = SMALL if args.small else SIZES
    sizes = args.sizes.split(",") if args.sizes else list(table)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    if args.plan_only:
        return plan_table(table, sizes, variants, args, gpu)
    print(f"device: {name}; torch {torch.__version__}; planner --gpu {gpu}; {args.repeats} blocks of {args.steps} "
          f"steps per side; train.precision=autocast-bf16")
    rows = []
    for size in sizes:
        if size not in table:
            raise SystemExit(f"unknown size {size!r} (known: {', '.join(table)})")
        for v in variants:
            row = measure(size, table[size], v, args, device, gpu, peak)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"\nattention kernel: {rows[0]['attention'] if rows else '-'}")
    print("| model | params | variant | tokens/s trainer | tokens/s plain | ratio (min-max) | MFU | step s | "
          f"peak mem GiB | planned step s ({gpu}) | planned total GiB ({gpu}) | categories = plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        plan_t = f"{r['plan_step_time_s']:.3f}" if r["plan_step_time_s"] is not None else r["plan_error"]
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['variant']} | {r['tokens_per_s_trainer']:,.0f} | "
              f"{r['tokens_per_s_plain']:,.0f} | {r['ratio']:.3f} ({r['ratio_spread'][0]:.2f}-"
              f"{r['ratio_spread'][1]:.2f}) | {mfu} | {r['step_time_s']:.3f} | {fmt_bytes(r['mem_peak'])} | "
              f"{plan_t} | {fmt_bytes(r['plan_memory_total'])} | {', '.join(r['exact_categories']) or 'none'} |")
    print(f"\nlosses of the first block, max |trainer - plain| over rows: "
          f"{max(r['first_losses_max_diff'] for r in rows):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main_fp8(args, device: torch.device, name: str, peak: float | None) -> None:
    from scaletrain.memory.fp8 import torchao_float8

    torchao_float8()  # imported quietly first (torchao's root logs the CUDA libraries a CPU build cannot load)
    import torchao

    table = FP8_SMALL if args.small else FP8_SIZES
    sizes = args.sizes.split(",") if args.sizes else list(table)
    unknown = [s for s in sizes if s not in table]
    if unknown:
        raise SystemExit(f"unknown size {unknown[0]!r} (known: {', '.join(table)})")
    gemm = "FP8 tensor cores" if device.type == "cuda" else "emulated"
    print(f"device: {name}; torch {torch.__version__}; torchao {torchao.__version__}; FP8 GEMMs {gemm}; "
          f"{args.repeats} blocks of {args.steps} steps per side, alternated; MFU against the bf16 dense peak")
    rows = [row for size in sizes for row in measure_fp8(size, table[size], args, device, peak)]
    fp8_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
