"""A replica group's side of the per-step quorum (torchft's Manager, github.com/pytorch/torchft; the quorum and
commit protocol of its Lighthouse, here on torch.distributed's TCPStore and gloo).

Each step a group asks the lighthouse (multinode/lighthouse.py, the store's host) to join the current round with
the number of steps it has completed. The lighthouse closes the round when every member of the previous quorum
has asked or stopped heartbeating, and publishes the quorum: its members (replica group ids), the step they will
compute (one past the highest completed step), which members are behind (they heal first from a live member) and
the id of the process group to use (a new gloo group over the members whenever they change, else the previous
one). After the gradient all-reduce each member reports ok or failed; the lighthouse commits the step only when
every member reported ok, so all members apply the same update or none does (a member that dies mid-collective
makes the round fail and the step is retried with the survivors).

A group of several processes (each group ZeRO-2 over its own ranks, train/runners/replicas.py): every rank
heartbeats (`hb/G/I`, I its rank in the group) so that one frozen rank makes the group dead; local rank 0 alone asks
to join and hands the quorum to the group's other ranks through the store (`qof/G/A/N`: A the group's restart
count, N the join); each rank I of the members forms the cross-group gloo group of local rank I (its ZeRO shard's
ordered sum, its heal) and reports its own outcome, so a round commits only when every rank of every member did.

A group whose heal keeps failing is excluded by the lighthouse (`parallel.heal_attempts` consecutive failed heals,
each reported by the receiving rank in `healfail/R/G/I`): `join` then raises `GroupExcluded` with the lighthouse's
line (`excluded/G`), so its process stops with that one line instead of asking to join forever.

Keys in the store: `hb/G/I` (heartbeat counter), `life/G/I` (incarnations: +1 at each start of the process),
`round`, `reqlife/R/G` (the incarnation that asked to join round R), `req/R/G` (completed steps), `quorum/R`,
`qof/G/A/N`,
`phase/R/G/I` (the heal phase's outcome, agreed inside a group), `ready/R/G/I` (a member's gradient is computed),
`done/R/G/I`, `heal/R/G/I` (seconds, bytes,
resent chunks), `healfail/R/G/I` (why a heal failed), `excluded/G`, `healed/R/I`, `commit/R`, `finished`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from scaletrain.errors import UserError

LIGHTHOUSE_ENV = "SCALETRAIN_LIGHTHOUSE"  # host:port of the lighthouse's store (set by multinode/replicas.py)
REPLICA_ENV = "SCALETRAIN_REPLICA"  # this process's replica group id


class GroupExcluded(UserError):
    """The lighthouse excluded this replica group (its heal failed `parallel.heal_attempts` rounds in a row): the
    process stops with the lighthouse's one line and exit 2; the other groups go on."""


@dataclass(frozen=True)
class Quorum:
    round: int
    members: list[int]  # replica group ids, sorted
    step: int  # the step this round computes
    behind: list[int]  # members whose completed steps < step - 1: they heal first
    pg_id: int
    rows: dict[str, list[int]] | None = None  # parallel.missing_rows=reassign: member -> groups whose rows it computes

    @property
    def source(self) -> int:
        """The member that sends its state to the ones behind (the first that is not behind)."""
        return next(m for m in self.members if m not in self.behind)


class QuorumClient:
    """One replica group's connection to the lighthouse: heartbeat, rounds, process groups, commits."""

    def __init__(self, address: str, group: int, heartbeat_s: float, pg_timeout_s: float, local_rank: int = 0,
                 attempt: int = 0):
        host, port = address.rsplit(":", 1)
        connect = timedelta(seconds=max(60.0, pg_timeout_s))
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=connect)
        self._beat = dist.TCPStore(host, int(port), is_master=False, timeout=connect)
        self.group, self.heartbeat_s, self.pg_timeout_s = group, heartbeat_s, pg_timeout_s
        self.local_rank, self.attempt, self._joins = local_rank, attempt, 0  # attempt: the agent's restart count
        self.beat_key = f"hb/{group}/{local_rank}"
        self.pg: dist.ProcessGroup | None = None
        self.pg_id = -1
        self._stop = threading.Event()
        # this process's incarnation of its group (1 at the first start, +1 at each restart by its agent): a round's
        # member that is restarted is dead for that round even though its heartbeat moves again
        self.life = self._beat.add(f"life/{group}/{local_rank}", 1)
        self._beat.add(self.beat_key, 1)
        threading.Thread(target=self._heartbeat, name="replica-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 5):
            self._beat.add(self.beat_key, 1)

    def close(self) -> None:
        self._stop.set()

    def finished(self) -> bool:
        return self.store.check(["finished"])

    def join(self, completed: int) -> Quorum | None:
        """The quorum of the next round this group is part of (None once the run is finished). Local rank 0 asks
        and hands the answer to the group's other ranks (`qof/...`); they wait for it."""
        key = f"qof/{self.group}/{self.attempt}/{self._joins}"
        self._joins += 1
        if self.local_rank > 0:
            while not self.store.check([key]):
                if self.finished():
                    return None
                time.sleep(0.002)
            q = json.loads(self.store.get(key))
            if q is not None and "excluded" in q:
                raise GroupExcluded(q["excluded"])
            return Quorum(**q) if q is not None else None
        try:
            q = self._join(completed)
        except GroupExcluded as e:  # the group's other ranks stop with the same line
            self.store.set(key, json.dumps({"excluded": str(e)}))
            raise
        self.store.set(key, json.dumps(dataclasses.asdict(q) if q is not None else None))
        return q

    def check_excluded(self) -> None:
        """Raise GroupExcluded (the lighthouse's line) once the lighthouse has excluded this group (checked before
        each request: an excluded group's requests are ignored, so it sees quorums without it until it asks again)."""
        key = f"excluded/{self.group}"
        if self.store.check([key]):
            raise GroupExcluded(self.store.get(key).decode() + "; the other groups go on without it")

    def _join(self, completed: int) -> Quorum | None:
        while not self.finished():
            self.check_excluded()
            r = self.store.add("round", 0)
            self.store.set(f"reqlife/{r}/{self.group}", str(self.life))  # before the request: the lighthouse reads both
            self.store.set(f"req/{r}/{self.group}", str(completed))
            key = f"quorum/{r}"
            while not self.store.check([key]):
                if self.finished():
                    return None
                time.sleep(0.002)
            q = json.loads(self.store.get(key))
            if self.group in q["members"]:
                return Quorum(r, q["members"], q["step"], q["behind"], q["pg_id"], q.get("rows"))
        return None

    def process_group(self, q: Quorum) -> dist.ProcessGroup:
        """The gloo group over this quorum's members (rank = index in `members`; one per local rank: rank I of every
        member group), made when membership changed."""
        if q.pg_id != self.pg_id:
            prefix = dist.PrefixStore(f"pg/{q.pg_id}/{self.local_rank}/", self.store)
            self.pg = dist.ProcessGroupGloo(prefix, q.members.index(self.group), len(q.members),
                                            timedelta(seconds=self.pg_timeout_s))
            self.pg_id = q.pg_id
        return self.pg

    def gather_sum(self, q: Quorum, flat: torch.Tensor) -> torch.Tensor | None:
        """The sum of `flat` over the quorum's members, added in member order (so one process adding the same
        tensors in that order gets the same bits: the replay), or None when the collective failed. An all-gather
        moves (Q - 1) x the bytes of a ring all-reduce's 2 (Q - 1) / Q: the price of an exactly replayable sum."""
        if len(q.members) == 1:
            return flat.clone()
        if not self._ready(q):  # a member died or froze before every member had its gradient
            self.pg_id = -1
            return None
        parts = [torch.empty_like(flat) for _ in q.members]
        try:
            self.process_group(q).allgather([parts], [flat]).wait()
        except RuntimeError:
            self.pg_id = -1  # never reuse a group a failure went through
            return None
        return ordered_sum(parts)

    def _ready(self, q: Quorum) -> bool:
        """Wait until every member has its gradient (`ready/R/G/I`) before the all-gather, whose timeout (2 x
        heartbeat_s) then covers the transfer only: members' compute times differ (a first step's warm-up, a healed
        group's step, a share of reassigned rows, a slower machine), and a wait inside the collective would fail the
        round on a timer. Bounded by liveness instead: False when the lighthouse fails the round (a member died or
        froze: its heartbeat stopped)."""
        self.store.set(f"ready/{q.round}/{self.group}/{self.local_rank}", "1")
        keys = [f"ready/{q.round}/{g}/{self.local_rank}" for g in q.members]
        while not self.store.check(keys):
            if self.store.check([f"commit/{q.round}"]):
                return False
            time.sleep(0.002)
        return True

    def wait(self, key: str, timeout_s: float) -> None:
        """Until `key` is in the store (RuntimeError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica group {self.group}: no {key!r} within {timeout_s} s")
            time.sleep(0.002)

    def agree(self, q: Quorum, ok: bool, ranks: int, timeout_s: float) -> bool:
        """Whether every rank of this group reported `ok` for round q's heal phase (False after `timeout_s` without
        all of them): the group's ranks enter their intra-group collectives together or not at all."""
        if ranks == 1:
            return ok
        prefix = f"phase/{q.round}/{self.group}/"
        self.store.set(prefix + str(self.local_rank), "1" if ok else "0")
        keys = [prefix + str(i) for i in range(ranks)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline or self.finished():
                return False
            time.sleep(0.002)
        return all(self.store.get(k) == b"1" for k in keys)

    def heal_failed(self, q: Quorum, reason: str) -> None:
        """Tell the lighthouse why this rank's heal in round q failed (it counts a group's consecutive failures)."""
        line = (reason.strip().splitlines() or ["no reason given"])[0][:300]
        self.store.set(f"healfail/{q.round}/{self.group}/{self.local_rank}", line)

    def commit(self, q: Quorum, ok: bool, heal: dict | None = None) -> bool:
        """Report this member's outcome (and its heal's stats); the lighthouse's decision for the round (True:
        apply the update)."""
        me = f"{q.round}/{self.group}/{self.local_rank}"
        if heal is not None:
            self.store.set(f"heal/{me}", json.dumps(heal))
        self.store.set(f"done/{me}", "1" if ok else "0")
        key = f"commit/{q.round}"
        while not self.store.check([key]):
            time.sleep(0.002)
        committed = self.store.get(key) == b"1"
        if not committed:
            self.pg_id = -1
        return committed


def group_store(rank: int, timeout_s: float) -> dist.Store:
    """The store a replica group's ranks make their own process group with: torchrun's (MASTER_ADDR:MASTER_PORT,
    hosted by its agent, or by rank 0 without one), prefixed by the agent's restart count, so that a restarted group
    never reads the addresses its dead incarnation left there (the agent keeps one store across restarts)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=not agent and rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"replica-group/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... left to right (the one summation order of runs and replays)."""
    total = parts[0].clone()
    for t in parts[1:]:
        total += t
    return total
