"""Fault-tolerant replica groups of two processes each (parallel.replicas = 2, parallel.dp = 4, parallel.zero = 2;
docs/fault_tolerance.md): every group is ZeRO-2 over its own 2 ranks, the members' shards are added per local rank in
member order. The replay's arithmetic for such groups equals the plain one-process Trainer; a run where one group's
rank is SIGKILLed, the group restarts and heals rank by rank from the same local rank of the live group (through a
corrupted chunk, detected and resent) ends bit-equal in both groups and equal to the replay of its membership log,
and its checkpoints (written by the lowest member's two ranks) equal the replay at their steps."""

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.replica_replay import TOLERANCE, load_log, replay_rounds
from tests.harness import TINY, train_reference
from tests.test_replicas import _finals, _group_steps, _max_diff, _train

pytestmark = pytest.mark.usefixtures("one_thread")  # the groups' one thread each: the replay adds as they do

RUN = {**TINY, "train.global_batch": 8, "train.micro_batch": 1, "train.checkpoint_every": 0, "parallel.dp": 4,
       "parallel.replicas": 2, "parallel.zero": 2, "parallel.heartbeat_s": 2.0}


def test_replay_of_zero2_groups_with_full_quorums_equals_the_single_process_trainer():
    """2 groups x 2 ZeRO-2 ranks, both groups in every step (the replay's per-micro-batch rank sums, then the
    groups' ordered sum) is the one-process Trainer on the whole batch (fp64, bound 1e-12)."""
    cfg = load_config(None, [f"{k}={v}" for k, v in RUN.items()])
    rows = [{"step": s, "members": [0, 1], "committed": True} for s in range(1, cfg.train.steps + 1)]
    _, ref = train_reference({k: v for k, v in RUN.items() if not k.startswith("parallel.")})
    assert _max_diff(replay_rounds(cfg, rows), ref) <= 1e-12


def test_zero2_group_killed_heals_rank_by_rank_and_the_run_equals_its_replay(tmp_path):
    out = tmp_path / "run"
    run = {**RUN, "train.steps": 12, "train.checkpoint_every": 1, "train.keep_checkpoints": 100,
           "train.report": False}
    # group 0's rank 1 is SIGKILLed after joining step 3's quorum (its agent stops rank 0 and restarts both);
    # both ranks of group 1 corrupt the first chunk of the heal they send once
    p = _train(out, run, "kill:0:3,corrupt:1:0", "--restarts", "1", pace=4.0)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_log(out)
    committed = [r for r in rows if r["committed"]]
    assert [r["step"] for r in committed] == list(range(1, 13))
    assert any(0 in r["dropped"] and r["step"] >= 3 for r in committed)  # dropped once killed, the run went on
    healed = [r for r in committed if 0 in r["behind"] and r["step"] > 3]
    assert len(healed) == 1 and healed[0]["members"] == [0, 1]  # back through a heal from group 1
    heal = healed[0]["heal"]["0"]
    assert heal["retries"] == 2 and heal["bytes"] > 0  # one corrupted chunk per rank, each detected and resent
    for g in (0, 1):  # each group logged exactly the committed steps it was a member of
        assert _group_steps(out, g) == [r["step"] for r in committed if g in r["members"]]
    finals = _finals(out)
    assert sorted(finals) == ["final-group0", "final-group1"]
    assert _max_diff(finals["final-group0"], finals["final-group1"]) == 0.0  # the healed group is bit-equal
    cfg = load_config(out / "config.yaml")
    diff = _max_diff(replay_rounds(cfg, rows), finals["final-group0"])
    print(f"replay vs run: largest parameter difference {diff:.3g}")
    assert diff <= TOLERANCE
    # checkpoints by the lowest member's 2 ranks (each its ZeRO shard): step 2 equals the replay of
    # steps 1-2, the last one the groups' final parameters
    two = ckpt.read_tensors(ckpt.checkpoint_dirs.step_dir(out / "checkpoints", 2))
    replayed = replay_rounds(cfg, [r for r in rows if r["step"] <= 2])
    assert max(float((two[k] - replayed[k]).abs().max()) for k in two) <= TOLERANCE
    writers = [ckpt.read_meta(ckpt.checkpoint_dirs.step_dir(out / "checkpoints", s))["replicas"]["writer"]
               for s in range(1, 13)]
    assert writers == [r["members"][0] for r in committed]
    last = ckpt.read_tensors(ckpt.latest(out / "checkpoints"))
    assert all(torch.equal(last[k], finals["final-group0"][k]) for k in last)
