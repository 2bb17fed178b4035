"""Heal time vs model size (issue 35; docs/fault_tolerance.md): a restarted replica's state (parameters + AdamW
state + step) sent from a live one over gloo on this machine (distributed/heal.py: chunked, SHA-256 per chunk,
verified before load), against what a whole-job restart reads instead: the same state written to disk with
torch.save and loaded back with torch.load (the checkpoint reload of heartbeat + restart + resume, without the
restart itself). Alternated, repeated; median and spread.

    nice -n 10 .venv/bin/python benchmarks/bench_heal.py [--sizes 64,128,256,384] [--repeats 5]
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

from scaletrain.config import load_config
from scaletrain.distributed.heal import load_training_state, recv_state, send_state, training_state
from scaletrain.model import build_gpt, loss_sum


def _state(d_model: int):
    cfg = load_config(None, [f"model.d_model={d_model}", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64"])
    model = build_gpt(cfg.model, 0, "cpu", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.model.vocab_size, (2, 64))
    loss_sum(model(x), x).backward()
    opt.step()
    return model, opt


def _rank(rank: int, store_path: str, sizes: list[int], repeats: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    for d in sizes:
        model, opt = _state(d)
        for _ in range(repeats):
            dist.barrier()
            if rank == 0:
                send_state(training_state(model, opt, 7), 1)
            else:
                t0 = time.perf_counter()
                state, stats = recv_state(0)
                load_training_state(model, opt, state)
                heal = time.perf_counter() - t0
                with tempfile.TemporaryDirectory() as tmp:  # the checkpoint baseline, alternated with the heal
                    path = os.path.join(tmp, "state.pt")
                    torch.save(training_state(model, opt, 7), path)
                    os.sync()
                    t0 = time.perf_counter()
                    load_training_state(model, opt, torch.load(path, weights_only=True))
                    reload = time.perf_counter() - t0
                q.put((d, stats.bytes, heal, reload))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,128,256,384")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), sizes, args.repeats, q))
                 for r in range(2)]
        for p in procs:
            p.start()
        rows = [q.get(timeout=1200) for _ in range(len(sizes) * args.repeats)]
        for p in procs:
            p.join()
    print(f"{'d_model':>8} {'state MB':>9} {'heal s (median, min-max)':>28} {'MB/s':>7} "
          f"{'ckpt reload s (median, min-max)':>32} {'heal/reload':>11}")
    for d in sizes:
        mine = [r for r in rows if r[0] == d]
        mb = mine[0][1] / 1e6
        h, c = [r[2] for r in mine], [r[3] for r in mine]
        hm, cm = statistics.median(h), statistics.median(c)
        print(f"{d:>8} {mb:>9.2f} {hm:>12.4f} ({min(h):.4f}-{max(h):.4f}) {mb / hm:>7.0f} "
              f"{cm:>14.4f} ({min(c):.4f}-{max(c):.4f}) {hm / cm:>11.2f}")


if __name__ == "__main__":
    main()
