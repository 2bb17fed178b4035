"""Build the optimizer `optim.name` selects (`registry.OPTIMIZERS`), its parameter groups, and its state's bytes.

`build_optimizer(name, param_groups, **hyper)` is the one place that turns a name into an optimizer object;
`state_bytes(optimizer)` is what a run reports as `mem_optim`. The package re-exports these names
(`from scaletrain.optim import build_optimizer`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from scaletrain.device.accounting import optimizer_tensors, tensor_bytes
from scaletrain.errors import ConfigError
from scaletrain.optim.registry import optimizer_spec


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class of optimizer `name` (ConfigError for an unknown name)."""
    module, attr = optimizer_spec(name).cls.split(":")
    return getattr(importlib.import_module(module), attr)


def _keyword_names(cls: type) -> list[str]:
    sig = inspect.signature(cls.__init__)
    skip = {"self", "params"}
    return [n for n, p in sig.parameters.items() if n not in skip and p.kind is not p.VAR_KEYWORD]


def build_optimizer(name: str, param_groups: Iterable[Any], **hyper: Any) -> torch.optim.Optimizer:
    """The optimizer called `name` (`adamw`, `adafactor`, `sm3`, `sgd`) over `param_groups`.

    `hyper` are keyword arguments of that optimizer's constructor (e.g. `lr`, `weight_decay`,
    `betas` for AdamW; `beta1`, `decay_rate`, `clip_threshold` for Adafactor; `momentum` for SM3).
    An unknown name, an argument the optimizer does not take or a value it rejects raises
    `ConfigError` naming it.
    """
    spec = optimizer_spec(name)
    cls = optimizer_class(name)
    accepted = _keyword_names(cls)
    unknown = sorted(set(hyper) - set(accepted))
    if unknown:
        raise ConfigError(
            f"optimizer {spec.name} does not take {', '.join(unknown)} (it takes {', '.join(accepted)})"
        )
    if spec.fused_kernel and not {"fused", "foreach"} & set(hyper):  # fused on CUDA, torch._foreach_* elsewhere
        from scaletrain.device.kernels import adamw_kernel, param_list

        param_groups = list(param_groups)
        hyper = {**hyper, **adamw_kernel(param_list(param_groups))}
    try:
        return cls(param_groups, **hyper)
    except ValueError as e:
        raise ConfigError(f"optimizer {spec.name}: {e}") from None


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups: weight decay on matrices and embeddings, none on biases and norm gains."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (distinct tensor storages in `optimizer.state`): the run's `mem_optim`."""
    return tensor_bytes(optimizer_tensors(optimizer))
