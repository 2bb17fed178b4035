"""The asynchronous runners' per-rank checkpoints (train/runners/rank_checkpoint.py; docs/async.md):
corrupted or unsafe files are CheckpointError, and what they cannot do is refused before any process starts, one
line on stderr naming the values, exit 2, nothing in the run folder changed: `--reshard` and `--init-from` with
parallel.sync != bsp, resuming under another layout (dp 2 -> 4), a bsp config over an asynchronous run's
checkpoint and an asynchronous config over a bsp (torch.distributed.checkpoint) one. Resume and kill/resume of
the runners themselves are in tests/test_async.py and tests/test_async_cli.py.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.errors import CheckpointError
from scaletrain.guards import mark_run
from scaletrain.train import checkpoint as dcp_ckpt
from scaletrain.train.runners import rank_checkpoint as rc
from scaletrain.train.runners.common import async_signature

TINY = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=16", "train.steps=2",
        "train.global_batch=4", "train.micro_batch=2", "train.eval_every=0"]
LOCAL2 = ["parallel.sync=local", "parallel.dp=2", "parallel.local_steps=2"]


def _argv(out: Path, sets: list[str], *extra: str) -> list[str]:
    argv = ["train", "--out", str(out), "--nproc", "2" if "parallel.dp=2" in sets else "4", *extra]
    for s in sets:
        argv += ["--set", s]
    return argv


def _snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _one_line(capsys, code: int, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture()
def async_run(tmp_path) -> Path:
    """A run folder holding a complete per-rank checkpoint of a dp=2 local-SGD run (written by the module's own
    save, as the runner writes it, both ranks in this process)."""
    out = tmp_path / "run"
    mark_run(out)
    cfg = load_config(None, TINY + LOCAL2)
    tmp = out / "checkpoints" / "step_00000001.tmp"
    calls = []

    def barrier() -> None:  # rank 1 writes its file between rank 0's creation of the folder and its publish
        calls.append(1)
        if len(calls) == 1:
            rc.save_rank_file(tmp, 1, {"params": torch.arange(4.0) + 1, "step": 1})

    rc.save(out / "checkpoints", 1, 0, 2, {"params": torch.arange(4.0), "step": 1}, async_signature(cfg), barrier,
            keep=2)
    return out


def test_per_rank_checkpoint_round_trip_and_corruption(async_run):
    found = rc.latest(async_run / "checkpoints")
    assert found is not None and rc.read_meta(found)["format"] == rc.FORMAT
    assert torch.equal(rc.load_rank(found, 1)["params"], torch.arange(4.0) + 1)
    data = bytearray((found / "rank00001.pt").read_bytes())
    data[-20] ^= 0xFF
    (found / "rank00001.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        rc.load_rank(found, 1)
    assert (found / "rank00001.pt").exists()  # nothing deleted


def test_per_rank_checkpoint_loads_weights_only(tmp_path):
    """A payload that would run code when unpickled is refused (torch.load weights_only=True)."""
    import hashlib

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    d = tmp_path / "step_00000001"
    d.mkdir()
    data = pickle.dumps({"x": Evil()}, protocol=2)
    (d / "rank00000.pt").write_bytes(data)
    (d / "rank00000.sha256").write_text(hashlib.sha256(data).hexdigest())
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        rc.load_rank(d, 0)


def test_async_run_refuses_reshard_and_init_from(async_run, capsys):
    before = _snapshot(async_run)
    _one_line(capsys, main(_argv(async_run, TINY + LOCAL2, "--reshard")), "--reshard needs parallel.sync=bsp",
              "parallel.sync=local")
    _one_line(capsys, main(_argv(async_run, TINY + LOCAL2, "--init-from", str(async_run))),
              "--init-from needs parallel.sync=bsp", "parallel.sync=local")
    assert _snapshot(async_run) == before


def test_async_run_refuses_another_layout_naming_both_values(async_run, capsys):
    before = _snapshot(async_run)
    sets = TINY + ["parallel.sync=local", "parallel.dp=4", "parallel.local_steps=2", "train.micro_batch=1"]
    _one_line(capsys, main(_argv(async_run, sets)), "layout.dp: checkpoint 2, this run 4", "cannot be resharded")
    _one_line(capsys, main(_argv(async_run, TINY + ["parallel.sync=local", "parallel.dp=2",
                                                      "parallel.local_steps=4"])),
              "sync.local_steps: checkpoint 2, this run 4")
    assert _snapshot(async_run) == before


def test_bsp_config_over_an_async_checkpoint_is_refused(async_run, capsys):
    before = _snapshot(async_run)
    _one_line(capsys, main(_argv(async_run, TINY + ["parallel.dp=2"])), "asynchronous run", rc.FORMAT)
    assert _snapshot(async_run) == before


def test_async_config_over_a_bsp_checkpoint_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    mark_run(out)
    d = out / "checkpoints" / "step_00000002"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"format": dcp_ckpt.FORMAT, "step": 2}))
    (d / dcp_ckpt.COMPLETE).write_text("{}")
    before = _snapshot(out)
    _one_line(capsys, main(_argv(out, TINY + LOCAL2)), dcp_ckpt.FORMAT, "resume it with parallel.sync=bsp")
    assert _snapshot(out) == before


def test_sample_and_checkpoint_inspect_refuse_an_async_checkpoint_in_one_line(async_run, capsys):
    before = _snapshot(async_run)
    _one_line(capsys, main(["sample", "--out", str(async_run)]), "asynchronous run", rc.FORMAT)
    _one_line(capsys, main(["checkpoint", "inspect", str(async_run / "checkpoints" / "step_00000001")]),
              "asynchronous run", rc.FORMAT)
    assert _snapshot(async_run) == before


def test_a_resume_keeps_config_yaml_and_records_the_changes(tmp_path):
    """Issue 21 (c) for the asynchronous runners too: a resume with another train.lr / train.steps keeps the run's
    config.yaml and appends the change to resumes.jsonl; current_config (report, replay) applies it."""
    from scaletrain.config.run import HISTORY, current_config
    from scaletrain.train.runners.common import Metrics

    out = tmp_path / "run"
    first = load_config(None, TINY + LOCAL2)
    Metrics(out, first, 0, False).close()
    original = (out / "config.yaml").read_bytes()
    resumed = load_config(None, TINY + LOCAL2 + ["train.lr=0.5", "train.steps=4"])
    Metrics(out, resumed, 2, False).close()
    assert (out / "config.yaml").read_bytes() == original
    record = json.loads((out / HISTORY).read_text().splitlines()[-1])
    assert record["from_step"] == 2
    assert record["changed"] == {"train.lr": [first.train.lr, 0.5], "train.steps": [2, 4]}
    assert current_config(out)["train"]["lr"] == 0.5 and current_config(out)["train"]["steps"] == 4
    Metrics(out, first, 0, False).close()  # a fresh start (no checkpoint) writes config.yaml and drops the history
    assert not (out / HISTORY).exists()
