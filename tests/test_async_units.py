"""Asynchronous data parallelism without processes: config refusals, the staleness gate, tensor placement,
the straggler, Hogwild's lost-update counter, the planner's synchronisation costs (docs/async.md)."""

import random

import pytest
import torch
from harness import TINY, make_config

from scaletrain.cli import main
from scaletrain.config import load_config, validate
from scaletrain.config.parse import parse_slow_ranks
from scaletrain.errors import ConfigError
from scaletrain.parallel.async_dp.gate import Gate
from scaletrain.parallel.async_dp.server import assign_tensors
from scaletrain.plan import async_costs
from scaletrain.train.runners.hogwild import check_one_machine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("sets, world, words", [
    (["parallel.sync=ps", "parallel.servers=4"], 4, ["parallel.servers (4)", "number of processes (4)"]),
    (["parallel.sync=ps", "parallel.dp=2"], 4, ["parallel.dp (2) workers + parallel.servers (1) = 3", "(4)"]),
    (["parallel.sync=ps", "parallel.staleness=-2"], None, ["parallel.staleness must be >= -1", "-2"]),
    (["parallel.sync=local", "parallel.local_steps=0"], None, ["parallel.local_steps (H) must be >= 1, got 0"]),
    (["parallel.sync=hogwild", "parallel.tp=2"], None, ["parallel.sync=hogwild needs parallel.tp=1, got 2"]),
    (["parallel.sync=hogwild", "parallel.pp=2"], None, ["parallel.sync=hogwild needs parallel.pp=1"]),
    (["parallel.sync=ps", "parallel.dp=2", "parallel.zero=1"], None, ["parallel.sync=ps needs parallel.zero=0, got 1"]),
    (["parallel.sync=ps", "parallel.tp=2"], None, ["parallel.sync=ps needs parallel.tp=1, got 2"]),
    (["parallel.sync=ps", "train.dtype=bf16"], None, ["needs train.dtype fp32 or fp64, got bf16"]),
    (["parallel.sync=lazy"], None, ["parallel.sync must be one of", "'lazy'"]),
    (["parallel.servers=2"], None, ["parallel.servers (2) is used only with parallel.sync=ps"]),
    (["parallel.sync=ps", "parallel.local_steps=4"], None, ["parallel.local_steps (4) is used only with"]),
    (["parallel.sync=ps", "parallel.ps_tolerate_loss=true"], None, ["ps_tolerate_loss needs parallel.staleness=-1"]),
    (["parallel.slow_ranks=3:0.5"], None, ["parallel.slow_ranks", "'3:0.5'", "parallel.dp (1)"]),
    (["parallel.slow_ranks=fast"], None, ["parallel.slow_ranks", "'fast'"]),
    (["parallel.sync=local", "parallel.outer=sgd"], None, ["parallel.outer must be avg or diloco, got 'sgd'"]),
    (["parallel.sync=hogwild", "train.device=cuda"], None, ["hogwild shares the parameters in host memory"]),
    (["optim.name=sgd", "parallel.dp=2", "parallel.zero=2"], None, ["optim.name=sgd needs parallel.zero=0, got 2"]),
    (["parallel.sync=local", "model.moe.experts=2"], None, ["needs a dense model"]),
    (["parallel.sync=hogwild", "train.profile_steps=2:3"], None, ["train.profile_steps needs parallel.sync=bsp"]),
    (["parallel.sync=local", "train.precision=autocast-bf16"], None, ["needs train.precision=dtype", "autocast-bf16"]),
    (["parallel.sync=ps", "train.compile=true"], None, ["train.compile=false, got dtype and true"]),
])
def test_validate_refuses_with_the_values(sets, world, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, sets), world)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_world_counts_servers_and_accepts_ps():
    cfg = validate(load_config(None, ["parallel.sync=ps", "parallel.dp=2", "parallel.servers=3"]), 5)
    assert cfg.world_size == 5
    assert validate(load_config(None, ["parallel.sync=local", "parallel.dp=2"]), 2).world_size == 2


@pytest.mark.parametrize("sets, words", [
    (["--set", "parallel.sync=ps", "--set", "parallel.servers=2", "--nproc", "2"], ["parallel.servers (2)"]),
    (["--set", "parallel.sync=ps", "--set", "parallel.staleness=-3"], ["parallel.staleness", "-3"]),
    (["--set", "parallel.sync=local", "--set", "parallel.local_steps=-1"], ["parallel.local_steps", "-1"]),
    (["--set", "parallel.sync=local", "--set", "parallel.dp=2", "--nproc", "2", "--set", "parallel.heartbeat_s=2"],
     ["parallel.heartbeat_s (2.0)", "parallel.sync=local"]),
])
def test_cli_bad_async_input_is_one_line_exit_2(tmp_path, capsys, sets, words):
    code = main(["train", "--out", str(tmp_path / "o"), *sets])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "o").exists()


def test_hogwild_refuses_more_than_one_machine():
    check_one_machine({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="WORLD_SIZE 8 processes and LOCAL_WORLD_SIZE 4"):
        check_one_machine({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="SLURM job has 2 nodes"):
        check_one_machine({"SLURM_PROCID": "0", "SLURM_JOB_NUM_NODES": "2"})


def test_slow_ranks_parse():
    assert parse_slow_ranks("", 4) == {}
    assert parse_slow_ranks("1:0.5, 3:2", 4) == {1: 0.5, 3: 2.0}
    for bad in ("1:0.5,1:1", "4:1", "1:-1", "1", "1:inf"):
        with pytest.raises(ConfigError):
            parse_slow_ranks(bad, 4)


def test_servers_hold_whole_tensors_balanced():
    numels = [1000, 10, 500, 500, 30, 990]
    owned = assign_tensors(numels, 2)
    assert sorted(i for o in owned for i in o) == list(range(6))  # every tensor on exactly one server
    # largest first onto the least loaded: 1000 | 990, 500 | 500, 30 | 10 -> 1510 vs 1520, each list in model order
    assert owned == [[0, 1, 3], [2, 4, 5]]


def _simulate(k: int, dp: int, steps: int, seed: int, slow: int = 0) -> list[int]:
    """Random arrival orders through the gate: each event, either a waiting worker asks for work or a random
    gradient in flight arrives (the slow worker's rarely). Returns the staleness of every applied gradient."""
    rng = random.Random(seed)
    gate, waiting, staleness = Gate(dp, k, steps * dp), list(range(dp)), []
    updates = 0
    while updates < steps:
        choices = []
        if waiting and gate.can_grant():
            choices.append("grant")
        if gate.in_flight:
            choices.append("push")
        assert choices, "the gate deadlocked"
        if rng.choice(choices) == "grant":
            w = waiting.pop(rng.randrange(len(waiting)))
            gate.grant(w)
            continue
        flying = sorted(gate.in_flight)
        weights = [0.05 if gate.in_flight[n][0] == slow else 1.0 for n in flying]
        n = rng.choices(flying, weights)[0]
        w = gate.in_flight[n][0]
        members = gate.push(n, w)
        waiting.append(w)
        if members is not None:
            updates += 1
            staleness += [gate.version - 1 - m.pulled for m in members]
            if k == 0:  # BSP: update v is exactly the dp slices of step v
                assert sorted(m.ticket for m in members) == list(range((gate.version - 1) * dp, gate.version * dp))
    return staleness


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_gate_bounds_staleness_under_any_arrival_order(k):
    for seed in range(40):
        st = _simulate(k, 3, 12, seed, slow=seed % 3)
        assert len(st) == 36 and max(st) <= k, (seed, max(st))


def test_unbounded_staleness_exceeds_the_bound_without_the_gate():
    """The same random schedules with k = -1 (ASP) do produce gradients more than 2 versions old: the bound of
    the test above is the gate's doing, not the schedules'."""
    assert max(max(_simulate(-1, 3, 12, seed, slow=seed % 3)) for seed in range(40)) > 2


def test_gate_reissues_a_lost_workers_ticket():
    gate = Gate(2, -1, 4)
    assert gate.grant(0) == (0, 0) and gate.grant(1) == (1, 0)
    assert gate.drop(1) == [1]
    assert gate.grant(0) == (1, 0)  # the lost ticket first, then new ones
    assert gate.push(0, 0) is None
    assert [m.ticket for m in gate.push(1, 0)] == [0, 1]


def _two_hogwild_workers():
    from scaletrain.train.runner import make_trainer

    cfg = make_config({**TINY, "parallel.sync": "hogwild", "parallel.dp": 2})
    a, b = make_trainer(cfg, None, None), make_trainer(cfg, None, None)
    b.shared, b.rank = a.shared, 1  # the second worker maps the first one's shared memory
    return a, b


def test_hogwild_counts_the_coordinates_an_interleaved_write_overwrote():
    a, b = _two_hogwild_workers()
    a._read_and_compute(0)
    b._read_and_compute(1)
    before_a = a._begin_update(0)  # a reads the shared parameters and steps privately ...
    read_by_a = before_a.clone()
    lost_b, _ = b._end_update(b._begin_update(1))  # ... b's whole update lands in between ...
    changed_by_b = int((a.shared.params != read_by_a).sum())
    lost_a, _ = a._end_update(before_a)  # ... and a's write overwrites it
    assert lost_b == 0
    assert lost_a == changed_by_b > 0.9 * a.shared.params.numel()  # AdamW + decay: (almost) every coordinate
    assert torch.equal(a.shared.params, a.model.flat)  # b's update is gone from shared memory


def test_hogwild_counts_nothing_without_interleaving():
    a, b = _two_hogwild_workers()
    for w, n in ((a, 0), (b, 1)):
        w._read_and_compute(n)
        assert w._end_update(w._begin_update(n))[0] == 0


def test_planner_sync_costs_formulas():
    link = (1e9, 1e-5)
    bsp = async_costs.allreduce_cost(4e6, 4, link)
    ps = async_costs.ps_cost(4e6, 4e6, 4, 2, link, 1e9)
    local = async_costs.local_cost(4e6, 4, 8, link)
    assert bsp.worker_bytes == 2 * 3 / 4 * 4e6
    assert ps.worker_bytes == 8e6 and ps.server_bytes == 4 * 8e6
    assert ps.time_s == pytest.approx(8e6 / (2 * 1e9 / 4) + 2e-5)  # server links the bottleneck: n/S = 2
    assert local.worker_bytes == bsp.worker_bytes / 8 and local.time_s == pytest.approx(bsp.time_s / 8)
    many = async_costs.ps_cost(4e6, 4e6, 4, 4, link, 1e9)
    assert many.time_s == pytest.approx(8e6 / 1e9 + 2e-5)  # S = n: a worker's own link is the bottleneck


def test_plan_cli_shows_sync_comparison(capsys):
    import json

    code = main(["plan", "--model", "gpt3-1.3b", "--gpus", "64", "--global-batch", "512", "--servers", "8",
                 "--local-steps", "16", "--top", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {r["mode"]: r for r in doc["sync_comm"]["rows"]}
    assert set(rows) == {"bsp (all-reduce)", "ps (8 servers)", "local SGD (H=16)", "diloco (H=16)",
                         "hogwild (shared memory)"}
    assert rows["local SGD (H=16)"]["worker_bytes"] == pytest.approx(rows["bsp (all-reduce)"]["worker_bytes"] / 16,
                                                                     rel=1e-3)  # fp32 grads vs bf16 params
    code = main(["plan", "--model", "gpt3-1.3b", "--gpus", "64", "--global-batch", "512", "--servers", "0"])
    assert code == 2 and "--servers must be >= 1, got 0" in capsys.readouterr().err


def test_sgd_single_process_is_a_plain_torch_loop():
    """optim.name=sgd is torch's SGD (momentum, L2 decay on matrices) under the trainer's schedule and clipping."""
    from scaletrain.train.trainer import Trainer

    over = {**TINY, "optim.name": "sgd", "optim.momentum": 0.9, "optim.lr_scale": 1.0, "train.lr": 0.05,
            "train.steps": 3}
    t = Trainer(make_config(over))
    ref = Trainer(make_config(over))  # its model and data, trained by hand
    params = [p for p in ref.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                           {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=0.05, momentum=0.9)
    from scaletrain.model import loss_sum
    from scaletrain.train.schedule import lr_at

    cfg = ref.cfg
    losses = t.run().losses
    for step in range(1, 4):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.train)
        opt.zero_grad()
        total = 0.0
        for x, y in ref.loader.micro_batches(step, 0, 1, cfg.train.micro_batch):
            loss = loss_sum(ref.model(x), y) / cfg.tokens_per_step
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        assert abs(total - losses[step]) < 1e-12, (step, total, losses[step])
    for (n, p), q in zip(t.full_state().items(), ref.full_state().values()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=n)
    assert t.mem["mem_optim"] == t.mem["plan_mem_optim"]  # the momentum buffers, predicted exactly


def test_bsp_straggler_sleeps_after_each_step_and_changes_no_number(monkeypatch):
    """parallel.slow_ranks on the synchronous trainer: one sleep per step, proportional to its compute."""
    from scaletrain.parallel.async_dp import straggler
    from scaletrain.train.trainer import Trainer

    over = {**TINY, "train.steps": 2}
    plain = Trainer(make_config(over))
    ref = plain.run().losses
    delays: list[float] = []
    monkeypatch.setattr(straggler.time, "sleep", delays.append)
    slow = Trainer(make_config({**over, "parallel.slow_ranks": "0:0.5"}))
    assert slow.run().losses == ref
    assert len(delays) == 2 and all(d > 0 for d in delays), delays
    s = straggler.Straggler(0.5)
    s.after_compute(0.25)
    assert delays[-1] == 0.125 and s.slept_s == 0.125


def test_plan_config_of_an_async_run_uses_its_servers_and_h(tmp_path, capsys):
    import json

    path = tmp_path / "run.yaml"
    small = "model:\n  n_layers: 1\n  d_model: 16\n  n_heads: 2\n  seq_len: 16\ntrain:\n  global_batch: 4\n" \
            "  micro_batch: 2\n"  # a tiny model and a catalog GPU: no calibration run
    path.write_text(small + "parallel:\n  sync: ps\n  dp: 2\n  servers: 2\n")
    assert main(["plan", "--config", str(path), "--gpu", "a100-80gb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["sync_comm"]
    assert doc["servers"] == 2 and "ps (2 servers)" in {r["mode"] for r in doc["rows"]}
    path.write_text(small + "parallel:\n  sync: local\n  dp: 2\n  local_steps: 4\n  outer: diloco\n")
    assert main(["plan", "--config", str(path), "--gpu", "a100-80gb", "--json"]) == 0
    rows = {r["mode"]: r for r in json.loads(capsys.readouterr().out)["sync_comm"]["rows"]}
    assert rows["diloco (H=4)"]["worker_bytes"] == rows["bsp (all-reduce)"]["worker_bytes"] / 4
