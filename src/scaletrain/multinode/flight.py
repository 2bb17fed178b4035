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

class _NoSteps:
    step = 0


# entry fields (a list per call, cheaper to build than an object); T1 is True once a synchronous call returned
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
        self.counts: dict = {}  # id(group) (collectives) or (direction, peer, tag) -> calls so far
        self.groups: dict[int, tuple[int, ...]] = {}  # id(group) -> global ranks (None group: the world)
        self.group_names: dict[int, str] = {}
        self.stepper: Any = _NoSteps()  # an object whose `.step` is the current step (the trainer)
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
        """The wrapper of one function: the hot path of the recorder, kept to plain Python operations."""
        t_i, g_i, p_i, tag_i, direction = spec
        peer_kw = PEER_KW.get(name)
        group_kw = f"group_{peer_kw}" if peer_kw else ""
        monotonic, ref, Tensor = time.monotonic, weakref.ref, torch.Tensor
        never = 1 << 30
        n_tensor, n_group = (t_i + 1 if t_i is not None else never), (g_i + 1 if g_i is not None else never)
        n_peer, n_tag = (p_i + 1 if p_i is not None else never), (tag_i + 1 if tag_i is not None else never)
        groups, counts, ring, size, rec = self.groups, self.counts, self.ring, self.size, self

        def recorded(*args, **kwargs):
            n = len(args)
            group = args[g_i] if n >= n_group else None
            peer = args[p_i] if n >= n_peer else None
            tag = args[tag_i] if n >= n_tag else 0
            if kwargs:
                group = kwargs.get("group", group)
                if peer_kw:
                    peer = kwargs.get(peer_kw, peer)
                    if peer is None and kwargs.get(group_kw) is not None:  # a peer given as a rank of the group
                        peer = rec.global_rank(group, kwargs[group_kw])
                tag = kwargs.get("tag", tag)
            tensor = args[t_i] if n >= n_tensor else None
            gid = id(group)
            if gid not in groups:
                groups[gid] = rec._ranks(group)
            key = (direction, peer, tag) if direction else gid
            num = counts.get(key, 0) + 1
            counts[key] = num
            now = monotonic()
            i = rec.n
            if isinstance(tensor, Tensor):
                entry = [i, name, gid, peer, tag, tensor.shape, tensor.dtype, rec.stepper.step, now, None, None,
                         num, None]
            else:
                entry = [i, name, gid, peer, tag, None, None, rec.stepper.step, now, None, None, num, None]
            ring[i % size] = entry
            rec.n = i + 1
            rec.last_activity = now
            try:
                out = fn(*args, **kwargs)
            except BaseException as e:
                entry[ERR] = f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}" if str(e) else repr(e)
                raise
            if out is not None and hasattr(out, "is_completed"):
                entry[WORK] = ref(out)  # completion is asked only when the ring is dumped
            else:
                entry[T1] = True  # a synchronous call that returned
            return out

        recorded.__name__ = recorded.__qualname__ = name
        recorded.__doc__ = fn.__doc__
        recorded.__wrapped__ = fn  # type: ignore[attr-defined]
        return recorded

    def _record(self, name: str, group, peer, tag, tensor, direction: str) -> list:
        """One entry, as the wrapper writes it (for tests that build a record without a process group)."""
        gid = id(group)
        if gid not in self.groups:
            self.groups[gid] = self._ranks(group)
        key = (direction, peer, tag) if direction else gid
        num = self.counts.get(key, 0) + 1
        self.counts[key] = num
        now = self.last_activity = time.monotonic()
        entry = [self.n, name, gid, peer, tag, None if tensor is None else tensor.shape,
                 None if tensor is None else tensor.dtype, self.stepper.step, now, None, None, num, None]
        self.ring[self.n % self.size] = entry
        self.n += 1
        return entry

    def global_rank(self, group, group_rank: int) -> int:
        ranks = self.groups.get(id(group)) or self._ranks(group)
        return ranks[group_rank] if 0 <= group_rank < len(ranks) else group_rank

    @staticmethod
    def _ranks(group) -> tuple[int, ...]:
        try:
            if group is None:
                return tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
            return tuple(dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError, KeyError):
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

    def dump(self, exc: BaseException | None = None) -> dict[str, Any]:
        """A JSON-friendly snapshot: the ring (oldest first), the counters, where the main thread is and which
        entry it is blocked on. `exc`: the exception the main thread is handling (its traceback is where it
        was); otherwise the main thread's live stack is read (it is blocked inside a call)."""
        now = time.monotonic()
        frames = _frames_of(exc) if exc is not None else _live_frames(self.main_thread)
        entries = self.entries()
        blocked = self._blocked(entries, frames)
        ops = []
        for e in entries:
            ops.append({
                "seq": e[SEQ], "op": e[OP], "group": self.group_label(e[GROUP]), "ranks": list(self.groups[e[GROUP]]),
                "peer": e[PEER], "tag": e[TAG], "shape": list(e[SHAPE]) if e[SHAPE] is not None else None,
                "dtype": str(e[DTYPE]).removeprefix("torch.") if e[DTYPE] is not None else None, "step": e[STEP],
                "age_s": round(now - e[T0], 3), "num": e[NUM], "error": e[ERR], "blocked": e[SEQ] == blocked,
                # a wait that raised leaves gloo's work "completed": the blocked entry of a failure failed
                "state": "failed" if e[SEQ] == blocked and exc is not None else self.state(e),
            })
        counts = {f"{k[0]} {k[1]} {k[2]}" if isinstance(k, tuple) else "coll " + self.group_label(k): n
                  for k, n in self.counts.items()}
        try:
            step = int(self.stepper.step)
        except Exception:  # noqa: BLE001 - a dump must never fail
            step = -1
        where = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in frames
                 if f.f_code.co_filename not in _OWN_FILES][:6]
        return {"rank": self.rank, "host": self.host, "step": step, "calls": self.n, "ops": ops,
                "counts": counts, "idle_s": round(now - self.last_activity, 3), "where": where}

    def _blocked(self, entries: list[list], frames: list) -> int | None:
        """The entry the main thread waits on: a synchronous call that has not returned (or failed), else the
        entry whose `Work` is held by the innermost frame (the one calling `wait()` on it)."""
        for e in reversed(entries):
            if e[T1] is None and e[WORK] is None:
                return e[SEQ]
        works = {}
        for e in entries:
            w = e[WORK]() if e[WORK] is not None else None
            if w is not None:
                works[id(w)] = e[SEQ]
        for f in frames:
            try:
                values = list(f.f_locals.values())
            except Exception:  # noqa: BLE001
                continue
            for v in values:
                if id(v) in works:
                    return works[id(v)]
        return None


_OWN_FILES = {__file__, __file__.replace("flight.py", "job.py"), __file__.replace("flight.py", "heartbeat.py")}


def _frames_of(exc: BaseException) -> list:
    """The frames of an exception's traceback, innermost first."""
    out, tb = [], exc.__traceback__
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return list(reversed(out))


def _live_frames(thread_id: int | None) -> list:
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    out = []
    while frame is not None and len(out) < 60:
        out.append(frame)
        frame = frame.f_back
    return out


# ---------------------------------------------------------------------- analysis

P2P = ("send", "isend", "recv", "irecv")
_ORD = {1: "st", 2: "nd", 3: "rd"}


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else _ORD.get(n % 10, 'th')}"


def _describe(o: dict) -> str:
    """'irecv of the 8th message from rank 0 (tag 0, [2, 32, 32] float32, step 2)' or
    'all_reduce #12 on dp [0, 2] ([1024] float32, step 3)'."""
    parts = []
    if o["op"] in P2P:
        head = f"{o['op']} of the {_nth(o['num'])} message {'to' if o['op'] in ('send', 'isend') else 'from'} " \
               f"rank {o['peer']}"
        parts.append(f"tag {o['tag']}")
    else:
        head = f"{o['op']} #{o['num']} on {o['group']}"
        if o["peer"] is not None:
            parts.append(f"root {o['peer']}")
    if o["shape"] is not None:
        parts.append(f"{o['shape']} {o['dtype']}")
    parts.append(f"step {o['step']}")
    return f"{head} ({', '.join(parts)})"


def _who(d: dict) -> str:
    return f"rank {d['rank']}" + (f" ({d['host']})" if d.get("host") else "")


def _blocked(d: dict) -> dict | None:
    return next((o for o in d["ops"] if o.get("blocked")), None)


def _in(d: dict) -> str:
    b = _blocked(d)
    return f"{_who(d)} is blocked in {_describe(b)}" if b else f"{_who(d)} is not blocked in a recorded call"


def diagnose(dumps: list[dict]) -> list[str]:
    """Match the ranks' dumps. Returns the report: its first line is the one-line verdict (the operation a
    blocked rank waits on that its peer never posted, or that a member of its group has not reached, or where
    two members called different collectives), then every such finding, then each rank's last calls."""
    by_rank = {d["rank"]: d for d in dumps}
    findings: list[str] = []
    for d in sorted(dumps, key=lambda x: x["rank"]):
        o = _blocked(d)
        if o is None:
            continue
        if o["op"] in P2P and o["peer"] in by_rank:
            peer = by_rank[o["peer"]]
            receiving = o["op"] in ("recv", "irecv")
            theirs = "send" if receiving else "recv"
            posted = peer["counts"].get(f"{theirs} {d['rank']} {o['tag']}", 0)
            if posted < o["num"]:
                did = f"sent only {posted}" if receiving else f"posted receives for only {posted}"
                findings.append(f"{_who(d)} is blocked in {_describe(o)}, which {_who(peer)} never "
                                f"{'sent' if receiving else 'received'}: it {did} message{'s' if posted != 1 else ''} "
                                f"{'to' if receiving else 'from'} rank {d['rank']} with tag {o['tag']}; "
                                f"{_in(peer).replace(_who(peer) + ' ', 'it ', 1)}")
        elif o["op"] not in P2P:
            behind = []
            for r in o["ranks"]:
                other = by_rank.get(r)
                if other is None or r == d["rank"]:
                    continue
                made = other["counts"].get(f"coll {o['group']}", 0)
                same = [x for x in other["ops"] if x["group"] == o["group"] and x["num"] == o["num"]]
                if made < o["num"]:
                    behind.append(f"{_who(other)} has made only {made} calls on that group ("
                                  f"{_in(other).replace(_who(other) + ' ', '', 1)})")
                elif same and same[0]["op"] != o["op"]:
                    behind.append(f"{_who(other)} called {_describe(same[0])} at that position")
            if behind:
                findings.append(f"{_who(d)} is blocked in {_describe(o)}; " + "; ".join(behind))
    detail = ["", "per rank (last calls, oldest first):"]
    for d in sorted(dumps, key=lambda x: x["rank"]):
        detail.append(f"  {_in(d)} at step {d['step']}; main thread at {d['where'][0] if d['where'] else '?'}")
        for o in d["ops"][-8:]:
            detail.append(f"    {'>' if o.get('blocked') else ' '} {o['state']:<11} {_describe(o)}  "
                          f"{o['age_s']:.1f} s ago" + (f"  [{o['error']}]" if o.get("error") else ""))
    missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank)) if by_rank else []
    if missing:
        detail.append(f"  no flight record from ranks {missing} (stopped, or too slow to answer)")
    if findings:
        head = findings
    elif dumps:
        stuck = [_in(d) for d in dumps if _blocked(d)]
        head = ["no unmatched operation found; " + ("; ".join(stuck) if stuck else "no rank is blocked in a call")]
    else:
        head = ["no flight records were collected"]
    return [*head, *detail]
