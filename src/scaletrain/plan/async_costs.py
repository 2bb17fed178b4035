"""Communication per step of the data-parallel synchronisation modes, side by side (`parallel.sync`).

For a data-parallel group of n workers, each holding Ψ parameters (G gradient bytes, P parameter bytes per
worker), on links of bandwidth B and latency α (the planner's alpha-beta model, `plan.costs`):

- BSP, ring all-reduce of the gradients (Patarasuk & Yuan, JPDC 2009): each worker sends 2(n-1)/n x G;
  time 2(n-1)/n x G/B + 2(n-1)α.
- Parameter server with S servers (Li et al., OSDI 2014; BytePS, Jiang et al., OSDI 2020, sec. 3): each worker
  pushes G and pulls P per step, and the servers together receive n x G and send n x P, each 1/S of it when the
  tensors are spread evenly. The push and the pull are separate phases (the pull waits for the update); in
  each, the bottleneck is the slower of a worker's link and a server's: time G / min(B_w, S B_s / n) +
  P / min(B_w, S B_s / n) + 2α. With S = n and B_s = B_w this is (G + P)/B, about the all-reduce's 2G(n-1)/(nB);
  with few servers the servers' links are the bottleneck (n/S times slower).
- Local SGD with H local steps (Lin et al., arXiv 1808.07217) and DiLoCo (arXiv 2311.08105): one all-reduce of
  the parameters every H steps: 1/H of BSP's bytes per step, 2(n-1)/n x P/H.
- Hogwild (arXiv 1106.5730): no network; each update moves its parameters through host memory three times
  (read for the gradient, read for the step, write), 3P per worker update, at the host memory bandwidth.

`server_bytes` is what a ps run logs per update (`metrics.jsonl`): n x (G + P), all the servers' traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.plan.costs import allreduce_time


@dataclass(frozen=True)
class SyncCost:
    mode: str
    worker_bytes: float
    """Bytes one worker sends per step (all-reduce) or sends and receives (ps: push + pull)."""
    server_bytes: float
    """Bytes through all the servers per step (ps only)."""
    time_s: float
    """Communication time per step (not overlapped with compute)."""
    formula: str

    def to_dict(self) -> dict:
        return {"mode": self.mode, "worker_bytes": self.worker_bytes, "server_bytes": self.server_bytes,
                "time_s": self.time_s, "formula": self.formula}


def allreduce_cost(grad_bytes: float, n: int, link: tuple[float, float]) -> SyncCost:
    sent = 2 * (n - 1) / n * grad_bytes if n > 1 else 0.0
    return SyncCost("bsp (all-reduce)", sent, 0.0, allreduce_time(grad_bytes, n, link), "2(n-1)/n G per worker")


def ps_cost(grad_bytes: float, param_bytes: float, n: int, servers: int, worker_link: tuple[float, float],
            server_bw: float) -> SyncCost:
    """Push G and pull P through `servers` servers of bandwidth `server_bw` each (bytes/s)."""
    bw = min(worker_link[0], servers * server_bw / n)
    time = (grad_bytes + param_bytes) / bw + 2 * worker_link[1]
    return SyncCost(f"ps ({servers} server{'s' if servers > 1 else ''})", grad_bytes + param_bytes,
                    n * (grad_bytes + param_bytes), time, "G + P per worker; n(G + P) / S per server")


def local_cost(param_bytes: float, n: int, h: int, link: tuple[float, float], outer: str = "avg") -> SyncCost:
    sent = 2 * (n - 1) / n * param_bytes / h if n > 1 else 0.0
    name = f"diloco (H={h})" if outer == "diloco" else f"local SGD (H={h})"
    return SyncCost(name, sent, 0.0, allreduce_time(param_bytes, n, link) / h, "2(n-1)/n P / H per worker")


def hogwild_cost(param_bytes: float, host_bw: float) -> SyncCost:
    return SyncCost("hogwild (shared memory)", 0.0, 0.0, 3 * param_bytes / host_bw,
                    "3P host-memory bytes per update, no network")


def compare(grad_bytes: float, param_bytes: float, n: int, link: tuple[float, float], servers: int,
            server_bw: float, local_steps: int, host_bw: float, outer: str = "avg",
            worker_link: tuple[float, float] | None = None) -> list[SyncCost]:
    """The rows `scaletrain plan` prints: all-reduce (on the dp group's `link`), parameter server (each worker on
    `worker_link`, default `link`), local SGD / DiLoCo, Hogwild."""
    rows = [allreduce_cost(grad_bytes, n, link),
            ps_cost(grad_bytes, param_bytes, n, servers, worker_link or link, server_bw),
            local_cost(param_bytes, n, local_steps, link, outer)]
    if outer != "diloco":
        rows.append(local_cost(param_bytes, n, local_steps, link, "diloco"))
    rows.append(hogwild_cost(param_bytes, host_bw))
    return rows


def as_bsp(cfg):
    """A copy of a run config with the synchronous defaults (`plan --config` times one worker's step as BSP and
    shows the run's synchronisation in the comparison table)."""
    import copy
    import dataclasses

    from scaletrain.config import ParallelConfig
    from scaletrain.config.schema import ASYNC_KEYS

    out = copy.deepcopy(cfg)
    default = ParallelConfig()
    for f in dataclasses.fields(ParallelConfig):
        if f.name in ("sync", *ASYNC_KEYS, "slow_ranks"):
            setattr(out.parallel, f.name, getattr(default, f.name))
    return out


def for_layout(m, gpu, train, lay, servers: int, local_steps: int, server_bw: float | None = None,
               outer: str = "avg", a=None) -> dict:
    """The comparison for one planned layout: its dp group, the parameters one rank holds (the fuller pipeline
    stage), gradient and parameter bytes in the run's dtypes; `server_bw` (bytes/s) defaults to one NIC."""
    from scaletrain.plan.costs import DEFAULT_ASSUMPTIONS, DTYPES, group_link, stage_params

    a = a or DEFAULT_ASSUMPTIONS
    pb, gb, _, _ = DTYPES[train.dtype]
    gb = train.grad_bytes or gb
    psi = max(x.total for x in stage_params(m, lay))
    link = group_link(gpu, lay.dp, lay.tp, a)
    nic = (gpu.inter_bw * a.link_efficiency, gpu.inter_latency)  # a worker reaches the servers through its NIC
    rows = compare(psi * gb, psi * pb, lay.dp, link, servers, server_bw or nic[0], local_steps,
                   gpu.hbm_bandwidth * a.hbm_efficiency, outer, nic)
    return {"dp": lay.dp, "params_per_rank": psi, "servers": servers, "local_steps": local_steps,
            "rows": [r.to_dict() for r in rows]}


def table(doc: dict):
    from rich.table import Table

    t = Table(title=f"data-parallel synchronisation per step: dp {doc['dp']}, {doc['params_per_rank']:,.0f} "
                    f"parameters per rank (docs/async.md)")
    for col in ("synchronisation", "bytes/worker/step", "bytes/servers/step", "comm s/step", "formula"):
        t.add_column(col, justify="left" if col in ("synchronisation", "formula") else "right")
    for r in doc["rows"]:
        t.add_row(r["mode"], _size(r["worker_bytes"]), _size(r["server_bytes"]) if r["server_bytes"] else "-",
                  f"{r['time_s']:.3g}", r["formula"])
    return t


def _size(x: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"
