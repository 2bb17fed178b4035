"""What one layout run computed and how a comparison came out (`verify/matrix.py`, `verify/stepwise.py`): the run
record, the training loop the matrix runs (as `scaletrain train` does), PipeDream-2BW's update rule on one process
(Narayanan et al., arXiv 2006.09503) and the validated config of a layout."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletrain.verify.layouts import Layout, config

if TYPE_CHECKING:
    import torch

@dataclass
class Run:
    """What one run computed: per-step losses and gradient norms, and the full final parameters (rank 0)."""

    losses: dict[int, float]
    grad_norms: dict[int, float]
    state: dict[str, torch.Tensor] | None
    decisions: dict | None = None
    """A low-precision MoE layout's routing decisions (`verify/stepwise.py`), which its reference replays."""


@dataclass
class Outcome:
    """One layout's comparison with its single-process run."""

    layout: str
    world: int
    dtype: str
    ok: bool
    loss: float
    """Largest relative loss difference over the steps."""
    grad_norm: float
    """Largest relative gradient-norm difference over the steps."""
    params: float
    """fp64: the largest element-wise excess over rtol (0 when within); else the relative L2 distance."""
    worst: str
    """The parameter with the largest element-wise difference."""
    error: str = ""
    routing: float = math.nan
    """Low-precision MoE layouts: the fraction of the layout's routing decisions that one process's own router
    would have taken otherwise (`verify/stepwise.py`)."""
    forced: str = ""
    """Low precision: the fp16 skip decisions one process took from the layout because its own differed within the
    margin (`verify/stepwise.py`), with the step and the loss scale ("": none)."""

    @property
    def result(self) -> str:
        if self.ok:
            return "PASS" + (f" (teacher-forced: {self.forced})" if self.forced else "")
        return "ERROR " + self.error if self.error else "FAIL"


def train(cfg, env=None, stale: bool = False, prepare: Callable | None = None) -> Run:
    """Train `cfg` for `cfg.train.steps` steps as `scaletrain train` does (2BW overlaps steps until the last);
    `stale` trains one process by PipeDream-2BW's rule (`StaleWeights`); `prepare(trainer)` may patch the
    trainer first (tests inject faults with it)."""
    import torch

    from scaletrain.train.trainer import Trainer

    t = Trainer(cfg, None, env)
    if prepare is not None:
        prepare(t)
    step = StaleWeights(t) if stale else t.train_step
    losses, norms = {}, {}
    while t.step < cfg.train.steps:
        t.step += 1
        row = step(t.step) if stale else step(t.step, drain=t.step == cfg.train.steps)
        losses[t.step], norms[t.step] = row["loss"], row["grad_norm"]
    state = t.full_state()
    t.mesh.close()
    keep = env is None or env.rank == 0
    return Run(losses, norms, {k: v.to(torch.float64) for k, v in state.items()} if keep else None)


class StaleWeights:
    """PipeDream-2BW's update rule (Narayanan et al., arXiv 2006.09503) on one process, around the real trainer:
    step t computes the loss and gradient at W(t-1) (`older`; W(0) = W(1)) and the optimizer applies them to W(t).
    Called with the step number, like `Trainer.train_step`; the optimizer's own state (moments, fp32 masters) is
    the trainer's."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.older = [p.detach().clone() for p in self.params]
        self._current: list = []
        opt = trainer.engine.optimizer
        self._update = opt.step
        opt.step = self._step_at_current

    def _step_at_current(self, lr=None):
        import torch

        with torch.no_grad():
            for p, w in zip(self.params, self._current):
                p.copy_(w)  # the update applies to W(t)
        self._update(lr)

    def __call__(self, step: int) -> dict:
        import torch

        self._current = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, w in zip(self.params, self.older):
                p.copy_(w)  # forward and backward at W(t-1)
        self.older = [w.clone() for w in self._current]
        return self.trainer.train_step(step)


def layout_config(layout: Layout, dtype: str | None = None):
    """The validated run config of `layout` (in `dtype` instead of its own when given)."""
    from scaletrain.config import validate

    cfg = config(layout)
    if dtype and fp8_keeps_dtype(layout, dtype) is None:
        cfg.train.dtype = dtype
    return validate(cfg, layout.world)


def fp8_keeps_dtype(layout: Layout, dtype: str | None) -> str | None:
    """An FP8 layout keeps its own dtype when the matrix is run in fp64 or fp16 (FP8 computes with fp32 or bf16
    parameters): that dtype, else None."""
    return layout["dtype"] if layout["precision"] == "fp8" and dtype in ("fp64", "fp16") else None
