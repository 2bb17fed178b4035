"""The tolerances of the layout matrix (`verify/matrix.py`, `verify/stepwise.py`): what "equal to one process"
means in each dtype (docs/verify.md).

- fp64: whole runs, element-wise within verify's defaults (the layouts differ from one process only in summation
  order, ~1e-15).
- fp32, bf16, fp16: step by step from the same state on the same routes (`verify/stepwise.py`), within bounds
  derived from the unit roundoff u of the coarsest rounding the run applies: the dtype's (2^-24, 2^-8, 2^-11: half
  the distance between 1 and the next number), or lossy activation compression's when coarser (memory.compress bf16:
  2^-8; int8: half a quantisation step of a block's largest value, 1/254 < 2^-8 of it). Set before they were
  measured (the compression term after the first measurement: fp32 layouts with int8-compressed activations
  differed by 1e-6 to 1e-5 in the loss, which fp32's u does not bound and bf16's does):
  - the loss of a step within `LOSS_UNITS` u (relative): one forward pass rounded in another order; the loss is a
    mean over the tokens, whose per-token errors mostly cancel;
  - the gradient norm within `GRAD_NORM_UNITS` u (relative): one backward pass; the norm averages the relative
    errors of all elements, grown through the depth of the model;
  - the parameters after the step within 2 sqrt(`FLIP_UNITS` u) of the step's size, plus 2u of the parameters'
    size (bf16 / fp16 parameters are the fp32 masters rounded: one ulp where two masters round apart). The first
    step of AdamW and SM3 moves each element by ±lr in the sign of its gradient, so an element whose gradient lies
    within rounding of zero moves by up to 2 lr more in one run than in the other; if at most a fraction f of the
    elements do, the difference is at most 2 sqrt(f) of the step. The bound allows f = `FLIP_UNITS` u (a gradient
    element within 16 u of its scale of zero). Later steps are smooth in the gradient and far inside it.
- train.precision=fp8 (fp32 or bf16 parameters; the FP8 GEMMs' inputs are bf16 under autocast or bf16 parameters):
  step by step as above, with u = `fp8_roundoff()` = sqrt(u_bf16 u_8), u_8 the coarsest float8 format of the recipe
  (e5m2, 2^-3, for the tensorwise recipe's output gradients; arXiv 2209.05433). From the same state, the layout casts
  the same bf16 values to float8 with the same scale (an amax along a split dimension is reduced over tp), except
  where its bf16 inputs differ by rounding (tensor parallelism adds partial products in another order): an element
  that moves by ~u_bf16 crosses a float8 rounding boundary with probability ~u_bf16 / u_8 and then moves by one
  float8 step ~u_8, so the elements differ by sqrt(u_bf16 u_8) in root mean square, which plays the role of u in
  the bounds above. Set before measuring; a layout without tp casts the same bf16 values (its differences are fp32
  rounding, far inside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RTOL_FP64, ATOL_FP64 = 1e-9, 1e-11

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
COMPRESS_ROUNDOFF = {"bf16": 2.0**-8, "int8": 2.0**-8}
"""memory.compress modes that round saved activations, and their unit roundoff (relu-mask is lossless)."""
FP8_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
"""Unit roundoff of the float8 formats (3 and 2 mantissa bits; arXiv 2209.05433)."""
LOSS_UNITS, GRAD_NORM_UNITS, FLIP_UNITS = 8, 16, 16

ROUTING_DISAGREEMENT = 0.25
"""Low-precision MoE layouts: the largest fraction of the layout's routing decisions that one process's own router,
on the layout's state, may decide otherwise (`model/routing_tape.py`). Set before measuring: rounding moves the few
tokens whose best scores lie within rounding of each other (a few percent in bf16), a router that the layout computes
wrongly decides independently of the reference (1 - 1/4 = 75% disagreement for 4 experts)."""


@dataclass(frozen=True)
class Tolerance:
    loss: float
    """Largest |loss - ref| / |ref| over the steps."""
    grad_norm: float
    """Largest |grad_norm - ref| / ref over the steps."""
    params: float
    """||W - W_ref|| / (||W_ref - W_before|| + 2u ||W_ref||) over all parameters, the largest over the steps."""


def unit_roundoff(dtype: str, compress: str = "none", precision: str = "dtype") -> float:
    """u of the coarsest rounding of a run in `dtype` with `memory.compress` (a mode or a comma list) and
    `train.precision` (fp8: `fp8_roundoff`)."""
    modes = [m.strip().lower() for m in str(compress).split(",")]
    u = max([UNIT_ROUNDOFF[dtype], *(COMPRESS_ROUNDOFF[m] for m in modes if m in COMPRESS_ROUNDOFF)])
    return max(u, fp8_roundoff()) if precision == "fp8" else u


def fp8_roundoff(recipe: str = "tensorwise") -> float:
    """The per-element roundoff one step of two FP8 runs differ by (module docstring): sqrt(u_in u_8), u_in the
    roundoff of the GEMMs' high-precision inputs (bf16: autocast around fp32 parameters, or bf16 ones) and u_8 the
    coarsest float8 format of the recipe (tensorwise: e5m2 for output gradients; rowwise: e4m3 throughout)."""
    u8 = FP8_ROUNDOFF["e5m2" if recipe == "tensorwise" else "e4m3"]
    return math.sqrt(UNIT_ROUNDOFF["bf16"] * u8)


def stepwise_bound(dtype: str, compress: str = "none", precision: str = "dtype") -> Tolerance:
    """The bounds of one low-precision step (module docstring)."""
    u = unit_roundoff(dtype, compress, precision)
    return Tolerance(loss=LOSS_UNITS * u, grad_norm=GRAD_NORM_UNITS * u, params=2 * math.sqrt(FLIP_UNITS * u))


def skip_margin(dtype: str, compress: str = "none", precision: str = "dtype") -> float:
    """δ: how far (relative) the loss scale may move before a run's fp16 skip decision must agree with the other's.
    The scaled gradients are linear in the loss scale, and one step of two runs differs in the gradient by the
    step's gradient bound (`GRAD_NORM_UNITS` u); so a run whose largest fp16 value is within that bound of the
    overflow threshold overflows when its scale is multiplied by 1 + δ, δ = `GRAD_NORM_UNITS` u. Set before
    measuring."""
    return stepwise_bound(dtype, compress, precision).grad_norm


TOLERANCE = {dtype: stepwise_bound(dtype) for dtype in UNIT_ROUNDOFF}
TOLERANCE["fp8"] = stepwise_bound("fp32", precision="fp8")  # train.precision=fp8 (fp32 or bf16 parameters: the same)


def tolerance_table() -> str:
    """docs/verify.md's table of tolerances (markdown), from the fp64 rtol/atol and `stepwise_bound`."""
    rows = ["| dtype | compared | loss (relative) | gradient norm (relative) | parameters |",
            "|---|---|---|---|---|",
            f"| fp64 | every step of one run | rtol {RTOL_FP64:g}, atol {ATOL_FP64:g} | rtol {RTOL_FP64:g} | "
            f"element-wise rtol {RTOL_FP64:g}, atol {ATOL_FP64:g} |"]
    for dtype, u in UNIT_ROUNDOFF.items():
        t = stepwise_bound(dtype)
        rows.append(f"| {dtype} (u = 2^{round(math.log2(u))}) | each step from the layout's state | "
                    f"{LOSS_UNITS} u = {t.loss:.2g} | {GRAD_NORM_UNITS} u = {t.grad_norm:.2g} | "
                    f"2 sqrt({FLIP_UNITS} u) = {t.params:.2g} of the step |")
    t = stepwise_bound("fp32", "int8")
    rows.append(f"| fp32 or fp16 with memory.compress bf16 or int8 (u = 2^-8) | each step from the layout's state | "
                f"{LOSS_UNITS} u = {t.loss:.2g} | {GRAD_NORM_UNITS} u = {t.grad_norm:.2g} | "
                f"2 sqrt({FLIP_UNITS} u) = {t.params:.2g} of the step |")
    t, u = TOLERANCE["fp8"], fp8_roundoff()
    rows.append(f"| precision=fp8, fp32 or bf16 (u = sqrt(2^-8 2^-3) = {u:.2g}) | each step from the layout's state | "
                f"{LOSS_UNITS} u = {t.loss:.2g} | {GRAD_NORM_UNITS} u = {t.grad_norm:.2g} | "
                f"2 sqrt({FLIP_UNITS} u) = {t.params:.2g} of the step |")
    return "\n".join(rows) + "\n"
