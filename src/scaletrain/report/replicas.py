"""The run report's section on fault-tolerant replica groups (parallel.replicas > 1; docs/fault_tolerance.md):
each failure (step, group), the steps and tokens it cost, each heal's time, and the whole-job resumes, read from
the membership log `OUT/membership.jsonl` that the lighthouse writes (multinode/lighthouse.py).

A failure is a group of the last committed step missing from the next committed one (the lighthouse's `dropped`).
It costs the steps committed without that group until it is a member again (each step lost is 1/R of that step's
batch, `tokens_per_step / R` tokens, with parallel.missing_rows=skip; with `reassign` its rows were computed by
live groups, counted as tokens reassigned, and nothing is lost); the heal is the row
where it rejoins behind, with the receiving side's seconds, bytes and chunks resent after a bad checksum. Steps
recomputed after a whole-job resume count once (multinode/replicas.py `effective_rows`). A group the lighthouse
excluded after `parallel.heal_attempts` consecutive failed heals never rejoins; the section names it, the step and
the last heal's failure.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.multinode.replicas import effective_rows, read_log
from scaletrain.report.page import Section, Table, Text, line_chart, series
from scaletrain.report.run_data import RunData


@dataclass
class Failure:
    step: int  # the first committed step without the group
    group: int
    steps_lost: int  # committed steps the group missed
    tokens_lost: int
    rejoined: int | None  # the step it computed again (None: never came back)
    heal: dict | None  # seconds, bytes, retries of the heal that brought it back
    tokens_reassigned: int = 0  # parallel.missing_rows=reassign: its rows of those steps, computed by live groups


def failures(rows: list[dict], replicas: int, tokens_per_step: int) -> list[Failure]:
    """Every drop of a group, with what it cost and how it came back, in step order."""
    steps = effective_rows(rows)
    out = []
    for i, row in enumerate(steps):
        for g in row["dropped"]:
            back = next((j for j in range(i + 1, len(steps)) if g in steps[j]["members"]), None)
            missed = (back if back is not None else len(steps)) - i
            heal = steps[back]["heal"].get(str(g)) if back is not None else None
            moved = sum(any(g in v for v in (x.get("rows") or {}).values()) for x in steps[i: i + missed])
            share = tokens_per_step // replicas
            out.append(Failure(row["step"], g, missed, (missed - moved) * share,
                               steps[back]["step"] if back is not None else None, heal, moved * share))
    return out


def replicas_section(run: RunData) -> Section:
    s = Section("replicas", "Fault tolerance: replica groups, failures, heals")
    r = run.cfg.parallel.replicas
    if r == 1:
        return s.add(Text("This run has no replica groups (parallel.replicas = 1): a failure restarts the whole job "
                          "from its newest checkpoint (docs/fault_tolerance.md).", "note"))
    rows = read_log(run.out)
    if not rows:
        return s.add(Text("No membership log yet (membership.jsonl has no complete line).", "note"))
    steps = effective_rows(rows)
    found = failures(rows, r, run.tokens_per_step)
    s.add(line_chart("replica-members", "replica groups in each step's quorum", "step", "groups",
                     [series([x["step"] for x in steps], [len(x["members"]) for x in steps], "groups")], zero=True))
    moved = run.cfg.parallel.missing_rows == "reassign"  # its rows computed by live groups: nothing lost
    if found:
        s.add(Table(["failed at step", "group", "steps missed" if moved else "steps lost",
                     "tokens reassigned" if moved else "tokens lost", "rejoined at step", "heal (s)",
                     "heal bytes", "chunks resent"],
                    [[f.step, f.group, f.steps_lost, f"{f.tokens_reassigned if moved else f.tokens_lost:,}",
                      f.rejoined if f.rejoined else "never",
                      f"{f.heal['seconds']:.3f}" if f.heal else "-", f"{f.heal['bytes']:,}" if f.heal else "-",
                      f.heal["retries"] if f.heal else "-"] for f in found], id="replica-failures"))
    else:
        s.add(Text("No replica group failed: every committed step had every group.", "note"))
    for x in rows:
        for g, e in x.get("excluded", {}).items():
            s.add(Text(f"Replica group {g} was excluded at step {x['step']} after {e['failed_heals']} consecutive "
                       f"failed heals (last: {e['reason']}); its agent was stopped and the other groups went on "
                       "without it.", "error"))
    lost = sum(f.tokens_lost for f in found)
    failed = sum(not x["committed"] for x in rows)
    resumes = [x["resumed_from"] for x in rows if x.get("resumed_from") is not None]
    how = (f"rows reassigned: {sum(f.tokens_reassigned for f in found):,} tokens of missing groups computed by the "
           "live groups (their extra compute; parallel.missing_rows=reassign, the global batch stays whole)" if moved
           else "a missing group's share of a step is skipped (parallel.missing_rows=skip)")
    s.add(Text(f"{len(steps)} steps committed in {len(rows)} rounds ({failed} failed and retried); {r} groups of "
               f"{run.tokens_per_step // r:,} tokens each per step; tokens lost {lost:,} ({how})"
               + (f"; whole-job resumes from the checkpoints of step(s) {', '.join(map(str, resumes))}"
                  if resumes else "") + ". `scaletrain replay --out RUN` recomputes these rounds in one process.",
               "note"))
    return s
