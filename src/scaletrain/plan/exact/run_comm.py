"""Collectives of a run timed where the run will issue them, for `scaletrain plan --config --calibrate`.

The alpha-beta model (Hockney; ring factors as in Thakur et al. 2005) with a bandwidth from one large
all-reduce and a latency from one small one describes an idle link. Inside a multi-process run on
shared cores a collective costs something else: the ranks arrive from their own compute, the transport
threads have to be woken, and the cost depends on the message size in ways the two-point fit misses (on
our 2-core machine a 64 KiB gloo all-reduce after 0.5 ms of compute takes 0.6-1.2 ms, ten times its
alpha-beta time, while an 8-byte one takes 0.35-0.5 ms). So, as a profile-guided planner does for its
layers (PipeDream, arXiv 1806.03377 Sec. 3.1), the calibration times each collective the step will issue
at its own size, kind and group, each after the run's mean compute between two collectives, and the
composition (`run_time.predict_step_time`) looks them up (`analytic.comm.MeasuredLink`) instead of using
alpha-beta.

The model also assumed that compute hides an asynchronous collective it outlasts. On CPU ranks with a
core each it does not: gloo's transport threads run on the compute's core, and a 470 KiB all-reduce
issued before 2.3 ms of compute finished after 4.3 ms, later than the two one after the other. So for
the collectives the composition overlaps (`OVERLAPPED`) the calibration also measures the overlap
efficiency (`overlap_efficiency`), and the composition pays the part it does not hide.

Which collectives: exactly those `predict_step_time` asks its links for, found by running it once with
recording links (`queries`): the trainer's small all-reduces (world), the tensor-parallel all-reduces
(tp), the data-parallel all-reduces / reduce-scatters / all-gathers of the real buckets or ZeRO-3 units
(dp), the pipeline's send/receive of one activation (pp), the expert all-to-alls (ep).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.plan.analytic.comm import MeasuredLink
from scaletrain.plan.exact import run_time
from scaletrain.plan.exact.probe import RunProbe, RunProfile, profile_from_sample

DIMS = ("world", "tp", "dp", "pp", "ep")
MAX_SIZES = 6  # distinct sizes timed per (dimension, kind); the others are interpolated


@dataclass(frozen=True)
class _Recorder(MeasuredLink):
    dim: str = "world"
    log: set = field(default_factory=set, compare=False, hash=False)

    def time(self, kind: str, nbytes: float, n: int) -> float:
        self.log.add((self.dim, kind, max(int(round(nbytes)), 1)))
        return MeasuredLink(self.bw, self.latency).time(kind, nbytes, n)


@dataclass
class _RecordingProfile(RunProfile):
    log: set = field(default_factory=set)

    def link(self, dim: str = "world"):
        return _Recorder(1e9, 1e-5, dim=dim, log=self.log)


def queries(cfg: Config) -> dict[tuple[str, str], list[int]]:
    """{(dimension, kind): byte sizes} that `predict_step_time` looks up for this run (at most MAX_SIZES
    per key, spread over the range)."""
    prof = _RecordingProfile(*(1e-3,) * 8)
    run_time.predict_step_time(cfg, prof)
    out: dict[tuple[str, str], list[int]] = {}
    for dim, kind, nbytes in prof.log:
        if dim in DIMS:
            out.setdefault((dim, kind), []).append(nbytes)
    for key, sizes in out.items():
        sizes = sorted(set(sizes))
        if len(sizes) > MAX_SIZES:  # evenly spaced picks, always the smallest and the largest
            sizes = [sizes[round(i * (len(sizes) - 1) / (MAX_SIZES - 1))] for i in range(MAX_SIZES)]
        out[key] = sizes
    return out


def _group(mesh, dim: str):
    return None if dim == "world" or mesh is None else mesh.group(dim)


def _op(kind: str, nbytes: int, group, mesh, dim: str):
    """A callable issuing one collective of `kind` moving `nbytes` (the full tensor) on `group`."""
    from scaletrain.distributed.comm import all_gather_single, reduce_scatter_single

    n = dist.get_world_size(group)
    numel = max(1, -(-nbytes // 4))
    if kind == "all_reduce":
        x = torch.zeros(numel)
        return lambda: [dist.all_reduce(x, group=group, async_op=True)]
    numel = -(-numel // n) * n
    full, shard = torch.zeros(numel), torch.zeros(numel // n)
    if kind == "all_gather":
        return lambda: [all_gather_single(full, shard, group=group, async_op=True)]
    if kind == "reduce_scatter":
        return lambda: [reduce_scatter_single(shard, full, group=group, async_op=True)]
    if kind == "all_to_all":  # the expert dispatch: every rank sends 1/n of the slots to each rank
        send, recv = torch.zeros(numel), torch.zeros(numel)
        return lambda: [dist.all_to_all_single(recv, send, group=group, async_op=True)]
    if kind == "p2p":  # one activation to the next stage while receiving one from the previous
        members = mesh.members[dim] if mesh is not None and dim != "world" else list(range(dist.get_world_size()))
        me = members.index(dist.get_rank())
        nxt, prv = members[(me + 1) % len(members)], members[(me - 1) % len(members)]
        send, recv = torch.zeros(numel), torch.zeros(numel)
        return lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                               dist.P2POp(dist.irecv, recv, prv, group)])
    raise ValueError(f"unknown collective kind {kind!r}")


def _busy(seconds: float, state: list) -> None:
    end = time.perf_counter() + seconds
    a = state[0]
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
    state[0] = a


def _work(iters: int, state: list) -> None:
    """A fixed amount of compute (unlike `_busy`, it takes longer when something takes the core from it)."""
    a = state[0]
    for _ in range(iters):
        a = torch.tanh(a @ a)
    state[0] = a


def _iters_for(seconds: float, state: list) -> int:
    """How many `_work` iterations take `seconds` on this core now."""
    t0 = time.perf_counter()
    _work(50, state)
    return max(1, round(seconds * 50 / max(time.perf_counter() - t0, 1e-9)))


OVERLAPPED = {("dp", "all_reduce"), ("dp", "reduce_scatter"), ("dp", "all_gather"), ("pp", "p2p")}
"""The (dimension, kind)s the composition lets compute hide: data-parallel buckets and ZeRO-3 units
issued asynchronously during the backward / forward, and pipeline sends."""


def overlap_efficiency(alone: float, plain: float, overlapped: float) -> float:
    """The fraction of the shorter of compute (`alone`) and collective (`plain`) that running them at once
    (`overlapped`: issue, compute, wait) saves over running them one after the other: 1 when the total is
    the longer of the two, 0 when it is their sum (clamped to [0, 1])."""
    shorter = min(alone, plain)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (alone + plain - overlapped) / shorter))


def measure_comm(cfg: Config, mesh, gap_s: float, repeats: int = 15,
                 overlap_s: float | None = None) -> dict[str, dict[str, list]]:
    """Time every collective `queries(cfg)` names on this rank's group of its dimension, each `repeats`
    times after `gap_s` seconds of computation, without a barrier (the ranks arrive from their own work,
    as in the run): the mean per size (a step adds many collectives, so their occasional multi-ms stalls
    on shared cores count, which a median would drop), and per kind the mean launch (the time until
    the asynchronous call returns).

    For the kinds the composition overlaps with compute (`OVERLAPPED`), also the overlap efficiency:
    per repeat, a fixed amount of compute of `overlap_s` seconds (default `gap_s`) timed alone and again
    between issuing the collective and waiting for it (`overlap_efficiency` of the means, then the mean
    over sizes). On CPU ranks with a core each the transport threads share that core with the compute;
    the measurement shows how much of the collective the compute really hides.

    Every rank of the run must call this together. Returns {dimension: {kind: [(bytes, seconds), ...],
    "launch": {kind: seconds}, "overlap": {kind: efficiency}}} for `RunProfile.comm`."""
    state = [torch.randn(32, 32)]
    iters = _iters_for(gap_s if overlap_s is None else overlap_s, state)
    out: dict[str, dict[str, list]] = {}
    for (dim, kind), sizes in sorted(queries(cfg).items()):
        group = _group(mesh, dim)
        if dim != "world" and (mesh is None or len(mesh.members[dim]) < 2):
            continue
        table = out.setdefault(dim, {})
        for nbytes in sizes:
            op = _op(kind, nbytes, group, mesh, dim)
            for w in op():  # first call: buffers and connections
                w.wait()
            times, launches, alone, together = [], [], [], []
            for _ in range(repeats):
                _busy(gap_s, state)
                t0 = time.perf_counter()
                works = op()
                launches.append(time.perf_counter() - t0)
                for w in works:
                    w.wait()
                times.append(time.perf_counter() - t0)
                if (dim, kind) in OVERLAPPED:
                    t0 = time.perf_counter()
                    _work(iters, state)
                    alone.append(time.perf_counter() - t0)
                    _busy(gap_s, state)
                    t0 = time.perf_counter()
                    works = op()
                    _work(iters, state)
                    for w in works:
                        w.wait()
                    together.append(time.perf_counter() - t0)
            table.setdefault(kind, []).append((nbytes, statistics.fmean(times)))
            table.setdefault("launch", {}).setdefault(kind, []).append(statistics.fmean(launches))
            if together:
                eff = overlap_efficiency(statistics.fmean(alone), statistics.fmean(times), statistics.fmean(together))
                table.setdefault("overlap", {}).setdefault(kind, []).append(eff)
    for table in out.values():  # one launch cost and one efficiency per kind (they hardly depend on the size)
        for key in ("launch", "overlap"):
            if key in table:
                table[key] = {k: statistics.fmean(v) for k, v in table[key].items()}
    return out


def gap_between_collectives(cfg: Config, sample: dict) -> float:
    """The mean compute between two of the run's blocking collectives, from one profile sample."""
    comp = run_time.compute_time(cfg, profile_from_sample({k: v for k, v in sample.items() if k != "comm"}))
    return comp / max(run_time.collectives_per_step(cfg), 1)


def sample_with_comm(cfg: Config, probe: RunProbe, mesh) -> dict:
    """One profile sample of this rank's compute followed by the in-place collective times at the gap
    it implies (every rank of the run calls this together)."""
    sample = probe.sample()
    sample["comm"] = measure_comm(cfg, mesh, gap_between_collectives(cfg, sample),
                                  overlap_s=overlapped_compute(sample))
    return sample


def overlapped_compute(sample: dict) -> float:
    """The compute an overlapped collective runs beside: one block's pass (forward and backward averaged;
    a bucket or ZeRO-3 unit is issued at a block and waited for a block later, a pipeline send is followed
    by a stage's pass)."""
    f, b = (sample["block_f"], sample["block_b"]) if sample.get("block_f") else (sample["moe_f"], sample["moe_b"])
    return (f + b) / 2
