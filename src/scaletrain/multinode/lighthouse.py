"""The lighthouse of fault-tolerant replica groups: hosts the store, decides each round's quorum and commit, and
writes the membership log (torchft's Lighthouse, github.com/pytorch/torchft; protocol in distributed/quorum.py).

Run by the replica launcher (multinode/replicas.py) as `python -m scaletrain.multinode.lighthouse`. A group is
alive while its heartbeat counter moves; one whose counter has not moved for `heartbeat_s` is dead (killed, frozen
by SIGSTOP, or its machine gone). A round closes when each member of the previous quorum has asked to join or is
dead (the first round: when every group has asked, or `start_s` passed), so a dead group is dropped within the
heartbeat bound and never stalls the others.
A group of several processes (`--ranks P`) is alive while every one of its ranks heartbeats, and a round commits only
when every rank of every member reported ok; a heal's row sums the bytes and resent chunks of the group's ranks and
takes the slowest rank's seconds. The membership log `OUT/membership.jsonl` has one line per round:
round, step, members, behind (healed), each heal's seconds, bytes and resent chunks, dropped groups,
committed, `rows` (parallel.missing_rows=reassign, a step without every group: member -> the groups whose rows
it computed, distributed/rows.py),
and on the first row of a launch that resumed from a checkpoint `resumed_from` (its step; the rows of
later steps before it were recomputed, multinode/replicas.py `effective_rows`), `checkpoint` (its folder, as group
0 put it in the store under `start`) and, for a `--reshard` start from another layout, `from_layout`; a fresh
launch from imported weights (`--init-from`) has `init_from` and `start_checkpoint` there (train/replica_init.py).
`scaletrain replay --out OUT` recomputes the committed rounds in one process (train/replica_replay.py), from that
checkpoint when the log has no rounds before it.
A group whose heal failed in `heal_attempts` consecutive rounds where it was behind (its receiving rank reported the
failure, `healfail/R/G/I`: a chunk corrupt on every resend, a state it could not load) is excluded: its later
requests are ignored, `excluded/G` in the store tells its processes to stop, `excluded-group{G}` in `--marks` tells
the launcher to stop its agent, and the round's row gets `excluded`: {G: {failed_heals, reason}}. A heal that fails
the same way every round would otherwise fail every round for the live groups too, and the run would stall.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from scaletrain.distributed.rows import assign_rows

POLL_S = 0.002
FIRST_ROUND_GRACE = 5
"""A member's first round after its process (re)started may go this many heartbeat bounds without a heartbeat before
the round fails: its first step initialises lazily (and a heal's first step follows a transfer); later rounds use
the bound itself."""


class Lighthouse:
    def __init__(self, store: dist.Store, groups: int, steps: int, heartbeat_s: float, log: Path,
                 start_s: float = 120.0, ranks: int = 1, heal_attempts: int = 3, marks: Path | None = None,
                 reassign: bool = False):
        self.store, self.groups, self.steps, self.heartbeat_s = store, groups, steps, heartbeat_s
        self.log, self.start_s, self.ranks = log, start_s, ranks
        self.heal_attempts, self.marks = heal_attempts, marks
        self.failed_heals: dict[int, int] = {}  # group -> consecutive rounds whose heal of it failed
        self.excluded: set[int] = set()  # groups excluded after heal_attempts failed heals: their requests are ignored
        self.reassign = reassign  # parallel.missing_rows=reassign: a missing group's rows go to a live member
        self.beats: dict[tuple[int, int], tuple[int, float]] = {}  # (group, rank) -> (counter, when it last moved)
        self.proven: dict[int, int | None] = {}  # group -> its incarnation that committed a round (past its first)

    def alive(self, g: int, bound_s: float | None = None) -> bool:
        """Whether every rank of group g heartbeats (one frozen or dead rank stalls its group's collectives): each
        counter moved within `bound_s` (default heartbeat_s)."""
        return all([self._rank_alive(g, i, bound_s or self.heartbeat_s) for i in range(self.ranks)])  # every counter

    def _rank_alive(self, g: int, i: int, bound_s: float) -> bool:
        now = time.monotonic()
        count = self.store.add(f"hb/{g}/{i}", 0)
        last = self.beats.get((g, i))
        if last is None or count != last[0]:
            self.beats[(g, i)] = (count, now)
            return count > 0
        return now - last[1] < bound_s

    def _requests(self, r: int) -> dict[int, int]:
        keys = {g: f"req/{r}/{g}" for g in range(self.groups)}
        return {g: int(self.store.get(k)) for g, k in keys.items() if g not in self.excluded and self.store.check([k])}

    def close_round(self, r: int, previous: list[int] | None) -> dict[int, int]:
        """Wait until round r can close; the requests (group -> completed steps) it closes with."""
        t0 = time.monotonic()
        while True:
            req = self._requests(r)
            if previous is None:
                waiting = [g for g in range(self.groups) if g not in req]
                if req and (not waiting or time.monotonic() - t0 > self.start_s):
                    return req
            else:
                waiting = [g for g in previous if g not in req and self.alive(g)]
                if req and not waiting:
                    return req
            for g in range(self.groups):
                self.alive(g)
            time.sleep(POLL_S)

    def incarnations(self, r: int, members: list[int]) -> dict[int, int | None]:
        """The incarnation of each member that asked to join round r (`reqlife/R/G`; None if it did not say)."""
        return {g: int(self.store.get(f"reqlife/{r}/{g}")) if self.store.check([f"reqlife/{r}/{g}"]) else None
                for g in members}

    def decide(self, r: int, members: list[int], born: dict[int, int | None]) -> bool:
        """Commit round r iff every rank of every member reported ok (a dead member that never reports fails it). A
        member is dead for the round when its heartbeat stopped or when its agent restarted it (its incarnation is
        not the one that asked to join: the new one heartbeats, but it joins a later round and never reports this
        one, which members waiting for its gradient would otherwise wait for forever)."""
        keys = {(g, i): f"done/{r}/{g}/{i}" for g in members for i in range(self.ranks)}
        while True:
            done = {gi: self.store.get(k) for gi, k in keys.items() if self.store.check([k])}
            if any(v != b"1" for v in done.values()):
                return False
            if len(done) == len(keys):
                return True
            for g in members:
                if all((g, i) in done for i in range(self.ranks)):
                    continue
                restarted = born[g] is not None and self.store.add(f"life/{g}/0", 0) != born[g]
                # a process's first round (its first step: lazy initialisation, a heal) may hold its heartbeat thread
                # off for seconds (seen at step 1 on a busy 2-core machine): FIRST_ROUND_GRACE x the bound
                bound = self.heartbeat_s * (1 if self.proven.get(g) == born[g] else FIRST_ROUND_GRACE)
                if restarted or not self.alive(g, bound):  # the lighthouse's log says why the round fails
                    print(f"round {r}: group {g} " + ("was restarted" if restarted else
                                                      f"stopped heartbeating for {bound:g} s"), flush=True)
                    return False
            time.sleep(POLL_S)

    def heal_stats(self, r: int, g: int) -> dict | None:
        """Group g's heal in round r: the bytes and resent chunks of its ranks summed, the slowest rank's seconds."""
        keys = [f"heal/{r}/{g}/{i}" for i in range(self.ranks)]
        got = [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]
        if not got:
            return None
        return {"seconds": max(h["seconds"] for h in got), "bytes": sum(h["bytes"] for h in got),
                "retries": sum(h["retries"] for h in got)}

    def heal_failure(self, r: int, g: int) -> str | None:
        """Why group g's heal in round r failed (its first failing rank's one line), or None when no rank of it
        reported a failed heal. Waits until every rank of g reported its outcome or g stopped heartbeating: a rank
        writes `healfail/...` before `done/...`, and the sender's failure can end the round first."""
        done = [f"done/{r}/{g}/{i}" for i in range(self.ranks)]
        while not self.store.check(done) and self.alive(g):
            time.sleep(POLL_S)
        keys = [f"healfail/{r}/{g}/{i}" for i in range(self.ranks)]
        return next((self.store.get(k).decode() for k in keys if self.store.check([k])), None)

    def count_heals(self, r: int, step: int, members: list[int], behind: list[int], ok: bool) -> dict[str, dict]:
        """Round r's effect on the consecutive failed heals of each group; the groups it excludes (with their count
        and the last failure's reason), told to stop through the store and the launcher's marks."""
        excluded = {}
        for g in members:
            reason = self.heal_failure(r, g) if g in behind and not ok else None
            if reason is None:
                if ok:
                    self.failed_heals[g] = 0
                continue
            self.failed_heals[g] = self.failed_heals.get(g, 0) + 1
            if self.failed_heals[g] < self.heal_attempts:
                continue
            self.excluded.add(g)
            excluded[str(g)] = {"failed_heals": self.failed_heals[g], "reason": reason}
            line = (f"replica group {g} excluded at step {step} after {self.failed_heals[g]} consecutive failed "
                    f"heals (last: {reason})")
            if self.marks is not None:  # first, so the launcher stops the agent before the process hears it
                (self.marks / f"excluded-group{g}").write_text(line + "\n")
            self.store.set(f"excluded/{g}", line)
        return excluded

    def run(self) -> None:
        previous: list[int] | None = None  # who the next round waits for
        last: list[int] = list(range(self.groups))  # the members of the last committed step
        pg_id, members_of_pg = -1, None
        completed = 0
        r = 0
        with open(self.log, "a") as log:
            while completed < self.steps:
                req = self.close_round(r, previous)
                members = sorted(req)
                step = max(req.values()) + 1
                behind = [g for g in members if req[g] < step - 1]
                if members != members_of_pg or behind:
                    pg_id, members_of_pg = r, members
                quorum = {"members": members, "step": step, "behind": behind, "pg_id": pg_id}
                if self.reassign and len(members) < self.groups:  # who computes the missing groups' rows
                    quorum["rows"] = assign_rows(members, self.groups)
                self.store.set(f"quorum/{r}", json.dumps(quorum))
                self.store.add("round", 1)
                t0 = time.time()
                born = self.incarnations(r, members)
                ok = self.decide(r, members, born)
                self.store.set(f"commit/{r}", "1" if ok else "0")
                heal = {g: h for g in behind if (h := self.heal_stats(r, g)) is not None}
                dropped = sorted(set(last) - set(members)) if ok else []
                row = {"round": r, "step": step, "members": members, "behind": behind, "heal": heal,
                       "dropped": dropped, "committed": ok, "time": t0}
                if "rows" in quorum:
                    row["rows"] = quorum["rows"]
                if excluded := self.count_heals(r, step, members, behind, ok):
                    row["excluded"] = excluded
                if r == 0 and step > 1:  # every group loaded the checkpoint of step - 1: a whole-job resume
                    row["resumed_from"] = step - 1
                # its folder name and the layout it was written with; or (step 1) the imported weights' start checkpoint
                if r == 0 and self.store.check(["start"]):
                    row.update(json.loads(self.store.get("start")))
                log.write(json.dumps(row) + "\n")
                log.flush()
                if ok:
                    completed = step
                    previous = last = members
                    self.proven.update({g: born[g] for g in members})  # these incarnations have stepped
                else:
                    pg_id, members_of_pg = -1, None
                    previous = [g for g in members if g not in self.excluded and self.alive(g)]
                r += 1
        self.store.set("finished", "1")


def claim_node(address: str, timeout_s: float = 300.0) -> int:
    """A multi-node replica run: the index of a node other than the lighthouse's host (node 0): 1, 2, ... in the
    order the nodes' launchers reach the store at `address` (waiting up to `timeout_s` for it to be up)."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    return store.add("nodes", 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scaletrain.multinode.lighthouse")
    p.add_argument("--claim-node", metavar="HOST:PORT", default=None,
                   help="print this node's index in a multi-node replica run (its launcher asks) and exit")
    p.add_argument("--port", type=int)
    p.add_argument("--groups", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--heartbeat-s", type=float)
    p.add_argument("--ranks", type=int, default=1, help="processes per replica group")
    p.add_argument("--log")
    p.add_argument("--missing-rows", choices=("skip", "reassign"), default="skip", help="parallel.missing_rows")
    p.add_argument("--heal-attempts", type=int, default=3, help="consecutive failed heals that exclude a group")
    p.add_argument("--marks", default=None, help="folder for excluded-group{G} files (the launcher stops their agent)")
    p.add_argument("--linger-s", type=float, default=30.0, help="keep the store up after the run for late readers")
    args = p.parse_args(argv)
    if args.claim_node is not None:
        print(claim_node(args.claim_node))
        return 0
    if None in (args.port, args.groups, args.steps, args.heartbeat_s, args.log):
        p.error("--port, --groups, --steps, --heartbeat-s and --log are required")
    # the store's server listens on every interface (groups of a multi-node run connect from other machines)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))
    store.add("round", 0)
    Lighthouse(store, args.groups, args.steps, args.heartbeat_s, Path(args.log), ranks=args.ranks,
               heal_attempts=args.heal_attempts, marks=Path(args.marks) if args.marks else None,
               reassign=args.missing_rows == "reassign").run()
    time.sleep(args.linger_s)  # groups still read `finished` and their commit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
