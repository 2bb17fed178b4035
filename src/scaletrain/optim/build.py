"""Optimizers: torch's AdamW and SGD and the memory-efficient Adafactor (arXiv 1804.04235) and SM3 (arXiv 1901.11150).

SGD (with optional momentum) is the inner optimizer of local SGD (Lin et al., arXiv 1808.07217): its update is
linear in the gradient, so averaging the parameters of workers that each took one step equals one step on the
averaged gradient (docs/async.md).

`build_optimizer(name, param_groups, **hyper)` is the one place that maps `optim.name` to a class;
`state_bytes(optimizer)` is what a run reports as `mem_optim`. The package re-exports these names
(`from scaletrain.optim import build_optimizer`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from scaletrain.device.accounting import optimizer_tensors, tensor_bytes
from scaletrain.errors import ConfigError
from scaletrain.optim.adafactor import Adafactor
from scaletrain.optim.sm3 import SM3

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adafactor": Adafactor,
    "sm3": SM3,
    "sgd": torch.optim.SGD,
}


def _keyword_names(cls: type) -> list[str]:
    sig = inspect.signature(cls.__init__)
    skip = {"self", "params"}
    return [n for n, p in sig.parameters.items() if n not in skip and p.kind is not p.VAR_KEYWORD]


def build_optimizer(name: str, param_groups: Iterable[Any], **hyper: Any) -> torch.optim.Optimizer:
    """The optimizer called `name` (`adamw`, `adafactor`, `sm3`) over `param_groups`.

    `hyper` are keyword arguments of that optimizer's constructor (e.g. `lr`, `weight_decay`,
    `betas` for AdamW; `beta1`, `decay_rate`, `clip_threshold` for Adafactor; `momentum` for SM3).
    An unknown name, an argument the optimizer does not take or a value it rejects raises
    `ConfigError` naming it.
    """
    key = str(name).lower()
    if key not in OPTIMIZERS:
        raise ConfigError(f"optim.name {name!r} is not one of {', '.join(OPTIMIZERS)}")
    cls = OPTIMIZERS[key]
    accepted = _keyword_names(cls)
    unknown = sorted(set(hyper) - set(accepted))
    if unknown:
        raise ConfigError(
            f"optimizer {key} does not take {', '.join(unknown)} (it takes {', '.join(accepted)})"
        )
    if key == "adamw" and not {"fused", "foreach"} & set(hyper):  # fused on CUDA, torch._foreach_* elsewhere
        from scaletrain.device.kernels import adamw_kernel, param_list

        param_groups = list(param_groups)
        hyper = {**hyper, **adamw_kernel(param_list(param_groups))}
    try:
        return cls(param_groups, **hyper)
    except ValueError as e:
        raise ConfigError(f"optimizer {key}: {e}") from None


# The multiplier of train.lr each optimizer uses when `optim.lr_scale` is 0. SM3 (like AdaGrad) divides by the
# root of *summed* squared gradients, so its step shrinks as 1/sqrt(t); at 5x the AdamW learning rate it trains the
# demo and the tiny test model about as fast as AdamW (tests/test_defaults_train.py, docs/memory.md).
# SGD has no per-coordinate normalisation: at 100x the AdamW learning rate (0.1 with the default train.lr) it lowers
# the test model's loss 0.95x as much as AdamW in 60 steps (1.06x with momentum 0.9; 0.37x at 10x).
DEFAULT_LR_SCALE = {"adamw": 1.0, "adafactor": 1.0, "sm3": 5.0, "sgd": 100.0}


def lr_multiplier(optim: Any) -> float:
    """The factor applied to the schedule's learning rate for `optim.name` (`optim.lr_scale`, or its default)."""
    return optim.lr_scale if optim.lr_scale > 0 else DEFAULT_LR_SCALE.get(str(optim.name).lower(), 1.0)


def config_hyper(cfg: Any) -> dict[str, Any]:
    """`build_optimizer` keywords for the run config's `optim.name` (weight decay goes in the groups).

    `train.lr` x `lr_multiplier` is the step size (AdamW, SM3, Adafactor with relative_step=false) or, with Adafactor's
    relative step, the cap of ρ_t = min(lr, 1/√t); the trainer's schedule sets it every step.
    Adafactor keeps a first moment only with `optim.use_beta1` (beta1 = None otherwise: the AdamW
    default 0.9 would add a full-size buffer); its parameter scaling follows `relative_step`.
    """
    o, lr = cfg.optim, cfg.train.lr * lr_multiplier(cfg.optim)
    name = str(o.name).lower()
    if name == "adafactor":
        return {"lr": lr, "relative_step": o.relative_step, "scale_parameter": o.relative_step,
                "decay_rate": o.decay_rate, "clip_threshold": o.clip_threshold,
                "beta1": o.beta1 if o.use_beta1 else None}
    if name == "sm3":
        return {"lr": lr, "momentum": o.momentum}
    if name == "sgd":
        return {"lr": lr, "momentum": o.momentum}
    return {"lr": lr, "betas": (o.beta1, o.beta2), "eps": o.eps}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (distinct tensor storages in `optimizer.state`): the run's `mem_optim`."""
    return tensor_bytes(optimizer_tensors(optimizer))
