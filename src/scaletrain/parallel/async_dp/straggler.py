"""Straggler injection: `parallel.slow_ranks=1:0.5` makes data-parallel rank 1 take 50% longer per step.

The delay is a sleep of `factor` x the rank's own measured forward+backward time of that step, taken right
after the backward, so the rank is slower in proportion to its work whatever the machine's load (a fixed sleep
would be a different fraction on a busy and on a quiet machine). It lets the hardware-efficiency side of
synchronous vs asynchronous training (Ho et al., SSP, NIPS 2013; Dutta et al., arXiv 1803.01113) be shown on
one machine; it is not meant for real runs.
"""

from __future__ import annotations

import time

from scaletrain.config.parse import parse_slow_ranks


class Straggler:
    """Sleeps `factor` x the measured compute time after each step of one data-parallel rank."""

    def __init__(self, factor: float):
        self.factor = factor
        self.slept_s = 0.0

    @classmethod
    def for_rank(cls, spec: str, dp: int, dp_rank: int) -> Straggler | None:
        factor = parse_slow_ranks(spec, dp).get(dp_rank, 0.0)
        return cls(factor) if factor > 0 else None

    def after_compute(self, compute_s: float) -> None:
        delay = self.factor * compute_s
        if delay > 0:
            time.sleep(delay)
            self.slept_s += delay


def wrap_engine(engine, straggler: Straggler | None) -> None:
    """Make `engine.forward_backward` sleep after the backward as the straggler (no-op for None)."""
    if straggler is None:
        return
    inner = engine.forward_backward

    def slow_forward_backward(micro, scale):
        t0 = time.perf_counter()
        out = inner(micro, scale)
        straggler.after_compute(time.perf_counter() - t0)
        return out

    engine.forward_backward = slow_forward_backward
