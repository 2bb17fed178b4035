"""Links and collective times: the alpha-beta model with ring factors (all-reduce 2(n-1)/n, reduce-scatter /
all-gather / all-to-all (n-1)/n; Thakur et al. 2005, Patarasuk & Yuan 2009), placed on the node topology with
Megatron's rank order tp (fastest) - ep - dp - pp (`group_link`), or looked up in collectives measured where the
run issues them (`MeasuredLink`, filled by `plan/exact/run_comm.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.plan.analytic.inputs import Assumptions
from scaletrain.plan.hardware import GPU


def group_link(gpu: GPU, size: int, stride: int, a: Assumptions) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a ring over `size` ranks spaced `stride` apart.

    A group inside one node runs on NVLink. A group that spans nodes is limited by the InfiniBand NICs
    of its members in each node (NCCL runs one ring per NIC), never more than NVLink.
    """
    gpn = gpu.gpus_per_node
    if size * stride <= gpn:
        return gpu.intra_bw * a.link_efficiency, gpu.intra_latency
    per_node = max(1, gpn // stride) if stride < gpn else 1
    return min(gpu.intra_bw, gpu.inter_bw * per_node) * a.link_efficiency, gpu.inter_latency


@dataclass(frozen=True)
class MeasuredLink:
    """A link given by collectives timed where the run will issue them (`plan/exact/run_comm.py`): per kind
    (all_reduce, all_gather, reduce_scatter, p2p), (bytes, seconds) pairs measured on the run's group
    after the run's compute between two collectives. Sizes between two measured ones are interpolated
    linearly; beyond the largest, the alpha-beta increment of (bw, latency) is added; a kind that was not
    measured falls back to alpha-beta. Indexes like the (bandwidth, latency) tuple links."""

    bw: float
    latency: float
    table: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    launch: tuple[tuple[str, float], ...] = ()
    """Per kind, the time an asynchronous collective keeps the calling thread before it returns (its
    launch); the compute clock pays it for every collective it issues and does not wait for."""

    overlap: tuple[tuple[str, float], ...] = ()
    """Per kind, the overlap efficiency: the fraction of an asynchronous collective's time that concurrent
    compute hides (`run_comm.overlap_efficiency`). 1 (what a GPU's separate communication engine comes
    close to) when not measured; on CPU ranks that have one core each the transport threads take their
    time from the compute, and measured values are well below 1."""

    def __getitem__(self, i: int) -> float:
        return (self.bw, self.latency)[i]

    def launch_time(self, kind: str) -> float:
        return dict(self.launch).get(kind, 0.0)

    def overlap_efficiency(self, kind: str) -> float:
        return dict(self.overlap).get(kind, 1.0)

    def time(self, kind: str, nbytes: float, n: int) -> float:
        ab = allreduce_time if kind == "all_reduce" else gather_time
        plain = (self.bw, self.latency)
        points = dict(self.table).get(kind)
        if not points:
            return ab(nbytes, n, plain) if kind != "p2p" else self.latency + nbytes / self.bw
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        b_max, t_max = points[-1]
        if kind == "p2p":
            return t_max + (nbytes - b_max) / self.bw
        return t_max + ab(nbytes, n, plain) - ab(b_max, n, plain)


def overlap_efficiency(link, kind: str) -> float:
    """`MeasuredLink.overlap_efficiency` of a link; 1 (perfect overlap) for an alpha-beta link."""
    return link.overlap_efficiency(kind) if isinstance(link, MeasuredLink) else 1.0


def allreduce_time(nbytes: float, n: int, link: tuple[float, float] | MeasuredLink) -> float:
    if n <= 1:
        return 0.0
    if isinstance(link, MeasuredLink):
        return link.time("all_reduce", nbytes, n)
    return 2 * (n - 1) / n * nbytes / link[0] + 2 * (n - 1) * link[1]


def gather_time(nbytes: float, n: int, link: tuple[float, float] | MeasuredLink, kind: str = "all_gather") -> float:
    """All-gather, reduce-scatter (`kind`) or all-to-all of `nbytes` (the full tensor) over n ranks."""
    if n <= 1:
        return 0.0
    if isinstance(link, MeasuredLink):
        return link.time(kind, nbytes, n)
    return (n - 1) / n * nbytes / link[0] + (n - 1) * link[1]
