"""Issue 30, second round: the stop signals proved on a cheap job, a full disk on every output that is not a
checkpoint, and the asynchronous runners' incomplete checkpoints (docs/errors.md).

- SIGHUP to the launcher of `train --nproc 2`: the real launcher path (config, folder lock, data, torchrun) with
  torchrun's workers replaced by `sleep` (torchrun's `--no-python`): the signal reaches torchrun, which stops its
  workers; the launcher waits, prints one line and exits 129; no process is left and the lock is released. (SIGTERM,
  with two real ranks, is tests/test_cli_bad_inputs.py::test_sigterm_to_the_launcher_stops_every_rank: it costs
  about what this one does, the launcher's own start being most of both.)
- A full disk (a small tmpfs, filled for real: no injected errors) while writing metrics.jsonl, the run log, an
  export (`export --to`, `checkpoint convert --to`), the token cache and the report: one line saying the disk is
  full, exit 1, the files written before left as they were (by hash), no partial output left behind.
- The asynchronous runners (ps, hogwild, local SGD) follow the synchronous path's rule: a checkpoint without
  COMPLETE newer than the newest complete one is passed over with a note naming both; when only incomplete ones
  exist the run stops before anything is written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.cli import main

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.steps=2", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=2", "--set", "train.eval_every=0"]


def hashes(path: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file() and not p.is_symlink() and not stat.S_ISFIFO(p.lstat().st_mode)}


def one_line(capsys, code: int, want_code: int, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == want_code and len(lines) == 1 and "Traceback" not in err, (code, err)
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- stop signals

CHEAP_WORKERS = """
import sys
import scaletrain.distributed.launch as launch

real = launch.torchrun_command

def cheap(nproc, argv, port=None, restarts=0):  # torchrun as the launcher runs it, its workers `sleep 600`
    cmd = real(nproc, argv, port, restarts)
    return cmd[:len(cmd) - len(argv) - 2] + ["--no-python", "sleep", "600"]

launch.torchrun_command = cheap
from scaletrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signame", ["SIGHUP"])  # SIGTERM: test_cli_bad_inputs.py, with real ranks, as cheap
def test_a_stop_signal_to_the_launcher_stops_torchrun_and_its_workers(tmp_path, signame):
    import psutil

    signum = getattr(signal, signame)
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", CHEAP_WORKERS, "train", "--nproc", "2", "--out", str(out), *TINY,
                          "--set", "parallel.dp=2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        family: list = []
        while sum(q.name() == "sleep" for q in family) < 2:  # torchrun has started both workers
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() else "no workers"
            time.sleep(0.1)
            try:
                family = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                family = []
        assert (out / ".scaletrain-lock").exists()
        p.send_signal(signum)
        err = p.communicate(timeout=90)[1]
    finally:
        p.kill()
    assert p.returncode == 128 + signum, err
    assert [x for x in err.splitlines() if x.startswith("scaletrain:")] == \
        [f"scaletrain: stopped by {signame}; the ranks were stopped"]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [(q.pid, q.name()) for q in alive]
    assert not (out / ".scaletrain-lock").exists()


# --------------------------------------------------------------------------- the asynchronous runners' checkpoints

MODES = {"ps": ["parallel.sync=ps", "parallel.dp=2", "parallel.servers=2"],
         "hogwild": ["parallel.sync=hogwild", "parallel.dp=2"],
         "local": ["parallel.sync=local", "parallel.dp=2", "parallel.local_steps=2"]}


def _async_run(out: Path, mode: str, steps: tuple[int, ...]) -> list[str]:
    """A run folder with a complete per-rank checkpoint of `mode` at each of `steps` (written by the runners' own
    save, every rank in this process); returns the --set items of the run."""
    import torch

    from scaletrain.config import load_config
    from scaletrain.guards import mark_run
    from scaletrain.train.runners import rank_checkpoint as rc
    from scaletrain.train.runners.common import async_signature

    items = [TINY[i] for i in range(1, len(TINY), 2)] + MODES[mode]
    cfg = load_config(None, items)
    mark_run(out)
    for step in steps:
        tmp = out / "checkpoints" / f"step_{step:08d}.tmp"
        others = iter(range(1, cfg.world_size))

        def barrier(tmp=tmp, others=others, step=step) -> None:  # the other ranks write between creation and publish
            for r in others:
                rc.save_rank_file(tmp, r, {"params": torch.arange(4.0) + r, "step": step})

        rc.save(out / "checkpoints", step, 0, cfg.world_size, {"params": torch.arange(4.0), "step": step},
                async_signature(cfg), barrier, keep=5)
    return items


def _argv(out: Path, items: list[str]) -> list[str]:
    argv = ["train", "--out", str(out)]
    for item in items:
        argv += ["--set", item]
    return argv


@pytest.mark.parametrize("mode", list(MODES))
def test_async_run_with_only_incomplete_checkpoints_stops_before_anything(capsys, tmp_path, mode):
    out = tmp_path / "run"
    items = _async_run(out, mode, (1, 2))
    for marker in (out / "checkpoints").glob("*/COMPLETE"):
        marker.unlink()
    before = hashes(out)
    code = main(_argv(out, items + ["train.steps=3"]))
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert f"{out}/checkpoints/step_00000001 is incomplete (no COMPLETE marker" in lines[0]
    assert "no earlier complete checkpoint to resume from" in lines[0]
    assert "loading data" not in captured.out  # said before the data is read (and nothing tokenized)
    assert hashes(out) == before and not (out / "logs").exists()


@pytest.mark.parametrize("mode", list(MODES))
def test_async_run_passes_over_an_incomplete_newest_checkpoint_saying_which(capsys, tmp_path, mode):
    """What the launcher says (check_async_run) and what every rank resumes from (find_resume): step 1."""
    from scaletrain.config import load_config
    from scaletrain.train.runners.common import check_async_run, find_resume

    out = tmp_path / "run"
    items = _async_run(out, mode, (1, 2))
    (out / "checkpoints" / "step_00000002" / "COMPLETE").unlink()
    cfg = load_config(None, items)
    check_async_run(out, cfg, False)
    assert f"note: {out}/checkpoints/step_00000002 is incomplete (no COMPLETE marker: an interrupted save?); " \
           f"resuming from {out}/checkpoints/step_00000001, the newest complete checkpoint" in capsys.readouterr().out
    found, meta = find_resume(out, cfg)
    assert found == out / "checkpoints" / "step_00000001" and meta["step"] == 1


# --------------------------------------------------------------------------- a full disk (a real tmpfs, really filled)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A tiny finished run on the ordinary disk (its checkpoint is what export, convert and report read)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("full") / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--out", str(out), *TINY, "--set", "train.report=false"]) == 0
    return out


@pytest.fixture()
def small_disk(tmp_path):
    """An 8 MiB tmpfs (a run report is about 4 MiB), and `fill()` that takes every free byte of it (a file written
    until ENOSPC)."""
    import errno

    disk = tmp_path / "disk"
    disk.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True)
    if rc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {rc.stderr.decode().strip()}")  # a failure under CI (conftest.py)

    def fill() -> None:
        with open(disk / "filler", "ab", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536 if shutil.disk_usage(disk).free > 65536 else b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        assert shutil.disk_usage(disk).free < 4096

    try:
        yield disk, fill
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_full_disk_while_writing_metrics_keeps_the_earlier_rows(capsys, small_disk, monkeypatch):
    """The disk fills after the run's second row (a row per step, no checkpoint before the end): the row that does
    not fit is one line naming metrics.jsonl, exit 1; metrics.jsonl keeps whole rows only, the first ones unchanged;
    config.yaml, written before, is left as it was."""
    import json

    from scaletrain.report.observers import RunObservers

    disk, fill = small_disk
    out = disk / "run"
    sets = [*TINY, "--set", "train.report=false", "--set", "train.log_every=1", "--set", "train.checkpoint_every=0",
            "--set", "train.steps=200"]
    real_log, seen = RunObservers.log, {}

    def log_then_fill(self, row):
        real_log(self, row)
        if row["step"] == 2:
            seen["metrics"], seen["config"] = (out / "metrics.jsonl").read_bytes(), (out / "config.yaml").read_bytes()
            fill()

    monkeypatch.setattr(RunObservers, "log", log_then_fill)
    line = one_line(capsys, main(["train", "--out", str(out), *sets]), 1,
                    f"cannot write the metrics {out}/metrics.jsonl: the disk is full", "rows written before are intact")
    assert "MiB free" in line
    text = (out / "metrics.jsonl").read_bytes()
    rows = [json.loads(x) for x in text.decode().splitlines()]
    assert text.startswith(seen["metrics"]) and text.endswith(b"\n")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert 2 <= len(rows) < 200 and (out / "config.yaml").read_bytes() == seen["config"]


def test_a_full_disk_while_writing_the_token_cache_is_one_line(capsys, small_disk, tmp_path):
    disk, fill = small_disk
    cache = disk / "cache"
    cache.mkdir()
    (cache / "earlier.bin").write_bytes(b"tokens of another source")
    fill()
    before = hashes(disk)
    code = main(["train", "--out", str(tmp_path / "run"), *TINY, "--set", f"data.cache_dir={cache}"])
    one_line(capsys, code, 1, f"cannot write the token cache {cache}/", "the disk is full",
             "set data.cache_dir or SCALETRAIN_CACHE to a folder with room")
    assert {p: h for p, h in hashes(disk).items() if p in before} == before  # the earlier files
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["earlier.bin"]  # no partial


@pytest.mark.parametrize("command", ["export", "convert", "convert-dp2"])
def test_a_full_disk_while_exporting_removes_the_partial_output(capsys, small_disk, finished_run, command):
    """convert-dp2: the conversion runs on 2 ranks (torchrun); the job's logs live outside the output, so the ranks'
    disk-full record is read, and the launcher says the single-process line."""
    disk, fill = small_disk
    (disk / "notes.txt").write_text("the user's earlier file")
    fill()
    before = hashes(disk)
    to = disk / "out"
    argv = (["export", str(finished_run), "--format", "hf", "--to", str(to)] if command == "export"
            else ["checkpoint", "convert", str(finished_run), "--to", str(to)]
            + (["--layout", "dp=2"] if command == "convert-dp2" else []))
    what = "the export" if command == "export" else "the converted run"
    one_line(capsys, main(argv), 1, f"cannot write {what} {to}: the disk is full", f"({to} is empty)")
    assert hashes(disk) == before and list(to.iterdir()) == []


def test_a_full_disk_while_writing_a_report_keeps_the_earlier_report(capsys, small_disk, finished_run):
    disk, fill = small_disk
    page = disk / "report.html"
    assert main(["report", "run", str(finished_run), "--to", str(page)]) == 0
    fill()
    before = hashes(disk)
    capsys.readouterr()
    one_line(capsys, main(["report", "run", str(finished_run), "--to", str(page)]), 1,
             f"cannot write the page {page}: the disk is full", "the earlier page is intact")
    assert hashes(disk) == before and sorted(p.name for p in disk.iterdir()) == ["filler", "report.html"]


def test_a_rank_with_no_room_for_its_error_record_is_still_one_line(capsys, small_disk):
    """A rank's failure on a full disk: its error record does not fit either, so WorkerContext says it on stderr
    (torchrun's log, the launcher's log) and report_failure prints that line alone."""
    import errno

    from scaletrain.distributed.launch import LOG_DIR_ENV, WorkerContext, report_failure

    disk, fill = small_disk
    logs = disk / "logs"
    logs.mkdir()
    fill()
    os.environ[LOG_DIR_ENV] = str(logs)
    try:
        with pytest.raises(OSError), WorkerContext(0):
            raise OSError(errno.ENOSPC, "No space left on device", str(disk / "run" / "run_info.json"))
    finally:
        del os.environ[LOG_DIR_ENV]
    said = capsys.readouterr().err
    assert said.startswith(f"scaletrain: error: rank 0: cannot write {disk}/run/run_info.json: the disk is full")
    launcher_log = disk / "launcher.log"
    launcher_log.touch()  # torchrun's stderr held this line; the test writes it where report_failure reads it
    with open(launcher_log, "w") as f:
        with pytest.raises(OSError):  # no room for it here either: report_failure gets it from a copy
            f.write(said * 2000)
            f.flush()
    copy = Path(str(disk) + ".log")
    copy.write_text("torchrun says ...\n" + said)
    try:
        assert report_failure(logs, 1, copy) == 1
    finally:
        copy.unlink()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [said.strip()]
    assert list(logs.iterdir()) == []  # no partial record left


# --------------------------------------------------------------------------- the audit tables name real tests

DOCS = Path(__file__).parent.parent / "docs"


def _table_ids(page: str, marker: str) -> list[str]:
    """The test ids (`tests/...::...`, in backticks) of the table between `<!-- marker:begin/end -->` of a docs page."""
    import re

    text = (DOCS / page).read_text()
    table = text[text.index(f"<!-- {marker}:begin -->"):text.index(f"<!-- {marker}:end -->")]
    return re.findall(r"`(tests/[\w/]+\.py::[^`]+)`", table)


def test_the_audit_tables_name_collected_tests():
    """Every test id in docs/errors.md's audit of the second sweep and docs/verify.md's table of planted bugs is one
    pytest collects (`x…x` stands for a run of x's): a renamed or dropped test fails here, not in a reader's hands."""
    import re

    ids = _table_ids("errors.md", "audit") + _table_ids("verify.md", "planted")
    assert len(ids) >= 60
    files = sorted({i.split("::")[0] for i in ids})
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                        "no:cacheprovider", *files], capture_output=True, text=True, cwd=DOCS.parent, timeout=300)
    collected = set(p.stdout.splitlines())
    assert collected, p.stdout + p.stderr
    missing = [i for i in ids if i not in collected
               and not any(re.fullmatch(re.escape(i).replace("x…x", "x+"), c) for c in collected)]
    assert missing == [], missing
