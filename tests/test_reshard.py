"""ZeRO-3 without resharding after forward (parallel.reshard_after_forward=false; FSDP's option of that name).

Claims, on 2 processes (gloo), fp64, 4 blocks, 2 micro-batches per rank and step:
- keeping the gathered parameters from forward to backward computes the single-process run (rtol 1e-10, atol 1e-12,
  the fp64 layout tolerance of tests/harness.py), alone, with recomputation (full with dropout, ops:matmul), with
  parameter offload, with expert parallelism, and under pipeline parallelism (where false is the stages' way);
- it all-gathers each unit once per micro-batch instead of twice: the step's all-gather bytes are half those of
  reshard_after_forward=true, and equal its reduce-scatter bytes (together: data parallelism's all-reduce volume);
- the most parameter bytes gathered at once (`mem_params_gathered`) are what the planner predicts to the byte: every
  unit's padded buffer (false), or the root and the two largest consecutive blocks (true);
- the setting is refused where it would be ignored (ZeRO < 3) or cannot hold (pp with true, nvme offload with false).
"""

from __future__ import annotations

import pytest
import torch
from harness import TINY, assert_same_run, make_config, run_ranks, train_reference

from scaletrain.errors import ConfigError

Z3 = {"train.steps": 3, "parallel.dp": 2, "parallel.zero": 3, "model.n_layers": 4}
KEEP = {**Z3, "parallel.reshard_after_forward": False}
RUNS = {  # name -> (overrides, the single-process model they are compared with)
    "reshard": (Z3, "plain"),
    "keep": (KEEP, "plain"),
    "keep-full-dropout": ({**KEEP, "memory.recompute": "full", "model.dropout": 0.1}, "dropout"),
    "keep-ops": ({**KEEP, "memory.recompute": "ops:matmul"}, "plain"),
    "keep-offload-params": ({**KEEP, "parallel.offload": "params"}, "plain"),
    "keep-ep": ({**KEEP, "parallel.ep": 2, "model.moe.experts": 4, "model.moe.every": 2}, "moe"),
    "pp-keep": ({"train.steps": 3, "parallel.pp": 2, "parallel.zero": 3, "model.n_layers": 4,
                 "parallel.reshard_after_forward": False}, "plain"),
}
REFERENCES = {"plain": {"train.steps": 3, "model.n_layers": 4},
              "dropout": {"train.steps": 3, "model.n_layers": 4, "model.dropout": 0.1},
              "moe": {"train.steps": 3, "model.n_layers": 4, "model.moe.experts": 4, "model.moe.every": 2}}


def _runs(rank, world):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for name, (over, _) in RUNS.items():
        t = Trainer(make_config({**TINY, **over}), None, DistEnv(rank, world, 0, "test"))
        losses = t.run().losses
        comm = dict(t.comm.bytes)  # the last step's collectives (before full_state gathers the parameters)
        out[name] = (losses, t.full_state(), comm, {k: v for k, v in t.mem.items() if "params_gathered" in k})
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_runs, 2, timeout=300)[0]


@pytest.fixture(scope="module")
def references():
    return {name: train_reference(over) for name, over in REFERENCES.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_zero3_keeping_parameters_gathered_matches_single_process(runs, references, name):
    assert_same_run(references[RUNS[name][1]], runs[name][:2], rtol=1e-10, atol=1e-12)


def test_keeping_parameters_gathered_halves_the_all_gathers(runs):
    reshard, keep = runs["reshard"][2], runs["keep"][2]
    assert keep["reduce_scatter"] == reshard["reduce_scatter"]
    assert reshard["all_gather"] == 2 * keep["all_gather"]  # gathered for the forward and again for the backward
    assert keep["all_gather"] == keep["reduce_scatter"]  # together: one all-reduce's volume per micro-batch


def test_gathered_parameter_peak_is_predicted_to_the_byte(runs):
    from scaletrain.parallel.zero import group_params
    from scaletrain.plan.exact.run_memory import engine_module_on_meta

    for name in RUNS:
        got = runs[name][3]
        assert got["plan_mem_params_gathered"] == got["mem_params_gathered"], (name, got)
    # from the units themselves: all four blocks and the root, or the root and two blocks (all blocks equal here)
    units = [2 * -(-sum(p.numel() for p in g) // 2) * 8
             for g in group_params(engine_module_on_meta(make_config({**TINY, **Z3})), 3, 25.0)]
    assert runs["keep"][3]["mem_params_gathered"] == sum(units)
    assert runs["reshard"][3]["mem_params_gathered"] == units[0] + 2 * units[1]


@pytest.mark.parametrize("sets, words", [
    ({"parallel.zero": 2, "parallel.reshard_after_forward": False}, "needs parallel.zero=3, got parallel.zero=2"),
    ({"parallel.zero": 0, "parallel.reshard_after_forward": True}, "needs parallel.zero=3, got parallel.zero=0"),
    ({"parallel.zero": 3, "parallel.pp": 2, "parallel.reshard_after_forward": True}, "pipeline stages keep"),
    ({"parallel.zero": 3, "parallel.offload": "nvme", "parallel.reshard_after_forward": False}, "ZeRO-Infinity"),
])
def test_reshard_after_forward_is_refused_where_it_would_be_ignored_or_cannot_hold(sets, words):
    with pytest.raises(ConfigError, match=words):
        make_config({**TINY, **sets})


def test_a_refused_setting_is_one_line_and_exit_code_2(tmp_path, capsys):
    from scaletrain.cli import main

    out = tmp_path / "run"
    code = main(["train", "--set", "parallel.reshard_after_forward=false", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "parallel.reshard_after_forward=false" in err
    assert not out.exists()
