"""Static checks of pipeline schedules, before any process starts.

`check_schedule` is an internal consistency check of the action lists `schedules.build_schedule`
produces (a failure is a bug in the schedule, so it raises ValueError). `validate_pipeline` checks the
user's pipeline settings and returns plain-language messages for the config's validate().

Deadlock model used by `check_schedule` (the strictest one a real backend can show):

- Each rank runs its list in order. A compute action never waits (its inputs were received by the
  comms before it). A maximal run of consecutive send/recv actions is one batch, posted all at once.
- No buffering (rendezvous): a send completes only once its matching receive is posted, and a receive
  once its matching send is posted. A rank leaves a batch when every operation in it has completed.
- The schedule deadlocks if, while some rank still has actions left, no rank can make progress.

A schedule that passes runs under any amount of buffering too, since buffering only lets sends finish
earlier. Example it rejects: rank 0 waits for a gradient from rank 1 before sending its activation, and
rank 1 waits for that activation before it can produce the gradient (each blocked in its own batch).

The V schedules (zb-v) are checked in the executor's own model instead: sends never block (posted with
isend, waited for only at the end of the step), receives block. Under rendezvous sends their two
same-direction streams (chunk 0's activations, chunk 1's gradients) deadlock, so where sends can block
until the receive is posted (NCCL, large messages) zb-v is refused (pipeline/rules.py).

`check_2bw(p, m)` checks PipeDream-2BW's cross-step lists (`schedules.build_2bw_step`) over a run of
steps: each step's lists on their own (matching, deadlock: steps are separated by the optimizer step's
collectives, so no message may cross a step boundary), and the concatenated per-rank sequence with
batches numbered absolutely (one forward and one backward per microbatch of every batch, receives
before and sends after their compute, every backward of batch t inside step t, at most two weight
versions in use).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from scaletrain.config.schema import PARTITION_KINDS, SCHEDULES
from scaletrain.errors import ConfigError
from scaletrain.parallel.pipeline.balance import ends
from scaletrain.parallel.pipeline.schedules import (
    V_SCHEDULES,
    Action,
    Op,
    action_stage,
    batches,
    build_2bw_step,
    message_key,
    peak_in_flight,
    rank_chunk_to_stage,
    schedule_constraints,
    stage_to_rank_chunk,
    stated_peak,
    unfold,
)

_BACKWARDS = (Op.BACKWARD, Op.BACKWARD_INPUT)


def check_schedule(actions: list[list[Action]], p: int, m: int, v: int, schedule: str | None = None) -> None:
    """Raise ValueError naming the first problem found in the per-rank action lists; None if sound.

    `schedule` names the stage placement (`schedules.rank_chunk_to_stage`): None or a loop schedule for
    stage chunk * p + rank, a V schedule for the V placement."""
    if len(actions) != p:
        raise ValueError(f"schedule has {len(actions)} rank lists, expected p={p}")
    for r in range(p):
        _check_overlaps(actions[r], r, schedule)
    actions = [unfold(acts) for acts in actions]  # every other check reads the halves, as the executor runs them
    for r in range(p):
        _check_fields(actions[r], r, p, m, v, schedule)
        _check_compute(actions[r], r, p, m, v, schedule)
    _check_matching(actions, p)
    for r in range(p):
        _check_comm_placement(actions[r], r, p, v, schedule)
    _check_deadlock(actions, p, sends_block=schedule not in V_SCHEDULES)
    bound = stated_peak(schedule, p) if schedule is not None else None
    for r in range(p):
        if bound is not None and peak_in_flight(actions[r]) != bound:
            raise ValueError(f"rank {r} holds {peak_in_flight(actions[r])} microbatch-chunks at its peak; {schedule}"
                             f" states {bound}")


def _check_overlaps(acts: list[Action], r: int, schedule: str | None) -> None:
    """OVERLAP_F_B (DualPipeV only): a forward of one chunk and a full backward of the rank's other chunk, the action
    itself carrying the forward's fields; no other action has halves."""
    for i, a in enumerate(acts):
        if a.op is not Op.OVERLAP_F_B:
            if a.pair is not None:
                raise ValueError(f"rank {r} action {i} {a}: only OVERLAP_F_B has halves")
            continue
        if schedule != "dualpipev":
            raise ValueError(f"rank {r} action {i} {a}: overlapped slots belong to dualpipev, not {schedule}")
        f, b = a.pair if a.pair is not None and len(a.pair) == 2 else (None, None)
        if f is None or f.op is not Op.FORWARD or b.op is not Op.BACKWARD or f.chunk == b.chunk:
            raise ValueError(f"rank {r} action {i} {a}: an overlapped slot is a forward and a full backward of the"
                             " other chunk")
        if (a.microbatch, a.chunk, a.stage, a.batch) != (f.microbatch, f.chunk, f.stage, f.batch) or a.peer is not None:
            raise ValueError(f"rank {r} action {i} {a}: its fields must be its forward's")


def _rank_of(stage: int, p: int, schedule: str | None) -> int:
    return stage_to_rank_chunk(stage, p, schedule)[0]


def _check_fields(acts: list[Action], r: int, p: int, m: int, v: int, schedule: str | None = None) -> None:
    last = p * v - 1
    for i, a in enumerate(acts):
        where = f"rank {r} action {i} {a}"
        if not isinstance(a, Action) or not isinstance(a.op, Op):
            raise ValueError(f"rank {r} action {i} is not an Action: {a!r}")
        if not 0 <= a.microbatch < m:
            raise ValueError(f"{where}: microbatch outside [0, {m})")
        if not 0 <= a.chunk < v:
            raise ValueError(f"{where}: chunk outside [0, {v})")
        if action_stage(r, a, p) != rank_chunk_to_stage(r, a.chunk, p, schedule):
            raise ValueError(f"{where}: stage {action_stage(r, a, p)} is not local chunk {a.chunk} of rank {r}"
                             f" (rank {r} holds stage {rank_chunk_to_stage(r, a.chunk, p, schedule)} there)")
        if a.op.is_compute:
            if a.peer is not None:
                raise ValueError(f"{where}: compute action has a peer")
            continue
        s = action_stage(r, a, p)
        to_next = a.op in (Op.SEND_ACT, Op.RECV_GRAD)  # talks to stage s + 1
        other = s + 1 if to_next else s - 1
        if not 0 <= other <= last:
            raise ValueError(f"{where}: stage {s} has no neighbour stage {other}")
        holder = _rank_of(other, p, schedule)
        if holder == r:
            raise ValueError(f"{where}: stage {other} is on the same rank; no send/recv is needed")
        if a.peer != holder:
            raise ValueError(f"{where}: peer should be rank {holder}, which holds stage {other}")


def _check_compute(acts: list[Action], r: int, p: int, m: int, v: int, schedule: str | None = None) -> None:
    """Each (microbatch, chunk): one forward, then one full backward or one input + one weight pass."""
    counts = Counter((a.op, a.microbatch, a.chunk) for a in acts if a.op.is_compute)
    for c in range(v):
        s = rank_chunk_to_stage(r, c, p, schedule)
        for mb in range(m):
            n = {op: counts[(op, mb, c)] for op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT,
                                                     Op.BACKWARD_WEIGHT)}
            what = f"rank {r} chunk {c} (stage {s}) microbatch {mb}"
            if n[Op.FORWARD] != 1:
                raise ValueError(f"{what}: {n[Op.FORWARD]} forwards, expected exactly 1")
            full, split = n[Op.BACKWARD], (n[Op.BACKWARD_INPUT], n[Op.BACKWARD_WEIGHT])
            if not ((full, split) == (1, (0, 0)) or (full, split) == (0, (1, 1))):
                raise ValueError(
                    f"{what}: {full} BACKWARD, {split[0]} BACKWARD_INPUT, {split[1]} BACKWARD_WEIGHT;"
                    " expected one BACKWARD, or one BACKWARD_INPUT and one BACKWARD_WEIGHT"
                )
    seen: set[tuple[Op, int, int]] = set()
    for a in acts:
        if a.op.is_comm:
            continue
        if a.op in _BACKWARDS and (Op.FORWARD, a.microbatch, a.chunk) not in seen:
            raise ValueError(f"rank {r}: {a} comes before the forward of that microbatch")
        if a.op is Op.BACKWARD_WEIGHT and (Op.BACKWARD_INPUT, a.microbatch, a.chunk) not in seen:
            raise ValueError(f"rank {r}: {a} comes before BACKWARD_INPUT of that microbatch")
        seen.add((a.op, a.microbatch, a.chunk))
    # Neighbouring stages on the same rank (p == 1, the V's tip) hand tensors over in memory: the order
    # must respect that.
    last = p * v - 1
    done: set[tuple[str, int, int]] = set()
    for a in acts:
        if a.op.is_comm:
            continue
        s = action_stage(r, a, p)
        if a.op is Op.FORWARD:
            if s > 0 and _rank_of(s - 1, p, schedule) == r and ("f", a.microbatch, s - 1) not in done:
                raise ValueError(f"rank {r}: {a} runs before the forward of stage {s - 1}")
            done.add(("f", a.microbatch, s))
        elif a.op in _BACKWARDS:
            if s < last and _rank_of(s + 1, p, schedule) == r and ("b", a.microbatch, s + 1) not in done:
                raise ValueError(f"rank {r}: {a} runs before the backward of stage {s + 1}")
            done.add(("b", a.microbatch, s))


def _check_matching(actions: list[list[Action]], p: int) -> None:
    """Every send has its receive on the peer and vice versa, in the same order on each rank pair."""
    sends: dict[tuple[int, int], list[tuple[Action, tuple]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[Action, tuple]]] = defaultdict(list)
    for r, acts in enumerate(actions):
        for a in acts:
            if a.op.is_send:
                sends[(r, a.peer)].append((a, message_key(r, a, p)))
            elif a.op.is_recv:
                recvs[(a.peer, r)].append((a, message_key(r, a, p)))
    for (src, dst) in sorted(set(sends) | set(recvs)):
        out, inc = sends[(src, dst)], recvs[(src, dst)]
        out_keys, in_keys = Counter(k for _, k in out), Counter(k for _, k in inc)
        for a, k in out:
            if out_keys[k] > 1:
                raise ValueError(f"rank {src} sends {a} {out_keys[k]} times")
            if k not in in_keys:
                recv = "RECV_ACT" if a.op is Op.SEND_ACT else "RECV_GRAD"
                raise ValueError(f"rank {src} {a} has no matching {recv} on rank {dst}")
        for a, k in inc:
            if in_keys[k] > 1:
                raise ValueError(f"rank {dst} receives {a} {in_keys[k]} times")
            if k not in out_keys:
                send = "SEND_ACT" if a.op is Op.RECV_ACT else "SEND_GRAD"
                raise ValueError(f"rank {dst} {a} has no matching {send} on rank {src}")
        for i, ((sa, sk), (ra, rk)) in enumerate(zip(out, inc)):
            if sk != rk:
                raise ValueError(
                    f"messages from rank {src} to rank {dst} are out of order: send #{i} is rank {src}"
                    f" {sa} but receive #{i} is rank {dst} {ra} (point-to-point messages match in order)"
                )


def _check_comm_placement(acts: list[Action], r: int, p: int, v: int, schedule: str | None = None) -> None:
    """Each compute that needs a remote input has its receive before it; each remote output is sent after."""
    if p == 1:
        return
    last = p * v - 1
    position = {(a.op, a.microbatch, a.chunk): i for i, a in enumerate(acts)}
    for i, a in enumerate(acts):
        s = action_stage(r, a, p)
        before_remote = s > 0 and _rank_of(s - 1, p, schedule) != r
        after_remote = s < last and _rank_of(s + 1, p, schedule) != r
        needs: list[tuple[Op, bool]] = []  # (comm op, must come before this compute)
        if a.op is Op.FORWARD:
            needs = [(Op.RECV_ACT, True)] if before_remote else []
            needs += [(Op.SEND_ACT, False)] if after_remote else []
        elif a.op in _BACKWARDS:
            needs = [(Op.RECV_GRAD, True)] if after_remote else []
            needs += [(Op.SEND_GRAD, False)] if before_remote else []
        for comm, before in needs:
            j = position.get((comm, a.microbatch, a.chunk))
            if j is None:
                raise ValueError(f"rank {r}: {a} has no {comm.name} for microbatch {a.microbatch}")
            if before and j > i:
                raise ValueError(f"rank {r}: {acts[j]} comes after {a}, which needs it")
            if not before and j < i:
                raise ValueError(f"rank {r}: {acts[j]} comes before {a}, which produces it")


def _check_deadlock(actions: list[list[Action]], p: int, sends_block: bool = True) -> None:
    """Run the rendezvous model of the module docstring; raise if it gets stuck.

    `sends_block=False` (V schedules): a rank leaves a batch once its receives have completed; its sends
    are posted and complete whenever their receives are posted, which is what the executor does."""
    steps = [batches(acts) for acts in actions]
    pos = [0] * p
    posted: set[tuple[str, tuple]] = set()  # ("send" | "recv", message key) currently posted
    completed: set[tuple] = set()
    while True:
        progress = False
        for r in range(p):
            while pos[r] < len(steps[r]):
                step = steps[r][pos[r]]
                if step[0].op.is_compute:
                    pos[r] += 1
                    progress = True
                    continue
                keys = []
                for a in step:
                    side, other = ("send", "recv") if a.op.is_send else ("recv", "send")
                    k = message_key(r, a, p)
                    posted.add((side, k))
                    if (other, k) in posted:
                        completed.add(k)
                    keys.append(k)
                if not all(k in completed for k, a in zip(keys, step) if sends_block or a.op.is_recv):
                    break
                pos[r] += 1
                progress = True
        if all(pos[r] == len(steps[r]) for r in range(p)):
            return
        if not progress:
            waiting = []
            for r in range(p):
                if pos[r] < len(steps[r]):
                    stuck = [a for a in steps[r][pos[r]] if message_key(r, a, p) not in completed]
                    waiting.append(f"rank {r} waits in " + ", ".join(str(a) for a in stuck))
            model = "blocking send/recv" if sends_block else "non-blocking sends, blocking receives"
            raise ValueError(f"schedule deadlocks ({model}): " + "; ".join(waiting))


def two_bw_phases(n_steps: int) -> list[tuple[bool, bool]]:
    """(first, last) of each step of a run of n_steps 2BW steps without an intermediate drain."""
    return [(i == 0, i == n_steps - 1) for i in range(n_steps)]


def check_2bw(p: int, m: int, n_steps: int = 4) -> None:
    """Raise ValueError naming the first problem of 2BW's lists over a run of n_steps steps (see module doc).

    Also checks the isolated step (first and last) with `check_schedule`.
    """
    check_schedule(build_2bw_step(p, m, True, True), p, m, 1)
    check_2bw_steps([build_2bw_step(p, m, first, last) for first, last in two_bw_phases(n_steps)], p, m)


def check_2bw_steps(steps: list[list[list[Action]]], p: int, m: int) -> None:
    """`check_2bw` on given lists: steps[t][r] is rank r's list of step t (the last step must drain)."""
    n_steps = len(steps)
    for t, lists in enumerate(steps):
        if len(lists) != p:
            raise ValueError(f"step {t}: {len(lists)} rank lists, expected p={p}")
        for r in range(p):
            _check_fields(lists[r], r, p, m, 1)
            for a in lists[r]:
                if a.batch not in (0, 1) or (a.batch and t == n_steps - 1):
                    raise ValueError(f"step {t} rank {r}: {a} has batch {a.batch}")
        check_step_messages(t, lists, p)
    for r in range(p):
        _check_2bw_sequence([(t, a) for t, lists in enumerate(steps) for a in lists[r]], r, p, m, n_steps)


def check_step_messages(t: int, lists: list[list[Action]], p: int) -> None:
    """One step's lists of a schedule that steps as a whole (2BW, PipeDream): every message matched within the
    step, and no deadlock under blocking sends; ValueError naming the step."""
    try:
        _check_matching(lists, p)
        _check_deadlock(lists, p)
    except ValueError as e:
        raise ValueError(f"step {t}: {e}") from None


def _check_2bw_sequence(seq: list[tuple[int, Action]], r: int, p: int, m: int, n_steps: int) -> None:
    """One rank's actions over all steps, as (step, action); batches numbered absolutely."""
    last = p - 1
    where: dict[tuple[Op, int, int], tuple[int, int]] = {}  # (op, batch, mb) -> (position, step)
    for i, (t, a) in enumerate(seq):
        key = (a.op, t + a.batch, a.microbatch)
        if key in where:
            raise ValueError(f"rank {r}: {a.op.name} of batch {key[1]} microbatch {a.microbatch} runs twice")
        where[key] = (i, t)
    for b in range(n_steps):
        for mb in range(m):
            what = f"rank {r} batch {b} microbatch {mb}"
            f, bw = where.get((Op.FORWARD, b, mb)), where.get((Op.BACKWARD, b, mb))
            if f is None or bw is None:
                raise ValueError(f"{what}: {'forward' if f is None else 'backward'} missing")
            if bw[1] != b:
                raise ValueError(f"{what}: backward in step {bw[1]}, not before its own optimizer step {b}")
            if f[0] > bw[0]:
                raise ValueError(f"{what}: backward before forward")
            needs = [(Op.RECV_ACT, f, True)] if r > 0 else []
            needs += [(Op.SEND_ACT, f, False)] if r < last else []
            needs += [(Op.RECV_GRAD, bw, True)] if r < last else []
            needs += [(Op.SEND_GRAD, bw, False)] if r > 0 else []
            for comm, (pos, step), before in needs:
                c = where.get((comm, b, mb))
                if c is None:
                    raise ValueError(f"{what}: no {comm.name}")
                if (c[0] > pos) if before else (c[0] < pos or c[1] != step):
                    raise ValueError(f"{what}: {comm.name} misplaced")
    for b in range(n_steps - 2):  # two weight versions: batch b+2 starts after batch b has finished
        done = max(where[(Op.BACKWARD, b, mb)][0] for mb in range(m))
        start = min(where[(Op.FORWARD, b + 2, mb)][0] for mb in range(m))
        if start < done:
            raise ValueError(f"rank {r}: batch {b + 2} starts before batch {b} is done (three weight versions)")


def validate_pipeline(n_layers: int, p: int, v: int, m: int, schedule: str, partition: str = "uniform") -> list[str]:
    """Plain-language problems with these pipeline settings (empty list when they are fine).

    `partition` is parallel.partition: `uniform` needs equal chunks; `params`/`time` need at least one
    block per chunk, `ends` one more on the first and the last; explicit counts ("2,3,3") must have
    pp x virtual_stages positive entries summing to n_layers.
    """
    if schedule not in SCHEDULES:
        return [f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}"]
    errors = []
    if partition not in PARTITION_KINDS:
        try:
            counts = [int(x) for x in partition.split(",")]
        except ValueError:
            return [f"parallel.partition must be uniform, params, time, ends or block counts like 2,3,3;"
                    f" got {partition!r}"]
        if len(counts) != p * v or sum(counts) != n_layers or min(counts) < 1:
            errors.append(f"parallel.partition ({partition}) must list parallel.pp ({p}) x parallel.virtual_stages"
                          f" ({v}) = {p * v} positive block counts summing to model.n_layers ({n_layers})")
    elif partition == "ends" and n_layers >= p * v:
        try:
            ends(n_layers, p * v)
        except ConfigError as e:
            errors.append(str(e))
    elif partition != "uniform":
        if n_layers < p * v:
            errors.append(f"model.n_layers ({n_layers}) is fewer than parallel.pp ({p}) x"
                          f" parallel.virtual_stages ({v}) = {p * v} stages")
    elif p >= 1 and v >= 1 and n_layers % (p * v):
        errors.append(
            f"model.n_layers ({n_layers}) is not divisible into parallel.pp ({p}) x"
            f" parallel.virtual_stages ({v}) = {p * v} equal chunks (or set parallel.partition)"
        )
    return errors + schedule_constraints(schedule, p, m, v)
