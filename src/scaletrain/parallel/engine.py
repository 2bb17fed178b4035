"""The Engine a rank trains with, and the interface every engine optimizer gives it (`EngineOptimizer`).

The Engine is what the trainer drives: forward/backward over this rank's micro-batches, the global gradient norm,
the (possibly sharded) optimizer step, and the full state. `parallelize.build_engine` makes one by passes over the
plain model; the passes fill its optional parts.

`EngineOptimizer` is what the trainer, the pipeline executor, the checkpoint code and the memory passes ask of an
optimizer: the replicated one (`data_parallel.ReplicatedOptimizer`), ZeRO (`zero.ZeroOptimizer`), ZeRO-Infinity
(`zero_nvme.NvmeZeroOptimizer`) and expert parallelism's pair (`experts.ExpertParallelOptimizer`) implement it.
They subclass the protocol, which gives the members only some of them need a default (nothing to gather, nothing
to report); callers never probe an optimizer for a method.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from scaletrain.device.accounting import SavedTensorCounter
from scaletrain.model import loss_sum
from scaletrain.model.moe import set_grad_scale


def weak_grad_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A tensor hook that calls an optimizer's bound `method` without keeping the optimizer alive. A hook lives in
    the parameter's C++ autograd data, where Python's garbage collector cannot see it: a bound method there makes
    parameter -> optimizer -> parameter a cycle that is never collected, and the optimizer's process groups (with
    their threads) outlive the run. A process that trains run after run (the layout matrix) kept them all."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return hook


class EngineOptimizer(Protocol):
    """One rank's optimizer with its gradient reduction, as the training loop drives it:

        begin_micro(i, n) before each micro-batch's backward, finish_backward() after the last one,
        [unscale_(1 / loss scale)], clip_grad_norm(max_norm), step(lr), zero_grad().

    Members with a body are defaults; the others every optimizer defines."""

    def begin_micro(self, index: int, count: int) -> None:
        """Before micro-batch `index` of `count`: gradients are reduced after the last one (or every one)."""
        ...

    def finish_backward(self) -> None:
        """After the last backward of the step: wait for the gradient reductions."""
        ...

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        """Multiply this rank's gradients by `inv_scale`; a bool device tensor: whether any is inf or NaN."""
        ...

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (each element counted on one rank of the world)."""
        ...

    def scale_grads_(self, coef: float | torch.Tensor) -> None:
        """Multiply this rank's (reduced) gradients by `coef`."""
        ...

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (0: no clipping) by the global norm; returns the norm before clipping (0-dim tensor)."""
        ...

    def step(self, lr: float | None = None) -> None:
        """One update with learning rate `lr` (None: the optimizer's own)."""
        ...

    def zero_grad(self) -> None:
        ...

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds per category: `params`, `grads`, `optim` (what the trainer measures)."""
        ...

    # ------------------------------------------------------------------ defaults

    @property
    def parts(self) -> tuple[EngineOptimizer, ...]:
        """The optimizers whose state is checkpointed: itself, or the pair of expert parallelism."""
        return (self,)

    @property
    def owns_params(self) -> bool:
        """Whether the parameters live here as shards (ZeRO-3) rather than in the module."""
        return False

    def begin_step(self) -> None:
        """A step begins: ZeRO-3 gathered per step (under pipeline parallelism) gathers its parameters."""

    @contextmanager
    def params_gathered(self) -> Iterator[None]:
        """The parameters whole for the duration of the block (an evaluation under ZeRO-3 gathered per step)."""
        yield

    def gather_params(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full parameter values by name for `local` (the module's state dict): ZeRO-3 gathers its shards."""
        return local

    def expert_grad_sq(self) -> torch.Tensor:
        """|G|² of the expert parameters' reduced, unclipped gradients over the world (0 without experts)."""
        return torch.zeros((), dtype=torch.float64)

    def use_arena(self, arena: Any) -> None:
        """memory.contiguous: take transient gradient buffers from `arena` (nothing to take by default)."""

    def step_report(self) -> dict[str, int]:
        """Fields this optimizer adds to the step's metrics row (ZeRO-Infinity: the bytes it read and wrote)."""
        return {}


@dataclass
class Engine:
    """One rank's share of the model and how to train it.

    Passes fill the optional parts: tensor parallelism swaps `loss_fn` for the vocab-parallel loss and
    sets `gather_state`; pipeline parallelism sets `runner` (the schedule executor), which replaces the
    plain micro-batch loop and must return the same loss on every rank of the pipeline.
    """

    module: nn.Module
    optimizer: EngineOptimizer | None = None  # set last by build_engine
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_sum  # sum of token losses on this rank
    runner: Any = None  # (engine, micro, scale) -> loss tensor; None = the plain loop below
    eval_runner: Any = None  # (engine, micro) -> float loss sum; None = plain forward
    gather_state: Any = None  # (local state dict) -> full state dict (unsharded), on every rank
    pipeline: Any = None  # the pipeline executor (set by split_pp)
    write_trace: Any = None  # (out dir) -> paths: the pipeline's measured timeline, written by rank 0
    next_micro: Any = None  # () -> the next step's micro-batches, set by the trainer when a schedule may
    #                         start the next step early (2bw); None = finish (drain) this step completely
    step: int = 0  # the optimizer step being run (PipeDream numbers its weight versions by it)
    activation_bytes: int = 0
    n_params: int = 0  # parameters of the whole (unsharded) model
    dropout: Any = None  # the model's DropoutContext (layout-independent dropout), set per micro-batch
    fp8: Any = None  # train.precision=fp8: what the FP8 pass converted and its GEMM counters (parallel/fp8.py)

    def forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; returns its share of the loss (detached)."""
        set_grad_scale(self.module, scale)  # MoE layers add their weighted auxiliary losses with this scale
        if self.runner is not None:
            return self.runner(self, micro, scale)
        total = torch.zeros((), dtype=torch.float64, device=micro[0][0].device)
        for i, (x, y) in enumerate(micro):
            self.optimizer.begin_micro(i, len(micro))
            if self.dropout is not None:
                self.dropout.at_micro(i, x.shape[0])
            if not self.activation_bytes and i == 0:
                counter = SavedTensorCounter(self.module.parameters())
                with counter.active():
                    loss = self.loss_fn(self.module(x), y) * scale
                self.activation_bytes = counter.bytes
            else:
                loss = self.loss_fn(self.module(x), y) * scale
            loss.backward()
            total += loss.detach()
        self.optimizer.finish_backward()
        return total

    @torch.no_grad()
    def eval_loss(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if self.eval_runner is not None:
            return self.eval_runner(self, micro)
        self.module.eval()
        total = sum(float(self.loss_fn(self.module(x), y)) for x, y in micro)
        self.module.train()
        return total

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full, unsharded parameters by name on CPU (gathered where sharded)."""
        local = self.optimizer.gather_params(self.module.state_dict())  # ZeRO-3: parameters live as shards
        full = self.gather_state(local) if self.gather_state is not None else local
        return {k: v.detach().cpu().clone() for k, v in full.items()}
