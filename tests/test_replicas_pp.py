"""Fault-tolerant replica groups with pipeline parallelism inside (parallel.replicas = 2, parallel.dp = 2,
parallel.pp = 2, schedule 1f1b, tied embeddings: 2 groups x 2 stages, world 4; docs/fault_tolerance.md). Stage I of
every member adds its own stage's gradients in member order (the tied embedding's gradient already summed across
the pipeline by the engine, on stage 0, before the cross-group sum), each group clips by the whole model's norm
(reduced over its two stages), a killed group heals stage by stage (each stage's parameters and optimizer state,
from the same stage of the live group). The run ends bit-equal in both groups and equal to the one-process replay of
its membership log within docs/verify.md's fp64 bound for layouts against one process (rtol 1e-9, atol 1e-11,
element-wise; set before measuring)."""

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
         "train.lr_schedule": "constant", "model.tie_embeddings": True}  # step 3 equal in a 3- and an 8-step run
RUN = {**MODEL, "parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.replicas": 2,
       "parallel.heartbeat_s": 2.0}



def test_pp_groups_a_killed_group_heals_stage_by_stage_and_the_run_equals_its_replay(tmp_path, capsys):
    out = tmp_path / "run"
    # one process trains steps 1-2 and checkpoints step 2; the replica groups start from it with --reshard
    assert main(["train", "--out", str(out), *_sets({**MODEL, "train.steps": 2, "train.checkpoint_every": 2})]) == 0
    # 12 steps: steps without group 0 take >= 3 s, so its restart has >= 24 s to come back (one took 15+ s at load
    # 10-17); the steps after the heal are fast
    run = {**RUN, "train.steps": 12, "train.checkpoint_every": 3, "train.keep_checkpoints": 100}
    # group 0's stage 1 is SIGKILLed after joining step 4's quorum (its agent stops stage 0 and restarts both);
    # both stages of group 1 corrupt the first chunk of the heal they send once
    p = _train(out, run, "kill:0:4,corrupt:1:0", "--restarts", "1", "--reshard", pace=3.0)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_log(out)
    assert rows[0]["resumed_from"] == 2 and rows[0]["from_layout"].endswith("(1 process)")
    committed = [r for r in rows if r["committed"]]
    assert [r["step"] for r in committed] == list(range(3, 13))
    # dropped once killed, the run went on (under load a group can also miss a round at the start and heal)
    drop = next(r["step"] for r in committed if 0 in r["dropped"] and r["step"] >= 4)
    back = [r for r in committed if r["step"] > drop and 0 in r["members"]]
    assert back and all(r["members"] == [0, 1] for r in back)  # back through a heal from group 1, to the end
    # a heal's stats are logged with its round when that round commits: one corrupted chunk per stage, each
    # detected and resent (under heavy load the first heal round can time out after the state was loaded: the group
    # is then caught up in the next round without a second transfer, and a later heal is sent uncorrupted)
    healed = [r["heal"]["0"] for r in committed if "0" in r["heal"]]
    assert all(h["bytes"] > 0 and h["retries"] in (0, 2) for h in healed)
    for g in (0, 1):  # the rows each group's logging rank wrote (its stages' loss, gathered to stage 0)
        assert _group_steps(out, g) == [r["step"] for r in committed if g in r["members"]]
    finals = _finals(out)
    assert sorted(finals) == ["final-group0", "final-group1"]
    assert _max_diff(finals["final-group0"], finals["final-group1"]) == 0.0  # the healed group is bit-equal
    group1 = [json.loads(x) for x in (out / "replicas" / "group1.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in group1]
    assert max(norms) > run["train.grad_clip"]  # the clip acts: a norm of one stage only would change the run
    # step 3 had both groups: the step-3 checkpoint (written by both stages of the lowest member) is the
    # single-process run of 3 steps, loss and parameters (fp64 bound of docs/verify.md)
    three = ckpt.read_tensors(ckpt.checkpoint_dirs.step_dir(out / "checkpoints", 3))
    ref_losses, ref = train_reference({**MODEL, "train.steps": 3})
    assert set(ref) - set(three) == {"lm_head.weight"}  # the tied copy is saved once, as wte.weight
    assert _within_tp_bound(ref, three)
    for r in group1[:1]:
        assert abs(r["loss"] - ref_losses[r["step"]]) <= 1e-11 + 1e-9 * abs(ref_losses[r["step"]])
    last = ckpt.read_tensors(ckpt.latest(out / "checkpoints"))
    assert all(torch.equal(last[k], finals["final-group0"][k]) for k in last)
    # scaletrain replay: from the step-2 checkpoint, every committed round recomputed in one process, within
    # verify's fp64 bound
    capsys.readouterr()
    assert main(["replay", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    print(f"gradient norms {min(norms):.3g} .. {max(norms):.3g}; step 3 vs one process: largest parameter "
          f"difference {_max_diff({k: ref[k] for k in three}, three):.3g}; replay vs run: "
          f"{max(summary['max_abs_diff'].values()):.3g}")
    assert summary["pass"] and summary["heals"][0]["group"] == 0
