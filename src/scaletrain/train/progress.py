"""The progress bar of a training run (the synchronous trainer and the asynchronous runners alike)."""

from __future__ import annotations

from typing import Any


class Progress:
    """A rich progress bar: step, loss, tokens/s, ETA (only on an interactive terminal)."""

    def __init__(self, total: int, start: int):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.p = Bar(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                     TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                     TextColumn("ETA"), TimeRemainingColumn(), transient=False)
        self.task = self.p.add_task("train", total=total, completed=start, loss="-", tps="-")
        self.p.start()

    def update(self, step: int, row: dict[str, Any]) -> None:
        self.p.update(self.task, completed=step, loss=f"{row['loss']:.4f}", tps=f"{row['tokens_per_s']:,.0f}")

    def close(self) -> None:
        self.p.stop()
