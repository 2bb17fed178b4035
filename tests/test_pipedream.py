"""PipeDream (Narayanan et al., SOSP 2019; Harlap et al., arXiv 1806.03377): asynchronous 1F1B without a flush,
weight stashing and vertical sync, `parallel.schedule=pipedream`.

Its proof is a replay, as for the asynchronous data-parallel modes: every stage logs the weight version each
forward and backward read, and a plain single-process fp64 loop written from the paper (tests/pipedream_replay.py,
independent of the executor) recomputes exactly what the stages computed from that log. Claims checked here:

- the per-step lists are sound over runs of steps with and without drains (matching, no deadlock, minibatch t's
  backward in step t, p - r minibatches in flight on stage r before each update);
- executed at pp2, pp4 (with and without vertical sync) and dp2 x pp2: the losses of every step and all final
  parameters equal the replay's (rtol 1e-10); the stashing invariant holds (a minibatch's backward reads its
  forward's version on every stage; with vertical sync the same version on all stages, the one stage 0 read); the
  versions are the paper's (`forward_version`): without vertical sync stage r reads t - (p - r) for minibatch t,
  with it every stage reads t - p; a stage held at most p - r versions (p with vertical sync);
- the steps are really asynchronous: the losses differ from the synchronous 1F1B run of the same data;
- bad settings are refused with one line.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from harness import make_config, run_ranks, train_reference_rules
from pipedream_replay import forward_versions, replay

from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError, UserError
from scaletrain.parallel.pipeline.pipedream import (
    build_pipedream_step,
    check_pipedream,
    forward_version,
    phases,
    stash_copies,
    versions_kept,
)
from scaletrain.parallel.pipeline.schedules import Op, build_schedule
from scaletrain.parallel.pipeline.simulate import simulate_free_steps, simulate_steps
from scaletrain.plan.analytic.estimate import estimate, pipeline_stages
from scaletrain.plan.analytic.inputs import DEFAULT_ASSUMPTIONS, DTYPES, Layout, Training
from scaletrain.plan.analytic.stages import inflight_count, pipeline_makespan, rank_params
from scaletrain.plan.catalog import get_model
from scaletrain.plan.hardware import get_gpu

RTOL, ATOL = 1e-10, 1e-12  # fp64: the replay runs the same operations on the same weights, measured max 2e-15
BASE = {"model.n_layers": 4, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": 32,
        "model.tie_embeddings": "false", "train.steps": 5, "train.global_batch": 2, "train.micro_batch": 2,
        "train.warmup_steps": 2, "train.eval_every": 0, "train.dtype": "fp64", "train.lr": 3e-3,
        "parallel.schedule": "pipedream"}


# --------------------------------------------------------------------------- lists, checker, simulator


def test_lists_pass_the_checker_for_p_1_to_8_with_and_without_drains():
    for p in range(1, 9):
        check_pipedream(p, n_steps=6)
        check_pipedream(p, n_steps=7, drains=(1, 2, 4))
        check_pipedream(p, n_steps=1)


def test_steady_step_is_one_forward_of_a_later_minibatch_and_this_minibatch_backward():
    p = 4
    for r in range(p):
        w = p - r - 1
        first, steady, drain = (build_pipedream_step(p, f, la)[r] for f, la in ((True, False), (False, False),
                                                                              (False, True)))
        assert [(a.op, a.batch) for a in steady if a.op.is_compute] == [(Op.FORWARD, w), (Op.BACKWARD, 0)]
        assert [a.batch for a in first if a.op is Op.FORWARD] == list(range(w + 1))
        assert [a.op for a in drain if a.op.is_compute] == ([Op.FORWARD] if w == 0 else []) + [Op.BACKWARD]
    assert build_pipedream_step(p, True, True) == build_schedule("pipedream", p, 1)


def test_checker_rejects_a_step_whose_forward_runs_ahead_of_the_paper_order():
    import scaletrain.parallel.pipeline.pipedream as pd

    real = pd.build_pipedream_step

    def one_ahead(p, first, last):  # stage 0 starts one more minibatch: p + 1 in flight
        out = real(p, first, last)
        if first and not last:
            out[0] = [a for a in out[0]]
            out[0].insert(0, type(out[0][0])(Op.FORWARD, 0, 0, None, p))
        return out

    pd.build_pipedream_step = one_ahead
    try:
        with pytest.raises(ValueError, match="in flight"):
            check_pipedream(3, n_steps=4)
    finally:
        pd.build_pipedream_step = real


def test_simulated_steady_step_is_one_forward_and_one_backward_without_a_barrier():
    p, n = 4, 12
    lists = [build_pipedream_step(p, f, la) for f, la in phases(n)]
    # barrier-free (as the executor runs): every rank does one forward and one backward per step, nothing waits
    assert simulate_free_steps(lists, 1.0, 2.0)[p:-1] == [1.0 + 2.0] * (n - p - 2)
    # with a barrier after every step (how the steps ran before, the benchmark's pipedream+barrier) the backward
    # chain to stage 0 is exposed: t_f + p t_b
    res = simulate_steps(lists, 1.0, 2.0)
    assert res.step_makespans[p:-1] == [1.0 + 2.0 + (p - 1) * 2.0] * (n - p - 1)
    assert max(res.window.peak_in_flight) == p


def test_versions_follow_the_paper():
    p = 4
    assert [forward_version(10, r, p, False) for r in range(p)] == [6, 7, 8, 9]  # W_r^(t - p + r + 1), 1-based
    assert [forward_version(10, r, p, True) for r in range(p)] == [6] * p
    assert forward_version(2, 0, p, False) == 0
    assert [versions_kept(p, r, False) for r in range(p)] == [4, 3, 2, 1]
    assert versions_kept(p, 3, True) == 4


def test_planner_step_is_the_simulated_barrier_free_steady_step():
    for p in range(2, 9):
        free = simulate_free_steps([build_pipedream_step(p, f, la) for f, la in phases(p + 4)], 1.0, 2.0)
        assert pipeline_makespan("pipedream", p, 1, 1, [3.0] * p, [3.0] * p) == pytest.approx(free[p])
    uneven = [1.0, 1.0, 1.5]  # the slowest stage sets the pace
    free = simulate_free_steps([build_pipedream_step(3, f, la) for f, la in phases(10)], uneven,
                               [2 * t for t in uneven])
    assert free[4:-1] == pytest.approx([4.5] * len(free[4:-1]))
    assert pipeline_makespan("pipedream", 3, 1, 1, [3 * t for t in uneven], [0.0] * 3) == pytest.approx(4.5)


def test_planner_counts_the_stashed_versions_and_the_minibatches_in_flight():
    m = get_model("gpt3-1.3b")
    train = Training(8)
    lay = Layout(dp=8, pp=4, micro_batch=1, schedule="1f1b")
    sync = estimate(m, get_gpu("h100-80gb"), train, lay, memory_only=True)
    pd = estimate(m, get_gpu("h100-80gb"), train, replace(lay, schedule="pipedream"), memory_only=True)
    vs = estimate(m, get_gpu("h100-80gb"), train, replace(lay, schedule="pipedream", vertical_sync=True),
                  memory_only=True)
    gpu, pd_lay = get_gpu("h100-80gb"), replace(lay, schedule="pipedream")
    first = rank_params(m, pd_lay, pipeline_stages(m, gpu, train, pd_lay, DEFAULT_ASSUMPTIONS))[0]
    pb = DTYPES[train.dtype][0]
    assert pd.memory["params"] == pytest.approx((1 + 4) * first.total * pb)  # rank 0, the most loaded: 4 copies
    assert vs.memory["params"] == pytest.approx(pd.memory["params"])  # rank 0 keeps p either way
    assert [inflight_count("pipedream", 4, 1, 1, r) for r in range(4)] == [4, 3, 2, 1]  # minibatches, across steps
    assert pd.memory["activations"] > 2.5 * sync.memory["activations"]  # 1f1b at m = 1 holds one per rank
    with pytest.raises(UserError, match="microbatches \\(2\\) must be 1"):
        estimate(m, get_gpu("h100-80gb"), Training(16), replace(lay, schedule="pipedream"), memory_only=True)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("sets, message", [
    ({"parallel.pp": 2}, "must be 1"),
    ({"parallel.pp": 2, "train.global_batch": 2, "model.tie_embeddings": "true"}, "tie_embeddings=true"),
    ({"parallel.pp": 2, "train.global_batch": 2, "parallel.virtual_stages": 2}, "needs parallel.schedule=interleaved"),
    ({"parallel.pp": 2, "train.global_batch": 2, "parallel.zero": 1}, "parallel.zero"),
    ({"parallel.pp": 2, "train.global_batch": 2, "model.dropout": 0.1}, "model.dropout"),
    ({"parallel.pp": 1, "train.global_batch": 2}, "needs parallel.pp > 1"),
    ({"parallel.pp": 2, "train.global_batch": 2, "train.compile": "true"}, "train.compile=true"),
    ({"parallel.pp": 2, "train.global_batch": 2, "train.on_nan": "skip"}, "train.on_nan=skip"),
    ({"parallel.pp": 2, "train.global_batch": 2, "train.log_noise_scale": "true"}, "log_noise_scale=true"),
    ({"parallel.pp": 2, "train.global_batch": 2, "memory.budget_gb": 4}, "memory.budget_gb"),
    ({"parallel.pp": 2, "train.global_batch": 2, "parallel.schedule": "1f1b", "parallel.vertical_sync": "true"},
     "vertical_sync"),
])
def test_bad_settings_are_refused_with_one_line(sets, message):
    cfg = load_config(None, [f"{k}={v}" for k, v in {**BASE, "train.global_batch": 4, **sets}.items()])
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg, 2)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- execution and replay


def _run(rank, world, runs):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for overrides in runs:
        cfg = make_config({k: v for k, v in {**BASE, **overrides}.items() if not k.startswith("_")})
        t = Trainer(cfg, overrides.get("_out"), DistEnv(rank, world, 0, "test"))
        with _counting_collectives(t, overrides.get("_count", False)) as calls:
            result = t.run()
        state = t.full_state()
        mem = t.memory()  # a collective: every rank asks
        stash = t.engine.pipeline.stash
        out.append({"losses": result.losses, "state": state if rank == 0 else None, "mem": mem,
                    "log": stash.log if stash is not None else None,
                    "peak": stash.peak_versions if stash is not None else None,
                    "copies": stash.peak_copies if stash is not None else None, "collectives": calls})
    return out


COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter_tensor", "gather", "broadcast_object_list", "all_to_all_single")


@contextlib.contextmanager
def _counting_collectives(trainer, on: bool):
    """Record (step, name) of every torch.distributed collective this rank calls during the run (when `on`)."""
    import torch.distributed as dist

    calls: list[tuple[int, str]] = []
    real = {name: getattr(dist, name) for name in COLLECTIVES} if on else {}

    def counted(name):
        def call(*args, **kwargs):
            calls.append((trainer.step, name))
            return real[name](*args, **kwargs)
        return call

    for name in real:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


PP2 = {"pp2": {"parallel.pp": 2}, "pp2-1f1b": {"parallel.pp": 2, "parallel.schedule": "1f1b"},
       "pp2-drain": {"parallel.pp": 2, "train.checkpoint_every": 3, "_out": ""},
       # without clipping: PipeDream clips each stage by its own norm, the 2BW-rule reference by the global norm
       "pp2-vsync": {"parallel.pp": 2, "parallel.vertical_sync": "true", "train.grad_clip": 0},
       # clipping that binds on every stage (each stage's norm is above 1e-3), logged every 3 steps, collectives counted
       "pp2-clip": {"parallel.pp": 2, "train.grad_clip": 1e-3, "train.steps": 6, "train.log_every": 3, "_out": "",
                    "_count": True}}
FOUR = {"pp4": {"parallel.pp": 4}, "pp4-vsync": {"parallel.pp": 4, "parallel.vertical_sync": "true"},
        # the memory savers' pp4 case (the pp2 ones: tests/test_pipedream_savers.py)
        "pp4-vsync-recompute-offload-contiguous": {"parallel.pp": 4, "parallel.vertical_sync": "true",
                                                   "memory.recompute": "full", "memory.offload_activations": "true",
                                                   "memory.contiguous": "true"},
        "dp2-pp2": {"parallel.pp": 2, "parallel.dp": 2, "train.global_batch": 4}}


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    PP2["pp2-drain"]["_out"] = str(tmp_path_factory.mktemp("pipedream"))
    PP2["pp2-clip"]["_out"] = str(tmp_path_factory.mktemp("pipedream-clip"))
    outs = run_ranks(_run, 2, list(PP2.values()), timeout=240)
    return {name: [o[i] for o in outs] for i, name in enumerate(PP2)}


@pytest.fixture(scope="module")
def runs4():
    outs = run_ranks(_run, 4, list(FOUR.values()), timeout=400)
    return {name: [o[i] for o in outs] for i, name in enumerate(FOUR)}


def _one_replica(ranks: list[dict]) -> list[dict]:
    """One data-parallel replica's stages: the first rank of each stage."""
    first: dict[int, dict] = {}
    for r in ranks:
        first.setdefault(r["log"][0]["stage"], r)
    return [first[s] for s in sorted(first)]


def _assert_replayed(name: str, ranks: list[dict], overrides: dict, norms: dict | None = None) -> dict:
    p = overrides["parallel.pp"]
    rows = [row for r in _one_replica(ranks) for row in r["log"]]
    losses, state = replay({**BASE, **overrides}, rows, p, norms)
    got = ranks[0]
    for step, want in losses.items():
        assert abs(got["losses"][step] - want) <= ATOL + RTOL * abs(want), f"{name} step {step}"
    for n, want in state.items():
        assert got["state"][n].sub(want).abs().max() <= ATOL + RTOL * want.abs().max(), f"{name}: {n}"
    return losses


def _assert_stashing(ranks: list[dict], p: int, vertical: bool, steps: int) -> None:
    rows = [row for r in _one_replica(ranks) for row in r["log"]]
    fwd = forward_versions(rows)
    for row in rows:
        if row["pass"] == "backward":
            assert row["version"] == fwd[(row["minibatch"], row["stage"])], f"stashing broken: {row}"
    for t in range(1, steps + 1):
        got = [fwd[(t, r)] for r in range(p)]
        assert got == [forward_version(t, r, p, vertical) for r in range(p)], f"minibatch {t}: versions {got}"
        if vertical:
            assert len(set(got)) == 1


@pytest.mark.parametrize("name", ["pp2", "pp2-drain", "pp2-vsync"])
def test_pp2_replays_exactly_from_the_version_log(runs2, name):
    _assert_replayed(name, runs2[name], PP2[name])


def test_pp2_stages_take_their_steps_without_a_collective_across_the_pipeline(runs2):
    """No barrier between PipeDream's stages: between logged steps a rank calls no collective at all (dp = 1, so
    every collective would cross the pipeline). Step 1 measures memory (max over ranks), step 2 is the traced step
    (a barrier for a common time origin, then the gathered timeline), steps 3 and 6 are logged (one all-reduce of the
    pending rows' losses and stage norms, and memory's max)."""
    for rank, r in enumerate(runs2["pp2-clip"]):
        steps = {step for step, _ in r["collectives"]}
        assert {4, 5}.isdisjoint(steps), (rank, r["collectives"])
        assert {3, 6} <= steps  # the counter sees the logged steps' gather


def test_pp2_clips_each_stage_by_its_own_norm_and_logs_the_whole_gradient_norm(runs2):
    """Clipping at 1e-3 binds on both stages: the run (losses of every step, final parameters) equals the per-stage
    replay, rtol 1e-10, and not one clipping by the global norm (the replay's clip replaced: the loss of step 3 moves
    by far more than the 1e-10 bound). Rank 0
    (stage 0, not the last stage) wrote metrics.jsonl: its logged loss and its grad_norm (sqrt of the sum of the
    stages' squared norms before clipping) equal the replay's, rtol 1e-10."""
    import pipedream_replay

    over = PP2["pp2-clip"]
    rows = [row for r in _one_replica(runs2["pp2-clip"]) for row in r["log"]]
    norms: dict[int, float] = {}
    losses = _assert_replayed("pp2-clip", runs2["pp2-clip"], over, norms)
    logged = [json.loads(line) for line in (Path(over["_out"]) / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [3, 6]
    for row in logged:
        assert row["loss"] == pytest.approx(losses[row["step"]], rel=RTOL, abs=ATOL)
        assert row["grad_norm"] == pytest.approx(norms[row["step"]], rel=RTOL)
        assert row["grad_norm"] > 10 * over["train.grad_clip"]  # so clipping bound

    real = pipedream_replay.clip_per_stage
    pipedream_replay.clip_per_stage = lambda named, clip, n_layers, p: real(named, clip, n_layers, 1)  # one "stage"
    try:
        global_losses, _ = replay({**BASE, **over, "train.steps": 3}, rows, 2)
    finally:
        pipedream_replay.clip_per_stage = real
    assert abs(global_losses[3] - losses[3]) > 1e3 * RTOL * abs(losses[3])


def test_pp2_backward_reads_the_version_its_forward_read(runs2):
    ranks = runs2["pp2"]
    _assert_stashing(ranks, 2, False, BASE["train.steps"])
    assert [r["peak"] for r in ranks] == [2, 1]  # p - r versions
    assert [r["copies"] for r in ranks] == [stash_copies(2, r, False) for r in (0, 1)] == [2, 0]


def test_pp2_drain_forwards_the_dropped_minibatch_again_and_writes_the_log(runs2):
    ranks = runs2["pp2-drain"]  # a drain after step 3 (the checkpoint): minibatch 4 is forwarded again, newest weights
    fwd = forward_versions([row for r in ranks for row in r["log"]])
    assert [fwd[(3, 0)], fwd[(4, 0)], fwd[(5, 0)]] == [1, 3, 3]
    logged = [json.loads(line) for r in (0, 1) for line in
              (Path(PP2["pp2-drain"]["_out"]) / "pipedream_versions" / f"rank{r}.jsonl").read_text().splitlines()]
    assert logged == ranks[0]["log"] + ranks[1]["log"]  # the run folder's version log is the one replayed


def test_pp2_vertical_sync_is_the_2bw_rule_of_an_independent_single_process_run(runs2):
    """At p = 2 vertical sync reads W(t - 2) for minibatch t on both stages and updates W(t - 1): PipeDream-2BW's
    rule W(t+1) = W(t) - lr grad f(W(t-1)) (arXiv 2006.09503) in its numbering, which harness.train_reference_rules
    computes in one process without any pipeline code."""
    losses, state = train_reference_rules({**BASE, **PP2["pp2-vsync"]}, ("2bw",) * BASE["train.steps"])
    got = runs2["pp2-vsync"][0]
    for step, want in losses.items():
        assert abs(got["losses"][step] - want) <= ATOL + RTOL * abs(want), f"step {step}"
    for n, want in state.items():
        assert got["state"][n].sub(want).abs().max() <= ATOL + RTOL * want.abs().max(), n


def test_pipedream_steps_are_asynchronous_unlike_1f1b(runs2):
    async_, sync = runs2["pp2"][0]["losses"], runs2["pp2-1f1b"][0]["losses"]
    assert async_[1] == pytest.approx(sync[1], rel=1e-12)  # the same first minibatch at the initial weights
    assert all(abs(async_[t] - sync[t]) > 1e-6 for t in range(3, BASE["train.steps"] + 1))


@pytest.mark.parametrize("name", list(FOUR))
def test_pp4_and_dp2_pp2_replay_exactly_and_keep_the_versions(runs4, name):
    ranks, overrides = runs4[name], FOUR[name]
    p, vertical = overrides["parallel.pp"], "parallel.vertical_sync" in overrides
    _assert_replayed(name, ranks, overrides)
    _assert_stashing(ranks, p, vertical, BASE["train.steps"])
    for r in ranks:  # data parallelism: the replicas of a stage read the same versions
        assert r["log"] == _one_replica(ranks)[r["log"][0]["stage"]]["log"]
    peaks = [r["peak"] for r in _one_replica(ranks)]
    assert peaks == ([p] * p if vertical else [p - r for r in range(p)]), peaks
    copies = [r["copies"] for r in _one_replica(ranks)]
    assert copies == [stash_copies(p, r, vertical) for r in range(p)], copies  # what the planner counts
    _assert_planned_stash(ranks)


def _assert_planned_stash(ranks: list[dict]) -> None:
    """The run-exact planner (`plan --config`, plan/exact/stash_memory.py) predicts the measured stashed copies to
    the byte (max over ranks, fp64)."""
    mem = ranks[0]["mem"]
    assert mem["mem_stash"] == mem["plan_mem_stash"] > 0, (mem["mem_stash"], mem["plan_mem_stash"])


def test_pp2_planner_predicts_the_measured_stash_to_the_byte(runs2):
    for name in ("pp2", "pp2-vsync"):
        _assert_planned_stash(runs2[name])
    assert runs2["pp2-vsync"][0]["mem"]["mem_stash"] == runs2["pp2"][0]["mem"]["mem_stash"]  # stage 0: 2 copies


# --------------------------------------------------------------------------- scaletrain replay --out RUN


def test_replay_command_recomputes_the_run_from_its_folder_and_fails_on_a_wrong_version(runs2, tmp_path, capsys):
    """`scaletrain replay --out RUN` (train/pipedream_replay.py, a second implementation beside this file's loop)
    replays the pp2 run with a drain from its folder alone: exit 0, losses and parameters within rtol 1e-10. The same
    folder with one forward's logged version changed (a log that does not say what ran) fails with exit 1."""
    import shutil

    from scaletrain.cli import main

    run = Path(PP2["pp2-drain"]["_out"])
    assert main(["replay", "--out", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["pass"] and got["step"] == BASE["train.steps"] and got["losses_compared"] == BASE["train.steps"]
    assert got["max_rel_param_diff"] <= 1e-10 and got["max_rel_loss_diff"] <= 1e-10

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    log = bad / "pipedream_versions" / "rank0.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    row = next(r for r in rows if r["pass"] == "forward" and r["minibatch"] == 3)
    row["version"] += 1
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["replay", "--out", str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_replay_command_refuses_a_folder_without_its_log_in_one_line(runs2, tmp_path, capsys):
    import shutil

    from scaletrain.cli import main

    bad = tmp_path / "nolog"
    shutil.copytree(Path(PP2["pp2-drain"]["_out"]), bad)
    shutil.rmtree(bad / "pipedream_versions")
    assert main(["replay", "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no PipeDream version log" in err and "\n" not in err
