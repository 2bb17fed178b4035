"""How far the planner's predictions can be trusted: its error on the published runs held out from its calibration
(tests/test_plan_published.py, docs/planner-validation.md section 1b) and the range those runs cover. The search ranks
with it (`rank_key`) and the report prints it beside every candidate.
"""

from __future__ import annotations

from scaletrain.plan.analytic.estimate import Estimate

TRUST = 0.20
"""How far a predicted step time can be trusted: the 90th percentile of the planner's |error| on the published runs
held out from its calibration (9 in 10 of them within it). Differences between layouts smaller than this are not ones
the planner can vouch for."""

VALIDATED_ZERO3_DP = 128
"""The widest ZeRO-3 / FSDP data-parallel group among the held-out published runs (MPT on 128 A100 40GB)."""


def coverage_notes(c: Estimate) -> list[str]:
    """Where a candidate goes beyond what the planner was checked against."""
    lay = c.layout
    if lay.zero == 3 and lay.dp > VALIDATED_ZERO3_DP:
        return [f"ZeRO-3 over {lay.dp} data-parallel ranks is beyond the validated range (the widest held-out FSDP run"
                f" has {VALIDATED_ZERO3_DP}); DeepSpeed's 2021 ZeRO-3 on 384-2240 GPUs ran 1.4-4.0x slower than this"
                " model's default predicts (docs/planner-validation.md); ranked as if its step took the held-out"
                f" error ({TRUST:.0%}) longer"]
    return []


def rank_key(c: Estimate) -> tuple[float, float]:
    """The search's order: predicted step time, then memory. A layout beyond the validated range ranks as if its step
    took the held-out error longer: it comes first only when it beats every validated layout by more than the error
    the planner has on the runs it was checked against."""
    penalty = 1 + TRUST if coverage_notes(c) else 1.0
    return c.step_time_s * penalty, c.memory["total"]


def trusted(best: Estimate, other: Estimate) -> bool:
    """Whether `best` is faster than `other` by more than the planner's held-out error."""
    return other.step_time_s > best.step_time_s * (1 + TRUST)
