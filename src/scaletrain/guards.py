"""Input guards shared by the subcommands: output folders and files, finite numbers, documented bounds.

No paper: this module keeps the CLI's promise for bad input (docs/errors.md) in one place. Every check raises
`scaletrain.errors.UserError` (one line naming the flag or key and the value, exit 2) *before* anything is
written, so nothing existing is touched:

- `check_out_dir` refuses an `--out` that is empty, a file, under a file, unwritable, or an existing non-empty
  folder that is not a scaletrain run (no `RUN_MARKER`); `mark_run` writes the marker when a run starts.
- `check_output_file` refuses an output file whose folder cannot be written, that is a folder, or whose suffix
  is wrong.
- `finite_float`, `positive_float`, `nonneg_float` and `bounded_int` are argparse types: a bad value becomes
  argparse's one-line error (exit 2) naming the flag.
- `non_finite_keys` lists the config's float keys holding NaN or infinity (config.validate refuses them).
- Upper bounds on work the user asks for (`MAX_STEPS`, `MAX_SAMPLE_TOKENS`, `MAX_TIMELINE_STAGES`,
  `MAX_TIMELINE_OPS`) keep a typo (1e30 steps) from being accepted; docs/errors.md states them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

RUN_MARKER = ".scaletrain-run"
"""File that marks a folder as a scaletrain run (written before the first output of `train`/`demo`)."""

MAX_STEPS = 100_000_000
"""train.steps above this is refused (a typo such as 1e30, not a run anyone can finish)."""
MAX_SAMPLE_TOKENS = 100_000
"""`sample --tokens` above this is refused (generation is one forward pass per token)."""
MAX_TIMELINE_STAGES = 256
"""`report timeline --pp` above this is refused (one chart row per stage)."""
MAX_TIMELINE_OPS = 20_000
"""`report timeline`: pp x microbatches x virtual stages above this is refused (simulated and drawn per op)."""


def _is_run(path: Path) -> bool:
    """A scaletrain run: the marker, or (runs from before the marker) config.yaml beside a checkpoints/ folder."""
    return (path / RUN_MARKER).is_file() or ((path / "config.yaml").is_file() and (path / "checkpoints").is_dir())


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_writable_dir(folder: Path, flag: str, shown: Path) -> None:
    """Refuse when nothing can be created in `folder` (probe: a temporary file, removed at once)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".scaletrain-probe-")
    except OSError as e:
        raise UserError(f"{flag} {shown}: cannot write in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def check_out_dir(out: str | os.PathLike, flag: str = "--out") -> Path:
    """The run folder `out`, or a UserError: empty, a file, under a file, unwritable, or a non-run folder."""
    if str(out).strip() == "":
        raise UserError(f"{flag} must name a folder, got an empty string")
    path = Path(out)
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{flag} {path} exists and is not a directory")
        if any(path.iterdir()) and not _is_run(path):
            raise UserError(f"{flag} {path} is a non-empty folder that is not a scaletrain run (no {RUN_MARKER}); "
                            "give a new or empty folder so nothing there is overwritten")
    base = _nearest_existing(path.absolute())
    if not base.is_dir():
        raise UserError(f"{flag} {path} is under {base}, which is a file, not a folder")
    _check_writable_dir(base, flag, path)
    return path


def mark_run(out: Path) -> None:
    """Create `out` and its run marker (idempotent), before any other output is written."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RUN_MARKER
    if not marker.exists():
        marker.write_text("this folder is a scaletrain run (scaletrain train --out resumes it)\n")


def check_output_file(path: str | os.PathLike, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """An output file that can be written (an existing file is replaced), or a UserError naming `flag`."""
    if str(path).strip() == "":
        raise UserError(f"{flag} must name a file, got an empty string")
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {p} is a folder; give a file name" + (f" ending in {suffixes[0]}" if suffixes else ""))
    if suffixes and p.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {p} must end in {' or '.join(suffixes)}, got {p.suffix or 'no suffix'!r}")
    base = _nearest_existing(p.absolute().parent)
    if not base.is_dir():
        raise UserError(f"{flag} {p} is under {base}, which is a file, not a folder")
    _check_writable_dir(base, flag, p)
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} {p} exists and cannot be written")
    return p


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """A folder for output files (created later; existing files in it may be replaced), or a UserError."""
    if str(path).strip() == "":
        raise UserError(f"{flag} must name a folder, got an empty string")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p} exists and is not a directory")
    base = _nearest_existing(p.absolute())
    if not base.is_dir():
        raise UserError(f"{flag} {p} is under {base}, which is a file, not a folder")
    _check_writable_dir(base, flag, p)
    return p


# --------------------------------------------------------------------------- argparse types


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (NaN and infinity refused)."""
    return _number(text)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def bounded_int(low: int, high: int | None = None):
    """argparse type: an integer in [low, high] (high None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            where = f">= {low}" if high is None else f"in [{low}, {high:,}]"
            raise argparse.ArgumentTypeError(f"must be an integer {where}, got {text}")
        return value

    parse.__name__ = "integer"
    return parse


# --------------------------------------------------------------------------- config values


def non_finite_keys(cfg: Any, prefix: str = "") -> list[str]:
    """`key (value)` for every float field of the config (nested sections too) that is NaN or infinite."""
    bad = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            bad += non_finite_keys(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(f"{prefix}{f.name} ({value})")
    return bad


def parse_positive(text: str, what: str) -> float:
    """A positive finite number such as 1e21, 5.76e23 or 70_000_000_000, or a UserError naming it."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(f"{what} must be a number such as 1e21, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{what} must be a positive finite number, got {text!r}")
    return value
