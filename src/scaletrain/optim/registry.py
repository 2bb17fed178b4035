"""Every optimizer `optim.name` selects, described once (no torch: the planner and `validate()` read it too).

An `OptimizerSpec` says what the engine, the planner and the checks need to know about an optimizer: its class, what
its state looks like (element-wise moments, or factored row / column statistics), which sharded paths step it, its
default learning-rate multiplier and its constructor keywords from the config. Call sites ask the spec (`spec.factored`,
`spec.sharded`, ...) instead of comparing names, so a new optimizer is one entry here (and its class in optim/).

- AdamW (Loshchilov & Hutter, arXiv 1711.05101): two element-wise moments and a step counter per tensor.
- Adafactor (Shazeer & Stern, arXiv 1804.04235) and SM3 (Anil et al., arXiv 1901.11150): factored statistics (rows
  and columns, or one accumulator per dimension) of the whole parameter; a rank holding a slice of a parameter (a
  ZeRO shard, a tensor-parallel slice, a stack of experts) combines its partial statistics with the other holders'
  (`parallel.zero_factored.ShardedFactored`).
- SGD (torch's, optional momentum): the inner optimizer of local SGD (Lin et al., arXiv 1808.07217); its update is
  linear in the gradient, so averaging workers that each took one step equals one step on the averaged gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    cls: str
    """`module:Class` of its torch.optim.Optimizer, imported when one is built (this module imports no torch)."""
    factored: bool
    """Keeps factored statistics of the whole parameter (per row / column or per dimension): a rank holding a slice
    of a parameter combines them with the other holders (ShardedFactored), and they are placed for 1d shards only."""
    sharded: bool
    """ZeRO and the tensor / expert-parallel paths step it (element-wise ones on ZeRO's flat pieces, factored ones
    through ShardedFactored). False: the replicated whole-parameter path only."""
    streamed: bool
    """ZeRO-Infinity (parallel.offload=nvme) streams its step shard by shard from the files (AdamW's arithmetic)."""
    fused_kernel: bool
    """Built with torch's fused (CUDA) or foreach kernel (`device.kernels.adamw_kernel`)."""
    lr_scale: float
    """The multiplier of train.lr when optim.lr_scale is 0."""
    moments: int
    """Element-wise state tensors of a parameter's size it always keeps (AdamW's two moments); factored optimizers
    count theirs with `parallel.zero_factored.state_sizes`."""
    momentum_buffer: bool
    """One more element-wise buffer when optim.momentum > 0 (SGD)."""
    step_tensor: bool
    """A scalar step counter per parameter tensor (AdamW)."""
    hyper: Callable[[Any, float], dict[str, Any]]
    """(optim config, learning rate) -> the constructor's keywords (weight decay goes in the parameter groups)."""


def _adamw(o: Any, lr: float) -> dict[str, Any]:
    return {"lr": lr, "betas": (o.beta1, o.beta2), "eps": o.eps}


def _adafactor(o: Any, lr: float) -> dict[str, Any]:
    # a first moment only with optim.use_beta1 (beta1 = None otherwise: the AdamW default 0.9 would add a full-size
    # buffer); parameter scaling follows relative_step
    return {"lr": lr, "relative_step": o.relative_step, "scale_parameter": o.relative_step,
            "decay_rate": o.decay_rate, "clip_threshold": o.clip_threshold,
            "beta1": o.beta1 if o.use_beta1 else None}


def _momentum(o: Any, lr: float) -> dict[str, Any]:
    return {"lr": lr, "momentum": o.momentum}


# lr_scale: SM3 (like AdaGrad) divides by the root of *summed* squared gradients, so its step shrinks as 1/sqrt(t);
# at 5x the AdamW learning rate it trains the demo and the tiny test model about as fast as AdamW
# (tests/test_defaults_train.py, docs/memory.md). SGD has no per-coordinate normalisation: at 100x the AdamW learning
# rate (0.1 with the default train.lr) it lowers the test model's loss 0.95x as much as AdamW in 60 steps (1.06x
# with momentum 0.9; 0.37x at 10x).
OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adamw", "torch.optim:AdamW", factored=False, sharded=True, streamed=True, fused_kernel=True,
                  lr_scale=1.0, moments=2, momentum_buffer=False, step_tensor=True, hyper=_adamw),
    OptimizerSpec("adafactor", "scaletrain.optim.adafactor:Adafactor", factored=True, sharded=True, streamed=False,
                  fused_kernel=False, lr_scale=1.0, moments=0, momentum_buffer=False, step_tensor=False,
                  hyper=_adafactor),
    OptimizerSpec("sm3", "scaletrain.optim.sm3:SM3", factored=True, sharded=True, streamed=False, fused_kernel=False,
                  lr_scale=5.0, moments=0, momentum_buffer=False, step_tensor=False, hyper=_momentum),
    OptimizerSpec("sgd", "torch.optim:SGD", factored=False, sharded=False, streamed=False, fused_kernel=False,
                  lr_scale=100.0, moments=0, momentum_buffer=True, step_tensor=False, hyper=_momentum),
)}


def optimizer_spec(name: str) -> OptimizerSpec:
    """The description of optimizer `name` (case-insensitive); ConfigError naming the choices for another name."""
    spec = OPTIMIZERS.get(str(name).lower())
    if spec is None:
        raise ConfigError(f"optim.name {name!r} is not one of {', '.join(OPTIMIZERS)}")
    return spec


def lr_multiplier(optim: Any) -> float:
    """The factor applied to the schedule's learning rate for `optim.name` (`optim.lr_scale`, or its default)."""
    spec = OPTIMIZERS.get(str(optim.name).lower())
    return optim.lr_scale if optim.lr_scale > 0 else (spec.lr_scale if spec is not None else 1.0)


def config_hyper(optim: Any, lr: float) -> dict[str, Any]:
    """`build_optimizer` keywords for `optim.name` at base learning rate `lr` (train.lr; weight decay goes in the
    groups).

    `lr` x `lr_multiplier` is the step size (AdamW, SM3, SGD, Adafactor with relative_step=false) or, with Adafactor's
    relative step, the cap of ρ_t = min(lr, 1/√t); the trainer's schedule sets it every step.
    """
    return optimizer_spec(optim.name).hyper(optim, lr * lr_multiplier(optim))


def state_elements(spec: OptimizerSpec, numel: int, momentum: bool) -> int:
    """Element-wise state elements a non-factored optimizer keeps for `numel` parameter elements."""
    return (spec.moments + (spec.momentum_buffer and momentum)) * numel
