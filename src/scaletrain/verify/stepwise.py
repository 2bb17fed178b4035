"""Low-precision layouts against one process, one step at a time from the same state (docs/verify.md, "Low
precision: step by step, from the same state, on the same routes").

In fp64 a layout and one process differ by summation order only (~1e-15) and stay together for any number of steps,
so the matrix compares whole runs element-wise. In fp32, bf16 and fp16 they round differently, and training
amplifies it: a token whose two best expert scores lie within rounding goes to another expert (a discrete change),
and the first step of AdamW and SM3 is a step of ±lr in the sign of each gradient element, so an element whose
gradient lies within rounding of zero moves by lr one way in one run and the other way (or, with SM3, not at all) in
the other; the next steps start from different weights. How far two runs drift then depends on the CPU's kernels,
not on the layout (the same layout differed from one process by 0.07, 0.09 and 0.22 in its third gradient norm on
three kernel sets). A whole-run bound fitted to one machine is no proof; so a low-precision layout is compared step
by step:

1. the layout trains its steps as `scaletrain train` does (2BW drains every step), writes a checkpoint after each
   (the layout-independent format of `train/checkpoint.py`: parameters, fp32 masters, optimizer state, the loss
   scaler, 2BW's older weights) and records its MoE routing decisions (`model/routing_tape.py`);
2. one process computes each step k from the layout's checkpoint of step k - 1 (step 1 from the common
   initialisation), routing every token as the layout did (teacher forcing: gates, capacity, losses and gradients
   stay its own), and compares that step's loss, gradient norm and new parameters with the layout's.

The differences are then those of one step's rounding, which the precision bounds (`tolerances.stepwise_bound`).
The routing check: the one process's own router, which is still run, may disagree with the layout's decisions on at
most `ROUTING_DISAGREEMENT` of them. What this does not cover, the fp64 rows do: every dimension's value appears in
fp64 layouts too (all pairs), compared over whole runs element-wise, routing included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.verify.layouts import STEPS, Layout, reference_config
from scaletrain.verify.tolerances import ROUTING_DISAGREEMENT, stepwise_bound

if TYPE_CHECKING:
    from scaletrain.verify.runs import Outcome, Run


@dataclass
class StepDiff:
    """One step of a layout against one process started from the layout's state before it."""

    loss: float
    """|loss - ref| / |ref|."""
    grad_norm: float
    """|grad_norm - ref| / ref (0 when both skipped the step for fp16 overflow)."""
    params: float
    """||W_layout - W_ref|| / (||W_ref - W_before|| + 2u ||W_ref||): the parameter difference in units of the step
    (plus the rounding of the stored parameters), all parameters together."""
    skipped: tuple[bool, bool] = (False, False)
    """(layout, one process) skipped the step for fp16 overflow."""


@dataclass
class Stepwise:
    """What the one process computed from the layout's checkpoints, and the differences of each step."""

    steps: dict[int, StepDiff]
    routing: tuple[int, int] | None
    """(decisions the one process's router would have taken otherwise, decisions) over all steps; None: no MoE."""


def checkpoints(root: str | Path) -> Path:
    return Path(root) / "checkpoints"


def run_layout(layout: Layout, root: str | Path, env=None, dtype: str | None = None,
               prepare: Callable | None = None) -> Run:
    """Train the layout (all its ranks call this together), writing a checkpoint into `root` after every step and
    recording the routing decisions; rank 0's `Run` carries the decisions of all ranks."""
    import torch

    from scaletrain.model.routing_tape import RoutingTape
    from scaletrain.train import resume
    from scaletrain.train.checkpoint import Saver
    from scaletrain.train.trainer import Trainer
    from scaletrain.verify.runs import Run, layout_config

    cfg = layout_config(layout, dtype)
    t = Trainer(cfg, None, env)
    if prepare is not None:
        prepare(t)
    t.saver = Saver(checkpoints(root), t.rank, keep=STEPS + 1)
    tape = RoutingTape().attach(t.model) if cfg.model.moe.experts else None
    losses, norms = {}, {}
    while t.step < cfg.train.steps:
        t.step += 1
        row = t.train_step(t.step)  # drained: a checkpoint holds nothing of the next step
        losses[t.step], norms[t.step] = row["loss"], row["grad_norm"]
        resume.save(t)
    decisions = None
    if tape is not None:
        decisions = tape.decisions
        if env is not None and env.world_size > 1:
            every: list = [None] * env.world_size
            torch.distributed.all_gather_object(every, decisions)
            decisions = merge(every)
    t.mesh.close()
    keep = env is None or env.rank == 0
    return Run(losses, norms, None, decisions if keep else None)


def merge(tables: list[dict]) -> dict:
    """The routing decisions of all ranks in one table per (layer, step) (-1: not recorded by that rank)."""
    import torch

    out: dict = {}
    for decisions in tables:
        for key, table in decisions.items():
            have = out.get(key)
            if have is None:
                out[key] = table.clone()
                continue
            if have.shape[0] < table.shape[0]:
                have = torch.cat([have, have.new_full((table.shape[0] - have.shape[0], have.shape[1]), -1)])
            have[: table.shape[0]] = torch.maximum(have[: table.shape[0]], table)
            out[key] = have
    return out


def reference(layout: Layout, root: str | Path, got: Run, dtype: str | None = None,
              masked: dict[str, slice] | None = None) -> Stepwise:
    """One process, each step from the layout's checkpoint of the step before (written by `run_layout` into
    `root`), on the layout's routes (`got.decisions`). `masked`: parameter entries left out of the comparison
    (key biases under scale-free optimizers: `matrix.key_bias_slices`)."""
    import torch

    from scaletrain.config import validate
    from scaletrain.model.routing_tape import RoutingTape
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train.resume import load_engine, restore_trainer
    from scaletrain.train.state import param_names
    from scaletrain.train.trainer import Trainer
    from scaletrain.verify.runs import StaleWeights, fp8_keeps_dtype

    cfg = reference_config(layout)
    if dtype and fp8_keeps_dtype(layout, dtype) is None:
        cfg.train.dtype = dtype
    cfg = validate(cfg, 1)
    dtype = cfg.train.dtype
    t = Trainer(cfg)
    tape = RoutingTape(got.decisions).attach(t.model) if got.decisions is not None else None
    stale = StaleWeights(t) if layout["schedule"] == "2bw" else None
    names = param_names(t.model)
    before = {k: v.to(torch.float64) for k, v in t.full_state().items()}
    steps: dict[int, StepDiff] = {}
    for k in range(1, STEPS + 1):
        if k > 1:
            d = ckpt.step_dir(checkpoints(root), k - 1)
            load_engine(t.engine, d)
            restore_trainer(t, ckpt.read_meta(d))
            if stale is not None:  # a drained 2BW step's checkpoint: W(t) in model/, W(t-1) in stale/
                older = ckpt.read_tensors(d, "stale/")
                stale.older = [older[names[id(p)]].to(p.dtype) for p in stale.params]
            before = ckpt.read_tensors(d, "model/", torch.float64)
        t.step = k
        row = stale(k) if stale is not None else t.train_step(k)
        theirs = ckpt.read_tensors(ckpt.step_dir(checkpoints(root), k), "model/", torch.float64)
        mine = t.full_state()
        for name, part in (masked or {}).items():
            if name in theirs:
                theirs[name][part] = mine[name][part].to(torch.float64)
        lay = {"loss": got.losses[k], "grad_norm": got.grad_norms[k]}
        steps[k] = _diff(lay, row, theirs, {n: mine[n].to(torch.float64) for n in theirs}, before, dtype)
    routing = (tape.differ, tape.total) if tape is not None else None
    return Stepwise(steps, routing)


def _diff(lay: dict, ref: dict, got: dict, mine: dict, before: dict, dtype: str) -> StepDiff:
    from scaletrain.verify.tolerances import UNIT_ROUNDOFF

    u = UNIT_ROUNDOFF[dtype]
    skipped = (not math.isfinite(lay["grad_norm"]), not math.isfinite(ref["grad_norm"]))
    loss = abs(lay["loss"] - ref["loss"]) / abs(ref["loss"]) if ref["loss"] else math.inf
    norm = 0.0 if all(skipped) else abs(lay["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-300)
    diff = math.sqrt(sum(float((got[n] - mine[n]).square().sum()) for n in got))
    step = math.sqrt(sum(float((mine[n] - before[n]).square().sum()) for n in got))
    size = math.sqrt(sum(float(mine[n].square().sum()) for n in got))
    return StepDiff(loss, norm, diff / (step + 2 * u * size), skipped)


def compare(layout: Layout, ref: Stepwise, dtype: str | None = None) -> Outcome:
    """The layout's steps against the one process's: every step within `stepwise_bound` (of the dtype, compression
    and precision: FP8's `tolerances.fp8_roundoff`), the same steps
    skipped, the routing mostly agreeing."""
    from scaletrain.verify.runs import Outcome, fp8_keeps_dtype

    dtype = fp8_keeps_dtype(layout, dtype) or dtype or layout["dtype"]
    bound = stepwise_bound(dtype, layout["compress"], layout["precision"])
    s = ref.steps.values()
    loss = max(d.loss for d in s)
    norm = max(d.grad_norm for d in s)
    params = max(d.params for d in s)
    finite = all(math.isfinite(x) for d in s for x in (d.loss, d.grad_norm, d.params))
    same_skips = all(d.skipped[0] == d.skipped[1] for d in s)
    ok = finite and same_skips and loss <= bound.loss and norm <= bound.grad_norm and params <= bound.params
    routing = math.nan
    if ref.routing is not None:
        routing = ref.routing[0] / max(ref.routing[1], 1)
        ok = ok and ref.routing[1] > 0 and routing <= ROUTING_DISAGREEMENT
    error = "" if same_skips else "fp16 overflow skipped different steps"
    return Outcome(layout.name, layout.world, dtype, ok, loss, norm, params, "", error, routing)
