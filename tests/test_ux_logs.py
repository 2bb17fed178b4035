"""Every rank's output lands in `OUT/logs/rankN.log` and the launcher's own lines in `OUT/logs/launcher.log`
(distributed/launch.py): a `--nproc 2` run through the CLI, with stdout a pipe (not a terminal)."""

import json
import os
import re
import subprocess
import sys

import pytest

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.steps=4", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=2", "--set", "train.eval_every=0", "--set", "train.log_every=1",
        "--set", "train.warmup_steps=1", "--set", "train.dtype=fp64", "--set", "train.device=cpu"]
HEADER = re.compile(r"^rank (\d) of 2, local rank (\d), host \S+, pid (\d+), started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs") / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    p = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--nproc", "2", "--out", str(out),
                        "--set", "parallel.dp=2", *TINY], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return out / "logs", p.stdout


def test_each_rank_writes_its_own_log_headed_by_its_rank_and_pid(two_ranks):
    logs, _ = two_ranks
    pids = {r["rank"]: r["pid"] for r in json.loads((logs / "preflight.json").read_text())}
    for rank in (0, 1):
        first = (logs / f"rank{rank}.log").read_text().splitlines()[0]
        m = HEADER.match(first)
        assert m, first
        assert (int(m[1]), int(m[2]), int(m[3])) == (rank, rank, pids[rank])  # written by that rank's process


def test_rank0_log_holds_rank0s_lines_and_rank1_log_none_of_them(two_ranks):
    logs, stdout = two_ranks
    rank0 = (logs / "rank0.log").read_text().splitlines()
    last = [x for x in stdout.splitlines() if x.startswith("train: step 4/4 (100%), loss ")]
    assert len(last) == 1, stdout  # the plain progress line reaches the user's stdout under the launcher
    for line in (last[0], *[x for x in stdout.splitlines() if x.startswith(("parameters ", "loss ", "throughput "))]):
        assert line in rank0, line  # what rank 0 printed is in its log
    assert not any("train: step" in x or x.startswith("parameters ") for x in (logs / "rank1.log").read_text()
                   .splitlines())


def test_launcher_log_holds_the_launchers_lines(two_ranks):
    logs, stdout = two_ranks
    lines = (logs / "launcher.log").read_text().splitlines()
    said = stdout.splitlines()[:stdout.splitlines().index("  starting 2 processes ...") + 1]
    started = next(i for i, x in enumerate(lines) if x.startswith("scaletrain launcher: started "))
    assert "--nproc-per-node=2" in lines[started]
    assert said[0].startswith("scaletrain train: 7,664 parameters, dp=2") and said[0] == lines[0]
    assert [x for x in lines[:started] if x in said] == said  # stdout's lines up to the start, in order (stderr's
    assert lines[started - 1] == "  starting 2 processes ..."  # lines, such as tokenizing, are between them)
    assert re.fullmatch(r"scaletrain launcher: the workers exited with code 0 after \d+\.\d s", lines[-1])
    assert not any(x in lines for x in (logs / "rank1.log").read_text().splitlines())
