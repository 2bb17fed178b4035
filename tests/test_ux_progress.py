"""A run whose output is not a terminal prints plain progress lines on stderr (train/progress.py), and `train --out`
on a finished run says "already complete at step N: nothing to do" without reading data or starting a process
(commands/train.py)."""

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess

import pytest

from scaletrain.cli import main
from scaletrain.train import progress

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.steps=4", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=2", "--set", "train.eval_every=0", "--set", "train.log_every=1",
        "--set", "train.warmup_steps=1", "--set", "train.dtype=fp64", "--set", "train.device=cpu"]
LINE = re.compile(r"^train: step (\d+)/4 \((\d+)%\), loss (\d+\.\d{4}), ([\d,]+) tokens/s \(mean over wall time\), "
                  r"ETA (.+)$")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step run in process with stdout and stderr captured (not terminals) and an interval no run reaches, so the
    only plain line is the one every run prints at its last step, whatever the load: (out, stdout, stderr)."""
    out = tmp_path_factory.mktemp("ux") / "run"
    so, se = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(progress, "LOG_EVERY_S", 1e9)
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            assert main(["train", "--out", str(out), *TINY]) == 0
    return out, so.getvalue(), se.getvalue()


def test_captured_run_prints_its_last_step_as_a_plain_line_on_stderr(finished_run):
    out, stdout, stderr = finished_run
    lines = [m for m in map(LINE.match, stderr.splitlines()) if m]
    assert len(lines) == 1, stderr  # the interval is never reached: the last step's line only
    step, pct, loss, rate, eta = lines[0].groups()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert (step, pct, eta) == ("4", "100", "0 s")
    assert loss == f"{rows[-1]['loss']:.4f}"  # the logged loss of step 4, to the digit shown
    assert int(rate.replace(",", "")) > 0
    assert not any(map(LINE.match, stdout.splitlines()))  # the lines go to stderr only


def test_console_median_is_the_reports(finished_run):
    """The summary's median and report.html's "tokens/s (median of logged steps)" are one number, to the digit."""
    out, stdout, _ = finished_run
    said = re.search(r"^throughput\s+([\d,]+) tokens/s over 4 steps \(median of the logged steps", stdout, re.M)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    page = re.search(r"tokens/s \(median of logged steps\)</td><td>([\d,]+)</td>", (out / "report.html").read_text())
    median = sum(sorted(r["tokens_per_s"] for r in rows)[1:3]) / 2  # 4 logged steps
    assert said and page and said[1] == page[1] == f"{median:,.0f}", stdout


def test_single_process_run_writes_launcher_and_rank0_logs(finished_run):
    out, stdout, stderr = finished_run
    log = (out / "logs" / "rank0.log").read_text().splitlines()
    launcher = (out / "logs" / "launcher.log").read_text().splitlines()
    assert re.fullmatch(rf"rank 0 of 1, local rank 0, host \S+, pid {os.getpid()}, started .+", log[0])
    assert launcher[0] == stdout.splitlines()[0] and launcher[0].startswith("scaletrain train: 7,664 parameters")
    assert launcher[-1] == "  building the model ..."  # the launcher's lines end where the rank's begin
    assert [x for x in log if x.startswith("train: step")] == [stderr.splitlines()[-1]]
    assert log[-1].startswith("memory MiB/rank")  # the summary, after the run
    assert stdout.splitlines() + stderr.splitlines() and all(line in log or line in launcher
                                                             for line in [*stdout.splitlines(), *stderr.splitlines()])


class Clock:
    """A fake monotonic clock the test advances by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_plain_lines_every_interval_and_at_the_last_step():
    clock, buf = Clock(), io.StringIO()
    bar = progress.PlainProgress(total=100, start=20, stream=buf, clock=clock)  # a run resumed at step 20
    assert bar.every_s == progress.LOG_EVERY_S == 10.0
    row = {"loss": 2.5, "tokens_per_s": 400.0, "step_time_s": 0.5}  # 200 tokens a step
    for step in range(21, 101):
        clock.now += 0.5  # 2 steps a second
        bar.update(step, row)
    lines = buf.getvalue().splitlines()
    # 10 s = 20 steps after the start, then every 20 steps, and step 100 (also 10 s after step 80)
    assert [int(x.split()[2].split("/")[0]) for x in lines] == [40, 60, 80, 100]
    assert lines[0] == ("train: step 40/100 (40%), loss 2.5000, 400 tokens/s (mean over wall time), "
                        "ETA 30 s")  # 60 steps left at 2 steps/s
    assert lines[-1].endswith("ETA 0 s")


def test_last_step_gets_a_line_before_the_interval():
    clock, buf = Clock(), io.StringIO()
    bar = progress.PlainProgress(total=3, start=0, stream=buf, clock=clock)
    for step in (1, 2, 3):
        clock.now += 1.0
        bar.update(step, {"loss": 1.0, "tokens_per_s": 10.0, "step_time_s": 1.0})
    assert buf.getvalue() == "train: step 3/3 (100%), loss 1.0000, 10 tokens/s (mean over wall time), ETA 0 s\n"


def test_eta_counts_minutes_and_hours():
    clock, buf = Clock(), io.StringIO()
    bar = progress.PlainProgress(total=10_000, start=0, stream=buf, clock=clock, every_s=0.0)
    clock.now += 2.0
    bar.update(1, {"loss": 1.0, "tokens_per_s": 5.0, "step_time_s": 2.0})  # 9,999 steps left at 2 s each
    clock.now += 2.0 * 69
    bar.update(70, {"loss": 1.0, "tokens_per_s": 5.0, "step_time_s": 2.0})
    assert [x.rsplit("ETA ", 1)[1] for x in buf.getvalue().splitlines()] == ["5 h 33 min", "5 h 31 min"]
    assert progress._duration(59.4) == "59 s" and progress._duration(190) == "3 min 10 s"


def test_terminal_gets_the_bar(monkeypatch):
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: True, raising=False)
    p = progress.Progress(4, 0)
    try:
        assert isinstance(p.impl, progress._Bar)
    finally:
        p.close()
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: False, raising=False)
    assert isinstance(progress.Progress(4, 0).impl, progress.PlainProgress)


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class Started(Exception):
    pass


def refuse(*a, **k):
    raise Started("a process or the data was started")


@pytest.mark.parametrize("extra, said", [
    ([], "already complete at step 4: nothing to do\n"),
    (["--nproc", "2", "--reshard", "--set", "parallel.dp=2"], "already complete at step 4: nothing to do\n"),
    (["--set", "train.steps=3"], "already complete at step 4: nothing to do (train.steps is 3)\n"),
])
def test_finished_run_starts_nothing_and_changes_nothing(finished_run, monkeypatch, capsys, extra, said):
    out = finished_run[0]
    before = digest(out)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr("scaletrain.distributed.launch.launch_local", refuse)
    monkeypatch.setattr("scaletrain.commands.train.run_single", refuse)
    monkeypatch.setattr("scaletrain.data.run.prepare", refuse)
    assert main(["train", "--out", str(out), *TINY, *extra]) == 0
    assert capsys.readouterr().out.endswith(said)
    assert digest(out) == before


def test_unfinished_run_goes_on_to_train(finished_run, monkeypatch):
    """The check above is not vacuous: with steps left the same command reaches the data and the launch."""
    monkeypatch.setattr("scaletrain.data.run.prepare", refuse)
    with pytest.raises(Started):
        main(["train", "--out", str(finished_run[0]), *TINY, "--set", "train.steps=5"])
