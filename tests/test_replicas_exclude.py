"""A replica group whose heal fails every time is excluded and the run goes on (parallel.heal_attempts;
docs/fault_tolerance.md). Group 0 of 2 (one process each, fp64) is SIGKILLed at step 2 and restarted by its agent;
group 1, the only heal source, corrupts every chunk of every heal it sends (`corrupt:1:all`), so every heal of group 0
fails its checksums. After `heal_attempts` = 2 failed heals in a row the lighthouse excludes group 0: the membership
log names it, its process stops with a one-line error, its agent is stopped (not restarted again although --restarts
allows more), group 1 finishes every step alone and its final parameters equal `scaletrain replay` of the log.
Without the exclusion the live group fails every round with the heal and the run stalls: the run is given a timeout
(STALL_S) well above what it needs, so that stall fails the test."""

import json
import os
import signal
import subprocess
import sys

import pytest

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.report.page import Text
from scaletrain.report.replicas import replicas_section
from scaletrain.report.run_data import RunData
from tests.harness import TINY
from tests.test_replicas import _group_steps, _sets

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 14
RUN = {**TINY, "train.steps": STEPS, "train.global_batch": 4, "train.checkpoint_every": 0, "parallel.dp": 2,
       "parallel.replicas": 2, "parallel.heartbeat_s": 2.0, "parallel.heal_attempts": 2, "train.report": False}
STALL_S = 150  # the run takes 20 to 70 s on the loaded 2-core box (mostly process starts); a stalled one: never


def _train_or_stall(out, overrides: dict, fault: str, *extra: str, pace: float) -> subprocess.CompletedProcess:
    """`scaletrain train` with a fault drill; a run still going after STALL_S is interrupted (SIGINT: the launcher
    stops its lighthouse and agents) and the test fails as stalled."""
    env = {**os.environ, "SCALETRAIN_FT_FAULT": fault, "SCALETRAIN_FT_PACE_S": str(pace)}
    cmd = [sys.executable, "-m", "scaletrain", "train", "--out", str(out), *_sets(overrides), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=STALL_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the replica run stalled (still going after {STALL_S} s):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_group_whose_heal_always_fails_is_excluded_and_the_others_finish_equal_to_the_replay(tmp_path, capsys):
    out = tmp_path / "run"
    # steps without every group take >= 3 s while a missing group is not excluded: the restart finds the run going
    p = _train_or_stall(out, RUN, "kill:0:2,corrupt:1:all", "--restarts", "3", pace=3.0)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (out / "membership.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["committed"]] == list(range(1, STEPS + 1))
    ex = [i for i, r in enumerate(rows) if "excluded" in r]
    assert len(ex) == 1
    row = rows[ex[0]]
    assert list(row["excluded"]) == ["0"] and row["excluded"]["0"]["failed_heals"] == 2
    assert "chunk 0 failed its checksum 3 times" in row["excluded"]["0"]["reason"]  # every resend was corrupt
    # exactly heal_attempts rounds had group 0 behind, each failed; none after it was excluded has it
    healing = [r for r in rows if 0 in r["behind"]]
    assert len(healing) == 2 and not any(r["committed"] for r in healing) and healing[-1] is row
    assert all(0 not in r["members"] for r in rows[ex[0] + 1:])
    drop = next(r["step"] for r in rows if r["committed"] and r["dropped"] == [0])
    assert all(r["members"] == [1] for r in rows if r["committed"] and r["step"] >= drop)
    assert _group_steps(out, 1) == list(range(1, STEPS + 1))  # the live group never stopped
    assert _group_steps(out, 0) == list(range(1, drop))
    # the excluded process stopped with one line naming the reason; its agent did not go on restarting it
    said = [x for x in (out / "logs" / "group0.log").read_text().splitlines() if "excluded at step" in x]
    assert said and len(said) <= 2  # the first incarnation's, at most one more restarted before the agent stopped
    assert said[0].startswith("scaletrain: error: replica group 0 excluded at step")
    assert "failed its checksum" in said[0]
    assert "replica group 0 excluded after 2 consecutive failed heals" in p.stdout
    assert sorted(f.name for f in (out / "replicas").glob("final-*.pt")) == ["final-group1.pt"]
    # the run report's fault-tolerance section (report/replicas.py; the launcher writes it with train.report)
    cfg = load_config(out / "config.yaml")
    said = [b.text for b in replicas_section(RunData(out, cfg, [])).blocks if isinstance(b, Text)]
    assert any(f"Replica group 0 was excluded at step {row['step']} after 2 consecutive failed heals" in x
               for x in said)
    # scaletrain replay: the committed rounds (group 0's steps 1..drop-1, group 1 alone after) equal the run
    capsys.readouterr()
    assert main(["replay", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["pass"] and [e["group"] for e in summary["excluded"]] == [0]
    resumed = next(r for r in rows[ex[0] + 1:] if r["committed"])  # the first step committed after it
    print(f"excluded at step {row['step']} (dropped at {drop}); first failed heal to the next committed step: "
          f"{resumed['time'] - healing[0]['time']:.2f} s; replay vs run: {max(summary['max_abs_diff'].values()):.3g}")


@pytest.mark.parametrize("sets, message", [
    ({"parallel.heal_attempts": 0}, "parallel.heal_attempts must be >= 1, got 0"),
    ({"parallel.heal_attempts": -1}, "parallel.heal_attempts must be >= 1, got -1"),
])
def test_heal_attempts_refused_where_it_cannot_work(tmp_path, capsys, sets, message):
    """Below 1 (with replicas = 1 the key is refused as ignored: tests/test_ignored_settings.py)."""
    assert main(["train", "--out", str(tmp_path / "o"), *_sets({**RUN, **sets})]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_heal_attempts_is_accepted_with_replicas():
    cfg = load_config(None, [f"{k}={v}" for k, v in {**RUN, "parallel.heal_attempts": 5}.items()])
    from scaletrain.config import validate

    assert validate(cfg, 2).parallel.heal_attempts == 5


def test_lighthouse_excludes_after_consecutive_failed_heals_only(tmp_path):
    """The lighthouse's count, without processes (groups of 2 ranks; the heal fails on rank 1 only): a failed heal
    counts, a round the group commits resets the count, a round that failed for another reason (no heal failure
    reported) leaves it; the third failure in a row excludes the group (marked for the launcher, told through the
    store) and its later requests are ignored."""
    import torch.distributed as dist

    from scaletrain.multinode.lighthouse import Lighthouse

    store = dist.HashStore()
    lh = Lighthouse(store, 3, 20, 5.0, tmp_path / "membership.jsonl", ranks=2, heal_attempts=3, marks=tmp_path)

    def round_(r: int, reason: str | None, ok: bool) -> dict:  # group 2 behind in round r, groups 0 and 1 live
        for g in (0, 1, 2):
            for i in (0, 1):
                store.set(f"done/{r}/{g}/{i}", "1" if ok else "0")
        if reason is not None:
            store.set(f"healfail/{r}/2/1", reason)
        return lh.count_heals(r, 5, [0, 1, 2], [2], ok)

    assert round_(0, "chunk 0 failed its checksum 3 times", False) == {} and lh.failed_heals[2] == 1
    assert round_(1, None, False) == {} and lh.failed_heals[2] == 1  # a member died mid-step: not the heal's fault
    assert round_(2, "bad chunk", False) == {} and lh.failed_heals[2] == 2
    assert round_(3, None, True) == {} and lh.failed_heals[2] == 0  # healed and committed
    assert round_(4, "bad", False) == {} and round_(5, "bad", False) == {}
    assert not (tmp_path / "excluded-group2").exists()
    assert round_(6, "the received state does not load: size mismatch", False) == {
        "2": {"failed_heals": 3, "reason": "the received state does not load: size mismatch"}}
    said = store.get("excluded/2").decode()
    assert said == (tmp_path / "excluded-group2").read_text().strip()
    assert said.startswith("replica group 2 excluded at step 5 after 3 consecutive failed heals (last: the received")
    for g in (0, 1, 2):
        store.set(f"req/7/{g}", "5")
    assert lh._requests(7) == {0: 5, 1: 5}


def test_every_rank_of_an_excluded_group_stops_with_the_lighthouse_line():
    """A group of 2 ranks: local rank 0 meets the exclusion when it asks to join and hands the line to rank 1
    (distributed/quorum.py), so both stop with it (GroupExcluded: one line, exit 2)."""
    from datetime import timedelta

    import torch.distributed as dist

    from scaletrain.distributed.launch import free_port
    from scaletrain.distributed.quorum import GroupExcluded, QuorumClient

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    host.add("round", 0)
    line = "replica group 0 excluded at step 4 after 3 consecutive failed heals (last: bad chunk)"
    host.set("excluded/0", line)
    clients = [QuorumClient(f"127.0.0.1:{port}", 0, 5.0, 10.0, local_rank=i) for i in (0, 1)]
    try:
        for c in clients:  # rank 0 first: it hands the line on; rank 1 reads it
            with pytest.raises(GroupExcluded) as e:
                c.join(2)
            assert str(e.value) == line + "; the other groups go on without it"
        assert not host.check(["req/0/0"])  # an excluded group does not ask again
    finally:
        for c in clients:
            c.close()
