"""Asynchronous data parallelism on real processes (gloo, fp64): what each mode must equal, and what its version
log proves (docs/async.md).

- ps with staleness 0 (BSP) == the single-process run (AdamW and Adafactor and SM3 on 2 servers), per-step losses and
  final parameters; exact resume of the servers' state (parameters and optimizer) bit for bit.
- ps ASP and SSP with a straggler: a single-process replay of the version log gives bit-identical parameters;
  with staleness 2 no applied gradient is more than 2 versions old.
- local SGD with H = 1 and SGD == the single-process run; DiLoCo with outer lr 1 and momentum 0 == local SGD;
  exact resume from a checkpoint in the middle of a round.
- locked Hogwild == its replay (ASP, one gradient per update), bit for bit; lock-free Hogwild trains on the
  embedded corpus and reports the coordinates it lost.
- The planner's bytes per step are the bytes the runs move (ps: through the servers; local: the all-reduce).

Tolerance of the fp64 comparisons with one process: rtol 1e-9, atol 1e-11. The measured differences are about
1e-15 (the order of additions: a server sums the workers' gradients, one process accumulates micro-batches);
a plausible bug (a learning rate one step off, a gradient lost or counted twice) moves parameters by 1e-5 or
more. Replays and resumes are compared bit for bit. Nothing here depends on timing: the straggler only changes
which schedule the log records, and every assertion is on the log.
"""

import pytest
import torch
from harness import TINY, assert_same_run, make_config, run_ranks, train_reference

from scaletrain.parallel.async_dp.replay import replay
from scaletrain.plan.analytic import async_costs
from scaletrain.train.runner import make_trainer

RTOL, ATOL = 1e-9, 1e-11
PS = {"parallel.sync": "ps", "parallel.dp": 3, "train.global_batch": 6, "parallel.servers": 1}
PS2 = {"parallel.sync": "ps", "parallel.dp": 2, "parallel.servers": 2}
SLOW = {"parallel.slow_ranks": "0:3", "train.steps": 8}  # worker 0 takes 4x as long as the others
CONSTANT = {"train.lr_schedule": "constant", "train.checkpoint_every": 3}
LOCAL = {"parallel.sync": "local", "parallel.dp": 2, "parallel.local_steps": 2}
SGD = {"optim.name": "sgd", "optim.momentum": 0.9, "optim.lr_scale": 1.0, "train.grad_clip": 0.0, "train.lr": 0.05}
HOGWILD = {"parallel.sync": "hogwild", "parallel.dp": 2}
# model.bias=false: the attention key bias has an exactly-zero true gradient and Adafactor normalises its rounding
# noise into a full step, so its value depends on the order of additions in any implementation (tests/test_zero.py)
ADAFACTOR = {"optim.name": "adafactor", "model.bias": False}
SM3 = {"optim.name": "sm3", "optim.momentum": 0.5, "model.bias": False}
# what validate() accepts with every sync mode: the workers run the single-process engine, so model variants and
# memory savers must leave the numbers unchanged
VARIANTS = {"model.dropout": 0.1, "model.position": "rope", "model.mlp": "swiglu", "model.tie_embeddings": False,
            "memory.recompute": "selective", "memory.compress": "bf16", "train.steps": 3}
SAVERS = {"memory.recompute": "full", "memory.offload_activations": True, "memory.contiguous": True,
          "train.steps": 3}


def _jobs(rank, world, jobs):
    """Each job: (overrides, output dir or None, stop after step or None); rank 0 returns what tests check."""
    from scaletrain.distributed.process_group import DistEnv

    out = []
    for overrides, directory, stop in jobs:
        t = make_trainer(make_config({**TINY, **overrides}), directory, DistEnv(rank, world, 0, "test"))
        result = t.run(stop) if stop is not None else t.run()
        if rank == 0:
            out.append({"losses": result.losses, "state": t.full_state(), "log": getattr(t, "version_log", None),
                        "rows": getattr(t, "rows", [])})
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def ps_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ps")
    jobs = {
        "bsp_adafactor_2_servers": ({**PS2, "parallel.staleness": 0, **ADAFACTOR}, None, None),
        "bsp_sm3_2_servers": ({**PS2, "parallel.staleness": 0, **SM3, "train.steps": 3}, None, None),
        "bsp_variants": ({**PS2, "parallel.staleness": 0, **VARIANTS}, None, None),
        "asp_straggler": ({**PS, "parallel.staleness": -1, **SLOW}, None, None),
        "ssp2_straggler": ({**PS, "parallel.staleness": 2, **SLOW}, None, None),
        "full": ({**PS2, **CONSTANT, "train.steps": 6}, d / "full", None),
        "first_half": ({**PS2, **CONSTANT, "train.steps": 3}, d / "resumed", None),
        "resumed": ({**PS2, **CONSTANT, "train.steps": 6}, d / "resumed", None),
    }
    results = run_ranks(_jobs, 4, list(jobs.values()), timeout=300, threads=1)[0]
    return dict(zip(jobs, results))


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("local")
    resume = {**LOCAL, "train.checkpoint_every": 3, "train.steps": 6}
    jobs = {
        "local_h1_sgd": ({**LOCAL, **SGD, "parallel.local_steps": 1}, None, None),
        "bsp_sgd": ({"parallel.dp": 2, **SGD}, None, None),
        "local_h1_sgd_savers": ({**LOCAL, **SGD, "parallel.local_steps": 1, **SAVERS}, None, None),
        "local_avg": (LOCAL, None, None),
        "diloco_lr1_m0": ({**LOCAL, "parallel.outer": "diloco", "parallel.outer_lr": 1.0,
                           "parallel.outer_momentum": 0.0}, None, None),
        "diloco": ({**LOCAL, "parallel.outer": "diloco"}, None, None),
        "local_full": (resume, d / "full", None),
        "local_killed": (resume, d / "resumed", 3),  # stops after the checkpoint of step 3 (mid-round: H = 2)
        "local_resumed": (resume, d / "resumed", None),
        "hogwild_locked": ({**HOGWILD, "parallel.hogwild_lock": True, "train.steps": 6}, None, None),
        "hogwild": ({**HOGWILD, "train.steps": 40, "train.dtype": "fp32", "train.lr": 1e-2,
                     "train.warmup_steps": 5}, None, None),
    }
    results = run_ranks(_jobs, 2, list(jobs.values()), timeout=300, threads=1)[0]
    return dict(zip(jobs, results))


def _run(r):
    return r["losses"], r["state"]


def _numel(overrides: dict) -> int:
    """Parameters of the model (each once: the tied output projection is the embedding)."""
    from scaletrain.parallel.async_dp.model import WorkerModel

    return WorkerModel(make_config({**TINY, **overrides}), torch.device("cpu")).numel


def _bit_identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ps_bsp_matches_single_process(ps_runs, one_thread):
    """AdamW on 2 servers, staleness 0 (the default), constant learning rate, a checkpoint at step 3."""
    assert_same_run(train_reference({**CONSTANT, "train.steps": 6}), _run(ps_runs["full"]), RTOL, ATOL)
    assert ps_runs["full"]["log"].summary()["staleness_max"] == 0


def test_ps_bsp_adafactor_on_two_servers_matches_single_process(ps_runs, one_thread):
    assert_same_run(train_reference(ADAFACTOR), _run(ps_runs["bsp_adafactor_2_servers"]), RTOL, ATOL)


def test_ps_bsp_sm3_on_two_servers_matches_single_process(ps_runs, one_thread):
    assert_same_run(train_reference({**SM3, "train.steps": 3}), _run(ps_runs["bsp_sm3_2_servers"]), RTOL, ATOL)


def test_ps_bsp_with_model_variants_and_memory_savers_matches_single_process(ps_runs, one_thread):
    """dropout, RoPE, SwiGLU, untied head, selective recomputation and bf16 activation compression on ps workers
    (checked once: a reference without dropout differs at step 1 by 7.6e-4)."""
    assert_same_run(train_reference(VARIANTS), _run(ps_runs["bsp_variants"]), RTOL, ATOL)


def test_local_sgd_h1_with_memory_savers_matches_single_process(two_worker_runs, one_thread):
    """full recomputation with offloaded, contiguous checkpoints on local-SGD workers."""
    assert_same_run(train_reference({**SGD, **SAVERS}), _run(two_worker_runs["local_h1_sgd_savers"]), RTOL, ATOL)


@pytest.mark.parametrize("name", ["asp_straggler", "ssp2_straggler"])
def test_ps_replay_of_the_version_log_is_bit_identical(ps_runs, name, one_thread):
    run = ps_runs[name]
    log = run["log"]
    assert len(log.updates) == 8 and sum(len(u.members) for u in log.updates) == 8 * 3
    got = replay(make_config({**TINY, **PS, **SLOW, "parallel.staleness": -1 if "asp" in name else 2}), log)
    assert _bit_identical(got.params, run["state"])


def test_ps_staleness_bound_holds_with_a_straggler(ps_runs):
    staleness = ps_runs["ssp2_straggler"]["log"].staleness()
    assert max(staleness) <= 2, staleness
    rows = ps_runs["ssp2_straggler"]["rows"]
    assert max(r["staleness_max"] for r in rows) == max(staleness)  # metrics.jsonl reports the log's numbers


def test_ps_resume_restores_the_servers_exactly(ps_runs):
    full, first, resumed = ps_runs["full"], ps_runs["first_half"], ps_runs["resumed"]
    assert sorted(first["losses"]) == [1, 2, 3] and sorted(resumed["losses"]) == [4, 5, 6]
    assert {**first["losses"], **resumed["losses"]} == full["losses"]
    assert _bit_identical(resumed["state"], full["state"])


def test_ps_server_bytes_are_the_planned_bytes(ps_runs):
    rows = ps_runs["full"]["rows"]
    numel = _numel(PS2)
    planned = async_costs.ps_cost(numel * 8, numel * 8, 2, 2, (1e9, 0.0), 1e9).server_bytes  # fp64
    assert [r["server_bytes"] for r in rows] == [planned] * len(rows)


def test_local_sgd_h1_matches_single_process(two_worker_runs, one_thread):
    ref = train_reference(SGD)
    assert_same_run(ref, _run(two_worker_runs["local_h1_sgd"]), RTOL, ATOL)
    assert_same_run(ref, _run(two_worker_runs["bsp_sgd"]), RTOL, ATOL)


def test_diloco_with_outer_lr_1_momentum_0_is_local_sgd(two_worker_runs):
    assert_same_run(_run(two_worker_runs["local_avg"]), _run(two_worker_runs["diloco_lr1_m0"]), RTOL, ATOL)
    a, b = two_worker_runs["local_avg"]["state"], two_worker_runs["diloco"]["state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-4  # the outer Nesterov step does change things


def test_local_resume_mid_round_is_exact(two_worker_runs):
    full, killed, resumed = (two_worker_runs[k] for k in ("local_full", "local_killed", "local_resumed"))
    assert sorted(killed["losses"]) == [1, 2] and sorted(resumed["losses"]) == [3, 4, 5, 6]  # step 3's round ends at 4
    assert {**killed["losses"], **resumed["losses"]} == full["losses"]
    assert _bit_identical(resumed["state"], full["state"])


def test_local_sgd_moves_one_h_th_of_the_bytes(two_worker_runs):
    rows = two_worker_runs["local_avg"]["rows"]
    numel = _numel(LOCAL)
    synced = [r["comm_all_reduce_bytes"] for r in rows if "comm_all_reduce_bytes" in r]
    assert len(synced) == 2  # steps 2 and 4 of 4
    per_step = async_costs.local_cost(numel * 8, 2, 2, (1e9, 0.0)).worker_bytes
    assert sum(synced) / len(rows) == per_step


def test_locked_hogwild_equals_its_replay(two_worker_runs):
    run = two_worker_runs["hogwild_locked"]
    assert len(run["log"].updates) == 12 and run["log"].summary()["lost_updates"] == 0
    got = replay(make_config({**TINY, **HOGWILD, "parallel.hogwild_lock": True, "train.steps": 6}), run["log"])
    assert _bit_identical(got.params, run["state"])


def test_lock_free_hogwild_trains_and_reports_lost_updates(two_worker_runs):
    run = two_worker_runs["hogwild"]
    losses = run["losses"]
    first = sum(losses[s] for s in range(1, 6)) / 5
    last = sum(losses[s] for s in range(36, 41)) / 5
    assert last < first - 1.0, (first, last)
    assert sum(r["lost_updates"] for r in run["rows"]) == run["log"].summary()["lost_updates"]
    # a write can overwrite only what other workers wrote after its gradient's read: at most every coordinate of
    # each update that landed in between (its staleness), and nothing when none did
    numel = sum(v.numel() for v in run["state"].values())
    for u in run["log"].updates:
        for m, stale in zip(u.members, u.staleness):
            assert 0 <= m.lost <= stale * numel, (u.update, m, stale)
    assert len(run["log"].updates) == 80 and [u.update for u in run["log"].updates] == list(range(1, 81))
