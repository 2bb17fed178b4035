"""validate()'s rule against settings a run would ignore: a key set off its default where nothing reads it is refused,
naming where it is used and the value that makes it unused — the rule the asynchronous keys follow
(parallel/async_dp/rules.py), for every other key whose use depends on another one.

A user who writes `optim.momentum=0.9` with AdamW, `parallel.sequence_parallel=true` on one tensor-parallel rank or
`train.loss_scale=1024` in bf16 believes the setting does something; the run would silently train without it. One
table (`IGNORED`) lists each such key with the condition under which it is read, checked against the code that reads
it (the optimizer registry's keywords, the MoE layer, the trainer's loss scaler, the pipeline and tensor-parallel
passes); tests/test_config.py refuses each key where it is unused and accepts it where it is used. Keys with their
own refusals elsewhere (the asynchronous modes', the NVMe offload keys, parallel.tp_depth, parallel.heartbeat_s,
parallel.virtual_stages, memory.contiguous with nothing to hold, model.moe.random_routing) are not repeated here.

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.config.rules import rule
from scaletrain.config.schema import Config


@dataclass(frozen=True)
class Unused:
    key: str
    """Dotted config key, e.g. `optim.momentum`."""
    used: Callable[[Config], bool]
    """Whether a run of this config reads the key."""
    where: str
    """Where it is read, completing "is used only with ..."."""
    got: Callable[[Config], str]
    """The values that make it unused, completing "got ..."."""


def _optim(*names: str) -> tuple[Callable[[Config], bool], str, Callable[[Config], str]]:
    return (lambda c: c.optim.name in names, f"optim.name {' or '.join(names)}", lambda c: f"optim.name={c.optim.name}")


def _moe_keys() -> tuple[Unused, ...]:
    keys = ("every", "top_k", "router", "capacity_factor", "group_tokens", "aux_loss_weight", "z_loss_weight",
            "router_noise", "random_routing", "switch_init_scale", "expert_dropout")
    return tuple(Unused(f"model.moe.{k}", lambda c: c.model.moe.experts > 0, "model.moe.experts > 0 (an MoE model)",
                        lambda c: "model.moe.experts=0 (a dense model)") for k in keys)


IGNORED: tuple[Unused, ...] = (
    # optimizers: the keywords each one's registry entry passes (optim/registry.py)
    Unused("optim.momentum", *_optim("sm3", "sgd")),
    Unused("optim.use_beta1", *_optim("adafactor")),
    Unused("optim.relative_step", *_optim("adafactor")),
    Unused("optim.decay_rate", *_optim("adafactor")),
    Unused("optim.clip_threshold", *_optim("adafactor")),
    Unused("optim.beta1", lambda c: c.optim.name == "adamw" or (c.optim.name == "adafactor" and c.optim.use_beta1),
           "optim.name adamw, or adafactor with optim.use_beta1=true",
           lambda c: f"optim.name={c.optim.name}" + (" and optim.use_beta1=false" * (c.optim.name == "adafactor"))),
    Unused("optim.beta2", *_optim("adamw")),
    Unused("optim.eps", *_optim("adamw")),
    # mixture of experts (model/moe.py)
    *_moe_keys(),
    Unused("model.moe.top_k", lambda c: c.model.moe.experts == 0 or c.model.moe.router != "switch",
           "model.moe.router topk or expert_choice (switch sends each token to its one best expert)",
           lambda c: "model.moe.router=switch"),
    Unused("model.moe.router_noise", lambda c: c.model.moe.experts == 0 or c.model.moe.router != "expert_choice",
           "model.moe.router topk (noisy gating) or switch (input jitter)", lambda c: "model.moe.router=expert_choice"),
    Unused("model.moe.aux_loss_weight",
           lambda c: c.model.moe.experts == 0 or c.model.moe.router != "expert_choice",
           "model.moe.router topk or switch (expert choice balances the load by construction and has no balance loss)",
           lambda c: "model.moe.router=expert_choice"),
    Unused("model.dropout_impl", lambda c: c.model.dropout > 0 or c.model.moe.expert_dropout > 0,
           "model.dropout > 0 or model.moe.expert_dropout > 0", lambda c: "no dropout"),
    # parallelism: the passes that read them run only with the dimension > 1
    Unused("parallel.sequence_parallel", lambda c: c.parallel.tp > 1, "parallel.tp > 1 (it splits the sequence over "
           "the tensor-parallel ranks)", lambda c: f"parallel.tp={c.parallel.tp}"),
    Unused("memory.partition_checkpoints", lambda c: c.parallel.tp > 1, "parallel.tp > 1 (it splits each kept block "
           "input over the tensor-parallel ranks)", lambda c: f"parallel.tp={c.parallel.tp}"),
    Unused("parallel.partition", lambda c: c.parallel.pp > 1, "parallel.pp > 1 (it splits the blocks into pipeline "
           "stages)", lambda c: f"parallel.pp={c.parallel.pp}"),
    Unused("parallel.schedule", lambda c: c.parallel.pp > 1 or c.parallel.schedule in ("2bw", "pipedream"),  # own rule
           "parallel.pp > 1 (a pipeline schedule)", lambda c: f"parallel.pp={c.parallel.pp}"),
    Unused("parallel.cp_mode", lambda c: c.parallel.cp > 1, "parallel.cp > 1 (how attention is split over the "
           "context-parallel ranks)", lambda c: f"parallel.cp={c.parallel.cp}"),
    Unused("parallel.missing_rows", lambda c: c.parallel.replicas > 1, "parallel.replicas > 1 (what a step without "
           "every replica group does with the missing groups' rows)",
           lambda c: f"parallel.replicas={c.parallel.replicas}"),
    Unused("parallel.heal_attempts", lambda c: c.parallel.replicas > 1, "parallel.replicas > 1 (the lighthouse "
           "excludes a replica group whose heal keeps failing)", lambda c: f"parallel.replicas={c.parallel.replicas}"),
    Unused("parallel.vertical_sync", lambda c: c.parallel.schedule == "pipedream", "parallel.schedule=pipedream "
           "(PipeDream's weight versions)", lambda c: f"parallel.schedule={c.parallel.schedule}"),
    # training: fp16's dynamic loss scaler (train/trainer.py), the schedule, evaluation
    *(Unused(f"train.{k}", lambda c: c.train.dtype == "fp16", "train.dtype=fp16 (dynamic loss scaling)",
             lambda c: f"train.dtype={c.train.dtype}")
      for k in ("loss_scale", "loss_scale_window", "loss_scale_backoff", "loss_scale_hysteresis", "loss_scale_min")),
    Unused("train.on_nan", lambda c: c.train.dtype != "fp16", "train.dtype fp32, fp64 or bf16 (fp16's loss scaler "
           "skips every non-finite step itself)", lambda c: "train.dtype=fp16"),
    Unused("train.min_lr", lambda c: c.train.lr_schedule == "cosine", "train.lr_schedule=cosine (the end of its "
           "decay)", lambda c: f"train.lr_schedule={c.train.lr_schedule}"),
    Unused("train.eval_batches", lambda c: c.train.eval_every > 0, "train.eval_every > 0 (validation)",
           lambda c: "train.eval_every=0"),
)


def _value(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


@functools.cache
def _defaults() -> dict[str, Any]:
    """Each `IGNORED` key's default (validate() runs unused_settings on every layout the covering search tries)."""
    default = Config()
    return {u.key: _value(default, u.key) for u in IGNORED}


def unused_settings(cfg: Config) -> list[str]:
    """One line per key of `IGNORED` set off its default where the run would not read it."""
    defaults = _defaults()
    errors, seen = [], set()
    for u in IGNORED:
        value = _value(cfg, u.key)
        if u.key in seen or value == defaults[u.key] or u.used(cfg):
            continue
        seen.add(u.key)  # one line per key (the first reason: an MoE key in a dense model is that)
        errors.append(f"{u.key} ({value}) is used only with {u.where}, got {u.got(cfg)}: the run would ignore it")
    return errors


@rule("combinations")
def ignored_settings(cfg: Config, world_size: int | None) -> list[str]:
    """Settings the run would ignore (module docstring)."""
    return unused_settings(cfg)
