"""parallel.missing_rows=reassign (docs/fault_tolerance.md, "The missing group's share of the batch"): while a replica
group is dead, the live groups compute its rows (round-robin, distributed/rows.py), so every step uses the whole
global batch and is the mean over all R groups' rows at the usual learning rate. A run where one of 3 groups is
SIGKILLed, restarts and heals therefore ends where an uninterrupted run of the same config ends (fp64, an independent
plain loop: tests/harness.py `train_reference_rules`), and equal to the replay of its membership log, which records
who computed which rows."""

import json

import pytest

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.distributed.rows import assign_rows
from scaletrain.report.page import Table
from scaletrain.report.replicas import replicas_section
from scaletrain.report.run_data import RunData
from scaletrain.train.replica_replay import TOLERANCE, TP_ATOL, TP_RTOL, load_log, replay_rounds
from tests.harness import TINY, train_reference_rules
from tests.test_replicas import _finals, _group_steps, _max_diff, _sets, _train

pytestmark = pytest.mark.usefixtures("one_thread")  # in-process references and replays on one thread, as each group

HEARTBEAT_S = 2.0
STEPS = 16  # the kill at step 3 leaves 13 paced steps (>= 2 s each) for the restart: ~26 s of margin
RUN = {**TINY, "train.global_batch": 6, "train.steps": STEPS, "train.checkpoint_every": 0, "parallel.dp": 3,
       "parallel.replicas": 3, "parallel.heartbeat_s": HEARTBEAT_S, "parallel.missing_rows": "reassign",
       "train.grad_clip": 0.5}  # the clip acts (logged norms 2-2.7), as in the tp and pp drills


def _within(ref: dict, got: dict) -> bool:
    """docs/verify.md's fp64 bound for a layout against one process: |got - ref| <= 1e-11 + 1e-9 |ref|, each element
    (set before measuring)."""
    return all(bool(((ref[k] - got[k]).abs() <= TP_ATOL + TP_RTOL * ref[k].abs()).all()) for k in ref)


@pytest.fixture(scope="module")
def plain():
    """The uninterrupted run of the same config: a plain loop over the whole global batch each step (no engine)."""
    return train_reference_rules(RUN, ("sync",) * STEPS)


def test_missing_groups_rows_go_round_robin_to_the_live_members():
    assert assign_rows([0, 1, 2], 3) == {"0": [0], "1": [1], "2": [2]}
    assert assign_rows([1, 2], 3) == {"1": [1, 0], "2": [2]}
    assert assign_rows([1, 3], 5) == {"1": [1, 0, 4], "3": [3, 2]}  # spread: no member takes two more than another
    assert assign_rows([4], 5) == {"4": [4, 0, 1, 2, 3]}
    for members in ([0], [2, 5], [0, 3, 6, 7]):
        rows = assign_rows(members, 8)
        assert sorted(g for v in rows.values() for g in v) == list(range(8))  # every group's rows exactly once
        loads = [len(v) for v in rows.values()]
        assert max(loads) - min(loads) <= 1


def test_replay_of_reassigned_rows_equals_the_plain_loop(plain):
    """The arithmetic alone (no lighthouse): steps 3-5 computed by groups 1 and 2, group 1 also on group 0's rows,
    divided by R = 3, is the whole-batch step of one process."""
    cfg = load_config(None, [f"{k}={v}" for k, v in RUN.items()])
    moved = {"1": [1, 0], "2": [2]}
    rows = [{"step": s, "members": [0, 1, 2] if s < 3 or s > 5 else [1, 2], "committed": True,
             **({"rows": moved} if 3 <= s <= 5 else {})} for s in range(1, STEPS + 1)]
    assert _within(plain[1], replay_rounds(cfg, rows))


def test_reassigned_rows_of_an_moe_model_with_dropout_draw_the_missing_groups_random_numbers():
    """MoE (router noise, random routing, expert dropout) and dropout are keyed by (seed, step, global row): a member
    computing group 0's rows draws group 0's numbers, so with 3 groups the step where group 1 computes groups 1 and 0
    (g1 + g0, which is g0 + g1 exactly) then + g2 is bit-equal to the step of the full quorum. Keyed by the computing
    member's own rows instead, it is not."""
    moe = {**RUN, "train.steps": 3, "model.moe.experts": 4, "model.moe.group_tokens": 16,
           "model.moe.router_noise": 0.1, "model.moe.random_routing": True, "model.moe.expert_dropout": 0.1,
           "model.dropout": 0.1}
    cfg = load_config(None, [f"{k}={v}" for k, v in moe.items()])
    full = [{"step": s, "members": [0, 1, 2], "committed": True} for s in (1, 2, 3)]
    moved = [{**r, "members": [1, 2], "rows": {"1": [1, 0], "2": [2]}} if r["step"] == 2 else r for r in full]
    assert _max_diff(replay_rounds(cfg, full), replay_rounds(cfg, moved)) == 0.0


def test_reassigned_run_through_a_kill_and_heal_equals_the_uninterrupted_run_and_its_replay(tmp_path, capsys, plain):
    out = tmp_path / "run"
    # group 0 is SIGKILLed after joining step 3's quorum and restarted (--restarts 1); steps without every group take
    # >= 2 s so that the restart finds the run still going; it heals from group 1 and rejoins
    p = _train(out, {**RUN, "train.report": False}, "kill:0:3", "--restarts", "1", pace=2.0)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_log(out)
    committed = [r for r in rows if r["committed"]]
    assert [r["step"] for r in committed] == list(range(1, STEPS + 1))
    assert committed[2]["step"] == 3 and committed[2]["members"] == [1, 2] and committed[2]["dropped"] == [0]
    # it came back (it restarted with nothing: only a heal from a live group brings it into a quorum) and stayed;
    # the heal's stats are logged with its round when that round commits (under heavy load the first heal round
    # can time out after the state was loaded: the group is then caught up in the next round, no second transfer)
    back = next((r["step"] for r in committed[3:] if 0 in r["members"]), None)
    assert back is not None, "group 0 never rejoined: " + p.stdout
    assert all(r["members"] == [0, 1, 2] for r in committed[back - 1:])
    assert all(r["heal"]["0"]["bytes"] > 0 for r in committed if "0" in r["heal"])
    missing = [r for r in committed if r["members"] != [0, 1, 2]]
    assert [r["step"] for r in missing] == list(range(3, back))
    # while group 0 is out, group 1 (the live member at position 0) computes its rows; the log says so
    assert all(r["rows"] == {"1": [1, 0], "2": [2]} for r in missing)
    assert all("rows" not in r for r in committed if r["members"] == [0, 1, 2])
    survivor = [json.loads(x) for x in (out / "replicas" / "group1.jsonl").read_text().splitlines()]
    assert [r.get("rows") for r in survivor] == [None] * 2 + [[1, 0]] * (back - 3) + [None] * (STEPS + 1 - back)
    assert all(r["groups_computed"] == 3 for r in survivor)
    assert _group_steps(out, 0) == [1, 2] + list(range(back, STEPS + 1))
    finals = _finals(out)
    assert sorted(finals) == ["final-group0", "final-group1", "final-group2"]
    assert all(_max_diff(finals["final-group0"], f) == 0.0 for f in finals.values())  # the healed group is bit-equal
    # the uninterrupted run: every step's loss and every final parameter within the fp64 bound
    losses, params = plain
    assert all(abs(r["loss"] - losses[r["step"]]) <= TP_ATOL + TP_RTOL * abs(losses[r["step"]]) for r in survivor)
    assert _within(params, finals["final-group1"])
    # `scaletrain replay` recomputes exactly what the membership log says was computed (the run's own bound, 1e-12)
    cfg = load_config(out / "config.yaml")
    capsys.readouterr()
    assert main(["replay", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["pass"] and max(summary["max_abs_diff"].values()) <= TOLERANCE
    assert (summary["tokens_lost"], summary["group_steps_reassigned"]) == (0, back - 3)
    # the launcher, the replay command and the report say "rows reassigned", with no tokens lost
    assert "its rows reassigned to the live groups" in p.stdout and "group-steps lost 0" in p.stdout
    assert f"rows reassigned: {back - 3} group-steps computed by live groups" in p.stdout
    # the report's section (report/replicas.py; the run's page is skipped here: CI time): one failure, its rows
    # reassigned for the steps it missed, nothing lost
    section = replicas_section(RunData(out, cfg, []))
    table = next(b for b in section.blocks if isinstance(b, Table))
    share = cfg.tokens_per_step // 3
    assert table.header[2:4] == ["steps missed", "tokens reassigned"]
    assert [list(r[:5]) for r in table.rows] == [[3, 0, back - 3, f"{(back - 3) * share:,}", back]]
    note = section.blocks[-1].text
    assert "tokens lost 0 (rows reassigned: " + f"{(back - 3) * share:,} tokens" in note
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # throughput counts the rows computed, reassigned ones included: the whole batch in every step
    assert all(abs(m["tokens_per_s"] * m["step_time_s"] - 3 * share) <= 1e-6 * share for m in metrics)


def test_summary_counts_reassigned_rows_apart_from_lost_ones():
    """`scaletrain replay --json`'s summary, from a membership log: a step with `rows` lost nothing and reassigned
    one group's share; one without lost that share."""
    from scaletrain.train.replica_replay import summarize

    cfg = load_config(None, [f"{k}={v}" for k, v in RUN.items()])
    rows = [{"round": 0, "step": 1, "members": [1, 2], "behind": [], "heal": {}, "dropped": [0], "committed": True,
             "rows": {"1": [1, 0], "2": [2]}},
            {"round": 1, "step": 2, "members": [1, 2], "behind": [], "heal": {}, "dropped": [], "committed": True}]
    s = summarize(cfg, rows)
    share = cfg.tokens_per_step // 3
    assert (s["tokens_lost"], s["group_steps_reassigned"], s["tokens_reassigned"]) == (share, 1, share)


@pytest.mark.parametrize("sets, message", [
    ({"parallel.missing_rows": "spread"}, "parallel.missing_rows must be skip or reassign, got 'spread'"),
    ({"parallel.dp": 4, "parallel.replicas": 2, "parallel.zero": 2, "train.global_batch": 8},
     "parallel.missing_rows=reassign with 2 processes per replica group"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.tp": 2},
     "parallel.missing_rows=reassign with 2 processes per replica group"),
    ({"parallel.replicas": 1, "parallel.dp": 1},
     "parallel.missing_rows (reassign) is used only with parallel.replicas"),
])
def test_missing_rows_refused_where_it_cannot_work(tmp_path, capsys, sets, message):
    assert main(["train", "--out", str(tmp_path / "o"), *_sets({**RUN, **sets})]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()
