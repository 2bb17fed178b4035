"""fp16 overflow skips in the step-by-step comparison (verify/stepwise.py, docs/verify.md "Low precision"): whether
a step overflows is a discrete decision on rounding-level differences, so the one process takes the layout's decision
(teacher forcing) and a decision taken on one side only must be marginal: within `tolerances.skip_margin` δ of the
loss scale at which the other run's decision changes.

The layouts here (dp2, fp16) are planted with a loss scale that is `f` times the one they report, so their skip
decision differs from one process's exactly where we put it: one process's own overflow threshold S* (the smallest
loss scale at which its first step overflows) is found first, then the runs are started at scales around it.
- f = 1 + δ/2 (a rounding-level difference) at a loss scale just below S*: the layout skips, one process would not;
  compared and PASS, the forced skip recorded. The reverse (f = 1 / (1 + δ/2) just above S*: one process would skip,
  the layout steps) PASSes with one process's step taken at the scale divided by 1 + δ.
- f = 4 (a layout whose fp16 gradients are 4x too large when it checks them) or 1/4: FAIL, the message naming the
  step and both runs' values. Neither crashes the comparison (the first case used to stop on the missing optimizer
  state of a skipped first step, a CheckpointError).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from scaletrain.verify.layouts import Layout
from scaletrain.verify.tolerances import skip_margin

LAYOUT = Layout.of(dp=2, dtype="fp16")
DELTA = skip_margin("fp16")
# (name, f: the layout's real loss scale over the one it reports, the start scale over one process's threshold S*)
CASES = [("layout skips, marginal", 1 + DELTA / 2, 1 / (1 + DELTA / 4)),
         ("layout skips, gross", 4.0, 0.5),
         ("one process skips, marginal", 1 / (1 + DELTA / 2), 1 + DELTA / 4),
         ("one process skips, gross", 0.25, 2.0)]


def _set_scale(scale: float, f: float = 1.0):
    """prepare(trainer): start the loss scaler at `scale`; f != 1 plants a layout that scales its loss by f x scale
    (and unscales by it, so its loss and unscaled gradients stay right) while reporting `scale`."""

    def prepare(t):
        t.scaler.scale = scale
        if f == 1.0:
            return
        eng, opt = t.engine, t.engine.optimizer
        fb, unscale = eng.forward_backward, opt.unscale_
        eng.forward_backward = lambda micro, factor: fb(micro, factor * f) / f
        opt.unscale_ = lambda inv: unscale(inv / f)

    return prepare


@pytest.fixture(scope="module")
def threshold() -> float:
    """One process's overflow threshold at step 1: the smallest loss scale whose first step overflows, to a relative
    δ/8 (bisection on log scale; probes are forced skips, so the state never changes)."""
    from scaletrain.config import validate
    from scaletrain.train.trainer import Trainer
    from scaletrain.verify.layouts import reference_config
    from scaletrain.verify.stepwise import SkipForcing

    t = Trainer(validate(reference_config(LAYOUT), 1))
    forcing = SkipForcing(t)
    saved = t.scaler.state_dict()

    def overflows(scale: float) -> bool:
        t.scaler.load_state_dict(saved)
        return forcing._try(t.train_step, 1, True, scale)[1]

    lo, hi = 1.0, 2.0**16
    while overflows(lo):
        lo, hi = lo / 16, lo
    while not overflows(hi):
        lo, hi = hi, hi * 16
    while hi / lo > 1 + DELTA / 8:
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if overflows(mid) else (mid, hi)
    t.mesh.close()
    return hi


def _layouts(rank, world, roots, starts):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.verify.stepwise import run_layout

    torch.set_num_threads(1)
    env = DistEnv(rank, world, 0, "test")
    return [run_layout(LAYOUT, roots[i], env, prepare=_set_scale(start, f)) for i, (_, f, start) in enumerate(starts)]


@pytest.fixture(scope="module")
def outcomes(threshold, tmp_path_factory):
    """{case: Outcome}: the four planted layouts (one launch of two ranks) against one process each."""
    from scaletrain.verify.stepwise import compare, reference

    top = tmp_path_factory.mktemp("skips")
    roots = [str(top / f"run{i}") for i in range(len(CASES))]
    starts = [(name, f, threshold * at) for name, f, at in CASES]
    runs = run_ranks(_layouts, 2, roots, starts, timeout=300)[0]
    return {name: compare(LAYOUT, reference(LAYOUT, root, got, prepare=_set_scale(start)))
            for (name, _, start), root, got in zip(starts, roots, runs)}


def test_a_marginal_skip_on_the_layout_only_is_teacher_forced_and_passes(outcomes):
    o = outcomes["layout skips, marginal"]
    print(o.result, o.error, o.loss, o.grad_norm, o.params)  # shown with pytest -rP
    assert o.ok, (o.result, o.error)
    assert o.forced.startswith("step 1: skipped as the layout did"), o.forced
    assert o.result.startswith("PASS (teacher-forced: step 1"), o.result


def test_a_marginal_skip_on_one_process_only_steps_at_the_lowered_scale_and_passes(outcomes):
    o = outcomes["one process skips, marginal"]
    print(o.result, o.error, o.loss, o.grad_norm, o.params)  # shown with pytest -rP
    assert o.ok, (o.result, o.error, o.loss, o.grad_norm, o.params)
    assert o.forced.startswith("step 1: stepped as the layout did"), o.forced


def test_a_gross_skip_on_the_layout_only_fails_naming_the_step_and_both_values(outcomes):
    o = outcomes["layout skips, gross"]
    print(o.result, o.error, o.loss, o.grad_norm, o.params)  # shown with pytest -rP
    assert not o.ok
    assert o.error.startswith("step 1: the layout skipped for fp16 overflow at loss scale "), o.error
    assert "and one process did not, not even at" in o.error, o.error
    assert "(gradient norms: layout non-finite, one process " in o.error, o.error
    assert "\n" not in o.error


def test_a_gross_skip_on_one_process_only_fails_naming_the_step_and_both_values(outcomes):
    o = outcomes["one process skips, gross"]
    print(o.result, o.error, o.loss, o.grad_norm, o.params)  # shown with pytest -rP
    assert not o.ok
    assert o.error.startswith("step 1: one process overflowed at loss scale "), o.error
    assert "where the layout did not (gradient norms: layout " in o.error, o.error
    assert "\n" not in o.error
