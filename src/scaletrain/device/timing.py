"""Step times without a host synchronisation inside the step.

On CUDA the host only queues work, so a step's wall time is read from two CUDA events recorded on the current
stream at its start and end (`torch.cuda.Event(enable_timing=True)`); their elapsed time is asked for only when
the step's metrics are written (`train.log_every`), by which time the events have completed or the one wait for
the newest covers all older ones. On CPU the work is done when the host returns, so `time.perf_counter` at both
ends is exact and costs nothing.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class PendingSeconds:
    """The duration of one step, readable later (`seconds()`), without waiting for the device now."""

    def __init__(self, start: Any, end: Any, cuda: bool):
        self.start, self.end, self.cuda = start, end, cuda
        self._value: float | None = None if cuda else end - start

    def seconds(self) -> float:
        if self._value is None:
            self.end.synchronize()  # the one wait: for the newest event, so older ones are done too
            self._value = self.start.elapsed_time(self.end) / 1000.0
        return self._value


class StepTimer:
    """`begin()` at the start of a step, `end(mark)` at its end -> PendingSeconds."""

    def __init__(self, device: torch.device, cuda: Any = None):
        self.cuda = device.type == "cuda"
        self._cuda = cuda if cuda is not None else (torch.cuda if self.cuda else None)

    def begin(self) -> Any:
        if self.cuda:
            ev = self._cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def end(self, mark: Any) -> PendingSeconds:
        if self.cuda:
            ev = self._cuda.Event(enable_timing=True)
            ev.record()
            return PendingSeconds(mark, ev, True)
        return PendingSeconds(mark, time.perf_counter(), False)
