"""Hogwild: workers on one machine update one copy of the parameters in shared memory, without a lock.

Niu, Recht, Ré and Wright, "Hogwild!: a lock-free approach to parallelizing stochastic gradient descent",
arXiv 1106.5730. The paper's guarantee rests on *sparsity*: each gradient touches few coordinates, so two
workers rarely write the same coordinate and an overwrite costs little. A dense transformer violates it
completely: every gradient touches every parameter. Here the cost is measured rather than assumed:
`lost_updates` counts the coordinates another worker wrote between this worker's read and its write, which
its write then overwrote (docs/async.md).

The parameters live in one file in /dev/shm (`torch.from_file(shared=True)`, a shared memory map: no
transport). Worker w, for each ticket n it draws from a shared counter (the job's store):
  1. reads the shared parameters into its own model (the version it reads is counted in the store),
  2. computes the gradient of ticket n (`async_dp.model.Ticket`, loss averaged over the slice) and clips it,
  3. reads the current shared parameters again, applies its own optimizer's step (each worker keeps its own
     optimizer state, as each process does in PyTorch's Hogwild example), counts the coordinates that changed
     in shared memory since that read, and writes the result back; the update's version is the store's count.
With `parallel.hogwild_lock=true` steps 1 and 3 are each done under an OS lock (flock): every update is then
atomic and the run is ASP with one gradient per update, which `parallel/async_dp/replay.py` reproduces bit for bit
from the version log. One update per ticket, learning rate of the ticket's step.

Evaluation and checkpoints wait for a quiet step (every ticket of the steps before it applied).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.distributed.process_group import DistEnv
from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.optim import lr_multiplier
from scaletrain.parallel.async_dp.model import Ticket, WorkerModel
from scaletrain.parallel.async_dp.straggler import Straggler, wrap_engine
from scaletrain.parallel.async_dp.versions import LogFile, Member, Update
from scaletrain.train.runners import rank_checkpoint as ckpt
from scaletrain.train.runners.common import Metrics, async_signature, default_store, find_resume, observers
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import TrainResult

RECORD = 4  # per ticket: version read, version written, worker, coordinates lost


def check_one_machine(env: dict[str, str] | None = None) -> None:
    """Hogwild's workers share memory: refuse a job that spans machines (torchrun or SLURM variables)."""
    env = dict(os.environ) if env is None else env
    world, local = env.get("WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    if world and local and int(world) != int(local):
        raise ConfigError(f"parallel.sync=hogwild needs every worker on one machine (shared memory); the job has "
                          f"WORLD_SIZE {world} processes and LOCAL_WORLD_SIZE {local} on this node")
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if nodes and int(nodes) > 1 and "SLURM_PROCID" in env:
        raise ConfigError(f"parallel.sync=hogwild needs every worker on one machine (shared memory); the SLURM job "
                          f"has {nodes} nodes")


class SharedState:
    """The shared memory of a hogwild job: parameters, per-ticket records and losses, and the lock file."""

    def __init__(self, numel: int, dtype: torch.dtype, tickets: int, path: str, create: bool):
        elem = torch.empty((), dtype=dtype).element_size()
        self.sizes = (numel * elem, tickets * RECORD * 8, tickets * 8)
        nbytes = sum(self.sizes)
        if create:
            with open(path, "wb") as f:
                f.truncate(nbytes)
            open(path + ".lock", "wb").close()
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        a, b, _ = self.sizes
        self.params = raw[:a].view(dtype)
        self.records = raw[a: a + b].view(torch.int64).view(tickets, RECORD)
        self.losses = raw[a + b:].view(torch.float64)
        self.lock_fd = os.open(path + ".lock", os.O_RDWR)

    @contextmanager
    def lock(self):
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class HogwildRunner:
    def __init__(self, cfg: Config, out: Path | None, env: DistEnv | None, progress: bool = False):
        check_one_machine()
        p, t = cfg.parallel, cfg.train
        self.cfg, self.out, self.progress = cfg, out, progress
        self.rank, self.dp = (env.rank if env else 0), p.dp
        self.locked = p.hogwild_lock
        self.model = WorkerModel(cfg, torch.device("cpu"))
        self.n_params = self.model.engine.n_params
        wrap_engine(self.model.engine, Straggler.for_rank(p.slow_ranks, p.dp, self.rank))
        self.opt = self.model.engine.optimizer  # this worker's own optimizer state
        self.lr_scale = lr_multiplier(cfg.optim)
        self.total = t.steps * p.dp
        self.step = 0
        found, meta = find_resume(out, cfg)
        state = None
        if found is not None:
            self.step = int(meta["step"])
            state = ckpt.load_rank(found, self.rank)
            try:
                self.opt.load_state_dict(state["optimizer"])
            except (KeyError, RuntimeError, ValueError) as e:
                raise CheckpointError(f"checkpoint {found} does not fit the model: {str(e).splitlines()[0]}") from None
        # rank 0 creates the shared file; every rank maps it; then its name is removed (the maps stay)
        multi = dist.is_initialized() and dist.get_world_size() > 1
        name = [f"{_shm_dir()}/scaletrain-hogwild-{uuid.uuid4().hex}" if self.rank == 0 else None]
        if self.rank == 0:  # created and filled before anyone else learns its name
            self.shared = SharedState(self.model.numel, self.model.flat.dtype, self.total, name[0], True)
            with torch.no_grad():
                self.shared.params.copy_(state["params"] if state is not None else self.model.flat)
        if multi:
            dist.broadcast_object_list(name, src=0)
        if self.rank != 0:
            self.shared = SharedState(self.model.numel, self.model.flat.dtype, self.total, name[0], False)
        if multi:
            dist.barrier()  # every rank has mapped it: its name can go
        if self.rank == 0:
            os.unlink(name[0])
            os.unlink(name[0] + ".lock")
        self.store = default_store()
        self.keys = f"scaletrain/hogwild/{os.path.basename(name[0])}"
        self.version0 = self.ticket0 = self.step * self.dp  # one update per ticket: the version at a quiet step
        self.counts = {"ticket": 0, "version": 0}  # single-process counters (no store)
        self.obs = observers(cfg, out, self.rank, torch.device("cpu"), p.dp, self.step)  # collective

    # ---- counters: the store's atomic add across processes

    def _add(self, key: str, amount: int) -> int:
        if self.store is None:
            self.counts[key] += amount
            return self.counts[key]
        return int(self.store.add(f"{self.keys}/{key}", amount))

    def _lock(self):
        return self.shared.lock() if self.locked else nullcontext()

    # ---- one ticket

    def _ticket(self, n: int) -> None:
        read, loss = self._read_and_compute(n)
        with self._lock():
            before = self._begin_update(n)
            lost, written = self._end_update(before)
        self._record(n, read, written, lost, loss)

    def _read_and_compute(self, n: int) -> tuple[int, float]:
        """Steps 1 and 2: read the shared parameters (the version read), compute and clip the ticket's gradient."""
        with self._lock():
            read = self.version0 + self._add("version", 0)
            with torch.no_grad():
                self.model.flat.copy_(self.shared.params)
        loss = self.model.gradient(Ticket(n, self.dp), self.dp / self.cfg.tokens_per_step)
        self.opt.clip_grad_norm(self.cfg.train.grad_clip)
        return read, loss

    @torch.no_grad()
    def _begin_update(self, n: int) -> torch.Tensor | None:
        """Step 3, first half: read the current shared parameters and take this worker's optimizer step on them
        (privately); returns what was read (lock-free: to count the coordinates overwritten at the write)."""
        self.model.flat.copy_(self.shared.params)
        before = None if self.locked else self.model.flat.clone()
        self.opt.step(lr_at(Ticket(n, self.dp).step, self.cfg.train) * self.lr_scale)
        self.opt.zero_grad()
        return before

    @torch.no_grad()
    def _end_update(self, before: torch.Tensor | None) -> tuple[int, int]:
        """Step 3, second half: count the coordinates another worker changed since our read (our write overwrites
        their update: lost), write, and take the next version; returns (lost, version written)."""
        lost = 0 if before is None else int((self.shared.params != before).sum())
        self.shared.params.copy_(self.model.flat)
        return lost, self.version0 + self._add("version", 1)

    def _record(self, n: int, read: int, written: int, lost: int, loss: float) -> None:
        self.shared.records[n] = torch.tensor([read, written, self.rank, lost])
        self.shared.losses[n] = loss

    # ---- quiet steps: evaluation, logging, checkpoints

    def _milestones(self) -> list[int]:
        t = self.cfg.train
        return [s for s in range(self.step + 1, t.steps + 1)
                if (t.eval_every and s % t.eval_every == 0) or s == t.steps
                or (self.out is not None and t.checkpoint_every and s % t.checkpoint_every == 0)]

    def _evaluate(self) -> float:
        with torch.no_grad():
            self.model.flat.copy_(self.shared.params)
        units = range(self.rank, self.model.eval_unit_count(), self.dp)
        total = torch.tensor([sum(self.model.eval_units(u, u + 1) for u in units)], dtype=torch.float64)
        if dist.is_initialized() and self.dp > 1:
            dist.all_reduce(total)
        return float(total) / (self.cfg.train.eval_batches * self.cfg.tokens_per_step)

    def _log(self, first: int, last: int, seconds: float, val: float | None, metrics: Metrics, logfile: LogFile,
             result) -> None:
        """Rank 0: rows of steps first..last and their updates in the version log (in version order)."""
        dp, t = self.dp, self.cfg.train
        rec, losses = self.shared.records, self.shared.losses
        tickets = range((first - 1) * dp, last * dp)
        updates = sorted(tickets, key=lambda n: int(rec[n, 1]))
        for n in updates:
            read, written, worker, lost = (int(x) for x in rec[n])
            logfile.add(Update(written, lr_at(Ticket(n, dp).step, t) * self.lr_scale, [Member(n, worker, read, lost)]))
        per_step = seconds / (last - first + 1)
        for s in range(first, last + 1):
            ns = range((s - 1) * dp, s * dp)
            st = [int(rec[n, 1]) - 1 - int(rec[n, 0]) for n in ns]
            row = {"step": s, "loss": sum(float(losses[n]) for n in ns) / dp, "lr": lr_at(s, t) * self.lr_scale,
                   "tokens_per_s": self.cfg.tokens_per_step / per_step, "step_time_s": per_step,
                   "staleness_max": max(st), "staleness_mean": sum(st) / dp,
                   "lost_updates": sum(int(rec[n, 3]) for n in ns)}
            if s == last and val is not None:
                row["val_loss"] = result.val_losses[s] = val
            result.losses[s] = row["loss"]
            metrics.write(row)
        logfile.flush()

    def _barrier(self) -> None:
        if dist.is_initialized() and self.dp > 1:
            dist.barrier()

    def run(self):
        t = self.cfg.train
        result = TrainResult(params=self.n_params, resumed_from=self.step)
        root = self.rank == 0
        metrics = Metrics(self.out if root else None, self.cfg, self.step, self.progress and root, self.obs)
        logfile = LogFile(self.out / "version_log.jsonl" if root and self.out is not None else None)
        p = self.cfg.parallel
        logfile.open({"mode": "hogwild", "dp": p.dp, "lock": self.locked, "worker_threads": [torch.get_num_threads()]},
                     self.version0)
        held = None
        t_start = t_seg = time.perf_counter()
        try:
            for m in self._milestones():
                while True:
                    n = held if held is not None else self.ticket0 + self._add("ticket", 1) - 1
                    held = None
                    if n >= m * self.dp:
                        held = n  # a ticket of a later step: after the quiet step
                        break
                    self._ticket(n)
                self._barrier()  # every ticket before step m is applied
                val = self._evaluate() if t.eval_every and (m % t.eval_every == 0 or m == t.steps) else None
                first = self.step + 1
                self.step = m
                if root:
                    self._log(first, m, time.perf_counter() - t_seg, val, metrics, logfile, result)
                t_seg = time.perf_counter()
                if self.out is not None and ((t.checkpoint_every and m % t.checkpoint_every == 0) or m == t.steps):
                    metrics.sync()
                    logfile.flush(sync=True)
                    payload = {"optimizer": self.opt.state_dict()}
                    if root:
                        payload["params"] = self.shared.params.clone()
                    ckpt.save(self.out / "checkpoints", m, self.rank, self.dp, payload, async_signature(self.cfg),
                              self._barrier, t.keep_checkpoints)
                    metrics.checkpoint(m)
                self._barrier()
        finally:
            metrics.close()
            logfile.close()
        self.version_log = logfile.log
        self.rows = metrics.rows
        self.obs.finish()
        elapsed = time.perf_counter() - t_start
        result.final_step = self.step
        result.tokens_per_s = sum(1 for _ in result.losses) * self.cfg.tokens_per_step / elapsed if elapsed else 0.0
        return result

    def full_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_with(self.shared.params)
