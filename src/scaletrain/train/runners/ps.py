"""Parameter server with bounded staleness: BSP (k = 0), SSP (k > 0) and ASP (k = -1) on gloo point-to-point.

Roles (Li et al., "Scaling distributed machine learning with the parameter server", OSDI 2014): ranks
0..S-1 are servers, each holding a shard of whole tensors and their optimizer state (`parallel/async_dp/server.py`);
ranks S..S+dp-1 are the workers. Server 0 is also the coordinator: it hands out work and decides the order of
everything, so every server applies the same updates in the same order and serves pulls of one version.

A worker's loop is one round trip per ticket: push the gradient of its last ticket (one message per server,
server 0's last) together with a request for work; receive a grant (ticket n, version v) and pull version v
from every server; compute the gradient of ticket n (`async_dp.model.Ticket`: the data of a synchronous run's
dp rank n mod dp at step n // dp + 1, scaled by 1 / tokens of the global batch). Server 0's receiving thread
takes the requests from any worker in arrival order.

Update i applies the first dp gradients to arrive after update i - 1, summed in ticket order: one global
batch's worth, as in K-async SGD with K = dp (Dutta et al., arXiv 1803.01113). The staleness bound
(`parallel.staleness` = k, `parallel/async_dp/gate.py`) is enforced when a ticket is granted: a gradient computed
on version r must be applied by update r + k + 1, and since the worst case is that every gradient in flight
arrives before it, a grant is made only while (gradients in flight + 1) <= (r_min + k + 1 - v) x dp - (pushes
already waiting), r_min the oldest version in flight (SSP, Ho et al., NIPS 2013, stated in versions). With k = 0
this admits exactly the dp tickets of step v + 1 on version v: BSP, the single-process run's arithmetic (up to
the order of additions). k = -1 grants always (ASP).

Evaluation and checkpoints happen at a quiet version: tickets beyond that step are held back until it is
applied with nothing in flight. A checkpoint is the servers' shards (parameters and optimizer state); workers
hold no state. Deaths: with `parallel.ps_tolerate_loss` (ASP), a worker the launcher reports dead (a store key)
is dropped, its ticket given to another worker, and the run goes on.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.distributed.process_group import DistEnv, pick_device
from scaletrain.errors import CheckpointError
from scaletrain.optim import lr_multiplier
from scaletrain.parallel.async_dp.gate import Gate
from scaletrain.parallel.async_dp.model import Ticket, WorkerModel
from scaletrain.parallel.async_dp.server import ServerShard, ShardLayout, add_in_order
from scaletrain.parallel.async_dp.straggler import Straggler, wrap_engine
from scaletrain.parallel.async_dp.versions import LogFile, Member, Update
from scaletrain.train.runners import rank_checkpoint as ckpt
from scaletrain.train.runners.common import Metrics, async_signature, default_store, find_resume, observers
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import TrainResult

# message tags
CTRL, PUSH, REPLY, PARAMS, CMD = 11, 12, 13, 14, 15
# worker -> server kinds (header word 0)
K_REQUEST, K_PUSH, K_EVAL, K_BYE, K_STOP = 1, 2, 3, 4, 5
# coordinator -> worker replies
R_GRANT, R_EVAL, R_DONE = 1, 2, 3
# coordinator -> server commands
C_PULL, C_APPLY, C_DEAD, C_SAVE, C_STOP = 1, 2, 3, 4, 5
HEADER = 8  # int64 words before a message's payload
DEAD_KEY = "scaletrain/ps/dead/{rank}"


class Message:
    """One contiguous byte buffer: an int64 header and a payload of `numel` elements of `dtype`."""

    def __init__(self, numel: int, dtype: torch.dtype):
        elem = torch.empty((), dtype=dtype).element_size()
        self.buf = torch.zeros(HEADER * 8 + numel * elem, dtype=torch.uint8)
        self.hdr = self.buf[: HEADER * 8].view(torch.int64)
        self.payload = self.buf[HEADER * 8:].view(dtype)

    def set(self, *words: int, value: float = 0.0) -> Message:
        self.hdr.zero_()
        for i, w in enumerate(words):
            self.hdr[i] = int(w)
        self.hdr.view(torch.float64)[HEADER - 1] = value  # the last word carries a float (a loss)
        return self

    @property
    def value(self) -> float:
        return float(self.hdr.view(torch.float64)[HEADER - 1])


def _groups(cfg: Config) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """The gloo group of the whole job (point-to-point; servers are CPU processes even when workers are GPUs) and
    the servers' group (their norm all-gather). Collective: every rank calls this, in the same order."""
    p = cfg.parallel
    timeout = timedelta(seconds=p.timeout_s)
    world = p.dp + p.servers
    every = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    servers = dist.new_group(list(range(p.servers)), backend="gloo", timeout=timeout) if p.servers > 1 else None
    return every, servers


def _tolerated(cfg: Config, rank: int, what: str, error: Exception) -> bool:
    """Whether a failed send to worker `rank` is a death the run tolerates (the caller then drops it)."""
    if not cfg.parallel.ps_tolerate_loss:
        raise RuntimeError(f"{what} worker {rank - cfg.parallel.servers} (rank {rank}) failed: "
                           f"{str(error).splitlines()[0][:200]}") from error
    return True


class _Server:
    """What every server does: hold its shard, stage pushed gradients (a receiving thread), apply updates."""

    def __init__(self, cfg: Config, rank: int, layout: ShardLayout, model: WorkerModel, groups, out: Path | None):
        self.cfg, self.rank, self.layout, self.out = cfg, rank, layout, out
        self.every, self.server_group = groups
        values = [model.params[i].detach() for i in layout.owned[rank]]
        self.shard = ServerShard(cfg, values)
        self.dtype = self.shard.flat.dtype
        self.staged: dict[tuple[int, int], torch.Tensor] = {}
        self.cond = threading.Condition()
        self.rx_error: BaseException | None = None
        self.version = 0
        self.timeout_s = cfg.parallel.timeout_s

    # ---- the gradients pushed to this server (any worker, arrival order)

    def start_receiving(self, tag: int, stop_when) -> threading.Thread:
        def loop() -> None:
            tolerated = 0
            try:
                while True:
                    msg = Message(self.shard.flat.numel(), self.dtype)
                    try:
                        dist.recv(msg.buf, tag=tag, group=self.every)
                    except RuntimeError as e:  # a worker died while sending: its message is void (never a member)
                        if not self.cfg.parallel.ps_tolerate_loss or tolerated >= self.cfg.parallel.dp or \
                                not any(w in str(e) for w in ("closed", "reset")):
                            raise
                        tolerated += 1
                        continue
                    kind, worker, ticket = (int(x) for x in msg.hdr[:3])
                    if kind == K_STOP:
                        return
                    with self.cond:
                        self.on_message(kind, worker, ticket, msg)
                        self.cond.notify_all()
                    if stop_when(kind):
                        return
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                with self.cond:
                    self.rx_error = e
                    self.cond.notify_all()

        thread = threading.Thread(target=loop, name=f"ps-recv-{tag}", daemon=True)
        thread.start()
        return thread

    def on_message(self, kind: int, worker: int, ticket: int, msg: Message) -> None:
        if kind == K_PUSH:
            self.staged[(ticket, worker)] = msg.payload

    def take_staged(self, key: tuple[int, int]) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while key not in self.staged:
                if self.rx_error is not None:
                    raise RuntimeError(f"server {self.rank}: receiving failed: {self.rx_error}") from self.rx_error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"server {self.rank}: the gradient of ticket {key[0]} from worker {key[1]} "
                                       f"did not arrive within {self.timeout_s:.0f} s")
                self.cond.wait(min(left, 1.0))
            return self.staged.pop(key)

    # ---- updates, pulls, checkpoints

    def apply(self, update: int, lr: float, members: list[tuple[int, int]]) -> float:
        """Sum the members' gradients (ticket order), clip by the global norm over the servers, step."""
        part = self.shard.sum_grads([self.take_staged(key) for key in members])
        if self.server_group is not None:
            parts = [torch.zeros_like(part) for _ in range(self.cfg.parallel.servers)]
            dist.all_gather(parts, part, group=self.server_group)
            total = add_in_order(parts)
        else:
            total = part
        norm = self.shard.step(total, lr)
        self.version = update
        return norm

    def send_params(self, worker_rank: int) -> bool:
        """Send this shard's parameters to a worker; False if the worker is gone (tolerated deaths only)."""
        try:
            dist.send(self.shard.flat, dst=worker_rank, tag=PARAMS, group=self.every)
            return True
        except RuntimeError as e:
            return not _tolerated(self.cfg, worker_rank, "sending parameters to", e)

    def save(self, step: int, extra: dict) -> None:
        payload = {**self.shard.state_dict(), "version": self.version, "server": self.rank, **extra}
        barrier = (lambda: dist.barrier(group=self.server_group)) if self.server_group is not None else (lambda: None)
        ckpt.save(self.out / "checkpoints", step, self.rank, self.cfg.parallel.servers, payload,
                  async_signature(self.cfg), barrier, self.cfg.train.keep_checkpoints)

    def resume(self) -> int:
        found, meta = find_resume(self.out, self.cfg)
        if found is None:
            return 0
        state = ckpt.load_rank(found, self.rank)
        try:
            self.shard.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {found} does not fit the model: {str(e).splitlines()[0]}") from None
        self.version = int(meta["step"])
        return self.version


class ServerProcess(_Server):
    """Servers 1..S-1: follow the coordinator's commands in order."""

    def run(self) -> None:
        self.resume()
        rx = self.start_receiving(PUSH, lambda kind: False)
        dp = self.cfg.parallel.dp
        cmd = torch.zeros(HEADER + 2 * dp, dtype=torch.int64)
        while True:
            dist.recv(cmd, src=0, tag=CMD, group=self.every)
            kind = int(cmd[0])
            if kind == C_PULL:
                self.send_params(int(cmd[1]))
            elif kind == C_APPLY:
                update, m = int(cmd[1]), int(cmd[3])
                lr = float(cmd[2:3].view(torch.float64))
                members = [(int(cmd[HEADER + j]), int(cmd[HEADER + dp + j])) for j in range(m)]
                self.apply(update, lr, members)
            elif kind == C_DEAD:
                worker, m = int(cmd[1]), int(cmd[2])
                with self.cond:
                    for j in range(m):
                        self.staged.pop((int(cmd[HEADER + j]), worker), None)
            elif kind == C_SAVE:
                self.save(int(cmd[1]), {})
            elif kind == C_STOP:
                self.lost_peers = bool(cmd[1])
                dist.send(self.shard.flat, dst=0, tag=PARAMS, group=self.every)  # the final parameters
                rx.join(timeout=self.timeout_s)
                return


class Coordinator(_Server):
    """Server 0: also grants tickets, orders updates, evaluates through the workers, logs and checkpoints."""

    def __init__(self, cfg, rank, layout, model, groups, out, progress: bool):
        super().__init__(cfg, rank, layout, model, groups, out)
        p = cfg.parallel
        self.model = model  # for the final state dict (server 0 keeps the whole model)
        self.dp, self.S, self.k = p.dp, p.servers, p.staleness
        self.live = set(range(p.dp))
        self.lost: list[int] = []
        self.waiting: deque[int] = deque()
        self.losses: dict[int, float] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.progress = progress
        self.store = default_store(unwrap=True) if p.ps_tolerate_loss else None
        self.lr_scale = lr_multiplier(cfg.optim)
        self.param_bytes = model.numel * model.flat.element_size()
        self.moved = 0  # payload bytes into and out of the servers since the last update
        self.worker_threads: dict[int, int] = {}
        self.byes: set[int] = set()
        self.result_losses: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}
        self.full: dict[str, torch.Tensor] = {}

    # ---- messages from workers (a receiving thread puts them in the inbox)

    def on_message(self, kind, worker, ticket, msg) -> None:
        self.inbox.put((kind, worker, ticket, msg))

    def _cmd(self, *words: int, lists: tuple[list[int], list[int]] = ((), ()), lr: float | None = None) -> None:
        if self.S == 1:
            return
        cmd = torch.zeros(HEADER + 2 * self.dp, dtype=torch.int64)
        for i, w in enumerate(words):
            cmd[i] = int(w)
        if lr is not None:
            cmd[2:3].view(torch.float64)[0] = lr
        for j, (a, b) in enumerate(zip(*lists)):
            cmd[HEADER + j], cmd[HEADER + self.dp + j] = a, b
        for s in range(1, self.S):
            dist.send(cmd, dst=s, tag=CMD, group=self.every)

    def _reply(self, w: int, *words: int) -> bool:
        try:
            dist.send(torch.tensor(list(words) + [0] * (HEADER - len(words)), dtype=torch.int64),
                      dst=self.S + w, tag=REPLY, group=self.every)
            return True
        except RuntimeError as e:
            _tolerated(self.cfg, self.S + w, "replying to", e)
            self._lose(w, "its connection closed")
            return False

    def _pull(self, w: int) -> bool:
        """Servers 1.. and then this one send the current version to worker w (after its reply)."""
        self._cmd(C_PULL, self.S + w)
        ok = self.send_params(self.S + w)
        if not ok:
            self._lose(w, "its connection closed")
        self.moved += self.param_bytes
        return ok

    # ---- granting work

    def _grant(self, w: int) -> None:
        if not self.granted:  # the first update's time counts from the first grant, not from the job's start
            self.granted, self.last_t = True, time.perf_counter()
        n, version = self.gate.grant(w)
        if self._reply(w, R_GRANT, n, version):
            self._pull(w)

    def _advance(self) -> None:
        """Serve waiting workers as far as the run's state allows."""
        while True:
            if self.phase == "train":
                if self.gate.quiet(self.milestone):
                    self._milestone()
                    continue
                while self.waiting and self.gate.can_grant(self.milestone * self.dp):
                    self._grant(self.waiting.popleft())
                return
            if self.phase == "eval":
                while self.waiting and self.eval_queue:
                    w = self.waiting.popleft()
                    cid, a, b = self.eval_queue.pop(0)
                    self.eval_out[cid] = (w, a, b)
                    if self._reply(w, R_EVAL, cid, self.version, a, b):
                        self._pull(w)
                if self.eval_queue or self.eval_out:
                    return
                units = self.cfg.train.eval_batches * self.cfg.tokens_per_step
                self.val_losses[self.version] = self.held_row["val_loss"] = self.eval_total / units
                self._write(self.held_row)
                self.evaluated = True
                self.phase = "train"
                continue
            while self.waiting:  # done
                w = self.waiting.popleft()
                if self._reply(w, R_DONE, 0, int(bool(self.lost))):
                    self.done_sent.add(w)
            return

    def _milestone(self) -> None:
        t = self.cfg.train
        s = self.milestone
        if t.eval_every and (s % t.eval_every == 0 or s == t.steps) and not self.evaluated:
            units = t.eval_batches * self.dp
            per = math.ceil(units / len(self.live))
            self.eval_queue = [(i, a, min(a + per, units)) for i, a in enumerate(range(0, units, per))]
            self.eval_out, self.eval_total = {}, 0.0
            self.phase = "eval"
            return
        if self.out is not None and ((t.checkpoint_every and s % t.checkpoint_every == 0) or s == t.steps):
            self.metrics.sync()
            self.logfile.flush(sync=True)
            self._cmd(C_SAVE, s)
            self.save(s, {"lost_workers": self.lost})
            self.metrics.checkpoint(s)
        self.evaluated = False
        if s >= t.steps:
            self.phase = "done"
        else:
            self.milestone = self._next_milestone(s)

    def _next_milestone(self, after: int) -> int:
        t = self.cfg.train
        for s in range(after + 1, t.steps + 1):
            if (t.eval_every and s % t.eval_every == 0) or s == t.steps or \
                    (self.out is not None and t.checkpoint_every and s % t.checkpoint_every == 0):
                return s
        return t.steps

    # ---- updates

    def _push(self, w: int, ticket: int, msg: Message) -> None:
        members = self.gate.push(ticket, w)
        self.staged[(ticket, w)] = msg.payload
        self.losses[ticket] = msg.value
        self.moved += self.param_bytes
        if members is not None:
            self._apply(members)

    def _apply(self, members: list[Member]) -> None:
        i = self.gate.version
        lr = lr_at(i, self.cfg.train) * self.lr_scale
        keys = [(m.ticket, m.worker) for m in members]
        self._cmd(C_APPLY, i, 0, len(keys), lists=([k[0] for k in keys], [k[1] for k in keys]), lr=lr)
        norm = self.apply(i, lr, keys)
        if not self.logfile.log.header:
            self.logfile.open(self._log_header(), self.start)
        update = Update(i, lr, members)
        self.logfile.add(update)
        st = update.staleness
        now = time.perf_counter()
        dt, self.last_t = now - self.last_t, now
        loss = sum(self.losses.pop(m.ticket) for m in members)
        self.result_losses[i] = loss
        row = {"step": i, "loss": loss, "lr": lr, "grad_norm": norm,
               "tokens_per_s": self.cfg.tokens_per_step / dt, "step_time_s": dt,
               "staleness_max": max(st), "staleness_mean": sum(st) / len(st), "server_bytes": self.moved,
               "workers": len(self.live)}
        self.moved = 0
        t = self.cfg.train
        if t.eval_every and (i % t.eval_every == 0 or i == t.steps):
            self.held_row = row  # written with its val_loss once the evaluation is done
        else:
            self._write(row)

    def _write(self, row: dict) -> None:
        self.metrics.write(row)
        self.logfile.flush()

    def _log_header(self) -> dict:
        p = self.cfg.parallel
        return {"mode": "ps", "dp": p.dp, "servers": p.servers, "staleness": p.staleness,
                "server_threads": torch.get_num_threads(),
                "worker_threads": sorted(set(self.worker_threads.values()))}

    # ---- deaths (parallel.ps_tolerate_loss)

    def _check_dead(self) -> None:
        if self.store is None:
            return
        for w in sorted(self.live):
            if self.store.check([DEAD_KEY.format(rank=self.S + w)]):
                self._lose(w, self.store.get(DEAD_KEY.format(rank=self.S + w)).decode())

    def _lose(self, w: int, why: str) -> None:
        if w not in self.live:
            return
        self.live.discard(w)
        self.lost.append(w)
        if w in self.waiting:
            self.waiting.remove(w)
        tickets = self.gate.drop(w)
        if self.phase == "eval":
            for cid, (who, a, b) in list(self.eval_out.items()):
                if who == w:
                    del self.eval_out[cid]
                    self.eval_queue.append((cid, a, b))
        self._cmd(C_DEAD, w, len(tickets), lists=(tickets, [0] * len(tickets)))
        sys.stderr.write(f"scaletrain: worker {w} (rank {self.S + w}) is gone ({why}) at update {self.version}; "
                         f"continuing with {len(self.live)} workers (parallel.ps_tolerate_loss)\n")
        if not self.live:
            raise RuntimeError(f"every worker is gone (last: worker {w}, {why})")

    # ---- the loop

    def run(self) -> None:
        self.start = self.resume()
        self.version = self.start
        self.gate = Gate(self.dp, self.k, self.cfg.train.steps * self.dp, self.start)
        self.logfile = LogFile(self.out / "version_log.jsonl" if self.out is not None else None)
        if self.start:
            self.logfile.open(self._log_header(), self.start)
        self.metrics = Metrics(self.out, self.cfg, self.start, self.progress, self.obs)
        self.phase, self.evaluated, self.done_sent = "train", False, set()
        self.milestone = self._next_milestone(self.start) if self.start < self.cfg.train.steps else self.start
        if self.start >= self.cfg.train.steps:
            self.phase = "done"
        self.last_t = time.perf_counter()
        self.granted = False
        byes = [0]

        def all_said_bye(kind: int) -> bool:  # the receiving thread ends after every worker's last message
            byes[0] += kind == K_BYE
            return byes[0] == self.dp

        rx = self.start_receiving(CTRL, all_said_bye)
        last_check = time.monotonic()
        try:
            while not (self.phase == "done" and self.live <= self.byes):
                try:
                    kind, w, ticket, msg = self.inbox.get(timeout=0.25)
                except queue.Empty:
                    if self.rx_error is not None:
                        raise RuntimeError(f"coordinator: receiving failed: {self.rx_error}") from self.rx_error
                    self._check_dead()
                    self._advance()
                    continue
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    self._check_dead()
                if w not in self.live:
                    continue  # a late message of a worker already declared gone
                self.worker_threads.setdefault(w, int(msg.hdr[5]))
                if kind == K_BYE:
                    self.byes.add(w)
                    continue
                if kind == K_PUSH:
                    self._push(w, ticket, msg)
                elif kind == K_EVAL:
                    self.eval_out.pop(ticket, None)
                    self.eval_total += msg.value
                self.waiting.append(w)
                self._advance()
        finally:
            self.metrics.close()
            self.logfile.close()
        self._stop(rx)

    def _stop(self, rx: threading.Thread) -> None:
        self._cmd(C_STOP, int(bool(self.lost)))
        for s in range(1, self.S):  # servers' receiving threads end on this message; then their parameters
            msg = Message(self.layout.sizes[s], self.dtype).set(K_STOP)
            dist.send(msg.buf, dst=s, tag=PUSH, group=self.every)
        shards = [self.shard.flat]
        for s in range(1, self.S):
            buf = torch.empty(self.layout.sizes[s], dtype=self.dtype)
            dist.recv(buf, src=s, tag=PARAMS, group=self.every)
            shards.append(buf)
        flat = torch.empty(sum(self.layout.numels), dtype=self.dtype)
        for s, shard in enumerate(shards):
            self.layout.scatter(shard, s, flat)
        self.full = self.model.state_with(flat)
        if not self.lost:
            rx.join(timeout=self.timeout_s)


class PSWorker:
    """A worker: ask for work, pull, compute, push; no state of its own."""

    def __init__(self, cfg: Config, w: int, layout: ShardLayout, model: WorkerModel, groups):
        self.cfg, self.w, self.layout, self.model = cfg, w, layout, model
        self.every, _ = groups
        self.S = cfg.parallel.servers
        dtype = model.flat.dtype
        self.msgs = [Message(n, dtype) for n in layout.sizes]  # the push to each server (server 0's with the request)
        self.params = [torch.empty(n, dtype=dtype) for n in layout.sizes]
        self.gflat = torch.empty_like(model.flat, device="cpu")
        self.pflat = torch.empty_like(model.flat, device="cpu")
        wrap_engine(model.engine, Straggler.for_rank(cfg.parallel.slow_ranks, cfg.parallel.dp, w))
        self.lost_peers = False

    def run(self) -> None:
        cfg, me, threads = self.cfg, self.w, torch.get_num_threads()
        ctrl = self.msgs[0]
        ctrl.set(K_REQUEST, me, -1, -1, 0, threads)
        reply = torch.zeros(HEADER, dtype=torch.int64)
        scale = 1.0 / cfg.tokens_per_step
        while True:
            dist.send(ctrl.buf, dst=0, tag=CTRL, group=self.every)
            dist.recv(reply, src=0, tag=REPLY, group=self.every)
            kind = int(reply[0])
            if kind == R_DONE:
                self.lost_peers = bool(reply[2])
                ctrl.set(K_BYE, me, -1, -1, 0, threads)
                dist.send(ctrl.buf, dst=0, tag=CTRL, group=self.every)
                return
            self._pull()
            if kind == R_GRANT:
                n, version = int(reply[1]), int(reply[2])
                loss = self.model.gradient(Ticket(n, cfg.parallel.dp), scale)
                self.model.grads_into(self.gflat)
                for s, msg in enumerate(self.msgs):
                    self.layout.gather(self.gflat, s, msg.payload)
                    msg.set(K_PUSH, me, n, version, 0, threads, value=loss)
                works = [dist.isend(self.msgs[s].buf, dst=s, tag=PUSH, group=self.every) for s in range(1, self.S)]
                for wk in works:  # server 0 hears of the push only once the others have their parts
                    wk.wait()
            else:  # R_EVAL
                cid, a, b = int(reply[1]), int(reply[3]), int(reply[4])
                ctrl.set(K_EVAL, me, cid, int(reply[2]), 0, threads, value=self.model.eval_units(a, b))

    def _pull(self) -> None:
        works = [dist.irecv(self.params[s], src=s, tag=PARAMS, group=self.every) for s in range(self.S)]
        for wk in works:
            wk.wait()
        for s in range(self.S):
            self.layout.scatter(self.params[s], s, self.pflat)
        with torch.no_grad():
            self.model.flat.copy_(self.pflat)


class PSRunner:
    """The run loop of one rank of a ps job, with the interface of `Trainer` that the commands use."""

    def __init__(self, cfg: Config, out: Path | None, env: DistEnv | None, progress: bool = False):
        p = cfg.parallel
        self.cfg, self.out = cfg, out
        self.rank = env.rank if env else 0
        if not dist.is_initialized() or dist.get_world_size() != p.dp + p.servers:
            raise RuntimeError(f"parallel.sync=ps needs a process group of dp + servers = {p.dp + p.servers} ranks")
        self.groups = _groups(cfg)
        self.is_server = self.rank < p.servers
        device = torch.device("cpu") if self.is_server else pick_device(cfg.train.device, env.local_rank if env else 0)
        model = WorkerModel(cfg, device)
        self.n_params = model.engine.n_params
        layout = ShardLayout(model.numels, p.servers)
        self.obs = observers(cfg, out, self.rank, device, p.dp + p.servers, 0)  # collective
        if self.rank == 0:
            self.role = Coordinator(cfg, 0, layout, model, self.groups, out, progress)
            self.role.obs = self.obs
        elif self.is_server:
            self.role = ServerProcess(cfg, self.rank, layout, model, self.groups, out)
        else:
            self.role = PSWorker(cfg, self.rank - p.servers, layout, model, self.groups)
        if self.is_server and self.rank > 0:
            del model  # servers keep only their shard
        self.step = 0
        if self.rank == 0 and out is not None:
            found, meta = find_resume(out, cfg)
            self.step = int(meta["step"]) if found is not None else 0

    def run(self):
        t0 = time.perf_counter()
        self.role.run()
        result = TrainResult(params=self.n_params, resumed_from=self.step)
        if self.rank == 0:
            role: Coordinator = self.role
            result.losses, result.val_losses = role.result_losses, role.val_losses
            result.final_step = role.version
            done = len(role.result_losses)
            elapsed = time.perf_counter() - t0
            result.tokens_per_s = done * self.cfg.tokens_per_step / elapsed if elapsed else 0.0
            result.last_row = {}
            self.version_log = role.logfile.log
            self.rows = role.metrics.rows
            self.lost_workers = list(role.lost)
            self.obs.finish()
        self.step = self.cfg.train.steps
        self._finish()
        return result

    def _finish(self) -> None:
        """A job that tolerates deaths leaves without the final barrier over all ranks: a worker may be gone, or
        die while the others finish. All messages have been delivered by now (every worker said goodbye)."""
        if self.cfg.parallel.ps_tolerate_loss and dist.is_initialized():
            dist.destroy_process_group()

    def full_state(self) -> dict[str, torch.Tensor]:
        """The final parameters by name (on the coordinator, rank 0; empty elsewhere)."""
        return dict(self.role.full) if self.rank == 0 else {}
