"""In-memory ZeRO-3, CPU offload and NVMe offload (ZeRO-Infinity, arXiv 2104.07857) at the same model.

For each mode, in a fresh process: tokens/s (median step time over the steps after the first), resident bytes per
category (`mem_params`, `mem_grads`, `mem_optim`) and the measured resident set of a step (`mem_resident`,
memory/budget.py), the planner's predicted step time (`plan.exact.run_time`, profiled on this machine, with the
offload folder's measured bandwidth for nvme) next to the measured one, and for nvme the bytes read and written
per step next to the formula. The disk's read/write bandwidth is measured twice: through the page cache with
the engine's own I/O path (what the run sees on a machine with free RAM) and with O_DIRECT (the device).

    .venv/bin/python benchmarks/bench_offload.py                  # ~2-4 min on 2 busy CPU cores
    .venv/bin/python benchmarks/bench_offload.py --layers 8 --steps 4 --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile

MODES = {"ZeRO-3 in memory": {"parallel.offload": "none"},
         "ZeRO-3 + CPU offload (params)": {"parallel.offload": "params"},
         "ZeRO-3 + NVMe offload": {"parallel.offload": "nvme"}}


def _config(args, mode: dict):
    from scaletrain.config import load_config, validate

    sets = {"model.n_layers": args.layers, "model.d_model": args.d_model, "model.n_heads": 4, "model.seq_len": 64,
            "train.global_batch": 2, "train.micro_batch": 2, "train.steps": args.steps, "train.eval_every": 0,
            "train.warmup_steps": 1, "parallel.zero": 3, "memory.budget_gb": 64, **mode}  # budget: to measure
    if mode["parallel.offload"] == "nvme":
        sets["parallel.offload_dir"] = args.dir
    return validate(load_config(None, [f"{k}={v}" for k, v in sets.items()]))


def _measure(args, name, plan, q) -> None:
    import os

    import torch

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from scaletrain.plan.exact.probe import collect_samples
    from scaletrain.plan.exact.run_time import estimate_step_time
    from scaletrain.train.trainer import Trainer

    cfg = _config(args, MODES[name])
    trainer = Trainer(cfg)
    rows = []
    step = trainer._train_step
    trainer._train_step = lambda s, drain=True: rows.append(step(s, drain)) or rows[-1]
    trainer.run()
    times = [r["step_time_s"] for r in rows[1:]]
    planned = estimate_step_time(cfg, collect_samples(cfg, repeats=5)).step_time_s if plan else None
    out = {"params": trainer.n_params, "times": times, "plan_step_s": planned,
           **{k: v for k, v in rows[-1].items() if k.startswith(("mem_", "nvme_", "plan_nvme_"))},
           **{k: trainer.mem.get(k, 0) for k in ("mem_params", "mem_grads", "mem_optim")}}
    q.put((name, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="offload folder (a fast local disk)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the modes, alternating (planner: first round)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args()

    from scaletrain.memory.nvme_io import measure_bandwidth

    def median(direct: bool) -> tuple[float, float]:
        runs = [measure_bandwidth(args.dir, 256 << 20, direct=direct) for _ in range(3)]
        return sorted(r for r, _ in runs)[1], sorted(w for _, w in runs)[1]

    cached, direct = median(False), median(True)
    print(f"disk under {args.dir} (median of 3): page cache read {cached[0] / 1e9:.2f} GB/s, "
          f"write {cached[1] / 1e9:.2f} GB/s; O_DIRECT read {direct[0] / 1e9:.2f} GB/s, "
          f"write {direct[1] / 1e9:.2f} GB/s")
    ctx = mp.get_context("spawn")
    results: dict = {}
    for rnd in range(args.rounds):
        for name in MODES:
            q = ctx.Queue()
            p = ctx.Process(target=_measure, args=(args, name, rnd == 0, q))
            p.start()
            _, out = q.get()
            p.join()
            if name not in results:
                results[name] = {**out, "rounds": []}
            results[name]["rounds"].append(statistics.median(out["times"]))
            results[name]["all"] = results[name].get("all", []) + out["times"]
    for r in results.values():
        r["step_s"] = statistics.median(r["all"])
        r["spread"] = (min(r["rounds"]), max(r["rounds"]))
        r["tokens_per_s"] = 2 * 64 / r["step_s"]  # global batch 2 x seq_len 64
    mib = 2**20
    any_r = next(iter(results.values()))
    print(f"\nmodel: {args.layers} layers, d_model {args.d_model}, {any_r['params'] / 1e6:.1f}M parameters "
          f"(fp32 masters + AdamW = {12 * any_r['params'] / mib:.0f} MiB), 1 process with {args.threads} thread(s), "
          f"{args.rounds} rounds of {args.steps} steps (the first step of each left out)\n")
    print("| mode | tokens/s | step s, median (round medians min-max) | planned step s | "
          "params / grads / optim MiB resident | step resident MiB | read / written MiB per step (formula) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        io = "-"
        if "nvme_read_bytes" in r:
            io = (f"{r['nvme_read_bytes'] / mib:.1f} / {r['nvme_write_bytes'] / mib:.1f} "
                  f"({r['plan_nvme_read_bytes'] / mib:.1f} / {r['plan_nvme_write_bytes'] / mib:.1f})")
        print(f"| {name} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} ({r['spread'][0]:.3f}-{r['spread'][1]:.3f}) "
              f"| {r['plan_step_s']:.3f} | {r['mem_params'] / mib:.1f} / {r['mem_grads'] / mib:.1f} / "
              f"{r['mem_optim'] / mib:.1f} | {r.get('mem_resident', 0) / mib:.1f} | {io} |")


if __name__ == "__main__":
    main()
