"""What a training run reports besides metrics.jsonl, behind one object the trainer calls: the run's
description (`run_info.json`, `memory_ranks.json`), TensorBoard events, profiler traces, and the HTML report
refreshed at each checkpoint and written at the end.

None of it may fail a run: an error in any of these is logged as one line on stderr and that observer is
switched off for the rest of the run (the report is still attempted at the next checkpoint); metrics.jsonl,
checkpoints and the other outputs are untouched, and the report file is replaced atomically.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scaletrain.config.parse import parse_steps
from scaletrain.errors import DiskFull, disk_full, disk_full_line
from scaletrain.report.profile import StepProfiler


def warn(what: str, error: BaseException) -> None:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    sys.stderr.write(f"scaletrain: warning: {what} failed ({type(error).__name__}: {first}); the run goes on\n")
    sys.stderr.flush()


def safely(what: str, fn: Callable[[], Any]) -> bool:
    """Run fn; on any error log one line and return False."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reporting must never fail the run
        if disk_full(e):  # but a full disk stops it at the next metrics row or checkpoint: say it once, now
            raise e if isinstance(e, DiskFull) else DiskFull(disk_full_line(e)) from None
        warn(what, e)
        return False
    return True


class RunObservers:
    """The trainer's reporting hooks. Disabled entirely when the trainer has no output directory."""

    def __init__(self, trainer) -> None:
        cfg, self.out = trainer.cfg, trainer.out
        self.cfg, self.rank = cfg, trainer.rank
        self.tb = None
        self.profiler: StepProfiler | None = None
        self.trace_written = False
        if self.out is None:
            return
        from scaletrain.distributed.process_group import detect_env
        from scaletrain.report.runinfo import record_run_info

        env = detect_env()
        launcher = env.launcher if env is not None else ("test harness" if trainer.mesh.world_size > 1 else "single")
        engine = getattr(trainer, "engine", None)  # the asynchronous runners have none (and no fp8: validate())
        fp8 = engine.fp8.info() if engine is not None and engine.fp8 is not None else None  # train.precision=fp8
        safely("recording run_info.json",
               lambda: record_run_info(self.out, self.rank, trainer.device, launcher, fp8))
        window = parse_steps(cfg.train.profile_steps)
        if window is not None:
            self.profiler = StepProfiler(window, self.out, self.rank, trainer.device)
        if cfg.train.tensorboard and self.rank == 0:
            from scaletrain.report.tensorboard import TensorBoardLog

            def open_tb() -> None:
                self.tb = TensorBoardLog(self.out / "tb", trainer.step + 1)

            safely("opening TensorBoard event files", open_tb)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one optimizer step: the profiler's window."""
        if self.profiler is not None and not safely("starting the profiler", lambda: self.profiler.begin(step)):
            self.profiler = None
        yield
        if self.profiler is not None and not safely("writing the profiler trace", lambda: self.profiler.end(step)):
            self.profiler = None

    def first_memory(self, local: dict[str, Any], step: int, peak: int) -> None:
        """Each rank's measured memory after its first step (collective: every rank calls it)."""
        if self.out is None:
            return
        from scaletrain.report.runinfo import record_rank_memory

        safely("recording memory_ranks.json", lambda: record_rank_memory(self.out, self.rank, step, local, peak))

    def log(self, row: dict[str, Any]) -> None:
        """A row just written to metrics.jsonl (rank 0)."""
        if self.tb is not None and not safely("writing TensorBoard events", lambda: self.tb.write(row)):
            self.tb = None

    def checkpoint(self, step: int, write_trace: Callable | None) -> None:
        """After a checkpoint: flush TensorBoard, refresh the report (the last step's is written by finish)."""
        if self.out is None:
            return
        if self.tb is not None and not safely("flushing TensorBoard events", self.tb.flush):
            self.tb = None
        if step < self.cfg.train.steps:
            self._trace(write_trace)
            self._report()

    def stop(self) -> None:
        """End of the loop (also on errors): write the profiler trace and close TensorBoard."""
        if self.profiler is not None:
            safely("writing the profiler trace", self.profiler.close)
            self.profiler = None
        if self.tb is not None:
            safely("closing TensorBoard event files", self.tb.close)
            self.tb = None

    def finish(self) -> None:
        """After the run (and its pipeline trace): the final report."""
        if self.out is not None:
            self._report()

    def _trace(self, write_trace: Callable | None) -> None:
        """The pipeline's measured step, as soon as it exists, so the refreshed report can show it."""
        if write_trace is None or self.trace_written:
            return

        def write() -> None:
            self.trace_written = bool(write_trace(self.out))  # no collective: rank 0 writes, the others get []

        if not safely("writing the pipeline trace", write):
            self.trace_written = True

    def _report(self) -> None:
        if self.rank != 0 or not self.cfg.train.report:
            return
        from scaletrain.report.run_page import write_report

        safely(f"writing the run report {Path(self.out) / 'report.html'}", lambda: write_report(self.out))
