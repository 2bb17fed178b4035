"""The tolerances of the layout matrix (`verify/matrix.py`): what "equal to one process" means in each dtype.

fp64 compares element-wise within verify's defaults (the layouts differ from one process only in summation
order); fp32, bf16 and fp16 compare relative differences within 3x the largest measured over covering-set layouts
(docs/verify.md).
"""

from __future__ import annotations

from dataclasses import dataclass

RTOL_FP64, ATOL_FP64 = 1e-9, 1e-11


@dataclass(frozen=True)
class Tolerance:
    loss: float
    """Largest |loss - ref| / |ref| over the steps."""
    grad_norm: float
    """Largest |grad_norm - ref| / ref over the steps."""
    params: float
    """||params - ref||_2 / ||ref||_2 over all parameters at the end."""


# 3x the largest difference measured over covering-set layouts run in each dtype (docs/verify.md, "Where the
# tolerances come from": two measurements, 122 layouts of the 2- and 4-process sets in their own dtypes, 41 fp32,
# 41 bf16, 40 fp16; `benchmarks/bench_matrix_noise.py` measures every layout in every dtype); tests/test_matrix.py
# checks the docs.
TOLERANCE = {
    "fp32": Tolerance(loss=1.4e-4, grad_norm=1.5e-3, params=3.4e-3),
    "bf16": Tolerance(loss=3.8e-3, grad_norm=4.7e-2, params=0.1),
    "fp16": Tolerance(loss=2.9e-3, grad_norm=0.16, params=3.8e-2),
    # train.precision=fp8 layouts (the `precision` dimension), whatever their dtype: 3x the largest over 22 FP8
    # layouts of 4 processes (the 11 of the 4-process covering set and 11 variants of its widest one; docs/verify.md).
    # Layouts without tp were exact to fp32 rounding; with tp a bf16 difference moves a tensorwise scale and every
    # float8 rounding after it, which SM3's sign-like first steps amplify (the gradient-norm value comes from SM3)
    "fp8": Tolerance(loss=7.5e-3, grad_norm=1.3, params=0.18),
}


def tolerance_table() -> str:
    """docs/verify.md's table of tolerances (markdown), from `TOLERANCE` and the fp64 rtol/atol."""
    rows = ["| dtype | loss (relative, every step) | gradient norm (relative, every step) | parameters |",
            "|---|---|---|---|",
            f"| fp64 | rtol {RTOL_FP64:g}, atol {ATOL_FP64:g} | rtol {RTOL_FP64:g} | "
            f"element-wise rtol {RTOL_FP64:g}, atol {ATOL_FP64:g} |"]
    for dtype, t in TOLERANCE.items():
        rows.append(f"| {dtype} | {t.loss:.2g} | {t.grad_norm:.2g} | relative L2 {t.params:.2g} |")
    return "\n".join(rows) + "\n"
