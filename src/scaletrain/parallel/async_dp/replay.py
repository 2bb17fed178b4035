"""Replay an asynchronous run in one process from its version log, and compare with what the run produced.

Whatever the timing of a parameter-server or locked-Hogwild run, its result is a function of its version log
(`versions.py`): update i applied, in logged order, the gradients of its members' tickets computed on the
parameter versions they pulled. The replay keeps every version still needed, recomputes each member's gradient
on its stale version with the workers' code (`model.WorkerModel`) and applies it with the same update code as
the run (`server.ServerShard` for ps; each worker's own optimizer for Hogwild), at the thread counts the run
used. Equal final parameters, bit for bit, show that the servers applied exactly the logged schedule and
nothing else (no lost, doubled, reordered or wrongly-versioned gradient).

`scaletrain replay --out RUN` does it for a finished run's directory (docs/async.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scaletrain.config import Config
from scaletrain.errors import ConfigError
from scaletrain.parallel.async_dp.model import Ticket, WorkerModel, clip_
from scaletrain.parallel.async_dp.server import ServerShard, ShardLayout, add_in_order
from scaletrain.parallel.async_dp.versions import VersionLog


@dataclass
class ReplayResult:
    params: dict[str, torch.Tensor]  # final parameters by name
    updates: int
    gradients: int


def _threads(values, default: int) -> int:
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    return int(values[0]) if values else default


def _last_use(log: VersionLog) -> dict[int, int]:
    """For each version pulled by some member: the last update that needs it."""
    last: dict[int, int] = {}
    for u in log.updates:
        for m in u.members:
            last[m.pulled] = u.update
    return last


def replay(cfg: Config, log: VersionLog) -> ReplayResult:
    """Replay `log` for the run config `cfg` (ps or hogwild with hogwild_lock) from the initial weights."""
    log.check()
    mode = log.header.get("mode", cfg.parallel.sync)
    if mode == "hogwild" and not log.header.get("lock", cfg.parallel.hogwild_lock):
        raise ConfigError("a lock-free Hogwild run cannot be replayed: its workers read parameters while others "
                          "write them (only parallel.hogwild_lock=true runs have a replayable schedule)")
    if mode not in ("ps", "hogwild"):
        raise ConfigError(f"only ps and hogwild runs have a version log, got parallel.sync={mode}")
    before = torch.get_num_threads()
    worker_threads = _threads(log.header.get("worker_threads", []), before)
    server_threads = _threads(log.header.get("server_threads", worker_threads), worker_threads)
    torch.set_num_threads(worker_threads)
    try:
        model = WorkerModel(cfg, torch.device("cpu"))
        return (_replay_ps if mode == "ps" else _replay_hogwild)(cfg, log, model, worker_threads, server_threads)
    finally:
        torch.set_num_threads(before)


def _replay_ps(cfg: Config, log: VersionLog, model: WorkerModel, worker_threads: int,
               server_threads: int) -> ReplayResult:
    dp, servers = cfg.parallel.dp, int(log.header.get("servers", cfg.parallel.servers))
    layout = ShardLayout(model.numels, servers)
    shards = [ServerShard(cfg, [model.params[i].detach() for i in layout.owned[s]]) for s in range(servers)]
    versions = {0: model.flat.detach().clone()}
    last = _last_use(log)
    gflat = torch.empty_like(model.flat)
    current = model.flat.detach().clone()
    scale = 1.0 / cfg.tokens_per_step
    n_grads = 0
    for u in log.updates:
        per_server: list[list[torch.Tensor]] = [[] for _ in range(servers)]
        torch.set_num_threads(worker_threads)
        for m in u.members:
            with torch.no_grad():
                model.flat.copy_(versions[m.pulled])
            model.gradient(Ticket(m.ticket, dp), scale)
            model.grads_into(gflat)
            for s in range(servers):
                part = torch.empty(layout.sizes[s], dtype=gflat.dtype)
                layout.gather(gflat, s, part)
                per_server[s].append(part)
            n_grads += 1
        torch.set_num_threads(server_threads)
        parts = [shard.sum_grads(per_server[s]) for s, shard in enumerate(shards)]
        total = add_in_order(parts)
        for s, shard in enumerate(shards):
            shard.step(total, u.lr)
            layout.scatter(shard.flat, s, current)
        if last.get(u.update, -1) > u.update:
            versions[u.update] = current.clone()
        for v in [v for v in versions if last.get(v, -1) <= u.update]:
            del versions[v]
    return ReplayResult(_by_name(model, current), len(log.updates), n_grads)


def _replay_hogwild(cfg: Config, log: VersionLog, model: WorkerModel, worker_threads: int,
                    server_threads: int) -> ReplayResult:
    """Locked Hogwild: each update is one worker's own optimizer step on the current parameters with the
    gradient of its ticket computed on the version it read (each worker keeps its own optimizer state)."""
    dp = cfg.parallel.dp
    replicas = [ServerShard(cfg, [p.detach() for p in model.params]) for _ in range(dp)]  # per-worker optimizer
    versions = {0: model.flat.detach().clone()}
    last = _last_use(log)
    current = model.flat.detach().clone()
    scale = dp / cfg.tokens_per_step
    for u in log.updates:
        (m,) = u.members
        with torch.no_grad():
            model.flat.copy_(versions[m.pulled])
        model.gradient(Ticket(m.ticket, dp), scale)
        clip_(model.grads, cfg.train.grad_clip)
        rep = replicas[m.worker]
        with torch.no_grad():
            rep.flat.copy_(current)
            torch._foreach_copy_(rep.grad_views, model.grads)
        for g in rep.opt.param_groups:
            g["lr"] = u.lr
        rep.opt.step()
        current.copy_(rep.flat)
        if last.get(u.update, -1) > u.update:
            versions[u.update] = current.clone()
        for v in [v for v in versions if last.get(v, -1) <= u.update]:
            del versions[v]
    return ReplayResult(_by_name(model, current), len(log.updates), len(log.updates))


def _by_name(model: WorkerModel, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return model.state_with(flat)
