"""Metrics that stay on the device until they are written: one host read per logged step, not several per step.

A step's loss and gradient norm are 0-dim device tensors and its time a `device.timing.PendingSeconds`; the
trainer keeps the rows of the steps since the last read and `resolve_rows` turns all their tensor values into
Python numbers with one stacked device-to-host copy (one synchronisation), then the times. On CPU this changes
nothing but the order of work; on a GPU the host keeps queueing kernels for steps it has not read yet.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from scaletrain.device.timing import PendingSeconds


def resolve_rows(rows: list[dict[str, Any]], tokens_per_step: int) -> None:
    """In place: every tensor value of `rows` becomes a float (one host read for all), every PendingSeconds its
    seconds, and `tokens_per_s` (None until now) tokens_per_step / step_time_s."""
    slots = [(row, k) for row in rows for k, v in row.items() if isinstance(v, torch.Tensor)]
    if slots:
        stacked = torch.stack([row[k].detach().reshape(()).to(torch.float64) for row, k in slots])
        for (row, k), value in zip(slots, stacked.tolist()):
            row[k] = value
    for row in rows:
        for k, v in row.items():
            if isinstance(v, PendingSeconds):
                row[k] = v.seconds()
        if row.get("tokens_per_s", 0.0) is None:
            row["tokens_per_s"] = tokens_per_step / row["step_time_s"]


def first_bad_loss(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first resolved row whose loss is NaN or infinite, if any."""
    return next((r for r in rows if not math.isfinite(r["loss"])), None)
