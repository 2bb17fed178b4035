"""Fault-tolerant replica groups (parallel.replicas; docs/fault_tolerance.md): a killed group is dropped while the
others go on, restarts, heals from a live group through a corrupted chunk (detected, resent) and rejoins; the run's
final parameters equal the replay of its membership log in fp64; a frozen group is dropped within the heartbeat
bound; the replay itself equals the plain single-process Trainer when every group computed every step; bad input
is one line and exit 2.

Runs are `scaletrain train` subprocesses (3 replica groups of one process each, gloo on CPU) with the fault drills
of train/runners/replicas.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.report import page as pg
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.replica_replay import TOLERANCE, TP_ATOL, TP_RTOL, load_log, replay_rounds
from tests.harness import TINY, train_reference

HEARTBEAT_S = 2.0  # a live group is never starved of the CPU this long, even on a loaded CI machine
RUN = {**TINY, "train.global_batch": 6, "train.checkpoint_every": 0, "parallel.dp": 3, "parallel.replicas": 3,
       "parallel.heartbeat_s": HEARTBEAT_S}


def _sets(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


def _train(out, overrides: dict, fault: str, *extra: str, pace: float = 0.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "SCALETRAIN_FT_FAULT": fault, "SCALETRAIN_FT_PACE_S": str(pace)}
    cmd = [sys.executable, "-m", "scaletrain", "train", "--out", str(out), *_sets(overrides), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _tree(root: int) -> list[int]:
    """`root` and every process descended from it (the launcher's children run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def train_at_once(root, runs: dict) -> dict:
    """Run replica runs side by side (CI time: the kill drills mostly wait for a restart) and wait for them:
    runs {name: (overrides, fault, extra args, pace)} -> {name: (folder, exit code, output)}. Each starts once the one
    before has committed its first round (or ended, or after 60 s): start-ups (a score of processes importing torch on
    2 cores) starved a first round's collectives past their timeout when all began at once. A run that takes more
    than 300 s is killed whole (launcher, lighthouse, agents, groups)."""
    started = {}
    for name, (overrides, fault, extra, pace) in runs.items():
        if started:  # the previous run's first round is in its membership log
            before, (proc, _) = list(started)[-1], list(started.values())[-1]
            deadline = time.monotonic() + 60
            log_of = root / before / "membership.jsonl"
            while proc.poll() is None and time.monotonic() < deadline and not (
                    log_of.is_file() and log_of.read_text().strip()):
                time.sleep(0.2)
        env = {**os.environ, "SCALETRAIN_FT_FAULT": fault, "SCALETRAIN_FT_PACE_S": str(pace)}
        cmd = [sys.executable, "-m", "scaletrain", "train", "--out", str(root / name), *_sets(overrides), *extra]
        log = open(root / f"{name}.log", "w")
        started[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    done = {}
    for name, (proc, log) in started.items():
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            for pid in _tree(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            code = proc.wait()
        log.close()
        done[name] = (root / name, code, (root / f"{name}.log").read_text())
    return done


def _finals(out) -> dict[str, dict[str, torch.Tensor]]:
    return {f.stem: torch.load(f, weights_only=True)["params"] for f in sorted((out / "replicas").glob("final-*.pt"))}


def _group_steps(out, g: int) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "replicas" / f"group{g}.jsonl").read_text().splitlines()]


def _within_tp_bound(a: dict, b: dict) -> bool:
    """Every entry of `b` within the fp64 bound of split groups (docs/verify.md's) of `a`'s."""
    return all(bool(((a[k] - b[k]).abs() <= TP_ATOL + TP_RTOL * a[k].abs()).all()) for k in b)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_replay_of_full_quorums_equals_the_single_process_trainer():
    """Independent of the lighthouse: R=3 groups' gradients averaged every step (the replay's arithmetic) is the
    plain one-process Trainer on the whole batch (fp64; measured difference ~1e-16)."""
    cfg = load_config(None, [f"{k}={v}" for k, v in RUN.items()])
    rows = [{"step": s, "members": [0, 1, 2], "committed": True} for s in range(1, cfg.train.steps + 1)]
    params = replay_rounds(cfg, rows)
    _, ref = train_reference({k: v for k, v in RUN.items() if not k.startswith("parallel.")})
    assert _max_diff(params, ref) <= 1e-12


def test_a_step_committed_again_replaces_the_commit_whose_members_all_died():
    """Group 0 alone commits step 3 and dies before healing anyone; group 1 (still at step 2) computes step 3 again:
    the first update is lost with group 0, so the replay goes through the second commit only (and a resume's
    rows after its checkpoint go as before)."""
    from scaletrain.multinode.replicas import effective_rows

    def row(step, members, committed=True, **extra):
        return {"step": step, "members": members, "committed": committed, **extra}

    rows = [row(1, [0, 1]), row(2, [0, 1]), row(3, [0, 1], False), row(3, [0]), row(3, [1]), row(4, [0, 1])]
    assert [(r["step"], r["members"]) for r in effective_rows(rows)] == [(1, [0, 1]), (2, [0, 1]), (3, [1]),
                                                                         (4, [0, 1])]
    resumed = [*rows, row(3, [0, 1], resumed_from=2), row(4, [0, 1])]
    assert [(r["step"], r["members"]) for r in effective_rows(resumed)] == [(1, [0, 1]), (2, [0, 1]), (3, [0, 1]),
                                                                            (4, [0, 1])]


def test_killed_group_is_dropped_restarts_heals_through_a_corrupt_chunk_and_the_run_equals_its_replay(tmp_path):
    out = tmp_path / "run"
    run = {**RUN, "train.steps": 16, "train.checkpoint_every": 1, "train.keep_checkpoints": 100}
    # group 0 is SIGKILLed after joining step 3's quorum; group 1 (the heal source) corrupts its first chunk once;
    # steps without every group take >= 2 s so that the restarted group finds the run still going
    p = _train(out, run, "kill:0:3,corrupt:1:0", "--restarts", "1", pace=2.0)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = load_log(out)
    failed = [(r["step"], r["members"]) for r in rows if not r["committed"]]
    assert (3, [0, 1, 2]) in failed  # the round group 0 died in (a failed round is only ever retried)
    committed = [r for r in rows if r["committed"]]
    assert [r["step"] for r in committed] == list(range(1, 17))
    after = next(r for r in committed if r["step"] == 3)
    assert after["members"] == [1, 2] and after["dropped"] == [0]
    healed = [r for r in committed if r["behind"]]
    assert len(healed) == 1 and healed[0]["behind"] == [0] and healed[0]["members"] == [0, 1, 2]
    heal, back = healed[0]["heal"]["0"], healed[0]["step"]
    assert heal["retries"] == 1 and heal["bytes"] > 0  # the corrupted chunk was detected and sent again
    assert committed[-1]["members"] == [0, 1, 2]
    for g in (1, 2):  # the survivors never stopped: each committed every step once, in one process
        assert _group_steps(out, g) == list(range(1, 17))
    assert _group_steps(out, 0) == [1, 2] + list(range(back, 17))
    finals = _finals(out)
    assert sorted(finals) == ["final-group0", "final-group1", "final-group2"]
    assert all(_max_diff(finals["final-group0"], f) == 0.0 for f in finals.values())  # the healed group is bit-equal
    # every step's checkpoint is written by that step's lowest member: group 1 while group 0 is out, group 0 again
    # from the step it healed in (heal and checkpoint in one step: the healed group writes it)
    writers = [ckpt.read_meta(ckpt.checkpoint_dirs.step_dir(out / "checkpoints", s))["replicas"]["writer"]
               for s in range(1, 17)]
    assert writers == [0, 0] + [1] * (back - 3) + [0] * (17 - back)
    cfg = load_config(out / "config.yaml")
    at_heal = ckpt.read_tensors(ckpt.checkpoint_dirs.step_dir(out / "checkpoints", back))
    replayed = replay_rounds(cfg, [r for r in rows if r["step"] <= back])
    assert max(float((at_heal[k] - replayed[k]).abs().max()) for k in at_heal) <= TOLERANCE
    saved = ckpt.read_tensors(ckpt.latest(out / "checkpoints"))  # the last step's, by group 0
    assert all(torch.equal(saved[k], finals["final-group0"][k]) for k in saved)
    mine = replay_rounds(cfg, rows)
    assert _max_diff(mine, finals["final-group0"]) <= TOLERANCE
    assert "replica group(s) [0] dropped" in p.stdout and "healed from a live group" in p.stdout
    # the run report (written by the launcher) shows the failure, what it cost and the heal, from the log
    group_tokens = cfg.tokens_per_step // 3
    text = (out / "report.html").read_text()
    cells = [3, 0, back - 3, f"{(back - 3) * group_tokens:,}", back, f"{heal['seconds']:.3f}", f"{heal['bytes']:,}", 1]
    assert "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>" in text
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # by each step's writer
    survivor = [json.loads(x) for x in (out / "replicas" / "group1.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loss"], m["replica_groups"]) for m in metrics] == \
        [(r["step"], r["loss"], len(r["members"])) for r in survivor]
    assert pg.figures_of(text)["loss-step"]["data"][0]["x"] == list(range(1, 17))
    members = pg.figures_of(text)["replica-members"]["data"][0]
    assert members["x"] == list(range(1, 17))
    assert members["y"] == [3, 3] + [2] * (back - 3) + [3] * (17 - back)


def test_frozen_group_is_dropped_within_the_heartbeat_bound(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = _train(out, {**RUN, "train.steps": 5, "train.report": False}, "stop:2:3")  # SIGSTOP inside step 3's collective
    assert p.returncode == 0, p.stdout + p.stderr
    assert time.monotonic() - t0 < 200
    rows = load_log(out)
    failed = next(r for r in rows if not r["committed"] and r["step"] == 3 and 2 in r["members"])
    retry = next(r for r in rows if r["committed"] and r["step"] == 3)
    assert retry["members"] == [0, 1] and retry["dropped"] == [2]
    # frozen inside the collective: the members' group times out after 2 x heartbeat_s; 2 s of scheduling slack
    # (measured 2.07 s with heartbeat_s = 1)
    assert retry["time"] - failed["time"] <= 2 * HEARTBEAT_S + 2.0
    assert [r["step"] for r in rows if r["committed"]] == [1, 2, 3, 4, 5]
    assert "final-group2" not in _finals(out)


@pytest.mark.parametrize("sets, message", [
    ({"parallel.dp": 4, "parallel.replicas": 3}, "parallel.replicas (3) must divide parallel.dp (4)"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.sync": "ps"}, "is for parallel.sync=bsp"),
    ({"parallel.dp": 4, "parallel.replicas": 2, "parallel.zero": 3, "train.precision": "fp8",
      "train.fp8_all_gather": True}, "with ZeRO-3 groups needs train.fp8_all_gather=false"),
    ({"parallel.dp": 6, "parallel.replicas": 2, "parallel.zero": 2, "train.global_batch": 12},
     "with 3 processes per group (dp=6) needs groups of 2 ranks"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.zero": 2}, "one process per group has nothing to shard"),
    ({"parallel.dp": 4, "parallel.replicas": 2, "parallel.tp": 2, "parallel.zero": 2},
     "a replica group is data-parallel only"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.pp": 2, "parallel.tp": 2},
     "a replica group is data-parallel only"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.pp": 2, "parallel.schedule": "gpipe"},
     "with pp=2 groups needs parallel.schedule=1f1b, parallel.virtual_stages=1, parallel.zero=0"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
     "with tp=2 groups needs parallel.zero=0, parallel.sequence_parallel=false"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.tp": 2, "train.dtype": "bf16"},
     "with 2 processes per group needs train.dtype fp32/fp64 and optim.name=adamw"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "parallel.pp": 2, "optim.name": "sgd"},
     "with 2 processes per group needs train.dtype fp32/fp64 and optim.name=adamw"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "train.dtype": "fp16"}, "does not support train.dtype=fp16"),
    ({"parallel.dp": 2, "parallel.replicas": 2, "train.profile_steps": "2:3"}, "writes no TensorBoard events or "
                                                                               "profiler traces"),
])
def test_replicas_refused_where_they_cannot_work(tmp_path, capsys, sets, message):
    overrides = {**RUN, "train.global_batch": 8, **sets}
    assert main(["train", "--out", str(tmp_path / "o"), *_sets(overrides)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_replay_of_a_replica_run_without_its_membership_log_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text(load_config(None, [f"{k}={v}" for k, v in RUN.items()]).to_yaml())
    assert main(["replay", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no membership log" in err and len(err.strip().splitlines()) == 1
