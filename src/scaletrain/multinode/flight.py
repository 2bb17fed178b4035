"""Flight recorder: each rank's last N collectives and point-to-point messages, to name a hang.

While a run is supervised, the collective and point-to-point functions of `torch.distributed` (and of
`distributed_c10d`, where `batch_isend_irecv` finds `isend` / `irecv`) are replaced by thin wrappers that
write one entry per call into a fixed-size ring: operation, group, peer, tag, shape, dtype, the trainer's
step, start time, and either the end time (a synchronous call that returned) or a weak reference to the
returned `Work` (asked `is_completed()` only when the ring is dumped). Every call site in scaletrain - and
every future one - is covered without being edited; nothing else changes, and `uninstall()` restores the
originals. Cumulative counters per group and per (direction, peer, tag) survive the ring's wrap-around,
so the k-th receive of rank 1 from rank 0 can be matched with rank 0's k-th send to rank 1.

torch has a C++ flight recorder for NCCL (TORCH_FR_BUFFER_SIZE); for gloo in torch 2.13 it records
collectives but neither point-to-point messages nor their completion, and no training step, which is
what a pipeline hang report needs. The cost here is one Python call and a short list per operation
(`benchmarks/bench_multinode.py` measures it against a gloo collective).

`diagnose(dumps)` matches the dumps of all ranks: a receive whose sender never posted the matching send
(or the reverse), a collective some member of its group has not reached, or two ranks calling different
collectives at the same position of a group's sequence. Its first line is the one-line report.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# name -> (positional index of the tensor to describe, of the group, of the peer, of the tag, direction)
# direction: "send" / "recv" for point-to-point, "" for collectives. None: not positional.
SPECS: dict[str, tuple[int | None, int | None, int | None, int | None, str]] = {
    "all_reduce": (0, 2, None, None, ""),
    "broadcast": (0, 2, 1, None, ""),
    "reduce": (0, 3, 1, None, ""),
    "all_gather": (1, 2, None, None, ""),
    "all_gather_into_tensor": (1, 2, None, None, ""),
    "all_gather_single": (1, 2, None, None, ""),
    "reduce_scatter": (0, 3, None, None, ""),
    "reduce_scatter_tensor": (1, 3, None, None, ""),
    "reduce_scatter_single": (1, 3, None, None, ""),
    "all_to_all": (None, 2, None, None, ""),
    "all_to_all_single": (1, 4, None, None, ""),
    "gather": (0, 3, 2, None, ""),
    "scatter": (0, 3, 2, None, ""),
    "barrier": (None, 0, None, None, ""),
    "send": (0, 2, 1, 3, "send"),
    "isend": (0, 2, 1, 3, "send"),
    "recv": (0, 2, 1, 3, "recv"),
    "irecv": (0, 2, 1, 3, "recv"),
}
PEER_KW = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src", "send": "dst", "isend": "dst",
           "recv": "src", "irecv": "src"}
MODULES = (dist, c10d)

# entry fields (a list per call, cheaper to build than an object)
SEQ, OP, GROUP, PEER, TAG, SHAPE, DTYPE, STEP, T0, T1, WORK, NUM, ERR = range(13)

_installed: FlightRecorder | None = None


class FlightRecorder:
    """A ring of the last `size` communication calls of this process (see the module docstring)."""

    def __init__(self, size: int = 256, rank: int = 0, host: str = ""):
        if size < 1:
            raise ValueError(f"flight recorder size must be >= 1, got {size}")
        self.size, self.rank, self.host = size, rank, host
        self.ring: list[list | None] = [None] * size
        self.n = 0  # calls recorded so far
        self.counts: Counter = Counter()  # ("coll", group) or (direction, peer, tag) -> calls so far
        self.groups: dict[int, tuple[int, ...]] = {}  # id(group) -> global ranks (None group: the world)
        self.group_names: dict[int, str] = {}
        self.step_of: Callable[[], int] = lambda: 0
        self.last_activity = time.monotonic()
        self._saved: list[tuple[Any, str, Any]] = []
        self.main_thread = threading.main_thread().ident

    # ------------------------------------------------------------------ install

    def install(self) -> FlightRecorder:
        global _installed
        if _installed is not None:
            raise RuntimeError("a flight recorder is already installed in this process")
        for name, spec in SPECS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original, spec)
            for mod in MODULES:
                if getattr(mod, name, None) is original:
                    setattr(mod, name, wrapper)
                    self._saved.append((mod, name, original))
        _installed = self
        return self

    def uninstall(self) -> None:
        global _installed
        for mod, name, original in reversed(self._saved):
            setattr(mod, name, original)
        self._saved.clear()
        if _installed is self:
            _installed = None

    def name_groups(self, names: dict[str, Any]) -> None:
        """Label process groups for the report, e.g. {"dp": <group>, "tp": <group>} from the mesh."""
        for label, group in names.items():
            if group is not None:
                self.group_names.setdefault(id(group), label)  # the first name wins (edp may be dp itself)

    def _wrap(self, name: str, fn: Callable, spec: tuple) -> Callable:
        t_i, g_i, p_i, tag_i, direction = spec
        peer_kw = PEER_KW.get(name)
        record = self._record

        def recorded(*args, **kwargs):
            group = kwargs.get("group", args[g_i] if g_i is not None and len(args) > g_i else None)
            peer = (kwargs.get(peer_kw, args[p_i] if p_i is not None and len(args) > p_i else None)
                    if peer_kw else None)
            tag = kwargs.get("tag", args[tag_i] if tag_i is not None and len(args) > tag_i else 0) if direction else 0
            tensor = args[t_i] if t_i is not None and len(args) > t_i else None
            entry = record(name, group, peer, tag, tensor, direction)
            try:
                out = fn(*args, **kwargs)
            except BaseException as e:
                entry[ERR] = f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}" if str(e) else repr(e)
                raise
            if out is not None and hasattr(out, "is_completed"):
                entry[WORK] = weakref.ref(out)
            else:
                entry[T1] = time.monotonic()
            self.last_activity = entry[T1] or entry[T0]
            return out

        recorded.__name__ = recorded.__qualname__ = name
        recorded.__doc__ = fn.__doc__
        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        return recorded

    def _record(self, name: str, group, peer, tag, tensor, direction: str) -> list:
        gid = id(group)
        if gid not in self.groups:
            self.groups[gid] = self._ranks(group)
        if direction:
            key = (direction, peer, tag)
        else:
            key = ("coll", gid)
        self.counts[key] += 1
        now = time.monotonic()
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
        dtype = tensor.dtype if isinstance(tensor, torch.Tensor) else None
        entry = [self.n, name, gid, peer, tag, shape, dtype, self.step_of(), now, None, None, self.counts[key], None]
        self.ring[self.n % self.size] = entry
        self.n += 1
        self.last_activity = now
        return entry

    @staticmethod
    def _ranks(group) -> tuple[int, ...]:
        try:
            if group is None:
                return tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
            return tuple(dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError):
            return ()

    # ------------------------------------------------------------------ dump

    def entries(self) -> list[list]:
        """The ring's entries, oldest first."""
        start = max(0, self.n - self.size)
        return [self.ring[i % self.size] for i in range(start, self.n)]  # type: ignore[misc]

    def state(self, e: list) -> str:
        if e[ERR] is not None:
            return "failed"
        if e[T1] is not None:
            return "done"
        if e[WORK] is None:
            return "in progress"  # a synchronous call this thread has not returned from
        work = e[WORK]()
        if work is None:
            return "released"  # the caller dropped the handle (normally after waiting for it)
        try:
            return "done" if work.is_completed() else "pending"
        except RuntimeError:
            return "failed"

    def group_label(self, gid: int) -> str:
        ranks = list(self.groups.get(gid, ()))
        name = self.group_names.get(gid, "world" if gid == id(None) else "group")
        return f"{name} {ranks}"

    def dump(self) -> dict[str, Any]:
        """A JSON-friendly snapshot: the ring (oldest first), the counters and where the main thread is."""
        now = time.monotonic()
        ops = []
        for e in self.entries():
            ops.append({
                "seq": e[SEQ], "op": e[OP], "group": self.group_label(e[GROUP]), "ranks": list(self.groups[e[GROUP]]),
                "peer": e[PEER], "tag": e[TAG], "shape": list(e[SHAPE]) if e[SHAPE] is not None else None,
                "dtype": str(e[DTYPE]).removeprefix("torch.") if e[DTYPE] is not None else None, "step": e[STEP],
                "age_s": round(now - e[T0], 3), "state": self.state(e), "num": e[NUM], "error": e[ERR],
            })
        counts = {("coll " + self.group_label(k[1])) if k[0] == "coll" else f"{k[0]} {k[1]} {k[2]}": n
                  for k, n in self.counts.items()}
        try:
            step = int(self.step_of())
        except Exception:  # noqa: BLE001 - a dump must never fail
            step = -1
        return {"rank": self.rank, "host": self.host, "step": step, "calls": self.n, "ops": ops,
                "counts": counts, "idle_s": round(now - self.last_activity, 3), "where": self.where()}

    def where(self) -> list[str]:
        """The main thread's innermost frames (file:line function), innermost last."""
        frame = sys._current_frames().get(self.main_thread)
        out: list[str] = []
        while frame is not None and len(out) < 40:
            code = frame.f_code
            if code.co_filename != __file__:  # not the recording wrapper itself
                out.append(f"{code.co_filename}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return list(reversed(out))[-8:]


# ---------------------------------------------------------------------- analysis


def _waiting(d: dict) -> list[dict]:
    return [o for o in d["ops"] if o["state"] in ("in progress", "pending", "failed")]


def _describe(o: dict) -> str:
    what = o["op"]
    if o["peer"] is not None and o["op"] in PEER_KW:
        what += f" {'to' if PEER_KW[o['op']] == 'dst' else 'from'} rank {o['peer']}"
    if o["op"] in ("send", "isend", "recv", "irecv"):
        what += f" (#{o['num']}, tag {o['tag']}"
    else:
        what += f" (#{o['num']} on {o['group']}"
    if o["shape"] is not None:
        what += f", {o['shape']} {o['dtype']}"
    return what + f", step {o['step']})"


def _who(d: dict) -> str:
    return f"rank {d['rank']}" + (f" ({d['host']})" if d.get("host") else "")


def diagnose(dumps: list[dict]) -> list[str]:
    """Match the ranks' dumps; the first line is the one-line verdict, the rest the per-rank detail."""
    by_rank = {d["rank"]: d for d in dumps}
    findings: list[str] = []
    for d in sorted(dumps, key=lambda x: x["rank"]):
        for o in _waiting(d):
            if o["op"] in ("recv", "irecv", "send", "isend") and o["peer"] in by_rank:
                mine, theirs = ("recv", "send") if o["op"] in ("recv", "irecv") else ("send", "recv")
                peer = by_rank[o["peer"]]
                posted = peer["counts"].get(f"{theirs} {d['rank']} {o['tag']}", 0)
                if posted < o["num"]:
                    verb = "sent" if theirs == "send" else "posted receives for"
                    findings.append(
                        f"{_who(d)} waits in {_describe(o)}, which {_who(peer)} never matched: it {verb} only "
                        f"{posted} {'message' if posted == 1 else 'messages'} {'to' if theirs == 'send' else 'from'} "
                        f"rank {d['rank']} with tag {o['tag']}{_now_in(peer)}")
            elif o["op"] not in PEER_KW or o["op"] in ("broadcast", "reduce", "gather", "scatter"):
                label = o["group"]
                behind = []
                for r in o["ranks"]:
                    other = by_rank.get(r)
                    if other is None or r == d["rank"]:
                        continue
                    made = other["counts"].get(f"coll {label}", 0)
                    if made < o["num"]:
                        behind.append(f"{_who(other)} has made only {made}{_now_in(other)}")
                    else:
                        same = [x for x in other["ops"] if x["group"] == label and x["num"] == o["num"]]
                        if same and same[0]["op"] != o["op"]:
                            behind.append(f"{_who(other)} called {_describe(same[0])} at that position")
                if behind:
                    findings.append(f"{_who(d)} waits in {_describe(o)}; " + "; ".join(behind))
    detail = []
    for d in sorted(dumps, key=lambda x: x["rank"]):
        waiting = _waiting(d)
        now = f"waits in {_describe(waiting[-1])}" if waiting else "is not in a collective"
        detail.append(f"  {_who(d)} at step {d['step']}: {now}; main thread at {d['where'][-1] if d['where'] else '?'}")
        for o in d["ops"][-6:]:
            detail.append(f"      {o['state']:<11} {_describe(o)}  {o['age_s']:.1f} s ago"
                          + (f"  [{o['error']}]" if o.get("error") else ""))
    missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank)) if by_rank else []
    if missing:
        detail.append(f"  no flight record from ranks {missing} (stopped, or too slow to answer)")
    if findings:
        head = findings[0]
    elif dumps:
        stuck = [f"{_who(d)} in {_describe(_waiting(d)[-1])}" for d in dumps if _waiting(d)]
        head = "no unmatched operation found; waiting: " + ("; ".join(stuck) if stuck else "none")
    else:
        head = "no flight records were collected"
    return [head, *findings[1:], *detail]


def _now_in(d: dict) -> str:
    waiting = _waiting(d)
    return f" and now waits in {_describe(waiting[-1])}" if waiting else ""
