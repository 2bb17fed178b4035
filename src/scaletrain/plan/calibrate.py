"""`scaletrain plan --calibrate`: measure this machine instead of trusting the catalog.

Three quick measurements (a few seconds in all), used in place of the catalog's numbers:
- matmul FLOP/s: the best of a few square fp32 (or the run's dtype) `torch.mm` on this device;
- memory bandwidth: a large tensor copy (read + write bytes / time), for the element-wise terms;
- collective bandwidth and latency: `torch.distributed` all-reduce over gloo between local processes
  (127.0.0.1, FileStore rendezvous), bus bandwidth 2(n-1)/n x bytes / time (the nccl-tests definition)
  and latency from a one-element all-reduce.

The result is a `GPU` named `calibrated-<host>` with gemm_efficiency 1.0 (the measured rate is already
an achieved rate), one "node" holding all local processes.

For `plan --config run.yaml` (our own run) `plan.exact.run_calibrate.calibrate_run` profiles the run's own layers
instead and measures the link inside the run's process group: `link_on_group` (alpha-beta fit of a small
and a large all-reduce) and `sync_cost` (what a collective costs after the run's compute between two
collectives: on shared cores mostly the wait for a descheduled peer); `machine` then describes this
machine without spawning processes.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import torch

from scaletrain.plan.hardware import GPU

_TORCH_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_flops(dtype: str = "fp32", n: int = 1024, seconds: float = 0.5) -> float:
    a = torch.randn(n, n, dtype=_TORCH_DTYPES[dtype])
    b = torch.randn(n, n, dtype=_TORCH_DTYPES[dtype])
    torch.mm(a, b)  # warm-up
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, path: str, nbytes: int, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    x = torch.ones(nbytes // 4)
    small = torch.ones(1)
    dist.all_reduce(x)
    dist.barrier()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    lat = []
    for _ in range(20):
        t0 = time.perf_counter()
        dist.all_reduce(small)
        lat.append(time.perf_counter() - t0)
    if rank == 0:
        out["busbw"] = 2 * (world - 1) / world * nbytes / min(times)
        out["latency"] = sorted(lat)[len(lat) // 2] / (2 * (world - 1))
    dist.destroy_process_group()


def collective_bandwidth(world: int = 2, nbytes: int = 16 << 20) -> tuple[float, float]:
    """(bus bandwidth bytes/s, per-step latency s) of a gloo all-reduce among `world` local processes."""
    import torch.multiprocessing as mp

    world = max(2, world)
    with tempfile.TemporaryDirectory() as d:
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(_worker, args=(world, os.path.join(d, "store"), nbytes, out), nprocs=world, join=True)
        return float(out["busbw"]), float(out["latency"])


def link_on_group(group=None, nbytes: int = 16 << 20, repeats: int = 5) -> tuple[float, float]:
    """(bus bandwidth bytes/s, per-step latency s) of all-reduces on an existing process group: every rank
    of the group must call this together. Latency from a one-element all-reduce (median over 20), bandwidth
    from `nbytes` after subtracting that latency (median over `repeats`): the alpha-beta fit of two sizes."""
    import statistics

    import torch.distributed as dist

    n = dist.get_world_size(group)
    x, small = torch.ones(max(1, nbytes // 4)), torch.ones(1)
    dist.all_reduce(x, group=group)
    dist.all_reduce(small, group=group)

    def timed(t: torch.Tensor) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        return time.perf_counter() - t0

    lat = statistics.median(timed(small) for _ in range(20)) / (2 * (n - 1))
    big = statistics.median(timed(x) for _ in range(repeats))
    moved = 2 * (n - 1) / n * x.numel() * 4
    # the latency is subtracted, but never more than half the time: on a loaded machine the small
    # all-reduce can take nearly as long as the large one, and the difference alone would be noise
    return moved / max(big - 2 * (n - 1) * lat, big / 2), lat


def sync_cost(gap_s: float, group=None, repeats: int = 15) -> float:
    """Median time of a one-element all-reduce issued after `gap_s` seconds of computation on every rank,
    without a barrier: what a collective costs inside a run, where the ranks arrive from their own work.
    On an idle machine it is the link latency; when the cores are shared, it includes waiting for a peer
    that the OS has descheduled, which grows with the work between collectives. Collective over `group`."""
    import statistics

    import torch.distributed as dist

    a, small, times = torch.randn(32, 32), torch.ones(1), []
    dist.all_reduce(small, group=group)
    for _ in range(repeats):
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)
        t0 = time.perf_counter()
        dist.all_reduce(small, group=group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine(dtype: str, world: int, link: tuple[float, float] | None = None) -> GPU:
    """This machine as a `GPU` from in-process measurements (matmul rate, copy bandwidth) and, when
    given, the gloo link measured by the run's own calibration (no processes spawned here)."""
    flops, bw = matmul_flops(dtype, seconds=0.2), memory_bandwidth(64 << 20)
    busbw, lat = link if link is not None else (bw, 1e-6)
    return GPU(name=f"calibrated-{socket.gethostname()}", peak_flops=flops, memory_bytes=float(_host_memory()),
               hbm_bandwidth=bw, gpus_per_node=max(1, world), intra_bw=busbw, inter_bw=busbw,
               intra_latency=lat, inter_latency=lat, host_bw=bw, gemm_efficiency=1.0,
               source=f"measured by scaletrain plan --calibrate ({dtype} matmul, tensor copy"
                      + (f", gloo among {world} local processes)" if link is not None else ")"))


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def calibrate(dtype: str = "fp32", world: int = 2) -> GPU:
    flops = matmul_flops(dtype)
    bw = memory_bandwidth()
    busbw, lat = collective_bandwidth(world)
    mem = _host_memory()
    return GPU(
        name=f"calibrated-{socket.gethostname()}", peak_flops=flops, memory_bytes=float(mem),
        hbm_bandwidth=bw, gpus_per_node=max(1, world), intra_bw=busbw, inter_bw=busbw,
        intra_latency=lat, inter_latency=lat, host_bw=bw, gemm_efficiency=1.0,
        source=f"measured by scaletrain plan --calibrate ({dtype} matmul, tensor copy, gloo all-reduce"
               f" among {world} local processes)",
    )
