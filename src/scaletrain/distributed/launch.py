"""Local multi-process launch through torchrun, and the worker side of it.

`scaletrain train --nproc N` outside a torchrun/SLURM job re-runs the same command in N processes with
`python -m torch.distributed.run` on 127.0.0.1 (static rendezvous on a free port). Inside a job (RANK and
WORLD_SIZE, or SLURM variables, are set) nothing is launched: the process is one of the job's ranks.

Output: every rank's stdout and stderr land in `OUT/logs/rankN.log` (a single-process run's in `rank0.log`),
opened afresh by each invocation and headed by the rank's line (`rank 1 of 2, local rank 1, host ..., pid ...`);
rank 0 also writes to the terminal (its stdout) and, under the launcher, its stderr to `OUT/logs/launcher.log`,
which holds the launcher's own lines (the command it started, how it ended) and torchrun's. Rank 0 copies what
Python writes (prints, warnings, tracebacks); ranks > 0 send their whole output there. A rank that fails
writes `OUT/logs/rankN.error.json`; torchrun then stops the others within a second, and the launcher prints
the failure in one line (exit 2 for bad input, 1 otherwise): a rank killed by a signal (from torchrun's own
summary, `exitcode: -9`), else the earliest error record, with the path of a log only when it exists.
`restarts` is torchrun's `--max-restarts`: the workers are started again after a failure and resume from the
newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from scaletrain.errors import Stopped, UserError, disk_full, disk_full_line

LOG_DIR_ENV = "SCALETRAIN_LOG_DIR"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, argv: list[str], port: int | None = None, restarts: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1", "--node-rank=0",
        "--master-addr=127.0.0.1", f"--master-port={port or free_port()}",
        "--monitor-interval=0.2", f"--max-restarts={restarts}",
        "-m", "scaletrain", *argv,
    ]


def launch_local(nproc: int, argv: list[str], out_dir: Path, restarts: int = 0) -> int:
    """Run `scaletrain <argv>` on `nproc` local ranks (restarted up to `restarts` times after a failure, each
    time resuming from the newest complete checkpoint); returns the exit code for the user."""
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("rank*.error.json"):
        old.unlink()
    env = dict(os.environ)
    env[LOG_DIR_ENV] = str(logs.resolve())
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    rc = run_torchrun(torchrun_command(nproc, argv, restarts=restarts), env, logs / "launcher.log")
    if rc == 0:
        return 0
    return report_failure(logs, rc)


def report_failure(logs: Path, rc: int, launcher_log: Path | None = None) -> int:
    """Print the job's failure in one line and return the exit code: a rank killed by a signal (torchrun's
    summary in the launcher log knows it: `exitcode: -9`) is the cause; otherwise the earliest error record.
    Only logs that exist are named."""
    launcher_log = launcher_log or logs / "launcher.log"
    text = launcher_log.read_text(errors="replace") if launcher_log.exists() else ""
    errors = []
    for f in logs.glob("rank*.error.json"):
        try:
            errors.append(json.loads(f.read_text()))
        except ValueError:
            continue
    killed = [d for d in signal_deaths(text) if d["signal"] != "SIGTERM"]  # SIGTERM: torchrun stopping the rest
    if killed:
        d = killed[0]
        log = logs / f"rank{d['rank']}.log"
        where = f" (its output: {log})" if d["rank"] != 0 and log.exists() else ""
        sys.stderr.write(f"scaletrain: error: rank {d['rank']} (local rank {d['local_rank']} on host {d['host']}) was "
                         f"killed by {d['signal']} (exit code {d['exitcode']}); the other ranks were stopped{where}\n")
        return 1
    if not errors:
        full = [x for x in text.splitlines() if x.startswith("scaletrain: error: ") and "the disk is full" in x]
        if full:  # a rank that had no room left for its error record said it in the log (WorkerContext)
            sys.stderr.write(full[0] + "\n")
            return 1
        tail = text.strip().splitlines()[-5:]
        where = f"; see {launcher_log}" if launcher_log.exists() else ""
        sys.stderr.write(f"scaletrain: error: the workers failed (exit {rc}){where}\n")
        sys.stderr.write("".join(f"  {line}\n" for line in tail))
        return 1
    first = min(errors, key=lambda e: e["time"])
    code = int(first.get("exit_code", 1))
    log = logs / f"rank{first['rank']}.log" if first["rank"] != 0 else launcher_log
    where = "" if code == 2 or not first.get("traceback") or not log.exists() else f" (traceback in {log})"
    who = "" if first.get("plain") else f"rank {first['rank']}: "
    sys.stderr.write(f"scaletrain: error: {who}{first['message']}{where}\n")
    return code


_FAILURE = re.compile(r"host\s*:\s*(?P<host>\S+)\s*\n\s*rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)\s*\n"
                      r"\s*exitcode\s*:\s*(?P<code>-?\d+)")


def signal_deaths(text: str) -> list[dict]:
    """Workers that torchrun's failure summary reports as killed by a signal (negative exit code), root cause
    first: [{rank, local_rank, host, exitcode, signal}]."""
    import signal

    root = text.find("Root Cause")
    ordered = text[root:] + "\n" + text[:root] if root >= 0 else text
    out, seen = [], set()
    for m in _FAILURE.finditer(ordered):
        code, rank = int(m["code"]), int(m["rank"])
        if code < 0 and rank not in seen:
            seen.add(rank)
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            out.append({"rank": rank, "local_rank": int(m["local"]), "host": m["host"], "exitcode": code,
                        "signal": name})
    return out


STOP_SIGNALS = ("SIGTERM", "SIGHUP")
"""What job schedulers (SLURM, Kubernetes) and a closed terminal send to stop a job: forwarded to the ranks."""
STOP_GRACE_S = 60.0
"""After forwarding a stop signal, how long the launcher waits for its process group before SIGKILL."""


@contextlib.contextmanager
def stop_signals():
    """While the launcher waits for its ranks: SIGTERM and SIGHUP raise `errors.Stopped` in the main thread (the
    default action would kill the launcher alone and orphan torchrun and every rank, which train on)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    old = {name: signal.signal(getattr(signal, name), stop) for name in STOP_SIGNALS}
    try:
        yield
    finally:
        for name, handler in old.items():
            signal.signal(getattr(signal, name), handler)


def stop_group(proc: subprocess.Popen, signum: int, grace_s: float = STOP_GRACE_S) -> None:
    """Send `signum` to torchrun (`proc`), which stops its workers (they have sessions of their own), wait up to
    `grace_s` for it, then SIGKILL it. torchrun stays in the launcher's process group, so a SIGKILL of that group
    (a lost machine, the test of docs/multinode.md) takes torchrun with it, as before."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def run_torchrun(cmd: list[str], env: dict[str, str], launcher_log: Path) -> int:
    """Run a torchrun command with its stderr appended to `launcher_log`, between a line naming the command and one
    with its exit code; its exit code. Ctrl-C, SIGTERM and SIGHUP are
    forwarded to its process group (SIGINT as SIGTERM), waited for, and re-raised."""
    import signal

    with open(launcher_log, "a", buffering=1) as log, stop_signals():  # after the lines the command printed
        log.write(f"scaletrain launcher: started {' '.join(cmd)}\n")
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stderr=log)
        try:
            rc = proc.wait()
            took = time.monotonic() - start
            log.write(f"scaletrain launcher: the workers exited with code {rc} after {took:.1f} s\n")
            return rc
        except Stopped as e:
            stop_group(proc, e.signum)
            raise
        except KeyboardInterrupt:
            stop_group(proc, signal.SIGTERM, 30)
            raise


class Tee:
    """A text stream that writes to `stream` (the terminal, or the launcher's log) and to a rank's log file. The copy
    is best effort: a log that cannot be written (a full disk) is dropped, never the rank's output or the rank."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        if self.log is not None:
            try:
                self.log.write(text)
            except OSError:
                self.log = None
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        if self.log is not None:
            try:
                self.log.flush()
            except OSError:
                self.log = None

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's
        return getattr(self.stream, name)


class LauncherLines:
    """What the launching command prints (stdout and stderr) before the ranks start, kept in memory and written to
    `OUT/logs/launcher.log` by `save` once the folder is the run's: a refused command writes nothing."""

    def __enter__(self) -> LauncherLines:
        self.buf = io.StringIO()
        self.saved: tuple | None = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = Tee(sys.stdout, self.buf), Tee(sys.stderr, self.buf)
        return self

    def save(self, path: Path) -> None:
        """Stop copying and write the lines so far to `path` (the launcher appends torchrun's to it)."""
        self.stop()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.buf.getvalue(), errors="surrogateescape")

    def text(self) -> str:
        """Stop copying; the lines so far (a single-process run writes them once its checkpoint is read)."""
        self.stop()
        return self.buf.getvalue()

    def stop(self) -> None:
        if self.saved is not None:
            sys.stdout, sys.stderr = self.saved
            self.saved = None

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


def rank_header(rank: int) -> str:
    """The first line of a rank's log: who wrote it."""
    world, local = os.environ.get("WORLD_SIZE", "1"), os.environ.get("LOCAL_RANK", "0")
    return (f"rank {rank} of {world}, local rank {local}, host {socket.gethostname()}, pid {os.getpid()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def plain_progress_stream():
    """Where plain progress lines go: stderr, except on rank 0 under the launcher, whose stderr is the launcher's
    log: there stdout (the user's terminal, and rank0.log)."""
    return sys.stdout if LOG_DIR_ENV in os.environ else sys.stderr


class WorkerContext:
    """On a rank: its output in `logs/rankN.log` (rank 0: a copy, beside the terminal), and an error file when the
    rank fails. `logs`: the folder of a single-process run (a launched rank reads the launcher's)."""

    def __init__(self, rank: int, logs: Path | None = None, launcher_lines: str | None = None):
        self.rank = rank
        self.logs = Path(os.environ[LOG_DIR_ENV]) if LOG_DIR_ENV in os.environ else None  # error records there
        self.log_dir = self.logs if self.logs is not None else logs
        self.launcher_lines = launcher_lines
        self.saved = None
        self.pending: io.StringIO | None = None

    def __enter__(self) -> WorkerContext:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            exit_with_parent()
        if self.logs is not None:  # a restarted rank's record of an earlier attempt is stale
            (self.logs / f"rank{self.rank}.error.json").unlink(missing_ok=True)
        if self.logs is not None and self.rank != 0:
            f = open(self.logs / f"rank{self.rank}.log", "w", buffering=1)
            f.write(rank_header(self.rank))
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            sys.stdout = sys.stderr = f
        elif self.log_dir is not None and self.rank == 0:
            # one process: held in memory until `commit` (a refused resume leaves the run's logs as they were)
            if self.logs is None:
                f = self.pending = io.StringIO()
                f.write(rank_header(0))
            else:
                f = self._open(rank_header(0))
            self.saved = (sys.stdout, sys.stderr, f)
            sys.stdout, sys.stderr = Tee(sys.stdout, f), Tee(sys.stderr, f)
        return self

    def _open(self, first: str):
        """rank0.log starting with `first`, or None where it cannot be written (a full disk): the run goes on
        without its copy."""
        path, f = self.log_dir / "rank0.log", None
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            f = open(path, "w", buffering=1, errors="surrogateescape")
            f.write(first)
            f.flush()
            return f
        except OSError:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # no partial log left behind
            return None

    def commit(self) -> None:
        """A single-process run whose checkpoint was read: its logs are written from now on (launcher.log with the
        command's lines, rank0.log with what the rank printed so far)."""
        if self.pending is None or self.saved is None:
            return
        f = self._open(self.pending.getvalue())  # its header and what it printed so far
        try:
            if self.launcher_lines is not None:
                (self.log_dir / "launcher.log").write_text(self.launcher_lines, errors="surrogateescape")
        except OSError:
            pass  # a full disk: the logs are a copy of what the terminal shows; the run goes on
        sys.stdout.log = sys.stderr.log = f
        self.saved = (*self.saved[:2], f)
        self.pending = None

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            return self._exit(exc)
        finally:
            if self.saved is not None:  # rank 0: the streams of before, the log closed
                sys.stdout.flush()
                sys.stderr.flush()
                sys.stdout, sys.stderr, f = self.saved
                self.saved = None
                with contextlib.suppress(OSError):
                    if f is not None:
                        f.close()

    def _exit(self, exc) -> bool:
        if exc is None or self.logs is None or isinstance(exc, (SystemExit, KeyboardInterrupt)):
            return False
        code = exc.exit_code if isinstance(exc, UserError) else 1
        message = str(exc) if isinstance(exc, UserError) else f"{exc.__class__.__name__}: {exc}"
        full = disk_full(exc) and not isinstance(exc, UserError)
        message = disk_full_line(exc) if full else message
        first = message.splitlines()[0] if message else exc.__class__.__name__
        try:
            write_error_record(self.logs, self.rank, code, first, "".join(traceback.format_exception(exc)),
                               plain=getattr(exc, "names_ranks", False))
        except OSError as e:  # no room for the record either: the line goes to the launcher's log (report_failure)
            if not disk_full(e):
                raise
            sys.stderr.write(f"scaletrain: error: rank {self.rank}: {first}\n")
            sys.stderr.flush()
            return False
        if full:
            return False
        if self.rank != 0 or code != 2:
            traceback.print_exception(exc)  # into this rank's log (rank 0: the launcher log)
        return False


PARENT_POLL_S = 0.05
"""How often a rank checks that the torchrun that started it is alive."""

_PARENT_GRACE_S = [0.0]
_WATCHED_PARENT: list[int | None] = [None]


def hold_if_orphaned() -> None:
    """Called before a rank writes into OUT (a step, a checkpoint's commit, a metrics row): when the torchrun that
    started it has died, never return - the process ends by the heartbeat's verdict or `exit_with_parent`'s
    SIGKILL - so an orphaned rank writes nothing the next run would resume from."""
    parent = _WATCHED_PARENT[0]
    if parent is not None and os.getppid() != parent:
        while True:
            time.sleep(1.0)


def _parent_death_signal(signum: int) -> bool:
    """Linux's prctl(PR_SET_PDEATHSIG): the kernel sends `signum` (0: none) to this process the moment the thread
    that started it exits (torchrun starts its workers from its main thread). False where it is not available."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(1, signum, 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def defer_parent_exit(grace_s: float) -> None:
    """Another watcher of the parent (the multi-node heartbeat) names the lost launcher and ends the process: no
    kernel death signal, and the SIGKILL of `exit_with_parent` only `grace_s` after the parent is seen gone, as
    a backstop."""
    _parent_death_signal(0)
    _PARENT_GRACE_S[0] = grace_s


def exit_with_parent() -> None:
    """Stop this rank at once (SIGKILL, as if its machine died) when the torchrun that started it goes away.
    torchrun starts each rank in a session of its own, so a SIGKILL of the launcher's process group (a lost
    machine, an OOM kill, `kill -9` of the job) takes torchrun but not the ranks: orphaned, they would train on
    and write checkpoints into OUT while the next run resumes from it. The kernel's parent-death signal stops the
    rank at once (a polling thread alone can be starved for seconds on a loaded machine and write one more
    checkpoint); a daemon thread watching the parent pid is the portable backstop."""
    import signal

    parent = _WATCHED_PARENT[0] = os.getppid()
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        time.sleep(_PARENT_GRACE_S[0])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def write_error_record(logs: Path, rank: int, code: int, message: str, tb: str = "", plain: bool = False) -> None:
    """`logs/rankN.error.json`: what the launcher reports when this rank fails (written atomically). `plain`:
    the message already names the ranks concerned (print it without "rank N:")."""
    record = {"time": time.time(), "rank": rank, "exit_code": code, "message": message, "traceback": tb,
              "plain": plain}
    tmp = logs / f"rank{rank}.error.json.part"
    try:
        tmp.write_text(json.dumps(record))
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, logs / f"rank{rank}.error.json")
