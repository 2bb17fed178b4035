"""validate() refuses every setting a run would ignore (scaletrain.config.ignored), naming the key, where it is used
and the value that makes it unused — one case per key of `IGNORED`: refused where the run would not read it,
accepted where it would."""

from __future__ import annotations

import pytest

from scaletrain.cli import main
from scaletrain.config import load_config, validate
from scaletrain.config.ignored import IGNORED
from scaletrain.errors import ConfigError

MOE = ["model.moe.experts=4"]
FP16 = ["train.dtype=fp16"]
# key -> (config sets where the run ignores it, config sets where it reads it)
CASES: dict[str, tuple[list[list[str]], list[str]]] = {
    "optim.momentum": ([["optim.momentum=0.9"], ["optim.name=adafactor", "optim.momentum=0.9"]],
                       ["optim.name=sgd", "optim.momentum=0.9"]),
    "optim.use_beta1": ([["optim.use_beta1=true"], ["optim.name=sm3", "optim.use_beta1=true"]],
                        ["optim.name=adafactor", "optim.use_beta1=true"]),
    "optim.relative_step": ([["optim.relative_step=true"]], ["optim.name=adafactor", "optim.relative_step=true"]),
    "optim.decay_rate": ([["optim.decay_rate=0.5"]], ["optim.name=adafactor", "optim.decay_rate=0.5"]),
    "optim.clip_threshold": ([["optim.name=sm3", "optim.clip_threshold=2"]],
                             ["optim.name=adafactor", "optim.clip_threshold=2"]),
    "optim.beta1": ([["optim.name=sm3", "optim.beta1=0.8"], ["optim.name=adafactor", "optim.beta1=0.8"]],
                    ["optim.name=adafactor", "optim.use_beta1=true", "optim.beta1=0.8"]),
    "optim.beta2": ([["optim.name=adafactor", "optim.beta2=0.99"]], ["optim.beta2=0.99"]),
    "optim.eps": ([["optim.name=sgd", "optim.eps=1e-6"]], ["optim.eps=1e-6"]),
    **{f"model.moe.{k}": ([[f"model.moe.{k}={v}"]], [*MOE, f"model.moe.{k}={v}"]) for k, v in (
        ("every", 2), ("top_k", 1), ("router", "switch"), ("capacity_factor", 2.0), ("group_tokens", 32),
        ("aux_loss_weight", 0.1), ("z_loss_weight", 0.01), ("router_noise", 0.1), ("random_routing", True),
        ("switch_init_scale", 0.1), ("expert_dropout", 0.1))},
    "model.dropout_impl": ([["model.dropout_impl=torch"]], ["model.dropout=0.1", "model.dropout_impl=torch"]),
    "parallel.sequence_parallel": ([["parallel.sequence_parallel=true"]],
                                   ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "memory.partition_checkpoints": ([["memory.recompute=full", "memory.partition_checkpoints=true"]],
                                     ["parallel.tp=2", "memory.recompute=full", "memory.partition_checkpoints=true"]),
    "parallel.partition": ([["parallel.partition=params"]], ["parallel.pp=2", "parallel.partition=params"]),
    "parallel.schedule": ([["parallel.schedule=gpipe"]], ["parallel.pp=2", "parallel.schedule=gpipe"]),
    "parallel.cp_mode": ([["parallel.cp_mode=ulysses"]], ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "parallel.missing_rows": ([["parallel.missing_rows=reassign"]],
                              ["parallel.dp=2", "parallel.replicas=2", "train.eval_every=0",
                               "parallel.missing_rows=reassign"]),
    "parallel.heal_attempts": ([["parallel.heal_attempts=5"]],
                               ["parallel.dp=2", "parallel.replicas=2", "train.eval_every=0",
                                "parallel.heal_attempts=5"]),
    "parallel.vertical_sync": ([["parallel.vertical_sync=true"], ["parallel.pp=2", "parallel.vertical_sync=true"]],
                               ["parallel.pp=2", "parallel.schedule=pipedream", "parallel.vertical_sync=true",
                                "train.global_batch=2", "train.micro_batch=2", "model.tie_embeddings=false"]),
    **{f"train.{k}": ([[f"train.{k}={v}"], ["train.dtype=bf16", f"train.{k}={v}"]], [*FP16, f"train.{k}={v}"])
       for k, v in (("loss_scale", 1024.0), ("loss_scale_window", 100), ("loss_scale_backoff", 0.25),
                    ("loss_scale_hysteresis", 1), ("loss_scale_min", 2.0))},
    "train.on_nan": ([[*FP16, "train.on_nan=skip"]], ["train.on_nan=skip"]),
    "train.min_lr": ([["train.lr_schedule=constant", "train.min_lr=0"]], ["train.min_lr=0"]),
    "train.eval_batches": ([["train.eval_every=0", "train.eval_batches=2"]], ["train.eval_batches=2"]),
}
ROUTER_CASES = {  # MoE keys that one router does not read
    "model.moe.top_k": ([*MOE, "model.moe.router=switch", "model.moe.top_k=1"],
                        [*MOE, "model.moe.router=expert_choice", "model.moe.top_k=1"]),
    "model.moe.router_noise": ([*MOE, "model.moe.router=expert_choice", "model.moe.router_noise=0.1"],
                               [*MOE, "model.moe.router=switch", "model.moe.router_noise=0.1"]),
    "model.moe.aux_loss_weight": ([*MOE, "model.moe.router=expert_choice", "model.moe.aux_loss_weight=0.1"],
                                  [*MOE, "model.moe.router=switch", "model.moe.aux_loss_weight=0.1"]),
}


def _validate(sets: list[str]):
    cfg = load_config(None, sets)
    return validate(cfg, cfg.world_size)


def test_every_key_of_the_table_has_its_cases():
    assert {u.key for u in IGNORED} == set(CASES)
    assert set(ROUTER_CASES) <= set(CASES)


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_setting_the_run_would_ignore_is_refused_naming_why(key):
    unused, used = CASES[key]
    for sets in unused:
        with pytest.raises(ConfigError) as e:
            _validate(sets)
        said = str(e.value)
        assert f"{key} (" in said and "is used only with" in said and "the run would ignore it" in said, said
    _validate(used)  # where the run reads it, the same value is accepted


@pytest.mark.parametrize("key", sorted(ROUTER_CASES))
def test_an_moe_setting_its_router_does_not_read_is_refused(key):
    unused, used = ROUTER_CASES[key]
    with pytest.raises(ConfigError, match=f"{key} .* is used only with model.moe.router"):
        _validate(unused)
    _validate(used)


def test_defaults_and_the_shipped_demo_are_accepted():
    from pathlib import Path

    import scaletrain

    _validate([])
    demo = Path(scaletrain.__file__).parent / "configs" / "demo.yaml"
    cfg = load_config(demo, [])
    validate(cfg, cfg.world_size)


def test_the_command_line_refuses_an_ignored_setting_in_one_line(capsys):
    code = main(["config", "show", "--set", "optim.momentum=0.9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "optim.momentum (0.9) is used only with optim.name sm3 or sgd" in err
