"""The parameter server's bookkeeping of tickets and updates, without any communication.

A `Gate` decides which ticket a requesting worker may get and which pushes form the next update (see `ps.py`
for the protocol). Staleness bound k (SSP, Ho et al., NIPS 2013, counted in server versions): a gradient
computed on version r must be applied by update r + k + 1. Updates are the first dp pushes to arrive after
the previous one, so in the worst case every gradient in flight arrives before a given one; a new ticket (on
the current version v) is therefore granted only while

    (in flight + 1) <= (r_min + k + 1 - v) x dp - (pushes waiting for the next update),

r_min the oldest version in flight (v if none). The inequality holds after every push and update if it held
when the last ticket was granted, so no gradient is ever applied more than k versions late. With k = 0 it
admits exactly the dp tickets of step v + 1 on version v (BSP); k = -1 grants always (ASP).
"""

from __future__ import annotations

from scaletrain.parallel.async_dp.versions import Member


class Gate:
    def __init__(self, dp: int, staleness: int, total: int, version: int = 0):
        self.dp, self.k, self.total = dp, staleness, total
        self.version = version
        self.next_ticket = version * dp
        self.in_flight: dict[int, tuple[int, int]] = {}  # ticket -> (worker, version pulled)
        self.pending: list[Member] = []
        self.reissue: list[int] = []  # tickets of lost workers, granted again first

    def can_grant(self, limit: int | None = None) -> bool:
        """Whether a ticket may be granted now; `limit`: only tickets below it (a quiet step ahead)."""
        limit = self.total if limit is None else min(limit, self.total)
        if not (self.reissue or self.next_ticket < limit):
            return False
        if self.k < 0:
            return True
        oldest = min([r for _, r in self.in_flight.values()] + [self.version])
        return len(self.in_flight) + 1 <= (oldest + self.k + 1 - self.version) * self.dp - len(self.pending)

    def grant(self, worker: int) -> tuple[int, int]:
        """(ticket, version) for `worker`; call only when `can_grant()`."""
        if self.reissue:
            n = self.reissue.pop(0)
        else:
            n, self.next_ticket = self.next_ticket, self.next_ticket + 1
        self.in_flight[n] = (worker, self.version)
        return n, self.version

    def push(self, ticket: int, worker: int) -> list[Member] | None:
        """Record the push of a granted ticket; returns the members of the next update (ticket order, the order
        their gradients are added) once dp pushes are waiting, and advances the version."""
        got = self.in_flight.pop(ticket, None)
        if got is None or got[0] != worker:
            raise RuntimeError(f"worker {worker} pushed ticket {ticket}, which it was not granted")
        self.pending.append(Member(ticket, worker, got[1]))
        if len(self.pending) < self.dp:
            return None
        members, self.pending = sorted(self.pending, key=lambda m: m.ticket), []
        self.version += 1
        return members

    def quiet(self, version: int) -> bool:
        """At `version` with nothing in flight and no push waiting."""
        return self.version == version and not self.in_flight and not self.pending

    def drop(self, worker: int) -> list[int]:
        """Forget a lost worker: its tickets in flight are granted again (to others) first."""
        tickets = sorted(n for n, (who, _) in self.in_flight.items() if who == worker)
        for n in tickets:
            del self.in_flight[n]
        self.reissue = sorted(self.reissue + tickets)
        return tickets
