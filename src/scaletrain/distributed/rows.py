"""Who computes which replica group's rows of a step (parallel.missing_rows; docs/fault_tolerance.md, "The missing
group's share of the batch"). Torch-free: the lighthouse decides it, the membership log records it, the groups and
`scaletrain replay` read it.

Group g of R owns rows g*B/R .. (g+1)*B/R of each step's global batch B. With `skip` a step computed by Q < R members
uses only their rows. With `reassign` the rows of every missing group are computed by a live member, round-robin:
the j-th missing group (in increasing id) goes to the member at position j mod Q of the sorted members, so the extra
work is spread (no member computes more than one share more than another) and the assignment is a function of
(members, R) alone. Each member adds its shares' gradients in the order listed (its own first), the members' sums
are added in member order, and the total is divided by the number of groups whose rows were computed (R).
"""

from __future__ import annotations


def assign_rows(members: list[int], replicas: int) -> dict[str, list[int]]:
    """member (as a string: a JSON key) -> the groups whose rows it computes, its own first, then the missing
    groups it takes over in increasing id. Every group of range(replicas) appears exactly once."""
    live = sorted(members)
    if not live:
        raise ValueError("a quorum has at least one member")
    missing = [g for g in range(replicas) if g not in live]
    rows: dict[str, list[int]] = {str(m): [m] for m in live}
    for j, g in enumerate(missing):
        rows[str(live[j % len(live)])].append(g)
    return rows


def computed_groups(row: dict) -> int:
    """How many groups' rows a membership-log row's step used: all those its `rows` lists (reassign), or its members
    (skip, or a reassign run's full quorum, logged without `rows`)."""
    return divisor(row.get("rows"), row["members"])


def rows_of(rows: dict[str, list[int]] | None, member: int) -> list[int]:
    """The groups whose rows `member` computes under a quorum's (or log row's) `rows`: its own alone without."""
    return list(rows[str(member)]) if rows else [member]


def divisor(rows: dict[str, list[int]] | None, members: list[int]) -> int:
    """What a step's summed gradient is divided by: the number of groups whose rows were computed (each group's
    gradient is the mean over its own rows, so this makes the mean over all rows the step used)."""
    return sum(len(v) for v in rows.values()) if rows else len(members)
