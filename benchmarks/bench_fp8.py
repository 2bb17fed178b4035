"""What FP8 emulation costs on a CPU: train.precision=fp8 against autocast-bf16, side by side (issue 33).

FP8 training (Micikevicius et al., arXiv 2209.05433; torchao's float8 training, memory/fp8.py) needs FP8 tensor cores
to be fast. Without them (every CPU) the same path runs emulated: each GEMM operand is scaled and cast to float8 and
back, and the GEMM runs in fp32 on the dequantized values — the numerics of the hardware path, at a cost. This
script measures that cost, so users know emulation is for testing:

1. Whole steps: the scaletrain Trainer on the same model, batches and recipe under autocast-bf16, fp8 tensorwise and
   fp8 rowwise (emulated), in alternated blocks of steps after a warm-up block each; tokens/s is the median over
   blocks, the ratio is against autocast-bf16 with its spread (per-block ratios, min-max).
2. One linear layer at the model's sizes (d_model -> 4 d_model, micro-batch x sequence tokens): forward + backward
   of autocast's bf16 linear against the FP8 layer, and the FP8 layer's six casts alone (amax, scale, cast to float8
   of x and W for the output, dy and W for dx, dy and x for dW), repeated and alternated; median microseconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fp8.py --steps 3 --repeats 5

3. `--track N` (the accuracy claim, not a timing): the demo (configs/demo.yaml: its model, data, learning-rate
   schedule and seed) trained for N steps under autocast-bf16 and under fp8 with each recipe (emulated), validation
   loss at step N. The bound, set before measuring: each FP8 run's final validation loss within 0.05 of
   autocast-bf16's; the script prints the per-step worst relative training-loss difference too and exits 1 when a
   bound is missed.

    .venv/bin/python benchmarks/bench_fp8.py --track 300 --jobs 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scaletrain.config import load_config, validate
from scaletrain.memory.fp8 import (
    GRAD_INPUT,
    GRAD_OUTPUT,
    GRAD_WEIGHT,
    INPUT,
    OUTPUT,
    WEIGHT,
    Fp8Gemm,
    convert_linear,
    recipe_config,
)
from scaletrain.train.trainer import Trainer

VARIANTS = {
    "autocast-bf16": {"train.precision": "autocast-bf16"},
    "fp8 tensorwise": {"train.precision": "fp8", "train.fp8_recipe": "tensorwise"},
    "fp8 rowwise": {"train.precision": "fp8", "train.fp8_recipe": "rowwise"},
}
DEMO = {"model.n_layers": 6, "model.d_model": 192, "model.n_heads": 6, "model.seq_len": 128,
        "train.global_batch": 16, "train.micro_batch": 8, "train.eval_every": 0, "train.checkpoint_every": 0,
        "train.warmup_steps": 2}


def steps(args) -> list[dict]:
    total = (args.repeats + 1) * args.steps + 1
    trainers = {}
    for name, sets in VARIANTS.items():
        overrides = {**DEMO, **sets, "train.steps": total}
        trainers[name] = Trainer(validate(load_config(None, [f"{k}={v}" for k, v in overrides.items()])))
    tokens = next(iter(trainers.values())).cfg.tokens_per_step
    for t in trainers.values():  # warm-up block
        t.run(stop_after=args.steps)
    rates: dict[str, list[float]] = {n: [] for n in trainers}
    for _ in range(args.repeats):
        for name, t in trainers.items():
            t0 = time.perf_counter()
            t.run(stop_after=t.step + args.steps)
            rates[name].append(args.steps * tokens / (time.perf_counter() - t0))
    base = rates["autocast-bf16"]
    med = statistics.median
    return [{"variant": n, "tokens_per_s": med(r), "ratio": med(r) / med(base),
             "spread": (min(a / b for a, b in zip(r, base)), max(a / b for a, b in zip(r, base)))}
            for n, r in rates.items()]


TRACK_BOUND = 0.05  # final validation loss, FP8 against autocast-bf16 (issue 33), set before measuring


def _track_one(name: str, steps: int, threads: int) -> tuple[str, object, float]:
    """One variant of the demo for `steps` steps (a worker process of `track`): (name, RunResult, seconds)."""
    from pathlib import Path

    import scaletrain

    torch.set_num_threads(threads)
    demo = Path(scaletrain.__file__).parent / "configs" / "demo.yaml"
    base = {"train.steps": steps, "train.eval_every": steps, "train.checkpoint_every": 0, "train.report": False}
    cfg = validate(load_config(str(demo), [f"{k}={v}" for k, v in {**base, **VARIANTS[name]}.items()]))
    t0 = time.perf_counter()
    result = Trainer(cfg).run()
    return name, result, time.perf_counter() - t0


def track(steps: int, jobs: int = 1) -> bool:
    """The demo for `steps` steps under autocast-bf16 and fp8 (both recipes); prints the comparison, True if within.
    `jobs` > 1 trains the variants in that many processes at once (one thread each): the same runs, each
    deterministic given its seed, only the wall time differs."""
    import multiprocessing as mp

    results = {}
    if jobs > 1:
        with mp.get_context("spawn").Pool(min(jobs, len(VARIANTS))) as pool:
            done = pool.starmap(_track_one, [(name, steps, 1) for name in VARIANTS])
    else:
        done = [_track_one(name, steps, torch.get_num_threads()) for name in VARIANTS]
    for name, r, seconds in done:
        results[name] = r
        print(f"{name}: {steps} steps in {seconds:.0f} s, first loss {r.losses[1]:.4f}, last {r.losses[steps]:.4f}, "
              f"validation {r.val_losses[steps]:.5f}", flush=True)
    ref = results["autocast-bf16"]
    ok = True
    print(f"\n| variant | validation loss at step {steps} | vs autocast-bf16 | worst per-step relative loss gap |")
    print("|---|---|---|---|")
    for name, r in results.items():
        diff = r.val_losses[steps] - ref.val_losses[steps]
        worst = max(abs(r.losses[s] - ref.losses[s]) / ref.losses[s] for s in ref.losses)
        ok &= abs(diff) <= TRACK_BOUND
        print(f"| {name} | {r.val_losses[steps]:.5f} | {diff:+.5f} | {worst:.2e} |")
    print(f"\nbound |validation difference| <= {TRACK_BOUND}: {'within' if ok else 'MISSED'}")
    return ok


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def layer(args) -> list[tuple[str, float]]:
    """Forward + backward of one linear layer at the demo's sizes, and the FP8 layer's casts alone (microseconds)."""
    d, tokens = DEMO["model.d_model"], DEMO["train.micro_batch"] * DEMO["model.seq_len"]
    torch.manual_seed(0)
    plain = torch.nn.Linear(d, 4 * d)
    fp8 = convert_linear(torch.nn.Linear(d, 4 * d), Fp8Gemm(recipe_config("tensorwise", emulate=True)))
    fp8.load_state_dict(plain.state_dict())
    x = torch.randn(tokens, d)
    dy = torch.randn(tokens, 4 * d, dtype=torch.bfloat16)

    def run(m):
        def go():
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(xi)
            y.backward(dy)
        return go

    gemm = fp8.fp8
    xb, w = x.to(torch.bfloat16), fp8.weight.detach()

    def casts():
        for t, operand, which in ((xb, INPUT, OUTPUT), (w.t(), WEIGHT, OUTPUT), (dy, GRAD_OUTPUT, GRAD_INPUT),
                                  (w.t(), WEIGHT, GRAD_INPUT), (dy, GRAD_OUTPUT, GRAD_WEIGHT),
                                  (xb, INPUT, GRAD_WEIGHT)):
            gemm.cast(t, operand, which)

    sides = {"bf16 linear (autocast), fwd + bwd": run(plain), "fp8 linear (emulated), fwd + bwd": run(fp8),
             "fp8: the six casts alone": casts}
    for fn in sides.values():
        fn()
    out: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.layer_repeats):
        for k, fn in sides.items():
            out[k].append(_median_us(fn, 5))
    return [(k, statistics.median(v)) for k, v in out.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per variant")
    ap.add_argument("--layer-repeats", type=int, default=9, help="alternated rounds of the one-layer timing")
    ap.add_argument("--track", type=int, default=0, metavar="N",
                    help="instead of timing: train the demo N steps under autocast-bf16 and fp8, compare validation")
    ap.add_argument("--jobs", type=int, default=1, help="with --track: variants trained in parallel processes")
    args = ap.parse_args()
    if args.track:
        raise SystemExit(0 if track(args.track, args.jobs) else 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); demo model (6 layers, d_model 192, "
          f"sequence 128, global batch 16 = 2 micro-batches of 8); {args.repeats} blocks of {args.steps} steps")
    print("| variant | tokens/s (median) | vs autocast-bf16 (min-max) |")
    print("|---|---|---|")
    for r in steps(args):
        print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['ratio']:.3f} ({r['spread'][0]:.2f}-"
              f"{r['spread'][1]:.2f}) |")
    print("\n| one linear layer 192 -> 768, 1024 tokens | microseconds (median) |")
    print("|---|---|")
    for k, us in layer(args):
        print(f"| {k} | {us:,.0f} |")


if __name__ == "__main__":
    main()
