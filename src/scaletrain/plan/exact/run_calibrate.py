"""Profile a run on this machine in as many local processes as it has, so that they compete for the cores as the
run's ranks will, and predict its step time (`scaletrain plan --config --calibrate`): every rank builds its probe
on the run's own process groups (`probe.RunProbe`), samples its compute and the collectives in place
(`run_comm.sample_with_comm`), measures the alpha-beta link for sizes beyond those (`measure_link`), and rank 0
composes the step (`run_time.estimate_step_time_ranks`). One process: `probe.collect_samples` and
`run_time.estimate_step_time`.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletrain.config import Config
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.plan.calibrate import link_on_group, sync_cost
from scaletrain.plan.exact import run_memory
from scaletrain.plan.exact.probe import RunProbe, collect_samples, disk_bandwidth, profile_from_sample
from scaletrain.plan.exact.run_comm import sample_with_comm
from scaletrain.plan.exact.run_time import (
    StepTime,
    collectives_per_step,
    compute_time,
    estimate_step_time,
    estimate_step_time_ranks,
)


def measure_link(cfg: Config, samples: list[dict[str, float]], group=None) -> tuple[float, float]:
    """(bus bandwidth, per-step latency alpha) of the run's collectives, measured on `group` (every rank
    calls): the bandwidth of an all-reduce of the run's largest message, and alpha from what a small
    collective costs after the run's mean compute between two collectives (`calibrate.sync_cost`:
    on a shared machine a collective waits for descheduled peers, which is most of its cost)."""
    comp = statistics.median(compute_time(cfg, profile_from_sample(s)) for s in samples)
    gap = comp / max(collectives_per_step(cfg), 1)
    m, tr = cfg.model, cfg.train
    e = run_memory._TORCH[tr.dtype].itemsize
    act = tr.micro_batch * m.seq_len * m.d_model * e
    grads = run_memory.model_state_bytes(cfg)["grads"] if cfg.parallel.dp > 1 else 0
    bw, _ = link_on_group(group, nbytes=int(min(max(64 << 10, act, grads), 64 << 20)), repeats=5)
    n = dist.get_world_size(group)
    return bw, sync_cost(gap, group, repeats=25) / (2 * (n - 1))


def _rank_worker(rank: int, world: int, path: str, cfg: Config, repeats: int, out) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the launcher's OMP_NUM_THREADS
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        p = cfg.parallel
        mesh = Mesh.build(ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, ep=p.ep), p.timeout_s)
        probe = RunProbe(cfg, mesh=mesh)
        for _ in range(2):  # warm-up
            probe.sample()
        samples = [{**sample_with_comm(cfg, probe, mesh), **disk_bandwidth(cfg)} for _ in range(repeats)]
        link = measure_link(cfg, samples)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, samples)
        if rank == 0:
            out["samples"], out["link"] = everyone, link
    finally:
        dist.destroy_process_group()


def calibrate_run(cfg: Config, repeats: int = 9) -> tuple[StepTime, tuple[float, float] | None]:
    """Profile the run on this machine, in as many local processes as the run has (so that they compete
    for the cores as the run's ranks will), and predict its step time. Returns (prediction, link)."""
    world = cfg.world_size
    if world == 1:
        return estimate_step_time(cfg, collect_samples(cfg, repeats)), None
    with tempfile.TemporaryDirectory() as d:
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(_rank_worker, args=(world, os.path.join(d, "store"), cfg, repeats, out), nprocs=world, join=True)
        samples, link = out["samples"], out["link"]
    return estimate_step_time_ranks(cfg, samples, link), link
