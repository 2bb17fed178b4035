"""Profiler traces of chosen steps (`train.profile_steps=a:b`): torch.profiler records steps a..b on every
rank and writes one Chrome / Perfetto trace JSON per rank, `OUT/profile/rank<R>.steps<a>-<b>.json`, which the
run report links to. Each step is marked by a `scaletrain step <k>` range in the trace.

CPU activity is recorded always, CUDA kernels too when the run is on a GPU. A run resumed inside the window
profiles the steps it still runs (the file names say which); a run that stops before step b writes what it
recorded when it stops.
"""

from __future__ import annotations

from pathlib import Path

PROFILE_DIR = "profile"


class StepProfiler:
    """Starts torch.profiler before step a (or the first step run after it) and writes the trace after b."""

    def __init__(self, window: tuple[int, int], out: Path, rank: int, device):
        self.first, self.last = window
        self.dir, self.rank, self.device = out / PROFILE_DIR, rank, device
        self.prof = None
        self.range = None
        self.started_at = 0
        self.step = 0
        self.written: list[Path] = []

    def begin(self, step: int) -> None:
        import torch

        if self.prof is None and self.first <= step <= self.last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
            self.started_at = step
        if self.prof is not None:
            self.range = torch.profiler.record_function(f"scaletrain step {step}")
            self.range.__enter__()
            self.step = step

    def end(self, step: int) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.prof is not None and step >= self.last:
            self._write()

    def close(self) -> None:
        """Write what was recorded (a run stopped inside the window)."""
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.prof is not None:
            self._write()

    def _write(self) -> None:
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.steps{self.started_at}-{self.step}.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)
