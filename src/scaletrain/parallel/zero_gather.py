"""The bytes of ZeRO-3's gathered parameters (Rajbhandari et al., arXiv 1910.02054 Sec. 5.3; FSDP's
reshard_after_forward): how many are alive at once during a step, the trainer's `mem_params_gathered`.

`parallel.reshard_after_forward` decides the peak: true releases a unit after its forward and gathers it again for its
backward (about the root and two blocks at once, with the prefetch), false keeps every unit gathered from its forward
to its backward (the whole model's parameters at the end of the forward). `plan/exact/gathered.py` predicts it.
"""

from __future__ import annotations

from typing import Any


class GatherMeter:
    """ZeRO-3's gathered parameter buffers: bytes alive now (`live`) and the most alive at once (`peak`). The two
    ZeroOptimizers of expert parallelism share one (`report_gathered`)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.live = self.peak = 0

    def add(self, group: Any, nbytes: int) -> None:
        """`group`'s flat buffer was allocated to be gathered into (`nbytes`)."""
        self.live += nbytes - self.held.get(id(group), 0)
        self.held[id(group)] = nbytes
        self.peak = max(self.peak, self.live)

    def drop(self, group: Any) -> None:
        """`group`'s buffer was released (nothing when it was not gathered)."""
        self.live -= self.held.pop(id(group), 0)


def report_gathered(engine: Any) -> None:
    """Report the engine's ZeRO-3 gathered-parameter peak as `mem_params_gathered` (one meter for the optimizer's
    parts that gather)."""
    from scaletrain.device.accounting import add_memory_report

    meters = [o for o in engine.optimizer.parts if isinstance(getattr(o, "gathered", None), GatherMeter)]
    if not meters:
        return
    meter = meters[0].gathered
    for o in meters[1:]:  # expert parallelism's pair gathers onto one device: one meter for both
        o.gathered = meter
    add_memory_report(engine, lambda: {"mem_params_gathered": meter.peak})
