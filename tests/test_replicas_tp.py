"""Fault-tolerant replica groups with tensor parallelism inside (parallel.replicas = 2, parallel.dp = 2,
parallel.tp = 2: 2 groups x 2 tp ranks, world 4; docs/fault_tolerance.md). Rank I of every member adds its own tp
slice's gradient in member order, each group clips by the whole model's norm (reduced over its tp ranks), a killed
group heals rank by rank (each rank its tp slice, from the same local rank of the live group). The run ends
bit-equal in both groups and equal to the whole-width replay of its membership log within docs/verify.md's fp64
bound for layouts against one process (rtol 1e-9, atol 1e-11, element-wise; set before measuring)."""

import json

import pytest
import torch

from scaletrain.cli import main
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.replica_replay import load_log
from tests.harness import TINY, train_reference
from tests.test_replicas import _finals, _group_steps, _max_diff, _sets, _train, _within_tp_bound

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = {**TINY, "train.global_batch": 8, "train.micro_batch": 2, "train.grad_clip": 0.5, "train.report": False,
         "train.lr_schedule": "constant"}  # the same learning rate at step 4 of a 4-step and a 10-step run
RUN = {**MODEL, "parallel.dp": 2, "parallel.tp": 2, "parallel.replicas": 2, "parallel.heartbeat_s": 2.0}



def test_tp_groups_start_from_a_dp1_checkpoint_a_killed_group_heals_and_the_run_equals_its_replay(tmp_path, capsys):
    out = tmp_path / "run"
    # one process trains steps 1-2 and checkpoints step 2; the replica groups start from it with --reshard
    assert main(["train", "--out", str(out), *_sets({**MODEL, "train.steps": 2, "train.checkpoint_every": 2})]) == 0
    # 14 steps: steps without group 0 take >= 3 s, so its restart has >= 27 s to come back; the steps after the heal
    # are fast
    run = {**RUN, "train.steps": 14, "train.checkpoint_every": 4, "train.keep_checkpoints": 100}
    # group 0's tp rank 1 is SIGKILLed after joining step 5's quorum (its agent stops rank 0 and restarts both);
    # both tp ranks of group 1 corrupt the first chunk of the heal they send once
    p = _train(out, run, "kill:0:5,corrupt:1:0", "--restarts", "1", "--reshard", pace=3.0)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_log(out)
    assert rows[0]["resumed_from"] == 2  # the log records the start: the checkpoint of step 2, of one process
    assert rows[0]["checkpoint"] == "step_00000002" and rows[0]["from_layout"].endswith("(1 process)")
    start = [json.loads(x) for x in (out / "resumes.jsonl").read_text().splitlines()][-1]
    assert start["from_step"] == 2 and start["layout"]["to"] != start["layout"]["from"]
    committed = [r for r in rows if r["committed"]]
    assert [r["step"] for r in committed] == list(range(3, 15))
    assert any(0 in r["dropped"] and r["step"] >= 5 for r in committed)  # dropped once killed, the run went on
    drop = next(r["step"] for r in committed if 0 in r["dropped"])
    back = [r for r in committed if r["step"] > drop and 0 in r["members"]]
    assert back and all(r["members"] == [0, 1] for r in back)  # back through a heal from group 1, to the end
    # the heal's stats are logged with its round when that round commits (under heavy load the first heal round can
    # time out after the state was loaded: the group is then caught up in the next round, no second transfer)
    for r in committed:
        if "0" in r["heal"]:  # one corrupted chunk per tp rank, each detected and resent
            assert r["heal"]["0"]["retries"] == 2 and r["heal"]["0"]["bytes"] > 0
    for g in (0, 1):
        assert _group_steps(out, g) == [r["step"] for r in committed if g in r["members"]]
    finals = _finals(out)
    assert sorted(finals) == ["final-group0", "final-group1"]
    assert _max_diff(finals["final-group0"], finals["final-group1"]) == 0.0  # the healed group is bit-equal
    # the clip was active (grad_clip 0.5): a norm left unreduced over tp would change the run
    norms = [json.loads(x)["grad_norm"] for x in (out / "replicas" / "group1.jsonl").read_text().splitlines()]
    assert max(norms) > run["train.grad_clip"]
    # steps 3-4 had both groups: the step-4 checkpoint (written by the lowest member's 2 tp ranks, a plain one) is
    # the single-process run continued from step 2 (fp64 bound of docs/verify.md)
    four = ckpt.read_tensors(ckpt.checkpoint_dirs.step_dir(out / "checkpoints", 4))
    _, ref = train_reference({**MODEL, "train.steps": 4})
    assert _within_tp_bound(ref, four)
    last = ckpt.read_tensors(ckpt.latest(out / "checkpoints"))
    assert all(torch.equal(last[k], finals["final-group0"][k]) for k in last)
    # scaletrain replay: from the step-2 checkpoint through the membership log, within verify's fp64 bound
    capsys.readouterr()
    assert main(["replay", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    print(f"gradient norms {min(norms):.3g} .. {max(norms):.3g}; step 4 vs one process: largest parameter "
          f"difference {_max_diff({k: ref[k] for k in four}, four):.3g}; replay vs run: "
          f"{max(summary['max_abs_diff'].values()):.3g}")
    assert summary["pass"] and summary["heals"][0]["group"] == 0


def test_replay_of_a_run_started_from_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    """A run that started from the checkpoint of step 2 (`--reshard`) cannot be replayed once that checkpoint is
    gone: one line naming it, exit 2."""
    from scaletrain.config import load_config

    out = tmp_path / "run"
    (out / "replicas").mkdir(parents=True)
    (out / "config.yaml").write_text(load_config(None, [f"{k}={v}" for k, v in RUN.items()]).to_yaml())
    row = {"round": 0, "step": 3, "members": [0, 1], "behind": [], "heal": {}, "dropped": [], "committed": True,
           "time": 0.0, "resumed_from": 2}
    (out / "membership.jsonl").write_text(json.dumps(row) + "\n")
    torch.save({"step": 3, "params": {}}, out / "replicas" / "final-group0.pt")
    assert main(["replay", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "started from the checkpoint of step 2" in err and len(err.strip().splitlines()) == 1
