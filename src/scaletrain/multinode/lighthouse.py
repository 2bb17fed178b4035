"""The lighthouse of fault-tolerant replica groups: hosts the store, decides each round's quorum and commit, and
writes the membership log (torchft's Lighthouse, github.com/pytorch/torchft; protocol in distributed/quorum.py).

Run by the replica launcher (multinode/replicas.py) as `python -m scaletrain.multinode.lighthouse`. A group is
alive while its heartbeat counter moves; one whose counter has not moved for `heartbeat_s` is dead (killed, frozen
by SIGSTOP, or its machine gone). A round closes when each member of the previous quorum has asked to join or is
dead (the first round: when every group has asked, or `start_s` passed), so a dead group is dropped within the
heartbeat bound and never stalls the others. The membership log `OUT/membership.jsonl` has one line per round:
round, step, members, behind (healed), each heal's seconds, bytes and resent chunks, dropped groups,
committed, and on the first row of a launch that resumed from a checkpoint `resumed_from` (its step; the rows of
later steps before it were recomputed, multinode/replicas.py `effective_rows`). `scaletrain replay --out OUT`
recomputes the committed rounds in one process (train/replica_replay.py).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

POLL_S = 0.002


class Lighthouse:
    def __init__(self, store: dist.Store, groups: int, steps: int, heartbeat_s: float, log: Path,
                 start_s: float = 120.0):
        self.store, self.groups, self.steps, self.heartbeat_s = store, groups, steps, heartbeat_s
        self.log, self.start_s = log, start_s
        self.beats: dict[int, tuple[int, float]] = {}  # group -> (counter, when it last moved)

    def alive(self, g: int) -> bool:
        now = time.monotonic()
        count = self.store.add(f"hb/{g}", 0)
        last = self.beats.get(g)
        if last is None or count != last[0]:
            self.beats[g] = (count, now)
            return count > 0
        return now - last[1] < self.heartbeat_s

    def _requests(self, r: int) -> dict[int, int]:
        keys = {g: f"req/{r}/{g}" for g in range(self.groups)}
        return {g: int(self.store.get(k)) for g, k in keys.items() if self.store.check([k])}

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

    def decide(self, r: int, members: list[int]) -> bool:
        """Commit round r iff every member reported ok (a dead member that never reports fails it)."""
        while True:
            done = {g: self.store.get(f"done/{r}/{g}") for g in members if self.store.check([f"done/{r}/{g}"])}
            if any(v != b"1" for v in done.values()):
                return False
            if len(done) == len(members):
                return True
            if any(not self.alive(g) for g in members if g not in done):
                return False
            time.sleep(POLL_S)

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
                self.store.set(f"quorum/{r}", json.dumps({"members": members, "step": step, "behind": behind,
                                                          "pg_id": pg_id}))
                self.store.add("round", 1)
                t0 = time.time()
                ok = self.decide(r, members)
                self.store.set(f"commit/{r}", "1" if ok else "0")
                heal = {g: json.loads(self.store.get(f"heal/{r}/{g}")) for g in behind
                        if self.store.check([f"heal/{r}/{g}"])}
                dropped = sorted(set(last) - set(members)) if ok else []
                row = {"round": r, "step": step, "members": members, "behind": behind, "heal": heal,
                       "dropped": dropped, "committed": ok, "time": t0}
                if r == 0 and step > 1:  # every group loaded the checkpoint of step - 1: a whole-job resume
                    row["resumed_from"] = step - 1
                log.write(json.dumps(row) + "\n")
                log.flush()
                if ok:
                    completed = step
                    previous = last = members
                else:
                    pg_id, members_of_pg = -1, None
                    previous = [g for g in members if self.alive(g)]
                r += 1
        self.store.set("finished", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scaletrain.multinode.lighthouse")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--heartbeat-s", type=float, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--linger-s", type=float, default=30.0, help="keep the store up after the run for late readers")
    args = p.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))
    store.add("round", 0)
    Lighthouse(store, args.groups, args.steps, args.heartbeat_s, Path(args.log)).run()
    time.sleep(args.linger_s)  # groups still read `finished` and their commit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
