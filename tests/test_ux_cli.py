"""Defaults a newcomer meets: `train` without --out writes a fresh runs/train/<time> folder (never another run's),
`sample --run` (and the older --out) reads a run, `plan --model` without --global-batch uses the published batch."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.commands import train as train_cmd

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.steps=1", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=2", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=1",
        "--set", "train.report=false"]
STAMP = 1_800_000_000.0  # one fixed clock for both runs: the second must not reuse the first's folder


@pytest.fixture(scope="module")
def two_default_runs(tmp_path_factory):
    """Two `train` runs without --out in a row, with the clock frozen at one second, from a fresh working folder."""
    cwd, here = Path.cwd(), tmp_path_factory.mktemp("cwd")
    real = train_cmd.fresh_out
    train_cmd.fresh_out = lambda root, now=None: real(root, STAMP)
    os.chdir(here)
    outputs, codes = [], []
    try:
        for _ in range(2):
            with contextlib.redirect_stdout(io.StringIO()) as buf:
                codes.append(main(["train", *TINY]))
            outputs.append(buf.getvalue())
    finally:
        os.chdir(cwd)
        train_cmd.fresh_out = real
    return here, codes, outputs


def test_fresh_out_names_a_new_folder_by_time_with_a_suffix_on_collision(tmp_path):
    root = str(tmp_path / "runs")
    first = train_cmd.fresh_out(root, STAMP)
    assert Path(first).name.count("-") == 1 and len(Path(first).name) == len("YYYYmmdd-HHMMSS")
    Path(first).mkdir(parents=True)
    second = train_cmd.fresh_out(root, STAMP)
    assert second == first + "-2"
    Path(second).mkdir()
    assert train_cmd.fresh_out(root, STAMP) == first + "-3"


def test_two_train_runs_without_out_get_different_folders(two_default_runs, capsys):
    here, codes, outputs = two_default_runs
    assert codes == [0, 0]
    runs = sorted(p.name for p in (here / "runs" / "train").iterdir())
    stamp = Path(train_cmd.fresh_out("x", STAMP)).name
    assert runs == [stamp, f"{stamp}-2"]
    for name, printed in zip(runs, outputs):  # the folder is said before the data is read, and how to resume it
        said = f"no --out given: a new run folder runs/train/{name} (resume it with --out runs/train/{name})"
        assert said in printed and printed.index(said) < printed.index("loading data"), printed
    for name in runs:  # each a complete run of its own, neither resumed from the other
        assert (here / "runs" / "train" / name / "checkpoints").is_dir()
        assert len((here / "runs" / "train" / name / "metrics.jsonl").read_text().splitlines()) >= 1


def test_train_without_out_is_refused_under_torchrun(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out is required under torchrun" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", ["--run", "--out"])
def test_sample_reads_the_run_with_run_or_its_old_spelling_out(two_default_runs, capsys, flag):
    here = two_default_runs[0]
    capsys.readouterr()
    assert main(["sample", flag, str(here / "runs" / "train"), "--tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def ") and len(out.out) == len("def ") + 5 + 1
    assert "-2" in out.err  # a folder of runs: the newest (the second run) is named on stderr


def test_plan_model_without_batch_uses_the_published_batch_and_says_so(capsys):
    import json

    from scaletrain.commands.plan import PUBLISHED_BATCH

    assert main(["plan", "--model", "gpt2-xl", "--gpus", "8", "--json", "--top", "1"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["training"]["global_batch"] == 512
    lines = out.err.splitlines()
    assert lines == ["global batch 512 sequences x 1,024 tokens: gpt2-xl's published batch (Radford et al. 2019, "
                     "section 2.3); set it with --global-batch"]
    assert PUBLISHED_BATCH["gpt3-175b"][0] == 1536 == 3_145_728 // 2048  # Table 2.1's 3.2M tokens (plan --help)


@pytest.mark.parametrize("argv,words", [
    (["--model", "llama3-8b"], ["--global-batch is required", "llama3-8b has no published batch"]),
    (["--model", "gpt2", "--seq-len", "2048"], ["--global-batch is required", "seq_len 1,024", "--seq-len 2,048"]),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq-len", "32"],
     ["--global-batch is required (custom dimensions)"]),
])
def test_plan_without_batch_and_no_published_one_is_one_line_exit_2(capsys, argv, words):
    assert main(["plan", *argv, "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
