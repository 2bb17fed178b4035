"""TensorBoard logging (`train.tensorboard=true`): every scalar of every metrics.jsonl row, as event files in
`OUT/tb/`, written by rank 0 through `torch.utils.tensorboard.SummaryWriter` (the `tensorboard` package is the
optional extra `scaletrain[tb]`).

Tags are the metrics keys themselves (`loss`, `val_loss`, `mem_peak`, `comm_all_reduce_bytes`, ...); a list
value becomes one tag per element, `moe_load/<i>/<e>` (MoE block i in `moe_layers` order, expert e) and
`moe_dropped_frac/<i>`; booleans are 0/1. The step is the optimizer step. A resumed run opens the writer with
`purge_step` = the first step it redoes, so TensorBoard hides the events a killed run wrote after its last
checkpoint, as metrics.jsonl is trimmed to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def flatten(row: dict[str, Any]) -> dict[str, float]:
    """The scalars of a metrics row by tag (the `step` itself excluded)."""
    out: dict[str, float] = {}

    def visit(tag: str, value: Any) -> None:
        if isinstance(value, bool):
            out[tag] = float(value)
        elif isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{tag}/{i}", v)

    for key, value in row.items():
        if key != "step":
            visit(key, value)
    return out


class TensorBoardLog:
    """A SummaryWriter on OUT/tb for the rows written to metrics.jsonl."""

    def __init__(self, log_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=first_step if first_step > 1 else None)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for tag, value in flatten(row).items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
