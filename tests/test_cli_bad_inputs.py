"""Issue 21: every bad input is exit 2 and one line on stderr naming the bad value, no traceback, and nothing
existing is changed; plus the newcomer fixes (first line, warm-up note, plan units, config --doc, verify wording,
timeline legend, scaling fit identifiability).

The bulk is a table of (command line, expected fragment) run in-process through `cli.main`; the config rows
are generated from the config's own fields (every float key with NaN and infinity, every integer key with a
word and a fraction, every boolean key with a non-boolean, every choice key with an unknown choice).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.config import Config

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.steps=2", "--set", "train.global_batch=4",
        "--set", "train.micro_batch=2", "--set", "train.eval_every=0"]


def snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def call(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        return int(e.code)


def assert_one_line(code: int, err: str, *fragments: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished tiny run (its stdout kept): the existing outputs every bad input must leave alone."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("hard") / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["train", "--out", str(out), *TINY]) == 0
    return out, buf.getvalue()


# --------------------------------------------------------------------------- the generated config table


def _fields(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


FIELDS = list(_fields(Config()))
CHOICES = {  # keys with a fixed set of values: an unknown one is named in the message
    "model.mlp": "model.mlp", "model.position": "model.position", "model.dropout_impl": "model.dropout_impl",
    "model.moe.router": "model.moe.router", "parallel.offload": "parallel.offload",
    "parallel.schedule": "parallel.schedule", "parallel.partition": "parallel.partition",
    "train.lr_schedule": "train.lr_schedule", "train.dtype": "train.dtype", "train.device": "train.device",
    "train.on_nan": "train.on_nan", "optim.name": "optim.name", "memory.recompute": "memory.recompute",
    "memory.compress": "memory.compress", "parallel.cp_mode": "parallel.cp_mode",
}
GENERATED_ROWS = (  # from the config's own fields: one or two bad values per key of each kind
    [(f"{k}=nan", [f"{k} (nan)", "must be finite"]) for k, v in FIELDS if isinstance(v, float)]
    + [(f"{k}=-inf", [f"{k} (-inf)", "must be finite"]) for k, v in FIELDS if isinstance(v, float)]
    + [(f"{k}=inf", [f"{k} (inf)", "must be finite"]) for k, v in FIELDS if isinstance(v, float)][:8]
    + [(f"{k}=lots", [k, "expected an integer", "'lots'"]) for k, v in FIELDS
       if isinstance(v, int) and not isinstance(v, bool)]
    + [(f"{k}=2.5", [k, "expected an integer", "2.5"]) for k, v in FIELDS
       if isinstance(v, int) and not isinstance(v, bool)][:10]
    + [(f"{k}=maybe", [k, "expected true or false", "'maybe'"]) for k, v in FIELDS if isinstance(v, bool)]
    + [(f"{k}=bogus", [CHOICES[k], "bogus"]) for k, _ in FIELDS if k in CHOICES]
)
HANDWRITTEN_CONFIG_ROWS = (  # values chosen by hand: out-of-range sizes and ratios, empty keys, the steps limit
    [(f"{k}={x}", [k, str(x)]) for k, x in (
        ("model.n_layers", 0), ("model.d_model", 0), ("model.n_heads", -2), ("model.seq_len", 0),
        ("model.vocab_size", 0), ("parallel.dp", 0), ("parallel.tp", -1), ("parallel.pp", 0),
        ("parallel.virtual_stages", 0), ("train.global_batch", 0), ("train.micro_batch", -4), ("train.lr", 0),
        ("train.lr", -0.1), ("train.warmup_steps", -1), ("train.eval_every", -5), ("train.checkpoint_every", -1),
        ("train.keep_checkpoints", 0), ("train.log_every", 0), ("model.dropout", 1.5), ("model.d_ff", -1),
        ("data.val_fraction", 0.9), ("optim.beta1", 1.0), ("optim.beta2", -0.5), ("optim.eps", 0),
        ("parallel.bucket_mb", 0), ("parallel.timeout_s", 0), ("parallel.microbatches", -1),
        ("parallel.zero", 4), ("train.grad_clip", -1), ("train.min_lr", 5), ("parallel.cp", 0),
    )]
    + [("data.source=", ["data.source must be builtin", "got ''"]), ("train.dtype=", ["train.dtype", "got ''"]),
       ("=3", ["unknown config key ''"]), ("train.nosuch=1", ["unknown config key 'train.nosuch'"])]
    + [("train.steps=100000001", ["train.steps (100,000,001)", "above the limit of 100,000,000"]),
       ("train.steps=1e30", ["train.steps", "'1e30'"])]
)
CONFIG_ROWS = GENERATED_ROWS + HANDWRITTEN_CONFIG_ROWS


@pytest.mark.parametrize("item, fragments", CONFIG_ROWS, ids=[r[0] for r in CONFIG_ROWS])
def test_config_value_is_refused_in_one_line(capsys, item, fragments):
    code = call(["config", "show", "--set", item])
    assert_one_line(code, capsys.readouterr().err, *fragments)


def test_the_config_table_is_large_and_distinct():
    """Counted apart (docs/errors.md): the generated rows, one or two per float, integer, boolean and choice key of
    the schema (NaN and -inf for every float key, +inf for the first 8; a word for every integer key, a fraction for
    the first 10; a non-boolean; an unknown choice), and at least 140 cases written by hand (config values, command
    lines, files and folders)."""
    items = [r[0] for r in CONFIG_ROWS]
    assert len(items) == len(set(items))
    floats = [k for k, v in FIELDS if isinstance(v, float)]
    ints = [k for k, v in FIELDS if isinstance(v, int) and not isinstance(v, bool)]
    bools = [k for k, v in FIELDS if isinstance(v, bool)]
    assert {f"{k}=nan" for k in floats} <= set(items) and len(floats) >= 20
    assert len(GENERATED_ROWS) == 2 * len(floats) + min(8, len(floats)) + len(ints) + min(10, len(ints)) + \
        len(bools) + sum(k in CHOICES for k, _ in FIELDS)
    assert len(HANDWRITTEN_CONFIG_ROWS) + len(CLI_ROWS) + len(FILE_ROWS) >= 140


# --------------------------------------------------------------------------- command-line flags

PLAN = ["plan", "--gpus", "8"]
TL = ["report", "timeline"]
CLI_ROWS = [
    (PLAN + ["--params", "nan"], ["--params", "finite", "'nan'"]),
    (PLAN + ["--params", "inf"], ["--params", "finite", "'inf'"]),
    (PLAN + ["--params", "-5"], ["--params", "positive", "'-5'"]),
    (PLAN + ["--params", "0"], ["--params", "positive"]),
    (PLAN + ["--params", "many"], ["--params", "expected a number", "'many'"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--capacity-factor", "nan"],
     ["--capacity-factor", "finite"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--top", "0"], ["--top must be >= 1"]),
    (["plan", "--model", "gpt2", "--gpus", "0", "--global-batch", "8"], ["--gpus must be >= 1"]),
    (["plan", "--model", "llama3-8b", "--gpus", "8"], ["--global-batch is required", "no published batch"]),
    (["plan", "--model", "gpt9", "--gpus", "8", "--global-batch", "8"], ["gpt9"]),
    (["plan", "--model", "gpt2", "--gpu", "tpu9", "--gpus", "8", "--global-batch", "8"], ["tpu9"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--zero3-bw", "0"], ["--zero3-bw"]),
    (["plan", "--layers", "2", "--gpus", "8", "--global-batch", "8"], ["missing", "--hidden"]),
    (["plan", "--gpus", "8"], ["give a model"]),
    (TL + ["--t-f", "nan"], ["--t-f", "finite", "'nan'"]),
    (TL + ["--t-f", "inf"], ["--t-f", "finite"]),
    (TL + ["--t-f", "0"], ["--t-f", "positive"]),
    (TL + ["--t-b", "nan"], ["--t-b", "finite"]),
    (TL + ["--t-b", "-1"], ["--t-b", "positive"]),
    (TL + ["--t-w=-inf"], ["--t-w", "finite"]),
    (TL + ["--t-w=-0.5"], ["--t-w", ">= 0"]),
    (TL + ["--t-w", "-inf"], ["--t-w", "expected one argument"]),  # argparse: "-inf" looks like an option
    (TL + ["--pp", "100000", "--microbatches", "4"], ["--pp", "[1, 256]", "100000"]),
    (TL + ["--pp", "0"], ["--pp", "[1, 256]"]),
    (TL + ["--pp", "256", "--microbatches", "100000"], ["25,600,000", "above the limit of 20,000"]),
    (TL + ["--pp", "200", "--microbatches", "101"], ["= 20,200 is above the limit of 20,000"]),
    (TL + ["--microbatches", "0"], ["--microbatches", ">= 1"]),
    (TL + ["--virtual-stages", "0"], ["--virtual-stages", ">= 1"]),
    (TL + ["--schedule", "zigzag"], ["zigzag"]),
    (TL + ["--pp", "four"], ["--pp", "expected an integer", "'four'"]),
    (["verify", "--rtol", "-1"], ["--rtol", ">= 0", "'-1'"]),
    (["verify", "--dtype", "bogus"], ["train.dtype", "'bogus'"]),
    (["verify", "--set", "parallel.dp=0"], ["parallel.dp must be positive, got 0"]),
    (["verify", "--rtol", "nan"], ["--rtol", "finite"]),
    (["verify", "--atol", "inf"], ["--atol", "finite"]),
    (["verify", "--atol=-1e-9"], ["--atol", ">= 0"]),
    (["report", "run", "/nonexistent/run", "--to", "/proc/r.html"], ["--to /proc/r.html", "cannot write"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--png", "/proc/p.png"],
     ["--png /proc/p.png", "cannot write"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--png", "p.jpg"], ["--png p.jpg must end"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--html", "/proc/p.html"],
     ["--html /proc/p.html", "cannot write"]),
    (PLAN + ["--params", "1e9", "--html", "/proc/p.html"], ["--html /proc/p.html"]),
    (["scaling", "sweep", "--out", "/proc/sweep"], ["--out /proc/sweep", "cannot write"]),
    (["scaling", "sweep", "--minutes", "nan"], ["--minutes", "nan"]),
    (["scaling", "sweep", "--levels", "1"], ["--levels must be >= 2"]),
    (["scaling", "sweep", "--flops", "zero"], ["--flops", "'zero'"]),
    (["scaling", "optimal", "--flops", "nan"], ["--flops", "nan"]),
    (["scaling", "optimal", "--flops=-1e21"], ["--flops", "-1e21"]),
    (["scaling", "optimal", "--params", "inf"], ["--params", "inf"]),
    (["scaling", "optimal", "--flops", "1e21", "--tokens", "1e9"], ["exactly one of"]),
    (["scaling", "fit", "/nonexistent.csv"], ["/nonexistent.csv"]),
    (["scaling", "fit", "/nonexistent.csv", "--bootstrap", "-1"], ["--bootstrap must be >= 0"]),
    (["scaling", "fit", "/nonexistent.csv", "--approach", "4"], ["--approach", "'4'"]),
    ([], ["'scaletrain' needs one of", "train", "plan"]),
    (["config"], ["'scaletrain config' needs one of: show"]),
    (["report"], ["'scaletrain report' needs one of: run, timeline"]),
    (["train", "--nproc", "-2"], ["--nproc must be >= 1"]),
    (["train", "--set", "train.steps"], ["--set expects key=value", "'train.steps'"]),
    (["train", "--set", "model=3"], ["'model' is a section"]),
    (["train", "--set", "model.moe=3"], ["'model.moe' is a section"]),
    (["train", "--set", "model.n_layers.x=3"], ["model.n_layers.x"]),
    (["train", "--set", "train.lr=inf"], ["train.lr (inf)", "must be finite"]),
    (["train", "--set", "train.lr=nan"], ["train.lr (nan)", "must be finite"]),
    (["train", "--set", "parallel.tp=2", "--nproc", "1"], ["parallel.tp (2)"]),
    (["train", "--out", ""], ["--out must name a folder, got an empty string"]),
    (["train", "--out", " "], ["--out must name a folder"]),
    (["train", "--out", "/proc/scaletrain-run"], ["--out /proc/scaletrain-run", "cannot write in /proc"]),
    (["demo", "--out", ""], ["--out must name a folder"]),
    (["demo", "--out", "/proc/scaletrain-demo"], ["cannot write in /proc"]),
    (["demo", "--set", "train.lr=nan"], ["train.lr (nan)"]),
    (["sample", "--out", "/nonexistent/run"], ["not a scaletrain run"]),
    (TL + ["--out", "/proc/x.png"], ["--out /proc/x.png", "cannot write in /proc"]),
    (TL + ["--out", "chart.txt"], ["--out chart.txt must end in .png", "'.txt'"]),
    (TL + ["--out", "chart"], ["must end in .png", "no suffix"]),
    (TL + ["--out", ""], ["--out must name a file"]),
    (TL + ["--trace", "/proc/t.json"], ["--trace /proc/t.json", "cannot write"]),
    (TL + ["--trace", "t.txt"], ["--trace t.txt must end in .json"]),
    (TL + ["--run", "/nonexistent/run"], ["no pipeline trace", "/nonexistent/run"]),
    (["scaling", "fit", "/nonexistent.csv", "--plot", "/proc/plots"], ["--plot /proc/plots", "cannot write"]),
    (["scaling", "fit", "/nonexistent.csv", "--html", "/proc/fit.html"], ["--html /proc/fit.html"]),
]


@pytest.mark.parametrize("argv, fragments", CLI_ROWS, ids=[" ".join(r[0]) or "(nothing)" for r in CLI_ROWS])
def test_bad_command_line_is_refused_in_one_line(capsys, tmp_path, monkeypatch, argv, fragments):
    monkeypatch.chdir(tmp_path)  # relative outputs (chart.txt) would land here: nothing may be written
    code = call(argv)
    assert_one_line(code, capsys.readouterr().err, *fragments)
    assert list(tmp_path.iterdir()) == [], "a refused command wrote files"


# --------------------------------------------------------------------------- files and folders given by the user


def _file_case(kind: str, tmp: Path) -> tuple[list[str], list[str]]:
    """Bad files built in `tmp`: (argv, fragments)."""
    f = tmp / "afile"
    f.write_text("x")
    folder = tmp / "adir"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    yaml = tmp / "c.yaml"
    if kind == "config-folder":
        return ["config", "show", "--config", str(folder)], [f"--config {folder} is a folder"]
    if kind == "config-missing":
        return ["config", "show", "--config", str(tmp / "none.yaml")], ["config file not found"]
    if kind == "config-scalar-section":
        yaml.write_text("model: 5\n")
        return ["config", "show", "--config", str(yaml)], ["model: expected a mapping of keys, got 5"]
    if kind == "config-nested-scalar":
        yaml.write_text("model:\n  moe: 3\n")
        return ["config", "show", "--config", str(yaml)], ["model.moe: expected a mapping of keys, got 3"]
    if kind == "config-list":
        yaml.write_text("- 1\n- 2\n")
        return ["config", "show", "--config", str(yaml)], ["config: expected a mapping of keys"]
    if kind == "config-binary":
        yaml.write_bytes(b"\xff\xfe\x00\x81")
        return ["config", "show", "--config", str(yaml)], ["not a text file"]
    if kind == "config-unknown-key":
        yaml.write_text("train:\n  stepz: 3\n")
        return ["config", "show", "--config", str(yaml)], ["unknown config key 'train.stepz'"]
    if kind == "config-nan":
        yaml.write_text("train:\n  lr: .nan\n")
        return ["config", "show", "--config", str(yaml)], ["train.lr (nan)", "must be finite"]
    if kind == "config-inf-steps":
        yaml.write_text("train:\n  steps: 1.0e+30\n")
        return ["config", "show", "--config", str(yaml)], ["train.steps", "is beyond 64 bits"]
    if kind == "out-under-file":
        return ["train", *TINY, "--out", str(f / "sub")], ["is under", "which is a file"]
    if kind == "out-is-file":
        return ["train", *TINY, "--out", str(f)], ["exists and is not a directory"]
    if kind == "out-user-folder":
        return ["train", *TINY, "--out", str(folder)], ["not a scaletrain run", str(folder)]
    if kind == "demo-out-user-folder":
        return ["demo", "--out", str(folder)], ["not a scaletrain run"]
    if kind == "cache-dir-under-file":
        return ["train", *TINY, "--out", str(tmp / "new"), "--set", f"data.cache_dir={f}/c"], \
            ["data.cache_dir", "cannot be created"]
    if kind == "data-source-folder-empty":
        empty = tmp / "emptydir"
        empty.mkdir()
        return ["train", *TINY, "--out", str(tmp / "new"), "--set", f"data.source={empty}"], ["has no data"]
    if kind == "timeline-out-folder":
        return [*TL, "--out", str(folder)], [f"--out {folder} is a folder"]
    if kind == "timeline-out-under-file":
        return [*TL, "--out", str(f / "x.png")], ["which is a file"]
    if kind == "plot-is-file":
        return ["scaling", "fit", str(tmp / "none.csv"), "--plot", str(f)], ["--plot", "not a directory"]
    if kind == "plot-under-file":
        return ["scaling", "fit", str(tmp / "none.csv"), "--plot", str(f / "p")], ["which is a file"]
    if kind == "html-is-folder":
        return ["scaling", "fit", str(tmp / "none.csv"), "--html", str(folder)], ["is a folder"]
    if kind == "timeline-run-not-a-trace":
        js = tmp / "t.json"
        js.write_text('{"x": 1}')
        return [*TL, "--run", str(js)], ["is not a scaletrain pipeline trace"]
    if kind == "sample-without-checkpoint":
        run = tmp / "nock"
        run.mkdir()
        (run / "config.yaml").write_text("train:\n  steps: 2\n")
        return ["sample", "--out", str(run)], ["no complete checkpoint"]
    if kind == "fit-folder-without-runs":
        return ["scaling", "fit", str(folder)], ["no run folders"]
    if kind == "fit-bad-csv":
        csv = tmp / "runs.csv"
        csv.write_text("params,tokens,flops\n1,2,3\n")
        return ["scaling", "fit", str(csv)], ["missing column(s) loss"]
    if kind == "fit-nan-csv":
        csv = tmp / "runs.csv"
        csv.write_text("params,tokens,flops,loss\n1,2,3,nan\n")
        return ["scaling", "fit", str(csv)], ["column 'loss'", "finite"]
    raise AssertionError(kind)


FILE_ROWS = ["config-folder", "config-missing", "config-scalar-section", "config-nested-scalar", "config-list",
             "config-binary", "config-unknown-key", "config-nan", "config-inf-steps", "out-under-file",
             "out-is-file", "out-user-folder", "demo-out-user-folder", "cache-dir-under-file",
             "data-source-folder-empty", "timeline-out-folder", "timeline-out-under-file", "plot-is-file",
             "plot-under-file", "html-is-folder", "fit-bad-csv", "fit-nan-csv", "timeline-run-not-a-trace",
             "sample-without-checkpoint", "fit-folder-without-runs"]


@pytest.mark.parametrize("kind", FILE_ROWS)
def test_bad_file_or_folder_is_refused_and_left_alone(capsys, tmp_path, kind):
    argv, fragments = _file_case(kind, tmp_path)
    before = snapshot(tmp_path)
    code = call(argv)
    assert_one_line(code, capsys.readouterr().err, *fragments)
    assert snapshot(tmp_path) == before, "a refused command changed files"
    assert not (tmp_path / "new").exists()


def test_user_folder_as_out_dot_is_refused_and_its_files_kept(capsys, tmp_path, monkeypatch):
    """The issue's worst case: `train --out .` in a folder holding the user's own config.yaml and metrics.jsonl."""
    (tmp_path / "config.yaml").write_text("train:\n  steps: 2\n")
    (tmp_path / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = call(["train", "--config", "config.yaml", *TINY, "--out", "."])
    assert_one_line(code, capsys.readouterr().err, "--out . is a non-empty folder that is not a scaletrain run")
    assert snapshot(tmp_path) == before


def test_empty_out_writes_nothing_in_the_current_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = call(["train", *TINY, "--out", ""])
    assert_one_line(code, capsys.readouterr().err, "--out must name a folder")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_cache_from_environment_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SCALETRAIN_CACHE", "/proc/scaletrain-cache")
    code = call(["train", *TINY, "--out", str(tmp_path / "r")])
    assert_one_line(code, capsys.readouterr().err, "SCALETRAIN_CACHE /proc/scaletrain-cache cannot be created")


# --------------------------------------------------------------------------- runs: marker, resume, sample


def test_a_run_is_marked_and_resumes(capsys, run_dir, tmp_path):
    """The marker makes an existing run an accepted --out; a run from before the marker (config.yaml beside
    checkpoints/) is accepted too, and resumes."""
    out, _ = run_dir
    assert (out / ".scaletrain-run").is_file()
    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / ".scaletrain-run").unlink()
    assert call(["train", "--out", str(old), *TINY, "--set", "train.steps=3"]) == 0
    assert "resuming" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, fragments", [
    ("--temperature", "nan", ["--temperature", "finite"]),
    ("--temperature", "-1", ["--temperature", ">= 0"]),  # 0 is greedy decoding (docs/checkpoints.md)
    ("--tokens", "1000000000000", ["--tokens", "[1, 100,000]"]),
    ("--tokens", "0", ["--tokens", "[1, 100,000]"]),
    ("--tokens", "1e12", ["--tokens", "expected an integer"]),
    ("--top-k", "0", ["--top-k", ">= 1"]),
])
def test_sample_bad_values_are_refused_before_loading(capsys, run_dir, flag, value, fragments):
    out, _ = run_dir
    before = snapshot(out)
    code = call(["sample", "--out", str(out), flag, value])
    assert_one_line(code, capsys.readouterr().err, *fragments)
    assert snapshot(out) == before


@pytest.mark.parametrize("argv, fragments", [
    (["--out", "{run}", *TINY, "--set", "train.lr=nan"], ["train.lr (nan)"]),
    (["--out", "{run}", *TINY, "--set", "train.steps=100000001"], ["above the limit"]),
    (["--out", "{run}", *TINY, "--set", "parallel.dp=2", "--nproc", "1"],
     ["does not match the number of processes (1)"]),
])
def test_bad_resume_leaves_the_run_alone(capsys, run_dir, argv, fragments):
    out, _ = run_dir
    before = snapshot(out)
    code = call(["train", *(str(out) if a == "{run}" else a for a in argv)])
    assert_one_line(code, capsys.readouterr().err, *fragments)
    assert snapshot(out) == before


def test_first_line_comes_before_the_slow_phases(run_dir):
    """As soon as the config is valid: the run in one line (parameters exact, layout, steps, where), the warm-up
    note for a run shorter than its warm-up, then status lines, then the summary."""
    out, stdout = run_dir
    lines = stdout.splitlines()
    assert lines[0] == (f"scaletrain train: 7,664 parameters, dp=1 tp=1 pp=1 zero=0 on 1 process, 2 steps of 64 "
                        f"tokens, fp32 -> {out}")
    assert lines[1].startswith("note: train.warmup_steps (20) >= train.steps (2): the learning rate only rises, "
                               "to 0.0001 at the last step")
    assert lines[2] == "  loading data (builtin) ..." and lines[4] == "  building the model ..."
    assert lines[3].startswith("  data: 1") and "tokens in builtin" in lines[3]  # the corpus's size (issue 28)
    assert "parameters      7,664" in stdout  # the count the model really has


def test_diverging_single_process_run_is_one_line(capsys, tmp_path):
    code = call(["train", *TINY, "--set", "train.steps=4", "--set", "train.warmup_steps=0", "--set",
                 "train.grad_clip=0", "--set", "train.lr=1e30", "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("scaletrain: error: training diverged: loss is nan at step")


def test_closed_pipe_is_quiet():
    """`scaletrain config show --doc | head -1`: the reader leaves, scaletrain stops without a traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write hits a closed pipe
    try:
        p = subprocess.run([sys.executable, "-m", "scaletrain", "config", "show", "--doc"], stdout=write_end,
                           stderr=subprocess.PIPE, env=env, timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode == 141 and p.stderr.decode() == "", p.stderr.decode()


# --------------------------------------------------------------------------- what a newcomer reads


def test_config_doc_is_aligned_yaml_without_reprs():
    import yaml

    from scaletrain.config.doc import doc_text

    text = doc_text(Config())
    assert yaml.safe_load(text) == Config().to_dict()  # the documented view is the config itself, as YAML
    assert "MoEConfig(" not in text and "'gelu'" not in text and "True" not in text
    assert "  moe:" in text and "    experts: 0" in text and "  mlp: gelu" in text
    columns = {line.index("# ") for line in text.splitlines() if "# " in line}
    assert len(columns) == 1, columns


def test_plan_memory_unit_follows_the_size(capsys):
    from scaletrain.plan.report import MEM_LEGEND, memory_unit

    assert memory_unit([3 * 2**30, 0.5 * 2**30]) == ("GiB", 2.0**30)
    assert memory_unit([3 * 2**30, 5 * 2**20]) == ("MiB", 2.0**20)
    assert memory_unit([0, 50 * 2**10]) == ("KiB", 1024.0)
    assert main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq-len", "64",
                 "--gpus", "2", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "mem MiB (p/g/o/a/b)" in out and MEM_LEGEND.split(",")[0] in out and " 0.0/" not in out
    assert main(["plan", "--params", "1e6", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "params MiB" in out and " GB" not in out and "1.00M params" in out


def test_plan_explanation_puts_the_winner_first():
    """Headline 'best vs runner-up' and every part in the same order (the issue's 'pipeline sends 0.245 s vs 0 s'
    where the winner had pp=1)."""
    import re

    from scaletrain.plan import catalog, hardware, report
    from scaletrain.plan.analytic.inputs import Training
    from scaletrain.plan.search import search

    model = catalog.get_model("gpt3-1.3b")
    cluster = hardware.Cluster(hardware.get_gpu("a100-80gb"), 16)
    cands = search(model, cluster.gpu, 16, Training(global_batch=32)).candidates
    best = cands[0]
    other = next(c for c in cands[1:] if c.layout.pp != best.layout.pp)
    text = report.explain(best, other, model, cluster)
    for label, b, o in re.findall(r"([a-z -]+?) ([\d.e+-]+) s vs ([\d.e+-]+) s", text.split(" per step)")[-1]):
        key = next(k for k, v in report.TIME_LABELS.items() if v == label.strip(": ;"))
        assert float(b) == pytest.approx(best.time_breakdown[key], rel=5e-3), text  # printed to 3 digits
        assert float(o) == pytest.approx(other.time_breakdown[key], rel=5e-3), text
    assert f"pipeline bubble {best.bubble_fraction:.1%} vs {other.bubble_fraction:.1%}" in text


def test_verify_prints_the_largest_parameter_difference(capsys):
    import torch

    from scaletrain.verify.run import report

    ref = {"a": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": torch.tensor([10.0], dtype=torch.float64)}
    got = {"a": torch.tensor([1.0, 2.003], dtype=torch.float64), "b": torch.tensor([10.001], dtype=torch.float64)}
    assert report({1: 3.0}, ref, {1: 3.0}, got, 1e-9, 1e-11) == 1
    out = capsys.readouterr().out
    assert "largest parameter difference 3.00e-03 (a)" in out and "FAIL" in out


def test_timeline_legend_explains_labels_and_shading():
    from scaletrain.parallel.pipeline.draw import legend_notes

    assert legend_notes(True) == ["label m.c = microbatch m, model chunk c", "lighter = later chunk"]
    assert legend_notes(False) == ["label = microbatch"]


def test_scaling_fit_refuses_two_model_sizes_and_reports_progress(tmp_path):
    """Two model sizes cannot identify alpha (E + A/N^alpha has three unknowns along N): refused, not α = 3.03."""
    from scaletrain.errors import UserError
    from scaletrain.scaling.fit import fit_all, load_points

    rows = ["params,tokens,flops,loss,run"]
    for i, (n, d) in enumerate((n, d) for n in (1e6, 4e6) for d in (1e8, 3e8, 1e9, 3e9)):
        rows.append(f"{n:g},{d:g},{6 * n * d:g},{1.7 + 400 / n**0.34 + 410 / d**0.28:.6f},r{i}")
    csv = tmp_path / "runs.csv"
    csv.write_text("\n".join(rows) + "\n")
    heard: list[str] = []
    with pytest.raises(UserError, match=r"cannot identify alpha: the runs have 2 distinct model sizes"):
        fit_all(load_points(csv), (3,), bootstrap=0, progress=heard.append)
    assert heard == ["approach 3"]


def test_ctrl_c_is_one_line_and_exit_130(capsys, tmp_path, monkeypatch):
    """Long work is interruptible: a real SIGINT during the drawing ends the command with one line, exit 130."""
    import signal
    import threading
    import time

    from scaletrain.parallel.pipeline import draw

    timers = []

    def slow_draw(*args, **kwargs):  # stands in for a long drawing; a real SIGINT arrives while it runs
        # to the main thread itself: a process-directed os.kill may land on the timer thread, and the main
        # thread's sleep is then not interrupted
        timers.append(threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)))
        timers[0].start()
        time.sleep(60)
        raise AssertionError(f"SIGINT did not arrive (handler now {signal.getsignal(signal.SIGINT)})")

    # what a SIGINT meets in an interactive `scaletrain`: Python's handler, SIGINT not blocked (a CI run of the suite
    # once met neither: the signal did not arrive; an ignored or blocked SIGINT is the environment's, not the CLI's)
    monkeypatch.setattr(draw, "draw_timeline", slow_draw)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        code = call(["report", "timeline", "--out", str(tmp_path / "t.png")])
    finally:
        signal.signal(signal.SIGINT, before)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    timers[0].join()
    assert code == 130 and capsys.readouterr().err == "scaletrain: interrupted\n"
    assert not (tmp_path / "t.png").exists()


# =========================================================================== issue 30: the second sweep
# Each row: exit 2, one line naming the bad value, and every file in the test's folder unchanged (by hash).

LONG = "x" * 300  # a path part over the file system's 255 bytes
PATH_OPTIONS = [  # every option that names a path, with a 300-byte part
    ["train", "--out", f"runs/{LONG}"], ["demo", "--out", LONG], ["sample", "--out", LONG],
    ["config", "show", "--config", f"{LONG}.yaml"], ["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8",
                                                     "--cluster", LONG],
    ["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--png", f"{LONG}.png"],
    ["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--html", f"{LONG}.html"],
    [*TL, "--out", f"{LONG}.png"], [*TL, "--trace", f"{LONG}.json"], [*TL, "--run", LONG],
    ["scaling", "fit", LONG], ["scaling", "fit", "/nonexistent.csv", "--plot", LONG],
    ["scaling", "sweep", "--out", LONG], ["checkpoint", "convert", LONG, "--to", "x"],
    ["report", "run", LONG],
]
HARD_CLI_ROWS = [(argv, ["bytes long, above the file system's limit of 255"]) for argv in PATH_OPTIONS] + [
    (["plan", "--model", "gpt2", "--gpus", "100000000000000000000", "--global-batch", "8"],
     ["--gpus (100000000000000000000) is above the limit of 16,777,216"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "100000000000000000000"],
     ["--global-batch (100000000000000000000) is above the limit"]),
    (["plan", "--layers", "1000000000000000000000000000000", "--hidden", "64", "--heads", "4", "--vocab", "256",
      "--seq-len", "64", "--gpus", "8", "--global-batch", "8"], ["--layers", "above the limit of 100,000"]),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--layout", "tp=8,tp=4"],
     ["--layout names tp twice (tp=8 and tp=4)"]),
    (["plan", "--params", "1e9", "--gpus", "8", "--layout", "tp=99999999999999999999"],
     ["--layout: tp (99999999999999999999) is above the limit"]),
    (["launch-info", "--nnodes", "0"], ["--nnodes", "[1, 16,777,216]", "got 0"]),
    (["train", "--nnodes", "0"], ["--nnodes", "got 0"]),
    (["sample", "--out", "/nonexistent/run", "--seed", str(2**64)], ["--seed", str(2**64)]),
    (["sample", "--out", "/nonexistent/run", "--seed", "-1"], ["--seed", "got -1"]),
]
HARD_CONFIG_ROWS = [
    ("train.seed=-5", ["train.seed must be in [0, 2^63-1], got -5"]),
    ("train.seed=100000000000000000000000", ["train.seed (100000000000000000000000) is beyond 64 bits"]),
    ("model.n_layers=1000000000000000000000000000000", ["model.n_layers", "beyond 64 bits"]),
    ("model.n_layers=100000000000000000", ["model.n_layers (100000000000000000) is above the limit of 100,000"]),
    ("train.global_batch=1099511627776", ["train.global_batch (1099511627776) is above the limit"]),
    ("parallel.dp=1000000000", ["parallel.dp (1000000000) is above the limit"]),
    ("model.vocab_size=99999999999999", ["model.vocab_size", "above the limit"]),
    ("parallel.timeout_s=0.01", ["parallel.timeout_s (0.01) is below the floor of 2 s"]),
    ("model.norm_eps=-1", ["model.norm_eps must be positive", "-1.0"]),
    ("model.norm_eps=0", ["model.norm_eps must be positive"]),
    ("train.lr=1e999", ["train.lr (inf)", "must be finite"]),
    ("optim.eps=" + "9" * 400, ["optim.eps", "beyond the range of a number"]),
]


@pytest.mark.parametrize("argv, fragments", HARD_CLI_ROWS, ids=[" ".join(r[0])[:80] for r in HARD_CLI_ROWS])
def test_second_sweep_command_line_is_refused_in_one_line(capsys, tmp_path, monkeypatch, argv, fragments):
    monkeypatch.chdir(tmp_path)
    code = call(argv)
    assert_one_line(code, capsys.readouterr().err, *fragments)
    assert list(tmp_path.iterdir()) == [], "a refused command wrote files"


@pytest.mark.parametrize("item, fragments", HARD_CONFIG_ROWS, ids=[r[0][:60] for r in HARD_CONFIG_ROWS])
def test_second_sweep_config_value_is_refused_in_one_line(capsys, item, fragments):
    code = call(["config", "show", "--set", item])
    assert_one_line(code, capsys.readouterr().err, *fragments)


def _hard_case(kind: str, tmp: Path) -> tuple[list[str], list[str]]:
    """Bad files and folders of the second sweep, built in `tmp`: (argv, fragments)."""
    yaml, cluster = tmp / "c.yaml", tmp / "cluster.yaml"
    plan = ["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--cluster", str(cluster)]
    show = ["config", "show", "--config", str(yaml)]
    if kind.startswith("cluster-"):
        body = {"cluster-nan": "gpu:\n  base: a100-80gb\n  peak_flops: .nan\n",
                "cluster-inf": "gpu:\n  base: a100-80gb\n  memory_bytes: .inf\n",
                "cluster-dup": "gpu:\n  base: a100-80gb\ngpu:\n  base: h100\n",
                "cluster-gpus-huge": "gpu:\n  base: a100-80gb\ngpus: 100000000000000000000\n",
                "cluster-big-int": "gpu:\n  base: a100-80gb\n  memory_bytes: 1" + "0" * 30 + "\n"}.get(kind)
        if kind == "cluster-utf16":
            cluster.write_bytes("gpu:\n  base: a100-80gb\n".encode("utf-16"))
        elif kind == "cluster-fifo":
            os.mkfifo(cluster)
        else:
            cluster.write_text(body)
        return plan, {"cluster-nan": ["gpu.peak_flops (nan)", "finite"], "cluster-inf": ["gpu.memory_bytes (inf)"],
                      "cluster-dup": ["key 'gpu' appears twice (lines 1 and 3)"],
                      "cluster-gpus-huge": ["gpus (100000000000000000000)", "64 bits"],
                      "cluster-big-int": ["gpu.memory_bytes", "64 bits"],
                      "cluster-utf16": ["not a text file (not UTF-8"], "cluster-fifo": ["is a FIFO"]}[kind]
    if kind == "config-fifo":
        os.mkfifo(yaml)
        return show, [f"--config {yaml} is a FIFO, not a config file"]
    if kind == "config-devzero":
        return ["config", "show", "--config", "/dev/zero"], ["--config /dev/zero is a device, not a config file"]
    if kind == "config-loop":
        (tmp / "la").symlink_to(tmp / "lb")
        (tmp / "lb").symlink_to(tmp / "la")
        return ["config", "show", "--config", str(tmp / "la")], ["a symbolic link loop"]
    if kind == "config-dangling":
        (tmp / "d.yaml").symlink_to(tmp / "gone.yaml")
        return ["config", "show", "--config", str(tmp / "d.yaml")], ["is a symbolic link to", "which does not exist"]
    if kind == "config-deep":
        yaml.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
        return show, ["nested more than 64 levels deep"]
    if kind == "config-alias-bomb":
        lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
        lines += [f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(9)]
        yaml.write_text("\n".join(lines) + "\n")
        return show, ["more than 32 aliases"]
    if kind == "config-dup-key":
        yaml.write_text("train:\n  steps: 5\n  steps: 7\n")
        return show, ["key 'steps' appears twice (lines 2 and 3)"]
    if kind == "config-bad-section-repr":
        yaml.write_text("model: [" + ",".join(["1"] * 2000) + "]\n")
        return show, ["model: expected a mapping of keys, got [1, 1,", "...)"]
    if kind == "plan-config-with-model":
        yaml.write_text("train:\n  steps: 5\n")
        return ["plan", "--config", str(yaml), "--model", "gpt3-175b", "--gpus", "8"], \
            ["plan --config", "--model, --gpus would be ignored"]
    if kind in ("out-loop", "out-dangling"):
        if kind == "out-loop":
            (tmp / "oa").symlink_to(tmp / "ob")
            (tmp / "ob").symlink_to(tmp / "oa")
            return ["train", *TINY, "--out", str(tmp / "oa")], ["a symbolic link loop"]
        (tmp / "od").symlink_to(tmp / "nowhere")
        return ["train", *TINY, "--out", str(tmp / "od")], ["is a symbolic link to", "which does not exist"]
    if kind.startswith("trace-"):
        js = tmp / "t.json"
        body = {"trace-list": b"[1, 2]", "trace-utf16": "{}".encode("utf-16"),
                "trace-huge-pp": b'{"traceEvents": [], "otherData": {"schedule": "1f1b", "pp": 1000000000, '
                                 b'"microbatches": 1}}',
                "trace-inf-time": b'{"traceEvents": [{"ph": "X", "pid": 0, "ts": 1e999, "dur": 1, "name": "F"}], '
                                  b'"otherData": {"schedule": "1f1b", "pp": 1, "microbatches": 1}}'}[kind]
        js.write_bytes(body)
        return [*TL, "--run", str(js)], {"trace-list": ["is not a scaletrain pipeline trace"],
                                         "trace-utf16": ["not UTF-8"], "trace-huge-pp": ["pp=1000000000"],
                                         "trace-inf-time": ["out of range"]}[kind]
    if kind == "sweep-user-folder":
        (tmp / "mine").mkdir()
        (tmp / "mine" / "notes.txt").write_text("mine")
        return ["scaling", "sweep", "--out", str(tmp / "mine")], ["not a scaling sweep (no .scaletrain-sweep)"]
    if kind == "sweep-bad-plan":
        (tmp / "sw").mkdir()
        (tmp / "sw" / ".scaletrain-sweep").write_text("x")
        (tmp / "sw" / "plan.json").write_text("not json{")
        return ["scaling", "sweep", "--out", str(tmp / "sw"), "--minutes", "0.1"], ["plan.json is not a sweep plan"]
    if kind == "csv-fifo":
        os.mkfifo(tmp / "runs.csv")
        return ["scaling", "fit", str(tmp / "runs.csv")], ["is a FIFO"]
    if kind == "csv-bom":  # as spreadsheets save it: the mark is dropped, the header read (one run is too few)
        (tmp / "runs.csv").write_bytes(b"\xef\xbb\xbfparams,tokens,flops,loss,run\n1e6,2e7,1.2e14,4.1,a\n")
        return ["scaling", "fit", str(tmp / "runs.csv")], ["needs more than 5 final points (runs); got 1"]
    if kind == "csv-latin1":
        (tmp / "runs.csv").write_bytes("params,tokens,flops,loss,run\n1,2,3,4,caf\xe9\n".encode("latin-1"))
        return ["scaling", "fit", str(tmp / "runs.csv")], ["not a text file (not UTF-8: byte 0xe9"]
    raise AssertionError(kind)


HARD_FILE_ROWS = ["cluster-nan", "cluster-inf", "cluster-dup", "cluster-gpus-huge", "cluster-big-int",
                  "cluster-utf16", "cluster-fifo", "config-fifo", "config-devzero", "config-loop", "config-dangling",
                  "config-deep", "config-alias-bomb", "config-dup-key", "config-bad-section-repr",
                  "plan-config-with-model", "out-loop", "out-dangling", "trace-list", "trace-utf16", "trace-huge-pp",
                  "trace-inf-time", "sweep-user-folder", "sweep-bad-plan", "csv-fifo", "csv-latin1", "csv-bom"]


def _hashes(path: Path) -> dict:
    import hashlib

    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file() and not p.is_symlink() and not stat.S_ISFIFO(p.lstat().st_mode)}


@pytest.mark.parametrize("kind", HARD_FILE_ROWS)
def test_second_sweep_bad_file_is_refused_and_left_alone(capsys, tmp_path, kind):
    argv, fragments = _hard_case(kind, tmp_path)
    before, names = _hashes(tmp_path), sorted(p.name for p in tmp_path.rglob("*"))
    code = call(argv)
    err = capsys.readouterr().err
    assert_one_line(code, err, *fragments)
    assert len(err) < 400, err  # a message quotes bad input, never megabytes of it
    assert _hashes(tmp_path) == before and sorted(p.name for p in tmp_path.rglob("*")) == names
    assert "\ufeff" not in err


def test_a_non_utf8_out_name_trains_and_draws_its_loss_plot(capfd, tmp_path):
    """`--out $'r\\xff'`: the run succeeded, then drawing the plot crashed and the success was reported as a
    failure. Now: exit 0, the plot written, the name printed with an escape."""
    out = tmp_path / os.fsdecode(b"r\xff")
    assert call(["train", "--out", str(out), *TINY]) == 0
    assert (out / "loss.png").stat().st_size > 0 and (out / "metrics.jsonl").exists()
    assert "Traceback" not in capfd.readouterr().err
    before = _hashes(tmp_path)  # a refusal names the folder with \xff, and comes before the data is read
    code = call(["train", "--out", str(out), *TINY, "--set", "parallel.sync=hogwild", "--set", "parallel.dp=2"])
    captured = capfd.readouterr()
    assert_one_line(code, captured.err, f"checkpoint {tmp_path}/r\\xff/checkpoints/step_00000002 has format")
    assert "\\udc" not in captured.err and "loading data" not in captured.out
    assert _hashes(tmp_path) == before


# --------------------------------------------------------------------------- issue 30: runs, locks, signals, disks

HOLD = ("import sys, time\nfrom pathlib import Path\nfrom scaletrain.guards import lock_run\n"
        "lock = lock_run(Path(sys.argv[1]))\nprint('held', flush=True)\ntime.sleep(600)\n")


def test_a_locked_run_folder_is_refused_naming_the_holder_then_recovered_after_a_crash(capsys, run_dir, tmp_path):
    """Two `train --out X` at once: the second is refused (host and pid of the holder), nothing changed; after the
    holder is killed (SIGKILL: no clean-up), the next run takes the stale lock over, saying so, and trains."""
    import signal
    import socket

    out = tmp_path / "run"
    shutil.copytree(run_dir[0], out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _hashes(out)
        code = call(["train", "--out", str(out), *TINY, "--set", "train.steps=3"])
        assert_one_line(code, capsys.readouterr().err, f"--out {out} is in use by another scaletrain run",
                        f"host {socket.gethostname()}, pid {holder.pid}")
        assert _hashes(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert call(["train", "--out", str(out), *TINY, "--set", "train.steps=3"]) == 0
    captured = capsys.readouterr()
    assert f"was left by a run that stopped without releasing it (host {socket.gethostname()}, pid {holder.pid})" \
        in captured.err
    assert not (out / ".scaletrain-lock").exists()  # released at the end of the run


def test_resume_refuses_a_checkpoints_file_and_only_incomplete_checkpoints(capsys, run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir[0], out)
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").write_text("not a folder")
    before = _hashes(out)
    code = call(["train", "--out", str(out), *TINY, "--set", "train.steps=3"])
    assert_one_line(code, capsys.readouterr().err, "checkpoints is a file, not the run's folder of checkpoints")
    assert _hashes(out) == before
    shutil.rmtree(out)
    shutil.copytree(run_dir[0], out)
    for marker in (out / "checkpoints").glob("*/COMPLETE"):
        marker.unlink()
    before = _hashes(out)
    code = call(["train", "--out", str(out), *TINY, "--set", "train.steps=3"])
    assert_one_line(code, capsys.readouterr().err, "is incomplete (no COMPLETE marker",
                    "no earlier complete checkpoint to resume from")
    assert _hashes(out) == before  # config.yaml, metrics.jsonl, run_info.json: not rewritten


def test_resume_passes_over_an_incomplete_newest_checkpoint_saying_which(capsys, tmp_path):
    out = tmp_path / "run"
    assert call(["train", "--out", str(out), *TINY, "--set", "train.checkpoint_every=1"]) == 0
    capsys.readouterr()
    (out / "checkpoints" / "step_00000002" / "COMPLETE").unlink()
    assert call(["train", "--out", str(out), *TINY, "--set", "train.checkpoint_every=1",
                 "--set", "train.steps=3"]) == 0
    text = capsys.readouterr().out
    assert f"note: {out}/checkpoints/step_00000002 is incomplete (no COMPLETE marker: an interrupted save?); " \
           f"resuming from {out}/checkpoints/step_00000001, the newest complete checkpoint" in text
    assert "resumed from step 1" in text


def test_outputs_inside_a_runs_managed_folders_are_refused(capsys, run_dir):
    out = run_dir[0]
    before = _hashes(out)
    for argv in (["checkpoint", "convert", str(out), "--to", str(out / "checkpoints" / "single")],
                 ["export", str(out), "--format", "hf", "--to", str(out / "logs" / "hf")],
                 ["scaling", "sweep", "--out", str(out / "checkpoints" / "sw")],
                 ["report", "timeline", "--out", str(out / "checkpoints" / "t.png")],
                 ["train", "--out", str(out / "checkpoints" / "r"), *TINY]):
        code = call(argv)
        assert_one_line(code, capsys.readouterr().err, "a folder the run", "manages")
    assert _hashes(out) == before


def test_a_model_beyond_host_memory_is_refused_before_launch(capsys, tmp_path):
    """357,636 GiB per rank on a 23.5 GiB host was warned about, then allocated until the kernel killed it."""
    out = tmp_path / "big"
    code = call(["train", "--out", str(out), *TINY, "--set", "model.n_layers=2000", "--set", "model.d_model=8192",
                 "--set", "model.n_heads=64"])
    assert_one_line(code, capsys.readouterr().err, "the plan needs", "GiB per rank", "host memory per process is",
                    "nothing was started")
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_is_named_and_the_earlier_checkpoint_kept(capsys, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = disk / "run"
        sets = [*TINY, "--set", "train.checkpoint_every=1", "--set", "train.report=false"]
        assert call(["train", "--out", str(out), *sets, "--set", "train.steps=1"]) == 0
        first = _hashes(out / "checkpoints")
        capsys.readouterr()
        code = call(["train", "--out", str(out), *sets, "--set", "train.steps=4"])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert "the disk is full" in lines[0] and "unexpected pos" not in lines[0]
        assert f"the earlier checkpoint {out}/checkpoints/step_00000001 is intact" in lines[0]
        assert {p: h for p, h in _hashes(out / "checkpoints").items() if "step_00000001" in str(p)} == first
    finally:
        subprocess.run(["umount", str(disk)])


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    """`kill -TERM` to `scaletrain train --nproc 2` (how SLURM and Kubernetes stop a job): the launcher forwards it
    to torchrun's process group, waits for the ranks, and exits 143 with one line; no process is left behind. With
    two real ranks, signalled as soon as both run (waiting for a training step cost 30 s more); SIGHUP and SIGTERM on
    the launcher path alone are tests/test_hardening.py's cheaper pair."""
    import signal
    import time

    import psutil

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "scaletrain", "train", "--nproc", "2", "--out", str(out), *TINY,
                          "--set", "parallel.dp=2", "--set", "train.steps=100000"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "logs" / "rank1.log").exists():  # both ranks run scaletrain (rank 1 opened its log)
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() else "no ranks"
            time.sleep(0.1)
        family = psutil.Process(p.pid).children(recursive=True)
        assert len(family) >= 3  # torchrun and its two ranks
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert [x for x in err.splitlines() if x.startswith("scaletrain:")] == \
        ["scaletrain: stopped by SIGTERM; the ranks were stopped"]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [q.pid for q in alive]
    assert not (out / ".scaletrain-lock").exists()
