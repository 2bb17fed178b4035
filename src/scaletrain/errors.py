"""Errors that mean "the user's input is wrong": the CLI prints their one-line message and exits 2.

Everything else that goes wrong is an internal failure (exit 1, with a traceback for the developers), but for
`TrainingDiverged`: a run whose loss became NaN or infinite, raised by the trainer and by the asynchronous workers'
model (parallel/async_dp/model.py), reported as one line (exit 1); and `DiskFull` (a write that ran out of space:
one line, exit 1), which `disk_full` recognises in any error chain.
"""


import errno
import os
import shutil


class UserError(Exception):
    """Bad input (config, data, checkpoint, command line). The message names the bad values."""

    exit_code = 2


class ConfigError(UserError):
    """A config value or combination of values is invalid."""


class DataError(UserError):
    """The data source is missing, empty or unreadable."""


class CheckpointError(UserError):
    """A checkpoint is corrupted or does not match the run."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class Stopped(KeyboardInterrupt):
    """The launcher received SIGTERM or SIGHUP (a job scheduler stopping the job): raised in the launcher's main thread
    by `distributed.launch.stop_signals`, which has forwarded the signal to its ranks and waits for them; the CLI
    prints one line and exits 128 + the signal number, as a process killed by it would."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class DiskFull(UserError):
    """A write failed because the disk (or the user's quota) is full: one line naming the folder and the free space,
    exit 1 (the input was fine; the machine ran out of room). What was written before is left intact."""

    exit_code = 1


def disk_full(error: BaseException) -> bool:
    """Whether a failed write ran out of space: ENOSPC/EDQUOT anywhere in the chain, or torch's writer's words for
    a short write ("unexpected pos", it does not keep the errno)."""
    e: BaseException | None = error
    seen = 0
    while e is not None and seen < 32:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "unexpected pos" in text or "Disk quota exceeded" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def free_mib(path: str | os.PathLike) -> float | None:
    """Free space (MiB) of the file system holding `path` (its nearest existing parent); None if unknown."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free / 2**20
    except OSError:
        return None


def disk_full_error(what: str, path: str | os.PathLike, kept: str = "") -> DiskFull:
    """The one line for a write of `what` (`path`) that ran out of space; `kept` says what was left intact."""
    free = free_mib(path)
    room = f" ({free:,.1f} MiB free)" if free is not None else ""
    return DiskFull(f"cannot write {what} {path}: the disk is full{room}{kept}")


def disk_full_line(error: BaseException) -> str:
    """The one line for a disk-full failure nobody named more precisely (the CLI's and the ranks' last resort): the
    file, when the error knows it."""
    e: BaseException | None = error
    while e is not None and not (isinstance(e, OSError) and e.filename):
        e = e.__cause__ or e.__context__
    name = e.filename if isinstance(e, OSError) else None
    if name is None:
        return "the disk is full (No space left on device); the files written before are intact"
    free = free_mib(name)
    room = f" ({free:,.1f} MiB free)" if free is not None else ""
    return f"cannot write {name}: the disk is full{room}; the files written before are intact"
