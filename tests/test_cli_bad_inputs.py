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
CONFIG_ROWS = (
    [(f"{k}=nan", [f"{k} (nan)", "must be finite"]) for k, v in FIELDS if isinstance(v, float)]
    + [(f"{k}=-inf", [f"{k} (-inf)", "must be finite"]) for k, v in FIELDS if isinstance(v, float)]
    + [(f"{k}=inf", [f"{k} (inf)", "must be finite"]) for k, v in FIELDS if isinstance(v, float)][:8]
    + [(f"{k}=lots", [k, "expected an integer", "'lots'"]) for k, v in FIELDS
       if isinstance(v, int) and not isinstance(v, bool)]
    + [(f"{k}=2.5", [k, "expected an integer", "2.5"]) for k, v in FIELDS
       if isinstance(v, int) and not isinstance(v, bool)][:10]
    + [(f"{k}=maybe", [k, "expected true or false", "'maybe'"]) for k, v in FIELDS if isinstance(v, bool)]
    + [(f"{k}=bogus", [CHOICES[k], "bogus"]) for k, _ in FIELDS if k in CHOICES]
    + [(f"{k}={x}", [k, str(x)]) for k, x in (
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


@pytest.mark.parametrize("item, fragments", CONFIG_ROWS, ids=[r[0] for r in CONFIG_ROWS])
def test_config_value_is_refused_in_one_line(capsys, item, fragments):
    code = call(["config", "show", "--set", item])
    assert_one_line(code, capsys.readouterr().err, *fragments)


def test_the_config_table_is_large_and_distinct():
    """The generated rows cover every float, integer, boolean and choice key (150+ distinct bad inputs in all)."""
    items = [r[0] for r in CONFIG_ROWS]
    assert len(items) == len(set(items))
    floats = [k for k, v in FIELDS if isinstance(v, float)]
    assert {f"{k}=nan" for k in floats} <= set(items) and len(floats) >= 20
    assert len(items) + len(CLI_ROWS) + len(FILE_ROWS) >= 150


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
    (["plan", "--model", "gpt2", "--gpus", "8"], ["--global-batch is required"]),
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
        return ["config", "show", "--config", str(yaml)], ["train.steps", "above the limit"]
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
        timers.append(threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)))
        timers[0].start()
        time.sleep(60)
        raise AssertionError("SIGINT did not arrive")

    monkeypatch.setattr(draw, "draw_timeline", slow_draw)
    code = call(["report", "timeline", "--out", str(tmp_path / "t.png")])
    timers[0].join()
    assert code == 130 and capsys.readouterr().err == "scaletrain: interrupted\n"
    assert not (tmp_path / "t.png").exists()
