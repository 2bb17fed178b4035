"""Bad input: exit code 2, one line naming the bad value, no traceback, nothing deleted."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.steps=2", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=2", "--set", "train.eval_every=0"]


def run_cli(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, *words):
    assert code == 2, (code, err)
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture
def existing_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY]) == 0
    capsys.readouterr()
    return out


def snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv, words", [
    (["train", "--config", "/nonexistent.yaml"], ["config file not found", "/nonexistent.yaml"]),
    (["train", "--set", "model.n_layer=3"], ["unknown config key", "model.n_layer"]),
    (["train", "--set", "train.steps=many"], ["train.steps", "many"]),
    (["train", "--set", "train.steps=0"], ["train.steps must be positive, got 0"]),
    (["train", "--set", "model.d_model=-8"], ["model.d_model must be positive, got -8"]),
    (["train", "--set", "model.d_model=100", "--set", "model.n_heads=3"], ["d_model (100)", "n_heads (3)"]),
    (["train", "--set", "train.global_batch=10", "--set", "train.micro_batch=4"], ["global_batch (10)"]),
    (["train", "--set", "parallel.dp=2", "--nproc", "4"], ["does not match the number of processes (4)"]),
    # against an existing run the checkpoint check (before any data is read) names it first
    (["train", "--set", "data.source=/no/such/data.txt"], ["data.source", "/no/such/data.txt"]),
    (["train", "--nproc", "0"], ["--nproc must be >= 1"]),
    (["config", "show", "--set", "parallel.zero=9"], ["parallel.zero", "9"]),
    (["train", "--bogus-flag"], ["unrecognized arguments", "--bogus-flag"]),
])
def test_bad_input_one_line_exit_2(capsys, existing_run, argv, words):
    before = snapshot(existing_run)
    try:
        code = main([*argv, "--out", str(existing_run)] if argv[0] == "train" else argv)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err
    assert_one_line_error(code, err, *words)
    assert snapshot(existing_run) == before, "bad input changed existing outputs"


def test_yaml_syntax_error(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  n_layers: [1, 2\n")
    code, err = run_cli(capsys, ["config", "show", "--config", str(f)])
    assert_one_line_error(code, err, "not valid YAML", "line")


def test_empty_data(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = run_cli(capsys, ["train", "--out", str(tmp_path / "o"), *TINY, "--set", f"data.source={empty}"])
    assert_one_line_error(code, err, "no data", str(empty))


def test_corrupted_checkpoint_is_exit_2_and_kept(capsys, existing_run):
    ck = sorted((existing_run / "checkpoints").glob("step_*"))[-1] / "__0_0.distcp"
    data = bytearray(ck.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ck.write_bytes(bytes(data))
    before = snapshot(existing_run)
    code, err = run_cli(capsys, ["train", "--out", str(existing_run), *TINY, "--set", "train.steps=4"])
    assert_one_line_error(code, err, "corrupted", "__0_0.distcp")
    assert snapshot(existing_run) == before


def test_mismatched_checkpoint_is_exit_2(capsys, existing_run):
    code, err = run_cli(capsys, ["train", "--out", str(existing_run), *TINY, "--set", "model.d_model=32"])
    assert_one_line_error(code, err, "belongs to another run", "model.d_model 16 vs 32")


def test_real_process_no_traceback(tmp_path):
    """The installed entry point itself: exit 2, one line on stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--set", "model.n_heads=5"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "n_heads (5)" in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists()
