"""Heartbeat through the job's TCP store: a dead or frozen rank is noticed within `parallel.heartbeat_s`.

A collective with a dead peer fails only when its connection is reset, and with a frozen one (SIGSTOP, a
machine swapping itself to death) only after `parallel.timeout_s` (minutes). Instead every rank runs two
daemon threads with their own store client:

- the beat thread, every `interval` (heartbeat_s / 8): adds 1 to the rank's counter `hb/<rank>` and reads,
  in one `multi_get`, the counter of the rank it watches and the job's `abort` key. Rank r watches rank
  r + 1 (mod world), so every rank is watched by one other and, with ranks numbered node by node, a node is
  watched from the node before it. A watched counter that has not moved for 0.75 x heartbeat_s, measured on
  the watcher's own monotonic clock (no two machines' clocks are compared), means the rank is lost: the
  watcher takes a second look at every counter over one interval to name all the lost ranks (so the verdict
  comes at most heartbeat_s after the rank stopped, plus thread scheduling), writes it into `abort`
  (`compare_set`, so the first verdict wins) and stops its own process; every other rank reads the verdict
  within one interval and stops too.
- the guard thread: TCPStore calls have no timeout when the store's host is frozen (the connection stays
  open), so this thread only checks that the beat thread completed a round within 0.875 x heartbeat_s; if not,
  the store - hosted by the rank-0 node's torchrun agent - is lost. It also notices when this process's
  parent (the node's torchrun agent) dies, so workers never outlive a killed agent.

The same `multi_get` reads the `hang` key: when a rank's collective times out it sets `hang`, and every
rank's beat thread answers by publishing its flight record (the main thread may be blocked in C++).

A rank that finishes sets its counter to `done`, which its watcher accepts as a clean exit; one that ends
with an error sets it to `failed` beside the error's first line, which its watcher reports as the cause
(`rank 1 (host node-b) failed: FileNotFoundError: ...`) - useful when the logs are not shared.

A Python thread can be starved: of the GIL (a long call that holds it) or of CPU (a machine loaded many
times over). Two rules keep that from being taken for a lost rank: a thread that notices it woke up late
judges nobody on that round, and a silent rank on the same machine (same boot id) is declared lost only
when its process is gone or stopped (`running`, from psutil). Across machines only the counter can tell;
a rank starved there for 0.75 x heartbeat_s would be reported, so raise heartbeat_s on such machines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ABORT = "abort"
HANG = "hang"  # set by the first rank whose collective timed out: every rank then publishes its flight record


@dataclass
class Verdict:
    """Why the job stops: `lost` (a rank or the store vanished), `failed` (a rank ended with an error) or `hang`
    (a collective timed out)."""

    kind: str
    message: str
    by: int  # the rank that decided
    lost: list[int] = field(default_factory=list)
    code: int = 1  # the exit code every rank ends with (2: a rank failed on bad input)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "message": self.message, "by": self.by, "lost": self.lost,
                           "code": self.code})

    @classmethod
    def from_json(cls, raw: bytes | str) -> Verdict:
        d = json.loads(raw)
        return cls(d["kind"], d["message"], int(d["by"]), list(d.get("lost", [])), int(d.get("code", 1)))


def hb_key(rank: int) -> str:
    return f"hb/{rank}"


def name_ranks(ranks: list[int], hosts: list[str]) -> str:
    """'rank 2 (host node-b)', 'ranks 2, 3 (host node-b)' or 'ranks 2 (node-b), 5 (node-c)'."""
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(hosts[r] if r < len(hosts) else "?", []).append(r)
    word = "rank" if len(ranks) == 1 else "ranks"
    if len(by_host) == 1:
        host, rs = next(iter(by_host.items()))
        return f"{word} {', '.join(map(str, rs))} (host {host})"
    return f"{word} " + ", ".join(f"{r} ({hosts[r]})" for r in ranks)


class Heartbeat:
    """The two threads of one rank (see the module docstring). `fire(verdict)` is called once, from one of
    them, when the job must stop; it is expected not to return (it ends the process)."""

    def __init__(self, connect: Callable[[], Any], rank: int, world: int, hosts: list[str], bound_s: float,
                 fire: Callable[[Verdict], None], store_where: str = "", watch_parent: bool = True,
                 idle_check: Callable[[], None] | None = None, on_hang: Callable[[], None] | None = None,
                 running: Callable[[int], bool | None] | None = None):
        self.connect, self.rank, self.world, self.hosts = connect, rank, world, hosts
        self.bound = bound_s
        self.interval = max(0.05, bound_s / 8)
        self.stale = bound_s - 2 * self.interval  # + one poll + the second look = bound_s
        self.peer = (rank + 1) % world
        self._fire, self.store_where, self.idle_check, self.on_hang = fire, store_where, idle_check, on_hang
        self.running = running or (lambda rank: None)
        self.ppid = os.getppid() if watch_parent else None
        self.last_ok = time.monotonic()
        self.verdict: Verdict | None = None
        self._stop = threading.Event()
        self._fired = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.store = None

    def start(self) -> Heartbeat:
        self.store = self.connect()
        for target, name in ((self._beat, "scaletrain-heartbeat"), (self._guard, "scaletrain-heartbeat-guard")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, clean: bool = True) -> None:
        """Stop both threads; a clean stop tells the watcher this rank finished."""
        self._stop.set()
        # A clean stop waits for a store call in flight (the store is up): a daemon thread still inside one when
        # the interpreter finalizes is ended by pthread_exit inside C++, which aborts the process (SIGABRT).
        for t in self._threads:
            t.join(timeout=(self.bound if clean else 0) + 2 * self.interval + 1)
        if clean and self.store is not None and self.verdict is None:
            try:
                self.store.set(hb_key(self.rank), "done")
            except Exception:  # noqa: BLE001 - the store may be gone at the very end of a job
                pass

    def mark_failed(self, message: str, code: int = 1) -> None:
        """This rank ends with an error: its watcher reports the error itself (and its exit code), not a silent
        rank."""
        if self.store is None or self.verdict is not None:
            return
        try:
            self.store.set(f"err/{self.rank}", json.dumps({"message": message, "code": code}))
            self.store.set(hb_key(self.rank), "failed")
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    # ------------------------------------------------------------------ threads

    def fire(self, verdict: Verdict, publish: bool = True) -> None:
        """Record the verdict (the first one wins across ranks when published) and hand it to `fire`."""
        if not self._fired.acquire(blocking=False):
            return
        if publish and self.store is not None:
            try:
                won = self.store.compare_set(ABORT, "", verdict.to_json())
                if won and won != verdict.to_json().encode():
                    verdict = Verdict.from_json(won)
            except Exception:  # noqa: BLE001 - the store itself may be what was lost
                pass
        self.verdict = verdict
        self._stop.set()
        self._fire(verdict)

    def _beat(self) -> None:
        store, mine, theirs = self.store, hb_key(self.rank), hb_key(self.peer)
        last_value, last_change = None, time.monotonic()
        hang_seen, woke = False, time.monotonic()
        while not self._stop.wait(self.interval):
            if time.monotonic() - woke > 3 * self.interval:  # this thread was starved itself: judge nobody on it
                last_change = time.monotonic()
            woke = time.monotonic()
            try:
                store.add(mine, 1)
                value, abort, hang = store.multi_get([theirs, ABORT, HANG])
            except Exception as e:  # noqa: BLE001 - any store failure means its host is gone
                if not self._stop.is_set():
                    self.fire(self._store_lost(f"{e.__class__.__name__}: {str(e).splitlines()[0][:120]}"), False)
                return
            now = time.monotonic()
            self.last_ok = now
            if abort:
                self.fire(Verdict.from_json(abort), publish=False)
                return
            if hang and not hang_seen and self.on_hang is not None:
                hang_seen = True
                self.on_hang()
            if value == b"done":
                continue
            if value == b"failed":
                try:
                    err = json.loads(store.get(f"err/{self.peer}"))
                except Exception:  # noqa: BLE001
                    err = {"message": "?", "code": 1}
                self.fire(Verdict("failed", f"{name_ranks([self.peer], self.hosts)} failed: {err['message']}",
                                  self.rank, [self.peer], int(err.get("code", 1))))
                return
            if value != last_value:
                last_value, last_change = value, now
            elif now - last_change > self.stale:
                if self.running(self.peer):  # on this machine and not stopped: starved of CPU, not lost
                    last_change = now
                    continue
                self.fire(self._lost(store, now - last_change))
                return

    def _guard(self) -> None:
        woke = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - woke > 3 * self.interval:  # starved itself (like the beat thread): start the count anew
                self.last_ok = now
            woke = now
            if now - self.last_ok > self.stale + self.interval:
                self.fire(self._store_lost(f"no answer for {now - self.last_ok:.1f} s"), publish=False)
                return
            if self.ppid is not None and os.getppid() != self.ppid:
                mine = name_ranks([self.rank], self.hosts)
                self.fire(Verdict("lost", f"lost {mine}: its launcher (the node's torchrun agent, pid {self.ppid}) "
                                          "died, and its workers stop with it", self.rank, [self.rank]))
                return
            if self.idle_check is not None:
                self.idle_check()

    # ------------------------------------------------------------------ verdicts

    def _lost(self, store, silent_s: float) -> Verdict:
        """A second look at every counter over one interval names all the ranks that stopped."""
        keys = [hb_key(r) for r in range(self.world)]
        lost = [self.peer]
        try:
            before = store.multi_get(keys)
            time.sleep(self.interval)
            after = store.multi_get(keys)
            lost = sorted({self.peer} | {r for r, (a, b) in enumerate(zip(before, after))
                                         if a == b and a not in (b"done", b"failed") and r != self.rank
                                         and not self.running(r)})
        except Exception:  # noqa: BLE001 - keep the first finding
            pass
        return Verdict("lost", f"lost {name_ranks(lost, self.hosts)}: no heartbeat for {silent_s:.1f} s (process "
                               "killed or frozen, or its machine is down)", self.rank, lost)

    def _store_lost(self, why: str) -> Verdict:
        holder = [r for r in range(self.world) if r < len(self.hosts) and self.hosts[r] == self.hosts[0]]
        return Verdict("lost", f"lost {name_ranks(holder, self.hosts)}: the job's store{self.store_where} on that "
                               f"host stopped answering ({why})", self.rank, holder)
