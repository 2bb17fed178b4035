"""The progress of a training run (the synchronous trainer and the asynchronous runners alike): a bar on an
interactive terminal, and plain lines on stderr when the output goes to a pipe, a file or a scheduler's log (CI,
`| tee`, nohup, SLURM); rank 0 under `--nproc` writes them on stdout (its stderr is the launcher's log). Both reach
`OUT/logs/rank0.log` too: the lines, never the bar's escape codes."""

from __future__ import annotations

import sys
import time
from typing import Any

LOG_EVERY_S = 10.0
"""Seconds between two plain progress lines when stdout is not a terminal (the last step always gets one)."""


class Progress:
    """Step, loss, tokens/s and ETA: a rich bar when stdout is a terminal, otherwise a line on stderr every
    `LOG_EVERY_S` seconds and at the last step (`PlainProgress`)."""

    def __init__(self, total: int, start: int):
        from scaletrain.distributed.launch import plain_progress_stream

        tty = sys.stdout.isatty()
        self.impl: _Bar | PlainProgress = _Bar(total, start) if tty else PlainProgress(total, start,
                                                                                      plain_progress_stream())
        log = getattr(sys.stdout, "log", None)  # a rank log beside the terminal (distributed/launch.Tee)
        self.log = PlainProgress(total, start, log) if tty and log is not None else None  # the lines, not the bar

    def update(self, step: int, row: dict[str, Any]) -> None:
        self.impl.update(step, row)
        if self.log is not None:
            self.log.update(step, row)

    def close(self) -> None:
        self.impl.close()


class _Bar:
    """The rich progress bar of an interactive terminal."""

    def __init__(self, total: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        terminal = getattr(sys.stdout, "stream", sys.stdout)  # the bar stays out of the rank log (launch.Tee)
        self.p = Bar(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                     TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                     TextColumn("ETA"), TimeRemainingColumn(), transient=False,
                     console=Console(file=terminal))
        self.task = self.p.add_task("train", total=total, completed=start, loss="-", tps="-")
        self.p.start()

    def update(self, step: int, row: dict[str, Any]) -> None:
        self.p.update(self.task, completed=step, loss=f"{row['loss']:.4f}", tps=f"{row['tokens_per_s']:,.0f}")

    def close(self) -> None:
        self.p.stop()


class PlainProgress:
    """One line on stderr per `LOG_EVERY_S` seconds of training and one at step `total`:
    `train: step 120/400 (30%), loss 3.2141, 1,234 tokens/s (mean over wall time), ETA 3 min 10 s`.
    tokens/s and the ETA are this invocation's steps over its wall time since the first step began (a resumed run
    counts from its resume step), so they include evaluation, checkpoints and the first step's warm-up."""

    def __init__(self, total: int, start: int, stream=None, clock=None, every_s: float | None = None):
        self.total, self.start = total, start
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock if clock is not None else time.monotonic  # injectable (tests drive a fake one)
        self.every_s = LOG_EVERY_S if every_s is None else every_s
        self.t0 = self.last = self.clock()
        self.tokens = 0.0
        self.step = start

    def update(self, step: int, row: dict[str, Any]) -> None:
        self.tokens += (step - self.step) * _tokens_per_step(row)
        self.step = step
        now = self.clock()
        if step < self.total and now - self.last < self.every_s:
            return
        self.last = now
        self.stream.write(self.line(step, row["loss"], now - self.t0) + "\n")
        self.stream.flush()

    def line(self, step: int, loss: float, seconds: float) -> str:
        done = step - self.start
        rate = f"{self.tokens / seconds:,.0f} tokens/s" if seconds > 0 else "- tokens/s"
        eta = _duration(seconds / done * (self.total - step)) if done > 0 else "?"
        pct = 100 * step // self.total if self.total else 100
        return f"train: step {step}/{self.total} ({pct}%), loss {loss:.4f}, {rate} (mean over wall time), ETA {eta}"

    def close(self) -> None:
        pass


def _tokens_per_step(row: dict[str, Any]) -> float:
    """A step's tokens, from the row's own rate and time (every runner writes both)."""
    tps, seconds = row.get("tokens_per_s"), row.get("step_time_s")
    return float(tps) * float(seconds) if tps is not None and seconds is not None else 0.0


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
