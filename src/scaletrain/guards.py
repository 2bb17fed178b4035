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
import contextlib
import dataclasses
import functools
import json
import math
import os
import stat
import sys
import tempfile
import time
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
MIN_TIMEOUT_S = 2.0
"""parallel.timeout_s below this is refused: a rendezvous or collective on a loaded machine takes seconds."""
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
    path = check_path(out, flag)
    check_not_managed(path, flag)
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{flag} {path} exists and is not a directory")
        if any(p.name != LOCK_NAME for p in path.iterdir()) and not _is_run(path):
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
    p = check_path(path, flag)
    check_not_managed(p, flag)
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
    p = check_path(path, flag)
    check_not_managed(p, flag)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p} exists and is not a directory")
    base = _nearest_existing(p.absolute())
    if not base.is_dir():
        raise UserError(f"{flag} {p} is under {base}, which is a file, not a folder")
    _check_writable_dir(base, flag, p)
    return p


def check_own_dir(path: str | os.PathLike, flag: str, marker: str, what: str, legacy: tuple[str, ...] = ()) -> Path:
    """A folder a command fills and rewrites (a scaling sweep): new, empty, or already one of its own (`marker`, or
    every name in `legacy` for folders from before the marker); any other non-empty folder is refused so nothing
    of the user's is overwritten."""
    p = check_output_dir(path, flag)
    if p.is_dir() and any(p.iterdir()):
        own = (p / marker).is_file() or (legacy and all((p / name).exists() for name in legacy))
        if not own:
            raise UserError(f"{flag} {shown(p)} is a non-empty folder that is not a {what} (no {marker}); give a new "
                            "or empty folder so nothing there is overwritten")
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


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@functools.cache
def _is_section(cls: type) -> bool:
    return hasattr(cls, "__dataclass_fields__")


def non_finite_keys(cfg: Any, prefix: str = "") -> list[str]:
    """`key (value)` for every float field of the config (nested sections too) that is NaN or infinite."""
    bad = []
    for name in _field_names(type(cfg)):  # validate() runs this on every layout the covering search tries: cached
        value = getattr(cfg, name)
        if type(value) is float:  # the common case first (the covering search validates ~10^5 configs)
            if not math.isfinite(value):
                bad.append(f"{prefix}{name} ({value})")
        elif _is_section(type(value)):
            bad += non_finite_keys(value, f"{prefix}{name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(f"{prefix}{name} ({value})")
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


def short(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: a message quotes bad input, never megabytes of it (an alias bomb)."""
    text = repr(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


# --------------------------------------------------------------------------- paths

MAX_NAME_BYTES = 255
"""A path part longer than this (in bytes, as the file system stores it) is refused: no Linux file system takes it."""
MAX_INPUT_BYTES = 64 * 2**20
"""A config, cluster, layout or CSV file larger than this is refused before it is read (they are a few KB)."""
MAX_INT = 2**63 - 1
"""Integers beyond signed 64 bits are refused wherever a number is read (torch, numpy and JSON readers cannot hold
them)."""


def shown(path: str | os.PathLike) -> str:
    """A path as text that can always be printed: bytes that are not UTF-8 appear as \\xNN."""
    return os.fsencode(os.fspath(path)).decode("utf-8", "backslashreplace")


def check_path(path: str | os.PathLike, flag: str) -> Path:
    """Refuse a path no file system call can take, before one is made: a NUL byte, a part over 255 bytes, a symbolic
    link loop anywhere on it, or a name that ends in a dangling symbolic link."""
    text = os.fspath(path)
    if "\x00" in text:
        raise UserError(f"{flag} {shown(text)!r} contains a NUL byte")
    for part in os.fsencode(text).split(b"/"):
        if len(part) > MAX_NAME_BYTES:
            raise UserError(f"{flag}: the path part {part[:40].decode('utf-8', 'backslashreplace')}... is "
                            f"{len(part)} bytes long, above the file system's limit of {MAX_NAME_BYTES}")
    p = Path(text)
    try:
        os.stat(p)
    except FileNotFoundError:
        if p.is_symlink():
            raise UserError(f"{flag} {shown(p)} is a symbolic link to {shown(os.readlink(p))}, which does not "
                            "exist") from None
    except OSError as e:
        if e.errno == 40:  # ELOOP
            raise UserError(f"{flag} {shown(p)}: a symbolic link loop on this path") from None
        if e.errno == 20:  # ENOTDIR: a file in the middle of the path
            pass
        elif e.errno == 36:  # ENAMETOOLONG: the whole path
            raise UserError(f"{flag} {shown(p)[:60]}...: the path is too long for the file system") from None
    return p


def read_input(path: str | os.PathLike, flag: str, what: str = "file") -> str:
    """The text of a user's input file (config, cluster, layout, CSV), or a UserError naming `flag`: missing, a
    folder, a FIFO or device, a symbolic link loop or dangling link, larger than MAX_INPUT_BYTES, not UTF-8. A UTF-8
    byte-order mark (as spreadsheets save) is dropped."""
    p = check_path(path, flag)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {shown(p)}") from None
    except OSError as e:
        raise UserError(f"{flag} {shown(p)} cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{flag} {shown(p)} is a folder; give a {what}")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if (
            stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) else "a socket" if stat.S_ISSOCK(st.st_mode) \
            else "not a regular file"
        raise UserError(f"{flag} {shown(p)} is {kind}, not a {what}")
    if st.st_size > MAX_INPUT_BYTES:
        raise UserError(f"{flag} {shown(p)} is {st.st_size:,} bytes, above the limit of {MAX_INPUT_BYTES:,} for a "
                        f"{what}")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {shown(p)} cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {shown(p)} is not a text file (not UTF-8: byte 0x{data[e.start]:02x} at offset "
                        f"{e.start})") from None
    return text.removeprefix("\ufeff")


# --------------------------------------------------------------------------- YAML

MAX_YAML_DEPTH = 64
"""Mappings and lists nested deeper than this in a YAML input are refused (a config is 3 deep)."""
MAX_YAML_ALIASES = 32
"""More `*alias` references than this in a YAML input are refused (an alias bomb expands to billions of nodes)."""


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that refuses duplicate keys, deep nesting and alias bombs (one line each)."""

        def __init__(self, stream):
            super().__init__(stream)
            self._depth = 0
            self._aliases = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                self._aliases += 1
                if self._aliases > MAX_YAML_ALIASES:
                    raise _YamlRefused(f"more than {MAX_YAML_ALIASES} aliases (*name)")
            self._depth += 1
            if self._depth > MAX_YAML_DEPTH:
                raise _YamlRefused(f"nested more than {MAX_YAML_DEPTH} levels deep")
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _YamlRefused(f"key {short(key, 40)} appears twice (lines {seen[key] + 1} and "
                                           f"{key_node.start_mark.line + 1})")
                    seen[key] = key_node.start_mark.line
                except TypeError:  # an unhashable key: SafeLoader's own message
                    break
            return super().construct_mapping(node, deep)

    return Loader


class _YamlRefused(Exception):
    pass


def load_yaml(text: str, where: str) -> Any:
    """Parse a YAML input (text from `read_input`) with the limits above; a UserError names `where` and the
    line for invalid YAML."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except _YamlRefused as e:
        raise UserError(f"{where}: {e}") from None
    except RecursionError:
        raise UserError(f"{where}: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{where} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None


def non_finite_values(data: Any, prefix: str = "") -> list[str]:
    """`key (value)` for every NaN or infinite number, and every integer beyond 64 bits, in nested YAML/JSON data."""
    bad: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            bad += non_finite_values(v, f"{prefix}{k}.")
    elif isinstance(data, list):
        for i, v in enumerate(data):
            bad += non_finite_values(v, f"{prefix}[{i}].")
    elif isinstance(data, float) and not math.isfinite(data):
        bad.append(f"{prefix.rstrip('.')} ({data})")
    elif isinstance(data, int) and not isinstance(data, bool) and abs(data) > MAX_INT:
        bad.append(f"{prefix.rstrip('.')} ({short(data, 30)})")
    return bad


# --------------------------------------------------------------------------- managed folders of a run

MANAGED = ("checkpoints", "logs", "tokenizer", "profile", "tensorboard", "offload")
"""Folders of a run that scaletrain manages (rewrites, prunes, cleans up): no other output may go inside them."""


def check_not_managed(path: str | os.PathLike, flag: str) -> None:
    """Refuse an output inside a run's managed folder (`RUN/checkpoints/...`): the run's own clean-up would delete
    it without a word, or it would be read as part of the run."""
    p = Path(path).absolute()
    for parent in p.parents:
        if parent.name in MANAGED and _is_run(parent.parent):
            raise UserError(f"{flag} {shown(path)} is inside {shown(parent)}, a folder the run {shown(parent.parent)} "
                            "manages (its clean-up may delete it); choose a folder outside the run")
    if p.name in MANAGED and _is_run(p.parent):
        raise UserError(f"{flag} {shown(path)} is the managed folder {p.name}/ of the run {shown(p.parent)}; "
                        "choose a folder outside the run")


# --------------------------------------------------------------------------- the run-folder lock

LOCK_NAME = ".scaletrain-lock"
"""`OUT/.scaletrain-lock`: held (flock) by the one process that runs OUT; names its host and pid."""
LOCK_ENV = "SCALETRAIN_RUN_LOCK"
"""Set by a launcher that holds the lock for its ranks: they do not take it again."""


@dataclasses.dataclass
class RunLock:
    """The held lock of a run folder; `release()` (or leaving the `with`) frees it. A crash frees it too: the
    kernel drops the flock with the process, and the next run replaces the stale file, saying whose it was."""

    path: Path
    fd: int
    created_out: bool

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: a waiter re-checks the inode (lock_run)
            if self.created_out:
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()  # a run that never started leaves no folder behind
        finally:
            os.close(self.fd)
            self.fd = -1
            os.environ.pop(LOCK_ENV, None)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def lock_run(out: Path, flag: str = "--out") -> RunLock | None:
    """Take the lock of run folder `out` for this process, or a UserError naming the holder's host and pid. None
    when a launcher above this process holds it for us (LOCK_ENV). A lock file left by a crashed run is taken over
    with a note naming it."""
    import fcntl
    import socket

    if os.environ.get(LOCK_ENV) == str(Path(out).absolute()):
        return None
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    for _ in range(20):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"{flag} {shown(out)}: cannot create its lock file ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            h = _holder(path)
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if "started" in h else "?"
            raise UserError(f"{flag} {shown(out)} is in use by another scaletrain run (host {h.get('host', '?')}, "
                            f"pid {h.get('pid', '?')}, since {since}); wait for it or stop it (nothing was "
                            "changed)") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder released (unlinked) it between our open and flock: try the new file
            os.close(fd)
            continue
        old = _holder(path)
        if old.get("pid"):
            sys.stderr.write(f"note: {shown(path)} was left by a run that stopped without releasing it (host "
                             f"{old.get('host', '?')}, pid {old['pid']}); taking it over\n")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(record).encode())
        os.environ[LOCK_ENV] = str(out.absolute())  # our own launched ranks do not take it again
        return RunLock(path, fd, created)
    raise UserError(f"{flag} {shown(out)}: its lock file keeps changing; is another run starting there?")


# --------------------------------------------------------------------------- sizes

SIZE_LIMITS = {
    "model.n_layers": 100_000, "model.d_model": 2**20, "model.n_heads": 2**16, "model.seq_len": 2**24,
    "model.vocab_size": 2**32, "model.d_ff": 2**24, "model.moe.experts": 2**16, "model.moe.top_k": 2**16,
    "parallel.dp": 2**24, "parallel.tp": 2**16, "parallel.pp": 2**16, "parallel.ep": 2**16,
    "parallel.virtual_stages": 2**16, "parallel.microbatches": 2**30, "train.global_batch": 2**30,
    "train.micro_batch": 2**30,
}
"""Upper bounds on the sizes a config names, checked before any arithmetic uses them: 10^30 layers would make the
parameter count and the memory plan run for hours. Each is far above any model or cluster built so far."""
MAX_GPUS = 2**24
"""`plan --gpus` (and a cluster file's gpus) above this is refused: the layout search enumerates its divisors."""
MAX_GLOBAL_BATCH = 2**30
"""`plan --global-batch` above this is refused (the search enumerates micro-batch splits of it)."""


def oversized_keys(cfg: Any) -> list[str]:
    """`key (value) is above the limit of L` for every config size over SIZE_LIMITS."""
    out = []
    for key, limit in SIZE_LIMITS.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part, None)
        if isinstance(node, int) and node > limit:
            out.append(f"{key} ({short(node, 40)}) is above the limit of {limit:,}")
    return out


class AppendLines:
    """An append-only log of lines (`metrics.jsonl`): each `write` reaches the file at once (unbuffered), and a write
    that runs out of space is undone (the file truncated back to its last whole line) and raised as `DiskFull`
    naming the file, so the rows written before stay intact and readable. File-like: write, flush, fileno, close."""

    def __init__(self, path: str | os.PathLike, what: str = "the metrics"):
        self.path, self.what = Path(path), what
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str) -> int:
        from scaletrain.errors import disk_full, disk_full_error

        data = memoryview(text.encode())
        at = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as e:
            if not disk_full(e):
                raise
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, at)
            raise disk_full_error(self.what, self.path, "; the rows written before are intact") from None
        return len(text)

    def flush(self) -> None:
        """Nothing to do: every write went to the file."""

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> AppendLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
