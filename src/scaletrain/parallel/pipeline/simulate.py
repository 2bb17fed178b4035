"""Discrete-event simulation of pipeline action lists: timeline, bubble and in-flight activations.

`simulate(actions, t_f, t_b, t_w, t_comm)` runs the same per-rank lists the executor runs, with given
compute times, and reports what the planner needs: makespan, per-rank busy time, bubble fraction and
the peak number of microbatches whose activations are held. The closed forms it reproduces: bubble
(p-1)/(m+p-1) for GPipe (arXiv 1811.06965) and 1F1B (arXiv 2006.09503), about 1/v of that for
interleaved 1F1B (arXiv 2104.04473), and (p-1)(t_f+t_b-t_w) of idle time per rank for zero bubble H1
(arXiv 2401.10241), a third of 1F1B's when t_f = t_b = t_w.

Timing model:

- Each rank runs its list in order, starting at time 0. FORWARD takes t_f, BACKWARD_INPUT t_b,
  BACKWARD_WEIGHT t_w and an unsplit BACKWARD t_b + t_w (times of the rank and chunk that run them).
- Consecutive send/recv actions form one batch, all posted when the rank reaches it. By default sends
  are non-blocking: the sender goes on at once, and a receive finishes at
  max(its post time, matching send's post time + t_comm); the rank leaves the batch when its receives
  are done. With `blocking_sends=True` (the rendezvous model of `check.py`) every message, send or
  receive, finishes at max(both post times) + t_comm and the rank waits for all of them.
- Compute actions never wait otherwise: the schedule's receives carry every cross-rank dependency.

In-flight accounting: on each rank a (microbatch, chunk) is in flight from the start of its FORWARD
to the end of its last backward pass (BACKWARD, or BACKWARD_WEIGHT when the backward is split: the
weight pass still needs the stored inputs). `peak_in_flight[r]` counts these pairs; a chunk holds
1/v of the rank's layers, so `peak_in_flight_stages[r]` weights each pair by 1/v and is the held
activation memory in units of "one microbatch through a whole v = 1 stage". Both come from the order
of the list, not from the times.

Runs of steps (PipeDream-2BW, arXiv 2006.09503): `simulate_steps` simulates consecutive steps' lists
(`schedules.build_2bw_step`), each step starting on all ranks together `t_boundary` after the previous
one ended everywhere (the optimizer step's gradient-norm all-reduce is a barrier), and reports the
window's bubble and each step's makespan. With uniform stages and no communication time, a 2BW step in
steady state takes m(t_f + t_b) + (p-1) t_b (`steady_2bw_makespan`) instead of 1F1B's
(m + p - 1)(t_f + t_b): the next batch's warm-up forwards fill the cool-down, and what is left is the
backward chain from the last stage to the first that the barrier makes every step wait for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scaletrain.parallel.pipeline.schedules import Action, Op, batches, message_key, peak_in_flight, unfold

Times = float | Sequence[float] | Sequence[Sequence[float]] | Mapping[tuple[int, int], float]


@dataclass(frozen=True)
class Event:
    """One timed compute action on one rank (simulated, or measured by the executor)."""

    rank: int
    name: str  # Op value: "F", "B", "I", "W"; measured traces may add their own names
    start_s: float
    end_s: float
    microbatch: int = -1
    chunk: int = 0


@dataclass
class SimResult:
    """What `simulate` found. Times are in the units of the given t_f, t_b, t_w, t_comm."""

    events: list[Event]
    makespan: float
    busy: list[float]  # per rank: total compute time
    bubble: float  # overall: sum of idle time / (ranks * makespan)
    bubble_per_rank: list[float]  # idle / makespan per rank
    peak_in_flight: list[int]  # per rank: peak (microbatch, chunk) pairs held
    peak_in_flight_stages: list[float] = field(default_factory=list)  # same, each chunk weighted 1/v

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]


def _time_table(t: Times, p: int, v: int, name: str) -> list[list[float]]:
    """Normalise a time given as scalar, per rank, per (rank, chunk) table or mapping to [rank][chunk]."""
    if isinstance(t, (int, float)):
        return [[float(t)] * v for _ in range(p)]
    if isinstance(t, Mapping):
        try:
            return [[float(t[(r, c)]) for c in range(v)] for r in range(p)]
        except KeyError as e:
            raise ValueError(f"{name} has no time for (rank, chunk) {e.args[0]}") from None
    rows = list(t)
    if len(rows) != p:
        raise ValueError(f"{name} has {len(rows)} rows, expected one per rank ({p})")
    table = []
    for r, row in enumerate(rows):
        if isinstance(row, (int, float)):
            table.append([float(row)] * v)
        else:
            row = [float(x) for x in row]
            if len(row) != v:
                raise ValueError(f"{name}[{r}] has {len(row)} values, expected one per chunk ({v})")
            table.append(row)
    return table


def simulate(
    actions: list[list[Action]],
    t_f: Times,
    t_b: Times,
    t_w: Times = 0.0,
    t_comm: float = 0.0,
    blocking_sends: bool = False,
) -> SimResult:
    """Simulate per-rank action lists (from `build_schedule`) with the given times; see module doc. An overlapped
    slot (OVERLAP_F_B, DualPipeV) runs its forward then its backward on the rank's one compute stream."""
    actions = [unfold(acts) for acts in actions]
    p = len(actions)
    v = 1 + max((a.chunk for acts in actions for a in acts), default=0)
    tf, tb, tw = (_time_table(t, p, v, n) for t, n in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")))
    duration = {
        Op.FORWARD: lambda r, c: tf[r][c],
        Op.BACKWARD: lambda r, c: tb[r][c] + tw[r][c],
        Op.BACKWARD_INPUT: lambda r, c: tb[r][c],
        Op.BACKWARD_WEIGHT: lambda r, c: tw[r][c],
    }
    steps = [batches(acts) for acts in actions]
    pos, clock = [0] * p, [0.0] * p
    posted: dict[tuple[str, tuple], float] = {}  # (side, message key) -> post time
    events: list[Event] = []
    while True:
        progress = False
        for r in range(p):
            while pos[r] < len(steps[r]):
                step = steps[r][pos[r]]
                a = step[0]
                if a.op.is_compute:
                    end = clock[r] + duration[a.op](r, a.chunk)
                    events.append(Event(r, a.op.value, clock[r], end, a.microbatch, a.chunk))
                    clock[r] = end
                else:
                    done = _finish_batch(r, step, clock[r], posted, p, t_comm, blocking_sends)
                    if done is None:
                        break
                    clock[r] = done
                pos[r] += 1
                progress = True
        if all(pos[r] == len(steps[r]) for r in range(p)):
            break
        if not progress:
            stuck = [f"rank {r} at {steps[r][pos[r]][0]}" for r in range(p) if pos[r] < len(steps[r])]
            raise ValueError("simulation cannot progress (deadlock): " + "; ".join(stuck))
    return _result(actions, events, clock, v)


def _finish_batch(
    r: int,
    step: list[Action],
    now: float,
    posted: dict[tuple[str, tuple], float],
    p: int,
    t_comm: float,
    blocking_sends: bool,
) -> float | None:
    """Post one comm batch at `now`; return when the rank may leave it, or None if it must still wait."""
    ops = []
    for a in step:  # post the whole batch first
        side, other = ("send", "recv") if a.op.is_send else ("recv", "send")
        key = message_key(r, a, p)
        posted.setdefault((side, key), now)
        ops.append((side, other, key))
    end = now
    for side, other, key in ops:
        if side == "send" and not blocking_sends:
            continue
        if (other, key) not in posted:
            return None
        if blocking_sends:
            end = max(end, max(now, posted[(other, key)]) + t_comm)
        else:
            end = max(end, posted[(other, key)] + t_comm)
    return end


def _result(actions: list[list[Action]], events: list[Event], clock: list[float], v: int) -> SimResult:
    p = len(actions)
    makespan = max((e.end_s for e in events), default=0.0)
    busy = [0.0] * p
    for e in events:
        busy[e.rank] += e.end_s - e.start_s
    per_rank = [(makespan - b) / makespan if makespan > 0 else 0.0 for b in busy]
    overall = sum(makespan - b for b in busy) / (p * makespan) if makespan > 0 else 0.0
    peaks = [peak_in_flight(acts) for acts in actions]
    return SimResult(
        events=events,
        makespan=makespan,
        busy=busy,
        bubble=overall,
        bubble_per_rank=per_rank,
        peak_in_flight=peaks,
        peak_in_flight_stages=[k / v for k in peaks],
    )


# --------------------------------------------------------------------------- runs of steps (2BW)


@dataclass
class StepsResult:
    """`simulate_steps`: the whole window as one SimResult, plus each step's makespan."""

    window: SimResult
    step_makespans: list[float]

    @property
    def bubble(self) -> float:
        return self.window.bubble


def simulate_steps(
    steps: list[list[list[Action]]],
    t_f: Times,
    t_b: Times,
    t_w: Times = 0.0,
    t_comm: float = 0.0,
    t_boundary: float = 0.0,
) -> StepsResult:
    """Simulate consecutive steps' per-rank lists, each step starting on every rank at the same time.

    Every step's lists must be self-contained (no message crosses a step). Event microbatches are
    numbered over the stream, `microbatch + (step + batch) * m`; in-flight peaks count over the steps.
    """
    p = len(steps[0])
    m = sum(1 for a in steps[0][0] if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT))
    events: list[Event] = []
    makespans: list[float] = []
    start = 0.0
    for t, lists in enumerate(steps):
        res = simulate(lists, t_f, t_b, t_w, t_comm)
        order = [[a for a in lists[r] if a.op.is_compute] for r in range(p)]
        seen = [0] * p
        for e in res.events:  # events come out in each rank's list order
            a = order[e.rank][seen[e.rank]]
            seen[e.rank] += 1
            mb = a.microbatch + (t + a.batch) * m
            events.append(Event(e.rank, e.name, start + e.start_s, start + e.end_s, mb, e.chunk))
        makespans.append(res.makespan)
        start += res.makespan + t_boundary
    busy = [0.0] * p
    for e in events:
        busy[e.rank] += e.end_s - e.start_s
    span = start - t_boundary if steps else 0.0
    peaks = []
    for r in range(p):
        held = peak = 0
        for lists in steps:
            for a in lists[r]:
                if a.op is Op.FORWARD:
                    held += 1
                    peak = max(peak, held)
                elif a.op is Op.BACKWARD:
                    held -= 1
        peaks.append(peak)
    window = SimResult(
        events=events, makespan=span, busy=busy,
        bubble=sum(span - b for b in busy) / (p * span) if span > 0 else 0.0,
        bubble_per_rank=[(span - b) / span if span > 0 else 0.0 for b in busy],
        peak_in_flight=peaks, peak_in_flight_stages=[float(k) for k in peaks],
    )
    return StepsResult(window, makespans)


def simulate_2bw(p: int, m: int, n_steps: int, t_f: Times, t_b: Times, t_comm: float = 0.0,
                 t_boundary: float = 0.0) -> StepsResult:
    """A run of n_steps 2BW steps with no intermediate drain: fill in the first, drain in the last."""
    from scaletrain.parallel.pipeline.schedules import build_2bw_step

    lists = [build_2bw_step(p, m, i == 0, i == n_steps - 1) for i in range(n_steps)]
    return simulate_steps(lists, t_f, t_b, 0.0, t_comm, t_boundary)


def steady_2bw_makespan(p: int, m: int, t_f: float, t_b: float) -> float:
    """Closed form of one steady-state 2BW step with a barrier between steps (see module doc)."""
    return m * (t_f + t_b) + (p - 1) * t_b


def simulate_free_steps(steps: list[list[list[Action]]], t_f: Times, t_b: Times, t_comm: float = 0.0) -> list[float]:
    """Consecutive steps with no barrier between them (PipeDream, arXiv 1806.03377: each rank starts its next step
    as soon as its own is done): the steps' lists run back to back on every rank as one list (each action's `batch`
    made absolute, so the messages of different steps never match). Returns rank 0's step periods: the time from
    the end of one of its steps to the end of the next."""
    from dataclasses import replace

    p = len(steps[0])
    joined = [[replace(a, batch=t + a.batch + 1) for t, lists in enumerate(steps) for a in lists[r]] for r in range(p)]
    ends = [sum(1 for a in lists[0] if a.op.is_compute) for lists in steps]  # rank 0's compute actions per step
    done = [e.end_s for e in simulate(joined, t_f, t_b, 0.0, t_comm).events if e.rank == 0]
    marks, k = [], 0
    for n in ends:
        k += n
        marks.append(done[k - 1])
    return [b - a for a, b in zip(marks, marks[1:])]
