"""The version log: which gradients each update applied, in which order, and from which parameter version each
was computed.

An asynchronous run is not reproducible by seed alone: its result depends on timing. What makes it checkable
is this log. Version v is the parameters after v updates (version 0: the initial weights). Update i turns
version i - 1 into version i by applying the gradients of its members, each the gradient of one ticket
(`model.Ticket`) computed on version `pulled` <= i - 1; its staleness is i - 1 - pulled (0 in a synchronous
run). `replay.py` recomputes every member's gradient on its stale version in one process and applies the same
updates; bit-identical parameters prove the servers applied exactly what the log says (Ho et al., "More
effective distributed ML via a stale synchronous parallel parameter server", NIPS 2013, for the staleness
bound; Niu et al., arXiv 1106.5730, for Hogwild's reads of stale parameters).

File format (`OUT/version_log.jsonl`): a first line {"header": {...}} (mode, dp, servers, thread counts), then
one line per update: {"update": i, "lr": lr, "members": [[ticket, worker, pulled, lost], ...]} with members in
the order their gradients were added (ps) or the single member (hogwild). `lost` counts the coordinates of
other workers' updates this member's write overwrote (lock-free Hogwild; 0 otherwise).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.errors import CheckpointError


@dataclass(frozen=True)
class Member:
    ticket: int
    worker: int
    pulled: int  # the parameter version the gradient was computed on
    lost: int = 0


@dataclass
class Update:
    update: int
    lr: float
    members: list[Member]

    @property
    def staleness(self) -> list[int]:
        return [self.update - 1 - m.pulled for m in self.members]

    def to_json(self) -> str:
        return json.dumps({"update": self.update, "lr": self.lr,
                           "members": [[m.ticket, m.worker, m.pulled, m.lost] for m in self.members]})

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Update:
        return cls(int(row["update"]), float(row["lr"]), [Member(*map(int, m)) for m in row["members"]])


@dataclass
class VersionLog:
    header: dict[str, Any] = field(default_factory=dict)
    updates: list[Update] = field(default_factory=list)

    def staleness(self) -> list[int]:
        return [s for u in self.updates for s in u.staleness]

    def summary(self) -> dict[str, float]:
        st = self.staleness()
        return {"updates": len(self.updates), "gradients": len(st), "staleness_max": max(st, default=0),
                "staleness_mean": sum(st) / len(st) if st else 0.0,
                "lost_updates": sum(m.lost for u in self.updates for m in u.members)}

    def check(self) -> None:
        """Consistency a replay relies on: updates numbered 1, 2, ... and every member pulled an earlier version."""
        for k, u in enumerate(self.updates, 1):
            if u.update != k:
                raise CheckpointError(f"version log: update {u.update} where {k} was expected")
            for m in u.members:
                if not 0 <= m.pulled < u.update:
                    raise CheckpointError(f"version log: update {u.update} applies ticket {m.ticket} computed on "
                                          f"version {m.pulled}")

    @classmethod
    def load(cls, path: Path) -> VersionLog:
        if not path.is_file():
            raise CheckpointError(f"no version log at {path}")
        log = cls()
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "header" in row:
                    log.header = row["header"]
                else:
                    log.updates.append(Update.from_json(row))
            except (ValueError, KeyError, TypeError):
                raise CheckpointError(f"version log {path} line {i} is not a log record") from None
        return log


class LogFile:
    """Appends updates to `OUT/version_log.jsonl` (rank 0 only); `trim(step)` keeps the updates <= step (resume)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.f = None
        self.log = VersionLog()  # also kept in memory (tests without an output directory read it from here)

    def open(self, header: dict[str, Any], resume_step: int) -> None:
        self.log.header = header
        if self.path is None:
            return
        kept: list[str] = []
        if resume_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    break  # a line cut by a kill ends the valid part
                if "header" in row or row.get("update", 0) <= resume_step:
                    kept.append(line)
        if not kept:
            kept = [json.dumps({"header": header})]
        tmp = self.path.with_name(self.path.name + ".part")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, self.path)
        self.f = open(self.path, "a")

    def add(self, update: Update) -> None:
        self.log.updates.append(update)
        if self.f is not None:
            self.f.write(update.to_json() + "\n")

    def flush(self, sync: bool = False) -> None:
        if self.f is not None:
            self.f.flush()
            if sync:
                os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
