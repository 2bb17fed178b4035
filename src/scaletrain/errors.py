"""Errors that mean "the user's input is wrong": the CLI prints their one-line message and exits 2.

Everything else that goes wrong is an internal failure (exit 1, with a traceback for the developers), but for
`TrainingDiverged`: a run whose loss became NaN or infinite, raised by the trainer and by the asynchronous workers'
model (parallel/async_dp/model.py), reported as one line (exit 1).
"""


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
