"""Pipeline schedules as data: per-rank ordered lists of typed actions.

One pure function, `build_schedule(name, p, m, v)`, returns for each of the `p` pipeline ranks the
ordered list of `Action`s it runs in one optimizer step with `m` microbatches and `v` model chunks per
rank. The same lists are executed by the engine, checked by `check.py`, simulated by `simulate.py` and
drawn by `draw.py`.

Schedules (names of `parallel.schedule`):

- `gpipe`: all forwards, then all backwards (GPipe, Huang et al., arXiv 1811.06965).
- `1f1b`: PipeDream-flush; rank r runs p-r-1 warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards (Narayanan et al., arXiv 2006.09503; Megatron,
  arXiv 2104.04473 section 2.2.1).
- `interleaved`: Megatron's interleaved 1F1B with `v` model chunks per rank (arXiv 2104.04473
  section 2.2.2). Needs m % p == 0.
- `zb-h1`: zero bubble H1 (Qi et al., arXiv 2401.10241): each backward is split into BACKWARD_INPUT
  (gradient of the stage input, on the critical path) and BACKWARD_WEIGHT (gradient of the weights,
  deferrable); rank r delays its weight passes by r microbatches so that they fill the cool-down
  bubbles. At most p microbatches are in flight on any rank, the same peak as 1F1B.
- `2bw`: PipeDream-2BW (arXiv 2006.09503): asynchronous 1F1B with double-buffered weights. Every
  forward and backward of batch t reads weight version W(t-1), and the batch-t gradient is applied to the
  newest version, W(t+1) = W(t) - lr * grad f(W(t-1)) (gradients one version stale, two versions kept).
  `build_schedule("2bw", ...)` is one isolated step (1F1B order: fill and drain). `build_2bw_step(p, m,
  first, last)` gives the lists of one step of a run of steps: the warm-up forwards of batch t+1 run
  during batch t's cool-down (tagged `batch=1`; they read W(t)), so only the first step fills the
  pipeline and only the last one drains it. Needs m >= p so that two weight versions suffice (at most p
  microbatches in flight).
- `pipedream`: PipeDream's asynchronous 1F1B without a flush, with weight stashing and optional vertical
  sync (Narayanan et al., SOSP 2019; arXiv 1806.03377); one minibatch per step. `build_schedule("pipedream",
  p, 1)` is one isolated step; the lists of a run of steps are `pipedream.build_pipedream_step`'s.
- `zb-v`: zero bubble V (Qi et al., arXiv 2401.10241 section 6): two chunks per rank placed in a V, so
  rank r holds stages r and 2p-1-r and the first and last stages share rank 0; backwards split into
  BACKWARD_INPUT and BACKWARD_WEIGHT as in zb-h1. Warm-up: rank r runs 2(p-r)-1 chunk-0 forwards, then
  r (chunk-1 forward, chunk-0 forward) pairs, then p-r (chunk-1 forward, chunk-1 B, chunk-1 W) triples;
  steady state: (chunk-0 F, chunk-0 B, chunk-0 W, chunk-1 F, chunk-1 B, chunk-1 W); cool-down: r
  (chunk-0 B, chunk-1 B) pairs, then p-r (chunk-0 B, chunk-0 W) pairs, then the remaining weight
  passes fill the tail. Peak 2p microbatch-chunks in flight on every rank, the activation memory of
  1F1B. Needs parallel.virtual_stages = 2 and m >= 2p - 1 (the warm-up of rank 0).
- `dualpipev`: DualPipeV, the single-direction V form of DeepSeek-V3's DualPipe (arXiv 2412.19437 section
  3.2.1; torch.distributed.pipelining's ScheduleDualPipeV): the V placement of zb-v, and a steady state of
  OVERLAP_F_B slots, each the forward of one microbatch on one chunk and the full backward of another on the
  other chunk, which DualPipe overlaps (on GPUs one's compute hides the other's communication). Rank r:
  2(p-r-1) chunk-0 forwards; r+1 (chunk-0 F, chunk-1 F) pairs; p-r-1 (chunk-1 I, W, chunk-1 F) triples;
  m-2p+r+1 rounds of (chunk-0 F + chunk-1 B, chunk-1 F + chunk-0 B) overlapped pairs (the last rank runs its
  first chunk-0 F and chunk-1 B apart); p-r-1 (chunk-1 B, chunk-1 F + chunk-0 B); r+1 (chunk-1, chunk-0)
  backward pairs, the second half of them split into I and W (zero bubble's cool-down); p-r-1 (W, chunk-0
  backward); the remaining W passes. Peak in flight: 2p + 1 microbatch-chunks on every rank (`dualpipev_peak`:
  the 2p forwards of the warm-up, and one more because an overlapped slot's forward starts before its backward
  frees a pair), i.e. p + 1/2 microbatches of a full stage, one chunk more than zb-v. Needs
  parallel.virtual_stages = 2 and m >= 2p (as torch's: rank 0's warm-up runs 2p forwards).

Stages and chunks. The model is cut into S = p * v consecutive stages (chunks). Stage s lives on rank
`s % p` as local chunk `s // p`; equivalently chunk c on rank r holds model chunk `c * p + r`
(`rank_chunk_to_stage`, `stage_to_rank_chunk`). With v = 1 the chunk is always 0. The V schedules
(`V_SCHEDULES`) place the stages in a V instead: rank r holds stage r as chunk 0 and stage 2p-1-r as
chunk 1 (pass `schedule=` to the layout functions); their actions carry their global `stage`.

Send/recv convention (the executor relies on it):

1. `Action.chunk` is always the acting rank's *local* chunk: SEND_ACT names the chunk whose forward
   produced the activation, RECV_ACT the chunk whose forward will consume it, SEND_GRAD the chunk whose
   backward produced the input gradient, RECV_GRAD the chunk whose backward will consume the output
   gradient. `peer` is the other pipeline rank. A message from stage s goes to stage s + 1 (activations)
   or s - 1 (gradients); `message_key` gives the identity both ends agree on.
2. A RECV comes before the compute action that needs it; a SEND comes after the compute action that
   produced it. BACKWARD_INPUT (or BACKWARD) needs RECV_GRAD and produces SEND_GRAD; BACKWARD_WEIGHT
   communicates nothing. Compute actions are grouped into slots (usually one action; in the
   interleaved steady state a (forward, backward) pair, as in Megatron), and between two slots sits
   one run of comms: first the sends of what the earlier slot produced, then the receives of what the
   later slot needs. So a typical 1F1B list reads `F(k) SEND_ACT(k) RECV_GRAD(j) B(j) SEND_GRAD(j)
   RECV_ACT(k+1) F(k+1) ...`.
3. No send/recv is emitted between stages on the same rank (p == 1, or stages p-1 and p of a V
   schedule): the executor hands the tensor over in memory.
4. A maximal run of consecutive send/recv actions is one batch: the executor posts all of them together
   (`torch.distributed.batch_isend_irecv`) and must wait for the batch's receives before the next
   compute action. `SEND_ACT(k), RECV_GRAD(j)` between a forward and a backward is Megatron's
   send-forward-recv-backward. The lists cannot deadlock even if the executor also waits for the sends
   at once (that is what `check.py` verifies), but it should rather wait for a send only before it
   frees or reuses the sent buffer: blocking sends couple neighbouring ranks, and `simulate.py` shows
   they cost zb-h1 its whole gain over 1F1B.
5. Between any ordered pair of ranks, the k-th send from src to dst matches the k-th receive on dst
   from src (NCCL matches point-to-point messages in issue order; no tags needed).
6. `Action.batch` is 0 for the step's own batch. Only 2BW's cross-step lists use batch 1: the next
   step's batch, whose first forwards start early. Every message is sent and received within one
   step's lists (a receive may come at the end of a step, its forward in the next one).

`check.check_schedule` verifies all of this, and that no order can deadlock when every send blocks
until its receive is posted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from scaletrain.config.schema import SCHEDULES


class Op(Enum):
    """The kind of one action."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients in one pass
    BACKWARD_INPUT = "I"  # gradient w.r.t. the stage input only (zero bubble's B)
    BACKWARD_WEIGHT = "W"  # gradient w.r.t. the weights only (zero bubble's W)
    OVERLAP_F_B = "FB"  # DualPipe: a forward and another microbatch's backward in one slot (`Action.pair`)
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def is_compute(self) -> bool:
        return self not in _COMM

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACT, Op.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACT, Op.RECV_GRAD)


_COMM = frozenset({Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD})


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule.

    `microbatch` in [0, m); `chunk` is the local chunk in [0, v) on the acting rank; `peer` is the other
    rank of a send/recv and None for compute actions; `batch` is 0 for this step's batch and 1 for the
    next step's (2BW's early warm-up forwards, which read the newer weight version); `stage` is the
    acting chunk's global stage under a V placement (`V_SCHEDULES`), None for the loop placement
    (stage chunk * p + rank). `pair` is set on OVERLAP_F_B only: its (FORWARD, BACKWARD) halves, run one after
    the other on one stream (`unfold`); the action's own microbatch, chunk and stage are the forward's.
    """

    op: Op
    microbatch: int
    chunk: int = 0
    peer: int | None = None
    batch: int = 0
    stage: int | None = None
    pair: tuple[Action, Action] | None = None

    def __str__(self) -> str:
        if self.pair is not None:
            return f"{self.op.name}({self.pair[0]} + {self.pair[1]})"
        base = f"{self.op.name}(mb={self.microbatch}, chunk={self.chunk}"
        if self.batch:
            base += ", next batch"
        if self.peer is None:
            return base + ")"
        arrow = "to" if self.op.is_send else "from"
        return f"{base}, {arrow} rank {self.peer})"


# --------------------------------------------------------------------------- stage layout


V_SCHEDULES: tuple[str, ...] = ("zb-v", "dualpipev")  # two chunks per rank placed in a V


def rank_chunk_to_stage(rank: int, chunk: int, p: int, schedule: str | None = None) -> int:
    """Global stage (model chunk) index held by local `chunk` of `rank`: chunk * p + rank, or in the V
    placement of `V_SCHEDULES` rank (chunk 0) and 2p - 1 - rank (chunk 1)."""
    if schedule in V_SCHEDULES:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_to_rank_chunk(stage: int, p: int, schedule: str | None = None) -> tuple[int, int]:
    """(rank, local chunk) that holds global `stage` (placement of `schedule`, see `rank_chunk_to_stage`)."""
    if schedule in V_SCHEDULES:
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def stage_layout(p: int, v: int, schedule: str | None = None) -> list[tuple[int, int]]:
    """`layout[s] == (rank, chunk)` for every global stage s in [0, p * v)."""
    return [stage_to_rank_chunk(s, p, schedule) for s in range(p * v)]


def action_stage(rank: int, action: Action, p: int) -> int:
    """Global stage of the chunk `action` acts on: its `stage` when set (V placement), else chunk * p + rank."""
    return action.stage if action.stage is not None else rank_chunk_to_stage(rank, action.chunk, p)


def message_key(rank: int, action: Action, p: int) -> tuple[str, int, int, int]:
    """Identity of the message a send/recv action carries: (kind, microbatch, src_stage, dst_stage).

    A send and a receive match exactly when their keys are equal. A next-batch message (2BW) has the
    batch appended: (kind, microbatch, src_stage, dst_stage, batch).
    """
    s = action_stage(rank, action, p)
    mb = action.microbatch
    if action.op is Op.SEND_ACT:
        key = ("act", mb, s, s + 1)
    elif action.op is Op.RECV_ACT:
        key = ("act", mb, s - 1, s)
    elif action.op is Op.SEND_GRAD:
        key = ("grad", mb, s, s - 1)
    elif action.op is Op.RECV_GRAD:
        key = ("grad", mb, s + 1, s)
    else:
        raise ValueError(f"{action} is not a send or receive")
    return key + (action.batch,) if action.batch else key


# --------------------------------------------------------------------------- constraints


def schedule_constraints(name: str, p: int, m: int, v: int) -> list[str]:
    """Why (name, p, m, v) cannot be built, in plain language; empty when it can."""
    if name not in SCHEDULES:
        return [f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {name!r}"]
    errors = []
    for key, value in (("parallel.pp", p), ("parallel.microbatches", m), ("parallel.virtual_stages", v)):
        if value < 1:
            errors.append(f"{key} must be at least 1, got {value}")
    if errors:
        return errors
    if name in V_SCHEDULES:
        if v != 2:
            errors.append(f"parallel.schedule={name} places two chunks per rank in a V: it needs"
                          f" parallel.virtual_stages=2, got {v}")
        least = 2 * p if name == "dualpipev" else 2 * p - 1
        if m < least:
            errors.append(f"parallel.schedule={name} needs parallel.microbatches >= 2 x parallel.pp"
                          f"{'' if name == 'dualpipev' else ' - 1'} = {least} (rank 0's warm-up), got {m}")
    elif v > 1 and name != "interleaved":
        errors.append(
            f"parallel.virtual_stages ({v}) > 1 needs parallel.schedule=interleaved, zb-v or dualpipev, got {name!r}"
        )
    if name == "interleaved" and m % p:
        errors.append(
            f"parallel.schedule=interleaved needs parallel.microbatches ({m}) divisible by parallel.pp ({p})"
        )
    if name == "2bw" and m < p:
        errors.append(
            f"parallel.schedule=2bw needs at least as many microbatches as stages:"
            f" parallel.microbatches ({m}) < parallel.pp ({p})"
        )
    if name == "pipedream" and m != 1:
        errors.append(
            f"parallel.schedule=pipedream runs one minibatch per optimizer step, as the paper does:"
            f" parallel.microbatches ({m}) must be 1 (train.global_batch = train.micro_batch x parallel.dp)"
        )
    return errors


# --------------------------------------------------------------------------- compute orders
# Each builder returns, per rank, its compute actions in order, grouped into slots (see
# `_insert_comms`); `_insert_comms` then adds the sends and receives by the convention above.

Compute = tuple[Op, int, int] | tuple[Op, int, int, int]  # (op, microbatch, chunk[, batch])
Slots = list[list[Compute]]  # one rank's compute order, grouped


def _gpipe(p: int, m: int, v: int) -> list[Slots]:
    order = [(Op.FORWARD, i, 0) for i in range(m)] + [(Op.BACKWARD, i, 0) for i in range(m)]
    return [[[c] for c in order] for _ in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[Slots]:
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [(Op.FORWARD, i, 0) for i in range(warmup)]
        for j in range(m - warmup):  # steady state: forward of j + warmup, backward of j
            order += [(Op.FORWARD, j + warmup, 0), (Op.BACKWARD, j, 0)]
        order += [(Op.BACKWARD, j, 0) for j in range(m - warmup, m)]
        ranks.append([[c] for c in order])
    return ranks


def _interleaved_unit(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) unit on a rank in Megatron's table.

    Units come in groups of p * v: p microbatches through chunk 0, the same p through chunk 1, ...;
    backwards walk the chunks in reverse.
    """
    group, within = divmod(k, p * v)
    chunk = within // p
    if backward:
        chunk = v - 1 - chunk
    return group * p + within % p, chunk


def _interleaved(p: int, m: int, v: int) -> list[Slots]:
    if v == 1:
        return _one_f_one_b(p, m, v)
    total = m * v
    fwd = [(Op.FORWARD, *_interleaved_unit(k, p, v, backward=False)) for k in range(total)]
    bwd = [(Op.BACKWARD, *_interleaved_unit(k, p, v, backward=True)) for k in range(total)]
    ranks = []
    for r in range(p):
        # Megatron's warm-up: two units per downstream rank (one each way) plus one full round of
        # the earlier chunks, so the first backward's gradient has arrived when it is needed.
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        slots = [[f] for f in fwd[:warmup]]
        slots += [[fwd[warmup + j], bwd[j]] for j in range(total - warmup)]  # steady: (F, B) pairs
        slots += [[b] for b in bwd[total - warmup :]]
        ranks.append(slots)
    return ranks


def _zb_h1(p: int, m: int, v: int) -> list[Slots]:
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        lag = r  # weight passes run r microbatches behind their input passes: <= p in flight
        order = [(Op.FORWARD, i, 0) for i in range(warmup)]
        for j in range(m):
            if j < m - warmup:
                order.append((Op.FORWARD, j + warmup, 0))
            order.append((Op.BACKWARD_INPUT, j, 0))
            if j >= lag:
                order.append((Op.BACKWARD_WEIGHT, j - lag, 0))
        order += [(Op.BACKWARD_WEIGHT, i, 0) for i in range(max(m - lag, 0), m)]
        ranks.append([[c] for c in order])
    return ranks


def _zb_v(p: int, m: int, v: int) -> list[Slots]:
    """ZB-V (arXiv 2401.10241 section 6) in the order of the module docstring; chunk 0 is stage r, chunk 1
    stage 2p-1-r. Every phase count follows from the V: rank r's chunk-1 work waits for the 2(p-r)-1
    stages between its two chunks, so it starts that many chunk-0 forwards first."""
    F, B, W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    ranks = []
    for r in range(p):
        nxt = {(op, c): 0 for op in (F, B, W) for c in (0, 1)}  # next microbatch of each (op, chunk)
        order: list[Compute] = []

        def emit(op: Op, c: int, nxt=nxt, order=order) -> None:
            if nxt[(op, c)] < m:
                order.append((op, nxt[(op, c)], c))
                nxt[(op, c)] += 1

        for _ in range(2 * (p - r) - 1):
            emit(F, 0)
        for _ in range(r):
            emit(F, 1)
            emit(F, 0)
        for _ in range(p - r):
            emit(F, 1)
            emit(B, 1)
            emit(W, 1)
        while nxt[(F, 0)] < m or nxt[(F, 1)] < nxt[(F, 0)]:  # steady state
            emit(F, 0)
            emit(B, 0)
            emit(W, 0)
            emit(F, 1)
            emit(B, 1)
            emit(W, 1)
        for _ in range(r):  # cool-down: input gradients first, weight passes fill the tail
            emit(B, 0)
            emit(B, 1)
        for _ in range(p - r):
            emit(B, 0)
            emit(W, 0)
        while nxt[(W, 1)] < nxt[(B, 1)]:
            emit(W, 1)
        while nxt[(W, 0)] < nxt[(B, 0)]:
            emit(W, 0)
        ranks.append([[c] for c in order])
    return ranks


def _dualpipev(p: int, m: int, v: int) -> list[Slots]:
    """DualPipeV (arXiv 2412.19437) in the eight phases of the module docstring; chunk 0 is stage r, chunk 1 stage
    2p-1-r. A two-action slot is one overlapped (forward, full backward) pair (OVERLAP_F_B in `build_schedule`).
    A split backward's weight pass waits in a queue and fills the places the phases name."""
    F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    ranks = []
    for r in range(p):
        nxt = {(op, c): 0 for op in (F, B) for c in (0, 1)}  # next microbatch of forward / backward (B or I)
        waiting: list[tuple[int, int]] = []  # (microbatch, chunk) whose input gradient ran split, W pending
        slots: Slots = []

        def one(op: Op, c: int, nxt=nxt, waiting=waiting) -> Compute:
            key = (F if op is F else B, c)
            mb, nxt[key] = nxt[key], nxt[key] + 1
            if op is I:
                waiting.append((mb, c))
            return (op, mb, c)

        def alone(op: Op, c: int, slots=slots) -> None:
            slots.append([one(op, c)])

        def weight(slots=slots, waiting=waiting) -> None:
            if waiting:
                mb, c = waiting.pop(0)
                slots.append([(W, mb, c)])

        def overlap(f_chunk: int, slots=slots) -> None:  # forward on f_chunk, full backward on the other chunk
            slots.append([one(F, f_chunk), one(B, 1 - f_chunk)])

        for _ in range(2 * (p - r - 1)):  # 1: chunk-0 forwards fill the V's arm down to the tip
            alone(F, 0)
        for _ in range(r + 1):  # 2: both chunks' forwards
            alone(F, 0)
            alone(F, 1)
        for _ in range(p - r - 1):  # 3: zero-bubble chunk-1 backwards between chunk-1 forwards
            alone(I, 1)
            weight()
            alone(F, 1)
        for i in range(m - 2 * p + r + 1):  # 4: steady state, two overlapped slots per round
            if i == 0 and r == p - 1:  # the tip's first pair runs apart: less bubble (as DeepSeek's)
                alone(F, 0)
                alone(B, 1)
            else:
                overlap(0)
            overlap(1)
        for _ in range(p - r - 1):  # 5: chunk-0 forwards are done; chunk-1 ones still overlap
            alone(B, 1)
            overlap(1)
        split = False
        for i in range(r + 1):  # 6: cool-down, its second half split into I and W
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            alone(I if split else B, 1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            alone(I if split else B, 0)
        for _ in range(p - r - 1):  # 7
            weight()
            alone(I if split else B, 0)
        for _ in range(r + 1):  # 8: the weight passes left
            weight()
        ranks.append(slots)
    return ranks


def stated_peak(name: str, p: int) -> int | None:
    """The peak of (microbatch, chunk) pairs in flight the V schedules state for every rank (None for the others):
    zb-v 2p; dualpipev 2p + 1, the 2p forwards of its warm-up and one more because an overlapped slot (or phase
    3's I, W, F) starts a forward before a backward frees a pair. `check.check_schedule` holds the lists to it."""
    return {"zb-v": 2 * p, "dualpipev": 2 * p + 1}.get(name)


def peak_in_flight(acts: list[Action]) -> int:
    """Peak count of (microbatch, chunk) pairs held on one rank: from the start of a pair's FORWARD to the end of
    its last backward pass (BACKWARD, or BACKWARD_WEIGHT when the backward is split: the weight pass still needs
    the stored inputs); an overlapped slot counts as its forward, then its backward."""
    acts = unfold(acts)
    split = {(a.microbatch, a.chunk) for a in acts if a.op is Op.BACKWARD_WEIGHT}
    held = peak = 0
    for a in acts:
        if a.op is Op.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) or (
            a.op is Op.BACKWARD_INPUT and (a.microbatch, a.chunk) not in split
        ):
            held -= 1
    return peak


_BUILDERS: dict[str, Callable[[int, int, int], list[Slots]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zb-h1": _zb_h1,
    "2bw": _one_f_one_b,
    "pipedream": _one_f_one_b,  # one isolated step; the run of steps: pipedream.build_pipedream_step
    "zb-v": _zb_v,
    "dualpipev": _dualpipev,
}


def _insert_comms(slots_per_rank: list[Slots], p: int, v: int, schedule: str | None = None) -> list[list[Action]]:
    """Add sends and receives around groups ("slots") of compute actions (convention points 2 to 4).

    Between two consecutive slots goes one batch: the sends of everything the earlier slot produced,
    then the receives of everything the later slot needs. A slot is usually one compute action; the
    interleaved steady state uses (forward, backward) pairs, as Megatron does, so that neighbouring
    ranks meet in one four-message batch per pair and blocking sends cannot deadlock.
    """
    last = p * v - 1
    vee = schedule in V_SCHEDULES
    out = []
    for r, slots in enumerate(slots_per_rank):
        acts: list[Action] = []
        for slot in slots:
            recvs, sends, computes = [], [], []
            for op, mb, c, *tag in slot:
                b = tag[0] if tag else 0
                s = rank_chunk_to_stage(r, c, p, schedule)
                st = s if vee else None
                prev_rank = stage_to_rank_chunk(s - 1, p, schedule)[0] if s > 0 else r
                next_rank = stage_to_rank_chunk(s + 1, p, schedule)[0] if s < last else r
                if op is Op.FORWARD:
                    if prev_rank != r:
                        recvs.append(Action(Op.RECV_ACT, mb, c, prev_rank, b, st))
                    if next_rank != r:
                        sends.append(Action(Op.SEND_ACT, mb, c, next_rank, b, st))
                elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                    if next_rank != r:
                        recvs.append(Action(Op.RECV_GRAD, mb, c, next_rank, b, st))
                    if prev_rank != r:
                        sends.append(Action(Op.SEND_GRAD, mb, c, prev_rank, b, st))
                computes.append(Action(op, mb, c, None, b, st))
            if schedule == "dualpipev" and len(computes) == 2:  # DualPipe's overlapped slot: one action
                f = computes[0]
                computes = [Action(Op.OVERLAP_F_B, f.microbatch, f.chunk, None, 0, f.stage, pair=(f, computes[1]))]
            acts += recvs + computes + sends
        out.append(acts)
    return out


def _sends_in_receive_order(acts_per_rank: list[list[Action]], p: int) -> list[list[Action]]:
    """Delay sends so that, between every ordered pair of ranks, they go out in the order the receiver posts
    its receives (convention point 5).

    In a V two streams share the direction rank r -> r + 1 (chunk 0's activations, chunk 1's gradients), and
    rank r may produce a message earlier than rank r + 1 wants it. A send that would overtake one the
    receiver expects first is held and goes out right after that one; only sends move, and only later (the
    executor never waits for a send, so holding one stalls nobody)."""
    wanted: dict[tuple[int, int], list[tuple]] = {}
    for dst, acts in enumerate(acts_per_rank):
        for a in acts:
            if a.op.is_recv:
                wanted.setdefault((a.peer, dst), []).append(message_key(dst, a, p))
    out = []
    for src, acts in enumerate(acts_per_rank):
        pos = {dst: 0 for dst in range(p)}
        held: dict[int, dict[tuple, Action]] = {dst: {} for dst in range(p)}
        new: list[Action] = []
        for a in acts:
            if not a.op.is_send:
                new.append(a)
                continue
            dst, order = a.peer, wanted[(src, a.peer)]
            held[dst][message_key(src, a, p)] = a
            while pos[dst] < len(order) and order[pos[dst]] in held[dst]:
                new.append(held[dst].pop(order[pos[dst]]))
                pos[dst] += 1
        if any(held.values()):
            left = [str(a) for h in held.values() for a in h.values()]
            raise ValueError(f"rank {src}: sends with no matching receive: {left}")
        out.append(new)
    return out


def compute_order(name: str, p: int, m: int, v: int = 1) -> list[list[Compute]]:
    """Per rank, the compute actions (op, microbatch, chunk) of schedule `name` in order, without the sends and
    receives `build_schedule` adds (what the planner's memory walk needs). ValueError as `build_schedule`."""
    errors = schedule_constraints(name, p, m, v)
    if errors:
        raise ValueError("; ".join(errors))
    return [[c for slot in slots for c in slot] for slots in _BUILDERS[name](p, m, v)]


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per-rank ordered action lists of schedule `name` for p ranks, m microbatches, v chunks per rank.

    Raises ValueError when the combination is not allowed (see `schedule_constraints`).
    """
    errors = schedule_constraints(name, p, m, v)
    if errors:
        raise ValueError("; ".join(errors))
    actions = _insert_comms(_BUILDERS[name](p, m, v), p, v, name)
    return _sends_in_receive_order(actions, p) if name in V_SCHEDULES else actions


def build_2bw_step(p: int, m: int, first: bool, last: bool) -> list[list[Action]]:
    """Per-rank lists of one optimizer step of PipeDream-2BW's asynchronous 1F1B (arXiv 2006.09503).

    Over a run of steps, rank r runs the endless 1F1B order: w = p - r - 1 warm-up forwards once, then
    pairs (forward of microbatch k + w, backward of microbatch k) over the stream of all steps'
    microbatches. Step t's list holds the m pairs whose backwards belong to batch t; the forwards in the
    last w of them belong to batch t+1 (`batch=1`, reading W(t) while batch t's backwards read W(t-1)).
    So the step ends right after the rank's last backward of batch t (its optimizer step may follow), and
    batch t+1's first w forwards are already done. Rank r > 0 also receives, at the end of step t, the
    activation its first forward of step t+1 consumes, so every message stays within one step's lists.

    `first`: the step also runs batch t's own warm-up (nothing was started early). `last`: no batch t+1
    forwards (the pipeline drains, e.g. before a checkpoint or at the end). first and last together give
    `build_schedule("2bw", p, m)`, one isolated 1F1B step.
    """
    errors = schedule_constraints("2bw", p, m, 1)
    if errors:
        raise ValueError("; ".join(errors))
    ranks = []
    for r in range(p):
        w = p - r - 1
        order: list[Compute] = [(Op.FORWARD, i, 0, 0) for i in range(w)] if first else []
        for k in range(m):
            if k + w < m:
                order.append((Op.FORWARD, k + w, 0, 0))
            elif not last:
                order.append((Op.FORWARD, k + w - m, 0, 1))
            order.append((Op.BACKWARD, k, 0, 0))
        ranks.append([[c] for c in order])
    out = _insert_comms(ranks, p, 1)
    for r in range(1, p):
        w = p - r - 1
        if not first:  # the first forward's input arrived at the end of the previous step
            out[r].remove(Action(Op.RECV_ACT, w, 0, r - 1))
        if not last:  # the input of the next step's first forward: sent during this step
            out[r].append(Action(Op.RECV_ACT, w, 0, r - 1, 1))
    return out


def unfold(actions: list[Action]) -> list[Action]:
    """One rank's list with each OVERLAP_F_B replaced by its two halves, forward first (how CPU/gloo runs them:
    one after the other; the overlap of the two is a matter of GPU streams)."""
    return [half for a in actions for half in (a.pair if a.pair is not None else (a,))]


def batches(actions: list[Action]) -> list[list[Action]]:
    """Split one rank's list into steps: each compute action alone, each maximal run of comms together."""
    steps: list[list[Action]] = []
    for a in actions:
        if a.op.is_comm and steps and steps[-1][0].op.is_comm:
            steps[-1].append(a)
        else:
            steps.append([a])
    return steps
