"""Fault-tolerant replica groups with tensor parallelism inside (parallel.replicas = 2, parallel.dp = 2,
parallel.tp = 2: 2 groups x 2 tp ranks, world 4; docs/fault_tolerance.md). Rank I of every member adds its own tp
slice's gradient in member order, each group clips by the whole model's norm (reduced over its tp ranks), a killed
group heals rank by rank (each rank its tp slice, from the same local rank of the live group). The run ends
bit-equal in both groups and equal to the whole-width replay of its membership log within docs/verify.md's fp64
bound for layouts against one process (rtol 1e-9, atol 1e-11, element-wise; set before measuring)."""

import json

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.replica_replay import TP_ATOL, TP_RTOL, load_log, replay_rounds
from tests.harness import TINY
from tests.test_replicas import _finals, _group_steps, _max_diff, _train

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = {**TINY, "train.global_batch": 8, "train.micro_batch": 2, "train.checkpoint_every": 0, "parallel.dp": 2,
       "parallel.tp": 2, "parallel.replicas": 2, "parallel.heartbeat_s": 2.0, "train.grad_clip": 0.5}


def _within(a: dict, b: dict) -> bool:
    return all(bool(((a[k] - b[k]).abs() <= TP_ATOL + TP_RTOL * a[k].abs()).all()) for k in b)


def test_tp_group_killed_heals_rank_by_rank_and_the_run_equals_its_replay(tmp_path):
    out = tmp_path / "run"
    run = {**RUN, "train.steps": 8, "train.checkpoint_every": 4, "train.report": False}
    # group 0's tp rank 1 is SIGKILLed after joining step 3's quorum (its agent stops rank 0 and restarts both);
    # both tp ranks of group 1 corrupt the first chunk of the heal they send once
    p = _train(out, run, "kill:0:3,corrupt:1:0", "--restarts", "1", pace=2.0)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_log(out)
    committed = [r for r in rows if r["committed"]]
    assert [r["step"] for r in committed] == list(range(1, 9))
    assert any(0 in r["dropped"] and r["step"] >= 3 for r in committed)  # dropped once killed, the run went on
    healed = [r for r in committed if 0 in r["behind"] and r["step"] > 3]
    assert len(healed) == 1 and healed[0]["members"] == [0, 1]  # back through one heal from group 1
    heal = healed[0]["heal"]["0"]
    assert heal["retries"] == 2 and heal["bytes"] > 0  # one corrupted chunk per tp rank, each detected and resent
    for g in (0, 1):
        assert _group_steps(out, g) == [r["step"] for r in committed if g in r["members"]]
    finals = _finals(out)
    assert sorted(finals) == ["final-group0", "final-group1"]
    assert _max_diff(finals["final-group0"], finals["final-group1"]) == 0.0  # the healed group is bit-equal
    cfg = load_config(out / "config.yaml")
    replayed = replay_rounds(cfg, rows)
    print(f"replay vs run: largest parameter difference {_max_diff(replayed, finals['final-group0']):.3g}")
    assert _within(replayed, finals["final-group0"])
    # the clip was active (grad_clip 0.5): a norm left unreduced over tp would change the run
    norms = [json.loads(x)["grad_norm"] for x in (out / "replicas" / "group1.jsonl").read_text().splitlines()]
    print(f"gradient norms {min(norms):.3g} .. {max(norms):.3g}")
    assert max(norms) > run["train.grad_clip"]
    # the step-4 checkpoint (written by the lowest member's 2 tp ranks) is a plain one: it equals the replay of 1-4
    four = ckpt.read_tensors(ckpt.checkpoint_dirs.step_dir(out / "checkpoints", 4))
    assert _within(replay_rounds(cfg, [r for r in rows if r["step"] <= 4]), four)
    last = ckpt.read_tensors(ckpt.latest(out / "checkpoints"))
    assert all(torch.equal(last[k], finals["final-group0"][k]) for k in last)
