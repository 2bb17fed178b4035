"""Runs say what they did (issue 36): `--reshard` names both layouts and what it read, `--init-from` the weights and
how many parameters, training on one's own file the corpus size in tokens (train/announce.py, train/resume.py)."""

import contextlib
import io
import json
import re
import shutil

import pytest

from scaletrain.cli import main

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
        "--set", "model.seq_len=16", "--set", "train.global_batch=4", "--set", "train.micro_batch=2",
        "--set", "train.eval_every=0", "--set", "train.warmup_steps=1", "--set", "train.dtype=fp64",
        "--set", "train.device=cpu"]


@pytest.fixture(scope="module")
def own_file_run(tmp_path_factory):
    """A 2-step run on a text file of our own: (folder, corpus path, stdout)."""
    root = tmp_path_factory.mktemp("said")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a corpus of our own, with words" for i in range(400)))
    so = io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", "--out", str(root / "run"), *TINY, "--set", "train.steps=2",
                     "--set", f"data.source={corpus}"]) == 0
    return root / "run", corpus, so.getvalue()


def test_own_file_run_says_its_corpus_size_in_tokens_once(own_file_run):
    _, corpus, stdout = own_file_run
    said = [x for x in stdout.splitlines() if x.startswith("  data: ")]
    assert len(said) == 1, stdout
    m = re.match(rf"  data: ([\d,]+) tokens in {re.escape(str(corpus))} \(tokenizer byte \(256 ids\), uint16\); "
                 r"([\d,]+) for training, ([\d,]+) held out", said[0])
    total, train, held = (int(g.replace(",", "")) for g in m.groups())
    assert total == len(corpus.read_bytes()) + 1  # one document: its bytes and the end-of-text token
    assert train + held == total


def test_reshard_says_from_which_layout_to_which_and_what_it_read(own_file_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(own_file_run[0], run)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    index = json.loads((ckpt / "index.json").read_text())["tensors"]
    stored = sum(c["length"] for t in index.values() for c in t["chunks"])
    assert main(["train", "--out", str(run), *TINY, "--set", "train.steps=3", "--set", "train.micro_batch=1",
                 "--set", f"data.source={own_file_run[1]}", "--reshard"]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resharded ")]
    assert said == [f"resharded {ckpt.name} from dp=1 tp=1 pp=1 micro_batch=2 (1 process) to dp=1 tp=1 pp=1 "
                    f"micro_batch=1 (1 process): {len(index):,} tensors, {stored:,} bytes read"]
    assert len(index) > 0 and stored > 0


def test_init_from_says_which_weights_and_how_many_parameters(own_file_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--to", str(hf), str(own_file_run[0])]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), *TINY, "--set", "train.steps=1", "--set",
                 f"data.source={own_file_run[1]}", "--init-from", str(hf)]) == 0
    out = capsys.readouterr().out.splitlines()
    said = [x for x in out if x.startswith("initialised from ")]
    params = int(next(x for x in out if x.startswith("parameters ")).split()[1].replace(",", ""))
    m = re.fullmatch(rf"initialised from {re.escape(str(hf))} \(gpt2 weights\): ([\d,]+) parameters in (\d+) tensors",
                     said[0] if len(said) == 1 else "")
    assert m, out
    assert int(m[1].replace(",", "")) == params == 7_664  # every parameter of the model came from the folder
