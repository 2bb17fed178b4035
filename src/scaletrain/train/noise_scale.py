"""The gradient noise scale B_simple = tr(Σ) / |G|², measured during training at no extra backward passes.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv 1812.06162): the critical
batch size is about the noise scale B_noise, and its simple form B_simple = tr(Σ) / |G|² (G the true
gradient, Σ the per-example gradient covariance) can be measured from gradient norms alone. A gradient
averaged over B examples has E|G_B|² = |G|² + tr(Σ)/B, so norms at two batch sizes B_small < B_big give
unbiased estimates (their appendix A.1)

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

Both are noisy step by step (|G|² can come out negative), so each is averaged over steps with an
exponential moving average before the ratio is taken, as in the paper.

In scaletrain the small batch is a micro-batch (`train.micro_batch` sequences): `GradSqProbe` hooks the
parameters and adds up |g|² of every micro-batch's gradient as backward produces it (a tensor hook sees
the gradient of one backward before it is accumulated into `.grad` or reduced over data parallelism), and
the big batch is the global batch after reduction, whose norm the optimizer computes for clipping anyway.
The example unit is one sequence; `noise_scale_tokens` multiplies by the sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.parallel.norms import is_norm_owner

EMA_DECAY = 0.95
"""Decay of the moving averages of |G|² and tr(Σ) per optimizer step (a window of about 20 steps)."""


def unbiased_estimates(sq_small: float, b_small: float, sq_big: float, b_big: float) -> tuple[float, float]:
    """(|G|², tr(Σ)) from |G_small|² at batch b_small and |G_big|² at batch b_big (McCandlish App. A.1)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


@dataclass
class NoiseScaleEMA:
    """Moving averages of the unbiased |G|² and tr(Σ) estimates, and B_simple as their ratio.

    The averages are bias-corrected like Adam's moments (divided by 1 − decay^t), so the first steps are
    not pulled towards zero; the correction cancels in the ratio.
    """

    decay: float = EMA_DECAY
    g2: float = 0.0
    trace: float = 0.0
    steps: int = 0

    def update(self, sq_small: float, b_small: float, sq_big: float, b_big: float) -> dict[str, float]:
        """Add one step's norms; returns the metrics to log (B in examples of the two batch sizes)."""
        return self.update_parts([(sq_small, b_small, sq_big, b_big)])

    def update_parts(self, parts: list[tuple[float, float, float, float]]) -> dict[str, float]:
        """Add one step's norms measured on disjoint sets of parameters, each at its own small batch
        (sq_small, b_small, sq_big, b_big): |G|² and tr(Σ) are sums over parameters, so the unbiased estimates
        of the parts add up (expert parallelism: an expert's micro-batch gradient holds ep micro-batches)."""
        g2 = trace = sq_small = sq_big = 0.0
        for part in parts:
            g2_part, trace_part = unbiased_estimates(*part)
            g2, trace, sq_small, sq_big = g2 + g2_part, trace + trace_part, sq_small + part[0], sq_big + part[2]
        self.steps += 1
        self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
        self.trace = self.decay * self.trace + (1 - self.decay) * trace
        return {"grad_sq_small": sq_small, "grad_sq_big": sq_big, "noise_grad_sq": self.g2_avg,
                "noise_trace": self.trace_avg, "noise_scale": self.value}

    @property
    def g2_avg(self) -> float:
        return self.g2 / (1 - self.decay**self.steps) if self.steps else math.nan

    @property
    def trace_avg(self) -> float:
        return self.trace / (1 - self.decay**self.steps) if self.steps else math.nan

    @property
    def value(self) -> float:
        """B_simple = EMA[tr(Σ)] / EMA[|G|²]; NaN before the first step, inf while the |G|² average is <= 0."""
        if not self.steps:
            return math.nan
        return self.trace / self.g2 if self.g2 > 0 else math.inf

    def state_dict(self) -> dict[str, float]:
        return {"decay": self.decay, "g2": self.g2, "trace": self.trace, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay, self.g2, self.trace = float(state["decay"]), float(state["g2"]), float(state["trace"])
        self.steps = int(state["steps"])


class GradSqProbe:
    """Sums |g|² of the gradient of every backward pass, over the parameters this rank owns for norms.

    A tensor hook on a parameter runs once per backward with the gradient of that backward (autograd sums
    the uses of a tied weight before calling it), before it is accumulated into `.grad` and before any
    data-parallel reduction, so with one backward per micro-batch the sum is Σ_micro |g_micro|² restricted
    to this rank's share. Parameters marked `_st_norm_owner = False` (copies held by other tensor-parallel
    ranks) are not hooked, so summing over ranks counts each gradient element once; hooks added after the
    tensor-parallel ones see the gradient those produce. No hooks exist when noise logging is off.
    """

    def __init__(self, params: list[nn.Parameter]):
        owned = [p for p in params if p.requires_grad and is_norm_owner(p)]
        device = owned[0].device if owned else torch.device("cpu")
        # [dense, expert]: parameters split by expert parallelism (`_st_expert`) are summed apart, since their
        # gradient in one backward holds the micro-batches of the whole ep group
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)
        self.calls = 0
        self.handles = [p.register_hook(self._hook(int(getattr(p, "_st_expert", False)))) for p in owned]

    def _hook(self, part: int):
        def hook(grad: torch.Tensor) -> None:
            self.sums[part] += torch.linalg.vector_norm(grad.detach(), dtype=torch.float64).square()
            self.calls += 1
        return hook

    def reset(self) -> None:
        self.sums.zero_()
        self.calls = 0

    def take_parts(self) -> tuple[float, float]:
        """This rank's (dense, expert-parallel) sums since the last take (a device sync), and reset."""
        dense, expert = self.sums.tolist()
        self.reset()
        return dense, expert

    def take(self) -> float:
        """This rank's sum over all its parameters since the last take, and reset."""
        return sum(self.take_parts())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def world_sum(value: float) -> float:
    """Sum of a Python scalar over every process (identity without a process group)."""
    if not dist.is_initialized():
        return value
    from scaletrain.distributed.comm import collective_device

    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return float(t.item())


def small_batch_sq(local_sum: float, micro_batches: int, global_batch: int, micro_batch: int,
                   loss_scale: float = 1.0) -> float:
    """|G_small|²: the mean over the step's micro-batches of the squared norm of each one's mean gradient.

    `local_sum` is this rank's `GradSqProbe.take()`; summed over all ranks it counts every micro-batch of
    the global batch once (tensor-parallel shards add up to the whole gradient). The trainer's micro-batch
    loss is (sum of its token losses) × loss_scale / (tokens of the global batch), so its gradient is
    loss_scale × micro_batch / global_batch times the micro-batch's mean gradient.
    """
    total = world_sum(local_sum)
    factor = global_batch / (micro_batch * loss_scale)
    return total / micro_batches * factor * factor
