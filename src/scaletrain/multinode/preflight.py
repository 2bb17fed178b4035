"""Start-up checks of a multi-process job, before any model is built.

Two things fail late and confusingly on many machines: an `--out` that is private to each node (the first
checkpoint, possibly hours in, dies with FileNotFoundError on the nodes that cannot see rank 0's
directory), and nodes that run different code or configs (a collective deadlocks or, worse, the numbers
silently differ). So at start-up:

1. rank 0 creates `OUT/.preflight-<nonce>/rank0`; after a barrier every rank that sees it (with the
   nonce inside) writes its own `rank<N>` there; after a second barrier rank 0 lists the folder;
2. every rank's facts - host, local rank, pid, torch / scaletrain / Python versions, the SHA-256 of the
   resolved config (and the config itself, to name the differing keys), the interface it chose and what
   it saw of `--out` - are gathered on every rank (`all_gather_object`);
3. every rank computes the same verdict from the same facts; a problem raises `UserError` (exit 2) with one
   line naming the ranks, their hosts and the values. Rank 0 then removes the marker folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scaletrain.config import flatten
from scaletrain.errors import UserError


class JobCheckError(UserError):
    """A start-up check failed; the message names the ranks and hosts concerned (printed without "rank N:")."""

    names_ranks = True


@dataclass
class RankFacts:
    rank: int
    host: str
    local_rank: int
    pid: int
    torch: str
    scaletrain: str
    python: str
    config_sha: str
    config: dict[str, Any]
    interface: str
    address: str
    net_reason: str
    sees_out: bool = True  # this rank saw rank 0's marker in --out
    out_note: str = ""  # why not (missing folder, unreadable, read-only ...)
    seen_by_rank0: bool = True  # rank 0 saw this rank's marker
    out_path: str = ""  # --out as this rank resolves it
    machine: str = ""  # the kernel's boot id: equal on two ranks exactly when they share a machine


def config_sha(cfg_dict: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg_dict, sort_keys=True, default=str).encode()).hexdigest()


def local_facts(rank: int, local_rank: int, cfg_dict: dict[str, Any], interface: str = "", address: str = "",
                net_reason: str = "") -> RankFacts:
    import torch

    from scaletrain.version import __version__

    return RankFacts(rank, socket.gethostname(), local_rank, os.getpid(), torch.__version__, __version__,
                     platform.python_version(), config_sha(cfg_dict), cfg_dict, interface, address, net_reason,
                     machine=machine_id())


def machine_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def marker_dir(out: Path, nonce: str) -> Path:
    return out / f".preflight-{nonce}"


def write_first_marker(out: Path, nonce: str) -> None:
    """Rank 0: create --out (a UserError when impossible) and its marker."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        d = marker_dir(out, nonce)
        d.mkdir(exist_ok=True)
        (d / "rank0").write_text(nonce)
    except OSError as e:
        raise UserError(f"--out {out} cannot be written on host {socket.gethostname()}: "
                        f"{e.strerror or e.__class__.__name__}") from None


def check_marker(out: Path, nonce: str, rank: int) -> tuple[bool, str]:
    """A rank other than 0: does it see rank 0's marker? If so, leave its own."""
    d = marker_dir(out, nonce)
    try:
        if (d / "rank0").read_text() != nonce:
            return False, "another job's marker"
    except FileNotFoundError:
        return False, "not there" if out.exists() else f"{out} does not exist here"
    except OSError as e:
        return False, e.strerror or e.__class__.__name__
    try:
        (d / f"rank{rank}").write_text(nonce)
    except OSError as e:
        return False, f"cannot write ({e.strerror or e.__class__.__name__})"
    return True, ""


def seen_markers(out: Path, nonce: str) -> set[int]:
    d = marker_dir(out, nonce)
    try:
        return {int(p.name[4:]) for p in d.iterdir() if p.name.startswith("rank") and p.name[4:].isdigit()}
    except OSError:
        return set()


def remove_markers(out: Path, nonce: str) -> None:
    shutil.rmtree(marker_dir(out, nonce), ignore_errors=True)


# ---------------------------------------------------------------------------- verdict


def _ranks_on_hosts(facts: list[RankFacts]) -> str:
    by_host: dict[str, list[int]] = {}
    for f in facts:
        by_host.setdefault(f.host, []).append(f.rank)
    return ", ".join(f"host {h} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                     for h, rs in by_host.items())


def verdict(facts: list[RankFacts], out: Path | None) -> str | None:
    """One line naming every problem, or None when the job may start."""
    facts = sorted(facts, key=lambda f: f.rank)
    first = facts[0]
    problems: list[str] = []
    if out is not None:
        blind = [f for f in facts if not f.sees_out or not f.seen_by_rank0]
        if blind:
            notes = sorted({f.out_note for f in blind if f.out_note})
            problems.append(
                f"--out {out} is not one folder shared by every node: {_ranks_on_hosts(blind)} cannot see what "
                f"rank 0 (host {first.host}) wrote in {first.out_path or out}"
                + (f" ({'; '.join(notes)})" if notes else "")
                + "; use a folder on a filesystem all nodes mount at the same path")
    for what in ("torch", "scaletrain", "python"):
        values: dict[str, list[RankFacts]] = {}
        for f in facts:
            values.setdefault(getattr(f, what), []).append(f)
        if len(values) > 1:
            problems.append(f"{what} versions differ: " + "; ".join(f"{v} on {_ranks_on_hosts(fs)}"
                                                                   for v, fs in values.items()))
    odd = [f for f in facts if f.config_sha != first.config_sha]
    if odd:
        mine, theirs = flatten(first.config), flatten(odd[0].config)
        keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        diff = ", ".join(f"{k} = {theirs.get(k)!r} vs {mine.get(k)!r}" for k in keys[:4])
        problems.append(f"the config differs from rank 0's (host {first.host}) on {_ranks_on_hosts(odd)}: {diff}"
                        + (f" and {len(keys) - 4} more" if len(keys) > 4 else ""))
    return "; ".join(problems) if problems else None


def to_json(facts: list[RankFacts]) -> str:
    rows = []
    for f in facts:
        row = asdict(f)
        row.pop("config")
        rows.append(row)
    return json.dumps(rows, indent=1)
