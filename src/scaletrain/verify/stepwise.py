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
Whether fp16 skips a step for overflow is a discrete decision like a route: a gradient that lands at 65504 in one
run is inf in the other. The one process takes the layout's decision (`SkipForcing`: it skips where the layout
skipped; where the layout stepped and it overflowed, it takes the step at the loss scale divided by 1 + δ), and a
decision taken on one side only must be marginal: the run that did not overflow overflows with its loss scale
multiplied by 1 + δ, or the run that overflowed does not with it divided by 1 + δ, δ the step's gradient bound
(`tolerances.skip_margin`; the scaled gradients are linear in the loss scale). What was forced is recorded in the
outcome; a one-sided decision beyond the margin (a layout that forgets to unscale, or reduces the overflow flag over
too small a group) fails, naming the step and both runs' values.
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
from scaletrain.verify.tolerances import ROUTING_DISAGREEMENT, skip_margin, stepwise_bound

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
    """(layout, one process) skipped the step for fp16 overflow: one process's own decision, before forcing."""
    forced: str = ""
    """A one-sided skip decision the one process took from the layout, and why it was marginal ("": none)."""
    gross: str = ""
    """A one-sided skip decision beyond the margin (`tolerances.skip_margin`), naming both runs' values ("": none)."""


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
              masked: dict[str, slice] | None = None, prepare: Callable | None = None) -> Stepwise:
    """One process, each step from the layout's checkpoint of the step before (written by `run_layout` into
    `root`), on the layout's routes (`got.decisions`) and with its fp16 skip decisions (`SkipForcing`). `masked`:
    parameter entries left out of the comparison (key biases under scale-free optimizers:
    `matrix.key_bias_slices`); `prepare(trainer)` may patch the one process's trainer first (tests set its loss
    scale with it)."""
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
    if prepare is not None:
        prepare(t)
    tape = RoutingTape(got.decisions).attach(t.model) if got.decisions is not None else None
    stale = StaleWeights(t) if layout["schedule"] == "2bw" else None
    forcing = SkipForcing(t, tape, skip_margin(dtype, layout["compress"], layout["precision"]))
    names = param_names(t.model)
    before = {k: v.to(torch.float64) for k, v in t.full_state().items()}
    steps: dict[int, StepDiff] = {}

    def load(k: int) -> None:  # the layout's state after step k - 1 (step 1: the common initialisation)
        if k == 1:
            return
        d = ckpt.step_dir(checkpoints(root), k - 1)
        load_engine(t.engine, d)
        restore_trainer(t, ckpt.read_meta(d))
        if stale is not None:  # a drained 2BW step's checkpoint: W(t) in model/, W(t-1) in stale/
            older = ckpt.read_tensors(d, "stale/")
            stale.older = [older[names[id(p)]].to(p.dtype) for p in stale.params]

    for k in range(1, STEPS + 1):
        load(k)
        if k > 1:
            before = ckpt.read_tensors(ckpt.step_dir(checkpoints(root), k - 1), "model/", torch.float64)
        t.step = k
        lay = {"loss": got.losses[k], "grad_norm": got.grad_norms[k]}
        row, own, forced, gross = forcing.step(k, stale if stale is not None else t.train_step, load, lay)
        theirs = ckpt.read_tensors(ckpt.step_dir(checkpoints(root), k), "model/", torch.float64)
        mine = t.full_state()
        for name, part in (masked or {}).items():
            if name in theirs:
                theirs[name][part] = mine[name][part].to(torch.float64)
        diff = _diff(lay, row, theirs, {n: mine[n].to(torch.float64) for n in theirs}, before, dtype)
        steps[k] = StepDiff(diff.loss, diff.grad_norm, diff.params, (diff.skipped[0], own), forced, gross)
        if gross:  # not the same run from here on (and where the layout stepped, its next state is not ours)
            break
    routing = (tape.differ, tape.total) if tape is not None else None
    return Stepwise(steps, routing)


class SkipForcing:
    """Teacher forcing of the fp16 skip decision on the one process (module docstring): its optimizer's `unscale_`
    still checks its own gradients (`own`, and their norm before the check, `norm`) and reports an overflow where
    the layout skipped (`skip`). `step` takes one step with the layout's decision and checks that a decision taken
    on one side only is marginal."""

    def __init__(self, trainer, tape=None, margin: float = 0.0):
        self.trainer, self.tape, self.margin = trainer, tape, margin
        self.skip = False
        self.own = False
        self.norm = math.nan
        opt = trainer.engine.optimizer
        self._unscale = opt.unscale_
        opt.unscale_ = self._unscale_

    def _unscale_(self, inv_scale: float):
        opt = self.trainer.engine.optimizer
        self.norm = float(opt.local_grad_sq().sqrt()) * inv_scale  # one process: its whole gradient's norm
        flag = self._unscale(inv_scale)
        self.own = bool(flag)
        return flag | self.skip

    def _try(self, run: Callable[[int], dict], k: int, skip: bool, scale: float | None) -> tuple[dict, bool, float]:
        """Step k with the skip forced or not, at `scale` (None: the scaler's own): (row, own overflow, norm)."""
        t = self.trainer
        if scale is not None:
            t.scaler.scale = scale
        self.skip = skip
        row = run(k)
        return row, self.own or not math.isfinite(row["loss"]), self.norm

    def step(self, k: int, run: Callable[[int], dict], load: Callable[[int], None],
             lay: dict) -> tuple[dict, bool, str, str]:
        """Step k with the layout's skip decision (`lay`: its loss and gradient norm, NaN when it skipped; `load(k)`
        restores the state before step k): (row, one process's own overflow at the layout's scale, what was forced,
        the message of a decision beyond the margin)."""
        t = self.trainer
        lay_skip = not math.isfinite(lay["grad_norm"])
        saved = self._snapshot()
        scale = t.scaler.scale if t.scaler is not None else None
        row, own, norm = self._try(run, k, lay_skip, None)
        after = {"skipped": t.skipped, "rng": t.rng}
        if own == lay_skip:
            return row, own, "", ""
        if scale is None:  # no loss scaler: a non-finite loss or gradient on one side is no rounding
            side = "the layout" if lay_skip else "one process"
            return row, own, "", f"step {k}: only {side} had a non-finite loss or gradient (no loss scale to blame)"
        # A skip on one side only: the state is still that before step k (a skip changes only the scaler).
        up, down = scale * (1 + self.margin), scale / (1 + self.margin)
        self._restore(saved, load, k)
        if lay_skip:  # one process did not overflow: does it within the margin?
            _, over, _ = self._try(run, k, True, up)
            t.scaler.load_state_dict(saved["scaler_after_skip"])  # the state after the forced skip, as before
            t.skipped, t.rng = after["skipped"], after["rng"]
            if over:
                return row, own, (f"step {k}: skipped as the layout did (one process overflows at loss scale "
                                  f"{scale:g} x {1 + self.margin:.4g})"), ""
            return row, own, "", (f"step {k}: the layout skipped for fp16 overflow at loss scale {scale:g} and one "
                                  f"process did not, not even at {up:g} = scale x (1 + margin {self.margin:.3g}) "
                                  f"(gradient norms: layout non-finite, one process {norm:.6g})")
        row2, over, norm2 = self._try(run, k, False, down)
        if not over:
            return row2, own, (f"step {k}: stepped as the layout did, at loss scale {scale:g} / {1 + self.margin:.4g} "
                               "(one process overflows at the layout's scale)"), ""
        return row, own, "", (f"step {k}: one process overflowed at loss scale {scale:g} and still at {down:g} = "
                              f"scale / (1 + margin {self.margin:.3g}) where the layout did not (gradient norms: "
                              f"layout {lay['grad_norm']:.6g}, one process {norm:.6g})")

    def _snapshot(self) -> dict:
        t = self.trainer
        out = {"skipped": t.skipped, "rng": t.rng.clone() if hasattr(t.rng, "clone") else t.rng,
               "tape": (self.tape.differ, self.tape.total) if self.tape is not None else None}
        if t.scaler is not None:
            from scaletrain.memory.precision import DynamicLossScaler

            out["scaler"] = t.scaler.state_dict()
            after = DynamicLossScaler(**out["scaler"])
            after.update(True)
            out["scaler_after_skip"] = after.state_dict()
        return out

    def _restore(self, saved: dict, load: Callable[[int], None], k: int) -> None:
        """The state before step k again, after a step that skipped: the checkpoint (step 1: the parameters and
        optimizer state are untouched by the skip), the scaler, the skip count, the dropout stream, the routing
        counts."""
        t = self.trainer
        load(k)
        t.step, t.skipped, t.rng = k, saved["skipped"], saved["rng"]
        if t.scaler is not None:
            t.scaler.load_state_dict(saved["scaler"])
        if self.tape is not None:
            self.tape.differ, self.tape.total = saved["tape"]


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
    and precision: FP8's `tolerances.fp8_roundoff`), a skip decision taken on one side only marginal (then it was
    teacher-forced, and the outcome says so), the routing mostly agreeing."""
    from scaletrain.verify.runs import Outcome, fp8_keeps_dtype

    dtype = fp8_keeps_dtype(layout, dtype) or dtype or layout["dtype"]
    bound = stepwise_bound(dtype, layout["compress"], layout["precision"])
    s = ref.steps.values()
    loss = max(d.loss for d in s)
    norm = max(d.grad_norm for d in s)
    params = max(d.params for d in s)
    finite = all(math.isfinite(x) for d in s for x in (d.loss, d.grad_norm, d.params))
    gross = [d.gross for d in s if d.gross]
    unexplained = [k for k, d in ref.steps.items() if d.skipped[0] != d.skipped[1] and not d.forced and not d.gross]
    if unexplained:
        gross.append(f"fp16 overflow skipped different steps ({', '.join(map(str, unexplained))})")
    ok = finite and not gross and loss <= bound.loss and norm <= bound.grad_norm and params <= bound.params
    routing = math.nan
    if ref.routing is not None:
        routing = ref.routing[0] / max(ref.routing[1], 1)
        ok = ok and ref.routing[1] > 0 and routing <= ROUTING_DISAGREEMENT
    forced = "; ".join(d.forced for d in s if d.forced)
    return Outcome(layout.name, layout.world, dtype, ok, loss, norm, params, "", "; ".join(gross), routing, forced)
