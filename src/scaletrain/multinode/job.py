"""The worker side of a launched run: store, network choice, pre-flight, heartbeat and flight recorder.

`supervise(cfg, out, env, device)` wraps one rank of a job started by torchrun (ours or the user's) or
SLURM. On entry, in this order and before any model is built:

1. connect to the job's TCP store (MASTER_ADDR:MASTER_PORT; torchrun's agent hosts it, under plain srun
   rank 0 does) - the same store then initialises the default process group, under a prefix counting this
   rank's starts: torchrun keeps its store across `--max-restarts`, and a restarted gloo group would
   otherwise read the failed attempt's peer addresses and die connecting to them;
2. choose the interface for gloo / NCCL (`network.py`): GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when the
   user set them, else the one routing to MASTER_ADDR; on the rank-0 node of a multi-node job, where
   MASTER_ADDR may be this very host (and resolve to 127.0.1.1), the one routing to a rank of another
   node, whose address it reads from the store. Logged once per node;
3. `dist.init_process_group` (with `parallel.timeout_s` on every group), then a fresh key prefix for this
   attempt (a torchrun restart reuses the store) broadcast from rank 0;
4. the pre-flight checks (`preflight.py`): shared `--out`, versions, config; a mismatch is exit 2;
5. the heartbeat threads (`heartbeat.py`) and the flight recorder (`flight.py`).

On exit it stops them. When the run raised: a collective that timed out starts the hang protocol (every
rank publishes its flight record, the first rank to time out matches them with `flight.diagnose`, writes
`OUT/logs/hang_report.txt` and stops every rank with the one-line verdict); any other communication error
waits up to `parallel.heartbeat_s` for the heartbeat to name the rank that was lost (a connection reset on
rank 0 is usually the other end dying); other errors pass through. A verdict ends the process from the
heartbeat thread (the main thread may be blocked inside a collective): it writes the rank's error record
and flight record, prints the line on the node's first rank and calls `os._exit(1)`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.distributed import launch
from scaletrain.distributed.process_group import DistEnv
from scaletrain.errors import UserError
from scaletrain.multinode import network, preflight
from scaletrain.multinode.flight import T0, FlightRecorder, diagnose
from scaletrain.multinode.heartbeat import ABORT, HANG, Heartbeat, Verdict, hb_key

NETID_KEY = "scaletrain/netid/{attempt}/{rank}"  # this rank's network stack (network.net_identity)
NET_KEY = "scaletrain/net/{attempt}/{rank}"  # before the per-job prefix exists: this rank's chosen address


class CollectiveHang(RuntimeError):
    """A collective timed out; the message is the flight recorder's verdict."""


def master_endpoint() -> tuple[str, int]:
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))


def node_layout(env: DistEnv) -> tuple[int, int]:
    """(ranks per node, number of nodes) of the job, from torchrun's or SLURM's variables."""
    e = os.environ
    if "LOCAL_WORLD_SIZE" in e:
        per = int(e["LOCAL_WORLD_SIZE"])
    elif "SLURM_NTASKS_PER_NODE" in e and e["SLURM_NTASKS_PER_NODE"].isdigit():
        per = int(e["SLURM_NTASKS_PER_NODE"])
    elif e.get("SLURM_JOB_NUM_NODES", "").isdigit():
        per = max(1, env.world_size // int(e["SLURM_JOB_NUM_NODES"]))
    else:
        per = env.world_size
    per = max(1, min(per, env.world_size))
    return per, -(-env.world_size // per)


class Job:
    """One rank's supervision of a launched run (see the module docstring)."""

    def __init__(self, cfg: Config, out: Path | None, env: DistEnv, device: torch.device):
        self.cfg, self.out, self.env, self.device = cfg, out, env, device
        self.rank, self.world, self.local_rank = env.rank, env.world_size, env.local_rank
        self.timeout = cfg.parallel.timeout_s
        self.attempt = 1
        logs = os.environ.get("SCALETRAIN_LOG_DIR")
        self.logs = Path(logs) if logs else (out / "logs" if out is not None else None)
        self.store: Any = None
        self.kv: Any = None
        self.net: network.NetChoice | None = None
        self.facts: list[preflight.RankFacts] = []
        self.hosts: list[str] = [socket.gethostname()] * self.world
        self.heartbeat: Heartbeat | None = None
        self.recorder: FlightRecorder | None = None
        self.trainer: Any = None
        self._published_own = False
        self._publish_lock = threading.Lock()

    # ------------------------------------------------------------------ start-up

    def start(self) -> Job:
        from scaletrain.distributed import process_group as distributed

        host, port = master_endpoint()
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        self.store = dist.TCPStore(host, port, self.world, is_master=self.rank == 0 and not agent,
                                   timeout=timedelta(seconds=self.timeout), wait_for_workers=False)
        # torchrun's agent keeps one store for all restarts: keys of the attempt that failed (gloo's peer
        # addresses among them) would be read by the next one. The n-th start of rank r keys under "attempt n".
        self.attempt = int(self.store.add(f"scaletrain/starts/{self.rank}", 1)) if agent else 1
        self.net = self._choose_network(host, port)
        distributed.init(self.env, self.timeout, self.device,
                         store=dist.PrefixStore(f"default_pg/attempt{self.attempt}", self.store))
        box = [uuid.uuid4().hex[:16] if self.rank == 0 else ""]
        dist.broadcast_object_list(box, src=0)
        self.kv = dist.PrefixStore(f"scaletrain/{box[0]}/", self.store)
        self._preflight(box[0])
        p = self.cfg.parallel
        if p.flight_recorder > 0:
            self.recorder = FlightRecorder(p.flight_recorder, self.rank, self.hosts[self.rank]).install()
        if p.heartbeat_s > 0:
            self.heartbeat = Heartbeat(
                lambda: dist.PrefixStore(f"scaletrain/{box[0]}/", dist.TCPStore(
                    host, port, is_master=False, timeout=timedelta(seconds=self.timeout), wait_for_workers=False)),
                self.rank, self.world, self.hosts, p.heartbeat_s, self._stop_now, f" at {host}:{port}",
                watch_parent=self.env.launcher == "torchrun", idle_check=self._idle_check,
                on_hang=self._publish_flight, running=self._running).start()
            if self.heartbeat.ppid is not None:  # it names a lost launcher; launch's SIGKILL is the backstop
                launch.defer_parent_exit(4 * self.heartbeat.interval + 1.0)
        return self

    def _choose_network(self, master: str, port: int) -> network.NetChoice:
        """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for this rank, before any process group exists."""
        per_node, nodes = node_layout(self.env)
        var = "NCCL_SOCKET_IFNAME" if self.device.type == "cuda" else "GLOO_SOCKET_IFNAME"
        choice = network.from_variable(var)
        if choice is None and nodes == 1:  # one machine: the library's own choice works
            return network.NetChoice("", "", "one node: the library's default")
        if nodes > 1:  # published before any wait, so nodes that share a host never wait for each other
            self.store.set(NETID_KEY.format(attempt=self.attempt, rank=self.rank), network.net_identity())
        if choice is None:
            choice = network.route_to(master)
            if nodes > 1 and network.is_loopback(choice.address):
                choice = self._same_host(per_node, choice) or self._route_to_other_node(per_node, port, choice)
        self.store.set(NET_KEY.format(attempt=self.attempt, rank=self.rank), choice.address)
        if nodes > 1:
            for v in network.SOCKET_VARS if self.device.type == "cuda" else ("GLOO_SOCKET_IFNAME",):
                os.environ.setdefault(v, choice.interface)
            if self.local_rank == 0:
                ranks = f"rank {self.rank}" if per_node == 1 else f"ranks {self.rank}-{self.rank + per_node - 1}"
                sys.stderr.write(f"scaletrain: host {socket.gethostname()} ({ranks}): {var.split('_')[0].lower()} uses "
                                 f"{choice.interface} {choice.address} ({choice.reason})\n")
        return choice

    def _same_host(self, per_node: int, mine: network.NetChoice) -> network.NetChoice | None:
        """MASTER_ADDR is loopback here: when every node's first rank is in this network stack (agents that share a
        host, e.g. `--rdzv-endpoint 127.0.0.1:PORT`), loopback is the interface; else None."""
        firsts = range(0, self.world, per_node)
        keys = [NETID_KEY.format(attempt=self.attempt, rank=r) for r in firsts]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except RuntimeError:
            return None
        me = network.net_identity()
        if any(self.store.get(k).decode() != me for k in keys):
            return None
        return network.NetChoice(mine.interface, mine.address, f"{mine.reason}; all {len(keys)} nodes share this "
                                 "host, so loopback reaches them")

    def _route_to_other_node(self, per_node: int, port: int, mine: network.NetChoice) -> network.NetChoice:
        """MASTER_ADDR is this host: route to the first rank of the next node instead."""
        peer = (self.rank - self.local_rank + per_node) % self.world
        key = NET_KEY.format(attempt=self.attempt, rank=peer)
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except RuntimeError:
            raise UserError(f"rank {peer} (another node) did not publish its address within parallel.timeout_s "
                            f"({self.timeout:g} s); set GLOO_SOCKET_IFNAME on this host") from None
        addr = self.store.get(key).decode()
        if network.is_loopback(addr):
            raise UserError(f"MASTER_ADDR {master_endpoint()[0]!r} is a loopback address on another node too: start "
                            "torchrun with --local-addr <this node's address> (`scaletrain launch-info` prints it)")
        choice = network.route_to(addr)
        return network.NetChoice(choice.interface, choice.address,
                                 f"MASTER_ADDR {mine.reason.removeprefix('routes to ')} is this host; "
                                 f"{choice.reason} (rank {peer})")

    def _preflight(self, nonce: str) -> None:
        net = self.net or network.NetChoice("", "", "")
        mine = preflight.local_facts(self.rank, self.local_rank, self.cfg.to_dict(), net.interface, net.address,
                                     net.reason)
        if self.out is not None:
            mine.out_path = str(self.out.resolve())
            if self.rank == 0:
                preflight.write_first_marker(self.out, nonce)
            dist.barrier()
            if self.rank != 0:
                mine.sees_out, mine.out_note = preflight.check_marker(self.out, nonce, self.rank)
            dist.barrier()
        if self.rank == 0:
            self.kv.set(ABORT, "")
            self.kv.set(HANG, "")
        self.kv.add(hb_key(self.rank), 1)
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        self.facts = gathered
        if self.out is not None:
            seen = preflight.seen_markers(self.out, nonce) if self.rank == 0 else set()
            box = [sorted(seen)]
            dist.broadcast_object_list(box, src=0)
            for f in self.facts:
                f.seen_by_rank0 = f.rank == 0 or f.rank in box[0]
            if self.rank == 0:
                preflight.remove_markers(self.out, nonce)
        self.hosts = [f.host for f in self.facts]
        problem = preflight.verdict(self.facts, self.out)
        if problem:
            raise preflight.JobCheckError(problem)
        if self.rank == 0 and self.logs is not None and self.out is not None:
            try:
                self.logs.mkdir(parents=True, exist_ok=True)
                (self.logs / "preflight.json").write_text(preflight.to_json(self.facts))
            except OSError:
                pass

    def _running(self, rank: int) -> bool | None:
        """Whether `rank` is known to be alive and not stopped: only a rank on this machine can be looked at."""
        f = self.facts[rank] if rank < len(self.facts) else None
        if f is None or not f.machine or f.machine != self.facts[self.rank].machine:
            return None
        import psutil

        try:
            return psutil.Process(f.pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE,
                                                          psutil.STATUS_DEAD, psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return False

    def attach(self, trainer: Any) -> None:
        """Let the flight recorder stamp entries with the trainer's step and name the mesh's groups."""
        self.trainer = trainer
        if self.recorder is not None:
            self.recorder.stepper = trainer
            self.recorder.name_groups(dict(trainer.mesh.groups))

    # ------------------------------------------------------------------ stopping

    def close(self, exc: BaseException | None) -> None:
        """Called on the way out. A clean exit stops the threads; a failure may be turned into a verdict."""
        if exc is not None and not isinstance(exc, (UserError, KeyboardInterrupt, SystemExit)) and self.kv:
            if _is_timeout(exc) and self.recorder is not None:
                self._hang(exc)
            elif _is_comm_error(exc) and self.heartbeat is not None:
                self._await_verdict(self.heartbeat.bound + 3 * self.heartbeat.interval + 1)
        if self.heartbeat is not None:
            self.heartbeat.stop(clean=exc is None)
            if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                text = str(exc).splitlines()[0][:300] if str(exc) else exc.__class__.__name__
                user = isinstance(exc, UserError)
                self.heartbeat.mark_failed(text if user else f"{exc.__class__.__name__}: {text}", 2 if user else 1)
        if self.recorder is not None:
            self.recorder.uninstall()

    def _await_verdict(self, seconds: float) -> None:
        """Give the heartbeat time to decide (it ends the process if it does)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)

    def _stop_now(self, v: Verdict) -> None:
        """The heartbeat's verdict: record it, say it once per node, and end this process."""
        try:
            self._write_flight()
            if self.logs is not None:
                from scaletrain.distributed.launch import write_error_record

                self.logs.mkdir(parents=True, exist_ok=True)
                write_error_record(self.logs, self.rank, v.code, v.message, plain=True)
            if v.by == self.rank or (self.local_rank == 0 and self.hosts[v.by] != self.hosts[self.rank]):
                sys.stderr.write(f"scaletrain: error: {v.message}\n")
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(v.code)

    # ------------------------------------------------------------------ hangs

    def _publish_flight(self, exc: BaseException | None = None) -> None:
        """Put this rank's flight record into the store. The main thread's (after its call failed, with the
        traceback that shows what it waited on) is never replaced by the heartbeat thread's."""
        if self.recorder is None:
            return
        with self._publish_lock:
            if exc is None and self._published_own:
                return
            self._published_own = self._published_own or exc is not None
            try:
                self.kv.set(f"fr/{self.rank}", json.dumps(self.recorder.dump(exc)))
            except Exception:  # noqa: BLE001 - best effort: the report says whose record is missing
                pass

    def _write_flight(self) -> None:
        if self.recorder is None or self.logs is None:
            return
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
            (self.logs / f"flight-rank{self.rank}.json").write_text(json.dumps(self.recorder.dump(), indent=1))
        except OSError:
            pass

    def _idle_check(self) -> None:
        """Backstop for a hang that raises nothing (NCCL's watchdog kills the process at the timeout, so on
        CUDA the report is made at 0.9 x timeout): an operation waiting longer starts the hang protocol."""
        rec = self.recorder
        if rec is None:
            return
        limit = 0.9 * self.timeout if self.device.type == "cuda" else self.timeout + 3 * self.heartbeat.interval
        now = time.monotonic()
        for e in rec.entries()[-8:]:
            if now - e[T0] > limit and rec.state(e) in ("in progress", "pending"):
                self._hang(None)
                return

    def _hang(self, exc: BaseException | None) -> None:
        """A collective timed out here: gather every rank's flight record; the first such rank reports."""
        self._publish_flight(exc)
        try:
            first = self.kv.compare_set(HANG, "", str(self.rank)) == str(self.rank).encode()
        except Exception:  # noqa: BLE001
            return
        # a peer's own call times out up to a timeout after ours (it may have been posted later), and only then does
        # its record name the call it was blocked in: wait for that too, bounded (a rank outside any recorded call
        # never names one)
        wait = (max(2.0, 3 * self.heartbeat.interval) if self.heartbeat is not None else 2.0) + min(self.timeout, 10.0)
        if not first:  # the reporter's verdict reaches this rank through the heartbeat
            self._await_verdict(wait + 5.0)
            return
        keys = [f"fr/{r}" for r in range(self.world)]
        deadline = time.monotonic() + wait
        dumps: list[dict] = []
        while time.monotonic() < deadline:  # every record, each naming the call its rank is blocked in
            dumps = [json.loads(self.kv.get(k)) for k in keys if self.kv.check([k])]
            if len(dumps) == self.world and all(any(o["blocked"] for o in d["ops"]) for d in dumps):
                break
            time.sleep(0.05)
        lines = diagnose(dumps)
        step = self.trainer.step if self.trainer is not None else 0
        where = self._write_report(lines, dumps)
        message = (f"a collective timed out after {self.timeout:g} s (parallel.timeout_s) at step {step}: "
                   f"{lines[0]}" + (f"; full report: {where}" if where else ""))
        if where is None:  # no log folder to hold the report: it goes to this rank's stderr
            sys.stderr.write("\n".join(lines) + "\n")
        verdict = Verdict("hang", message, self.rank)
        if self.heartbeat is not None:
            self.heartbeat.fire(verdict)
        else:
            self.kv.set(ABORT, verdict.to_json())
            raise CollectiveHang(message) from exc

    def _write_report(self, lines: list[str], dumps: list[dict]) -> Path | None:
        if self.logs is None:
            return None
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
            path = self.logs / "hang_report.txt"
            path.write_text("\n".join(lines) + "\n")
            (self.logs / "flight_records.json").write_text(json.dumps(dumps, indent=1))
            return path
        except OSError:
            return None


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("Timed out" in text or "timed out" in text or "Timeout" in text)


def _is_comm_error(exc: BaseException) -> bool:
    text = str(exc)
    markers = ("gloo", "NCCL", "Connection", "peer", "Broken pipe")
    return isinstance(exc, (RuntimeError, ConnectionError)) and (
        isinstance(exc, dist.DistError) or any(s in text for s in markers))


class _Inert:
    """The supervisor of a single process: nothing to do."""

    hosts: list[str] = []
    facts: list = []

    def attach(self, trainer: Any) -> None:
        pass


@contextmanager
def supervise(cfg: Config, out: Path | None, env: DistEnv | None, device: torch.device) -> Iterator[Job | _Inert]:
    """Start (and on exit stop) the supervision of this rank; a no-op for a single process."""
    if env is None or env.world_size == 1:
        from scaletrain.distributed import process_group as distributed

        if env is not None:
            distributed.init(env, cfg.parallel.timeout_s, device)
        yield _Inert()
        return
    job = Job(cfg, out, env, device)
    try:
        job.start()
    except BaseException as e:
        job.close(e)
        raise
    try:
        yield job
    except BaseException as e:
        job.close(e)
        raise
    job.close(None)

