"""The checkpointing policies side by side on one GPT on CPU: what each keeps, what it costs, what the planner says.

Policies (`memory.recompute`): none, attn-core (Korthikanti et al., arXiv 2205.05198), full (Chen et al., arXiv
1604.06174), nth:2 (torchtitan's selective layer), ops:matmul and ops:matmul+attention (torchtitan's selective op,
torch's selective activation checkpointing). For each: `mem_activations` (bytes kept for backward, measured by the
trainer) next to the exact run planner's `plan_mem_activations`; the peak bytes of tensors allocated during one
forward + backward with the gradients already allocated (`TensorPeak`: kept activations plus the recomputation's
working set and temporaries; a whole step's peak is AdamW's temporaries here, the same for every policy); the median
forward + backward time with its spread (min-max over the timed steps) and its overhead over `none`; the hardware
FLOPs of a step over `none`'s (FlopCounterMode; the recomputed ops counted, the cached ones not). The configurations
take their timed steps in turn (`bench_memory.run_all`), after one warm-up step each; same weights and data
everywhere, so the final losses must be identical.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_recompute_policies.py [--layers 8 --d-model 720 --steps 5]
"""

from __future__ import annotations

import argparse

import torch
from bench_memory import MiB, make_trainer, run_all

from scaletrain.device.accounting import TensorPeak

POLICIES = ("none", "attn-core", "full", "nth:2", "ops:matmul", "ops:matmul+attention")


def fwd_bwd_peak(t) -> int:
    """Peak bytes allocated during one forward + backward of the trainer's engine, its gradients already allocated
    (a first pass allocates them; the measured one accumulates into them)."""
    micro = t.loader.micro_batches(1, 0, 1, t.cfg.train.micro_batch)
    t.engine.forward_backward(micro, 1.0)
    with TensorPeak() as peak:
        t.engine.forward_backward(micro, 1.0)
    return peak.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=720)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per policy (after one warm-up)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    params = make_trainer(args).n_params
    print(f"# Checkpointing policies: {params:,} parameters ({args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads), seq {args.seq}, batch {args.batch}, fp32, 1 thread, {args.steps} timed steps\n")
    rec = run_all(args, {p: [f"memory.recompute={p}"] for p in POLICIES})
    none = rec["none"]
    peaks = {p: fwd_bwd_peak(rec[p]["trainer"]) for p in POLICIES}
    print("| policy | kept for backward | planner (exact) | peak of fwd+bwd | fwd+bwd time (min-max) | overhead | "
          "FLOPs over none |")
    print("|---|---|---|---|---|---|---|")
    for p in POLICIES:
        r = rec[p]
        planned = r.get("plan_mem_activations")
        plan = f"{planned / MiB:.2f} MiB" + (" (=)" if planned == r["mem_activations"] else " (differs)")
        print(f"| {p} | {r['mem_activations'] / MiB:.2f} MiB | {plan} | {peaks[p] / MiB:.1f} MiB | "
              f"{r['fwd_bwd_s']:.2f} s ({min(r['fwd_bwd_all']):.2f}-{max(r['fwd_bwd_all']):.2f}) | "
              f"{r['fwd_bwd_s'] / none['fwd_bwd_s'] - 1:+.0%} | "
              f"{r['flops'] / none['flops'] - 1:+.1%} |")
    same = len({rec[p]["loss"] for p in POLICIES}) == 1
    print(f"\nFinal losses identical across policies: {same} ({none['loss']:.6f}).")


if __name__ == "__main__":
    main()
