"""The folders both checkpoint formats share, and how to tell the formats apart.

`OUT/checkpoints/step_00000100/` is one checkpoint of either format: the synchronous trainer's layout-independent
one (`train/checkpoint.py`, format DCP_FORMAT) or the asynchronous runners' per-rank one
(`train/runners/rank_checkpoint.py`, format RANK_FORMAT). Both are written into `step_NNNNNNNN.tmp/`, marked
complete by a `COMPLETE` file written last and renamed into place, so a folder without `COMPLETE` (or ending in
`.tmp`) is never read; each names its format in its `meta.json`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

DCP_FORMAT = "scaletrain-dcp/1"
RANK_FORMAT = "scaletrain-async-rank/1"
COMPLETE = "COMPLETE"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and not d.name.endswith(".tmp")]
    return sorted((d for d in dirs if (d / COMPLETE).exists()), key=lambda d: d.name)


def check_root(root: Path) -> None:
    """Refuse a run whose `checkpoints` is not a folder (a file put there): starting from step 0 would overwrite the
    run's config.yaml and metrics.jsonl, and the first save would fail."""
    if root.exists() and not root.is_dir():
        from scaletrain.errors import CheckpointError

        raise CheckpointError(f"{root} is a file, not the run's folder of checkpoints; move it away to resume or start "
                              "over (nothing was changed)")


def incomplete_checkpoints(root: Path) -> list[Path]:
    """`step_N` folders (not `.tmp`) without COMPLETE: a save interrupted after its rename, or a damaged copy."""
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_")
                   and not d.name.endswith(".tmp") and not (d / COMPLETE).exists()), key=lambda d: d.name)


def usable_latest(root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint of either format and a note for each newer incomplete one passed over (no
    COMPLETE). A CheckpointError when `root` is not a folder or only incomplete ones exist: the run stops rather than
    start again from step 0 over the run's config.yaml and metrics.jsonl. The caller checks the markers."""
    check_root(root)
    found = latest(root)
    newer = [d for d in incomplete_checkpoints(root) if found is None or d.name > found.name]
    notes = [f"{d} is incomplete (no {COMPLETE} marker: an interrupted save?)" for d in newer]
    if found is None and notes:
        from scaletrain.errors import CheckpointError

        raise CheckpointError(f"{notes[0]}, and there is no earlier complete checkpoint to resume from; move "
                              f"{root} away to start over (nothing was changed)")
    return found, notes


def latest(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def format_of(directory: Path) -> str | None:
    """The format a checkpoint's meta.json names (None if it is missing or unreadable)."""
    try:
        return json.loads((Path(directory) / "meta.json").read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None
