"""validate()'s rules for the optimizer's keys (`optim.*`): AdamW (arXiv 1711.05101), Adafactor (arXiv 1804.04235),
SM3 (arXiv 1901.11150) and SGD, and the layouts SGD is implemented for.

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.rules import rule
from scaletrain.config.schema import OPTIMIZER_NAMES, Config, or_list
from scaletrain.optim.registry import OPTIMIZERS


@rule("values")
def hyper(cfg: Config, world_size: int | None) -> list[str]:
    """optim.name and the ranges of the optimizers' hyper-parameters."""
    o = cfg.optim
    errors = []
    if o.name not in OPTIMIZER_NAMES:
        errors.append(f"optim.name must be {or_list(OPTIMIZER_NAMES)}, got {o.name!r}")
    if o.momentum < 0 or o.momentum >= 1 or o.clip_threshold < 1 or not 0 < o.decay_rate <= 1:
        errors.append(f"optim.momentum ({o.momentum}) must be in [0, 1), optim.clip_threshold ({o.clip_threshold})"
                      f" >= 1 and optim.decay_rate ({o.decay_rate}) in (0, 1]")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        errors.append(f"optim.beta1 ({o.beta1}) and optim.beta2 ({o.beta2}) must be in [0, 1)")
    if not o.lr_scale >= 0 or o.lr_scale == float("inf"):
        errors.append(f"optim.lr_scale must be a finite number >= 0 (0 = the optimizer's default), got {o.lr_scale}")
    if o.weight_decay < 0 or o.eps <= 0:
        errors.append(f"optim.weight_decay ({o.weight_decay}) must be >= 0 and optim.eps ({o.eps}) > 0")
    return errors


@rule("combinations")
def unsharded_layouts(cfg: Config, world_size: int | None) -> list[str]:
    """An optimizer the registry does not shard (plain SGD) runs on the replicated (non-ZeRO, non-factored) path."""
    p, spec = cfg.parallel, OPTIMIZERS.get(cfg.optim.name)
    if spec is None or spec.sharded:
        return []
    sharded = [name for name, s in OPTIMIZERS.items() if s.sharded]
    return [f"optim.name={spec.name} needs {name}={ok}, got {value}: ZeRO's sharded optimizer and the tensor/expert-"
            f"parallel factored path implement {', '.join(sharded[:-1])} and {sharded[-1]}"
            for name, value, ok in (("parallel.zero", p.zero, 0), ("parallel.tp", p.tp, 1), ("parallel.ep", p.ep, 1))
            if value != ok]
