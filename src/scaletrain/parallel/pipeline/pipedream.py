"""PipeDream's asynchronous pipeline as data: per-step action lists, their checker and the version rules.

PipeDream (Narayanan et al., SOSP 2019; Harlap et al., arXiv 1806.03377) runs 1F1B without a flush and
updates each stage's weights after every minibatch's backward. Here one optimizer step is one minibatch
(`parallel.microbatches` = 1: the minibatch is the unit that flows through the pipeline, as in the paper).
Over a run of steps rank r (stage r of p) runs the endless 1F1B order once warmed up: in step t it runs the
forward of minibatch t + w (w = p - r - 1) and the backward of minibatch t, then its optimizer step; so
p - r minibatches are in flight on stage r between its updates, and the last stage has none waiting.

`build_pipedream_step(p, first, last)` gives the lists of one step: `Action.batch` is the offset k of the
minibatch t + k the action works on (microbatch is always 0). `first`: the step warms up (forwards of
t .. t + w - 1 before the steady pair; after the start or after a drain); `last`: no forward of a later
minibatch (the pipeline drains before a checkpoint and at the end, and the minibatches already started
are dropped: their forwards run again after the drain). Rank r > 0 receives, at the end of step t, the
activation of its next step's forward, so no message crosses a step boundary.

Versions (weights after k optimizer steps are version k; step t runs with version t - 1 the newest):

- without vertical sync stage r's forward of minibatch i reads the newest version it has,
  i - w - 1 in steady state (the paper's W_r^(t-p+r+1) for 1-based stages), and weight stashing keeps it
  for minibatch i's backward: up to w + 1 = p - r versions on stage r;
- with vertical sync every stage uses the version stage 0 used for minibatch i, i - p, which travels
  with the activation; stage r then keeps the versions from i - p up to the newest: up to p versions.

`forward_version` gives both rules (steady state, first step 1); `check_pipedream` checks the lists over
a run of steps.
"""

from __future__ import annotations

from scaletrain.parallel.pipeline.check import check_step_messages
from scaletrain.parallel.pipeline.schedules import Action, Compute, Op, _insert_comms


def build_pipedream_step(p: int, first: bool, last: bool) -> list[list[Action]]:
    """Per-rank lists of one PipeDream step (see module doc)."""
    if p < 1:
        raise ValueError(f"parallel.pp must be at least 1, got {p}")
    ranks, steady = [], []
    for r in range(p):
        w = p - r - 1
        if first and last:  # one isolated step: only this step's minibatch
            offsets = [0]
        else:
            offsets = list(range(w)) if first else []
            if not last or w == 0:  # a drain starts no later minibatch (the last stage's forward is this one)
                offsets.append(w)
        steady.append(not first and w in offsets)
        order: list[Compute] = [(Op.FORWARD, 0, 0, k) for k in offsets] + [(Op.BACKWARD, 0, 0, 0)]
        ranks.append([[c] for c in order])
    out = _insert_comms(ranks, p, 1)
    for r in range(1, p):
        w = p - r - 1
        if steady[r]:  # this forward's input arrived at the end of the previous step
            out[r].remove(Action(Op.RECV_ACT, 0, 0, r - 1, w))
        if not last:  # the input of the next step's forward, sent by rank r - 1 during this step
            out[r].append(Action(Op.RECV_ACT, 0, 0, r - 1, w + 1))
    return out


def phases(n_steps: int, drains: tuple[int, ...] = ()) -> list[tuple[bool, bool]]:
    """(first, last) of each step of a run of n_steps steps with drains after the given (0-based) steps."""
    out = []
    for i in range(n_steps):
        out.append((i == 0 or (i - 1) in drains, i == n_steps - 1 or i in drains))
    return out


def forward_version(i: int, r: int, p: int, vertical_sync: bool, start: int = 1) -> int:
    """The version stage r's forward of minibatch i reads in a run warmed up at step `start` (steady rule, clipped
    to the versions that exist: start - 1 is the newest at the warm-up)."""
    lag = p if vertical_sync else p - r
    return max(i - lag, start - 1)


def in_flight(p: int, r: int) -> int:
    """Minibatches whose forward stage r has run and whose backward it has not, just before an update: p - r."""
    return p - r


def versions_kept(p: int, r: int, vertical_sync: bool) -> int:
    """Weight versions stage r holds at most (the live one included): p - r, or p with vertical sync."""
    return p if vertical_sync else p - r


def stash_copies(p: int, r: int, vertical_sync: bool) -> int:
    """Frozen copies of stage r's weights held at most besides the live ones (`stash.WeightStash`): without vertical
    sync p - r (the versions of the minibatches in flight), none on the last stage (its forward and backward run in
    one step, on the live weights); with vertical sync p on every stage (p = 1: none)."""
    if p == 1:
        return 0
    if vertical_sync:
        return p
    return 0 if r == p - 1 else p - r


def check_pipedream(p: int, n_steps: int = 5, drains: tuple[int, ...] = ()) -> None:
    """Raise ValueError naming the first problem of PipeDream's lists over a run of steps.

    Each step's lists on their own (every message matched within the step, no deadlock under blocking sends),
    and each rank's sequence: minibatch t's backward in step t, after its forward; the forward's receive
    before it and its send after it; p - r minibatches in flight just before each update in steady state.
    """
    steps = [build_pipedream_step(p, f, la) for f, la in phases(n_steps, drains)]
    for t, lists in enumerate(steps):
        check_step_messages(t, lists, p)
    for r in range(p):
        _check_rank(steps, r, p, drains)


def _check_rank(steps: list[list[list[Action]]], r: int, p: int, drains: tuple[int, ...]) -> None:
    forwarded: dict[int, int] = {}  # minibatch -> position of its (latest) forward
    recv: set[int] = set()
    pos = 0
    for t, lists in enumerate(steps):
        for a in lists[r]:
            pos += 1
            i = t + a.batch
            if a.op is Op.RECV_ACT:
                recv.add(i)
            elif a.op is Op.FORWARD:
                if r > 0 and i not in recv:
                    raise ValueError(f"rank {r} step {t}: forward of minibatch {i} before its activation arrived")
                forwarded[i] = pos
            elif a.op is Op.BACKWARD:
                if i != t:
                    raise ValueError(f"rank {r} step {t}: backward of minibatch {i}, not of this step's minibatch")
                if i not in forwarded:
                    raise ValueError(f"rank {r} step {t}: backward of minibatch {i} before its forward")
                held = sum(1 for j in forwarded if j >= t)
                draining = t in drains or t == len(steps) - 1
                if (held != in_flight(p, r)) if not draining else held > in_flight(p, r):
                    raise ValueError(f"rank {r} step {t}: {held} minibatches in flight, expected p - r = {p - r}")
                for j in [j for j in forwarded if j <= t or t in drains]:
                    del forwarded[j]
                recv = {j for j in recv if j > t and t not in drains}
