"""The checkpoint format: rectangles of shards, the files of a checkpoint, resume records, and bad input.

- `shards`: a flat range of a row-major tensor is tiled by rectangles that are contiguous runs of it, and a
  tensor-parallel shard (stacked parts, vocabulary padding, either dimension) lands where `ShardSpec.global_index`
  puts each element.
- A single-process run's checkpoint holds every tensor by name (index.json, per-chunk SHA-256, COMPLETE with the
  checksums of meta.json and index.json); resuming reads it back bitwise, keeps config.yaml as the run started
  and appends the changed keys (old and new values) to resumes.jsonl.
- Bad input is one line on stderr, exit 2, and leaves every file as it was: not a checkpoint, a truncated or
  corrupted tensor file, a tampered meta.json, the old per-rank format, a checkpoint of another model (naming the
  differing keys and both values), another layout without --reshard (naming both layouts), unwritable or
  non-empty --to, unknown --layout keys, a model without a Hugging Face equivalent, bad sample options.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from harness import TINY

from scaletrain.cli import main
from scaletrain.parallel.tp_plan import ShardSpec
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.shards import flat_range_blocks, local_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = {**TINY, "train.steps": 2, "train.checkpoint_every": 1, "train.report": False}


def _sets(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        out += ["--set", f"{k}={v}"]
    return out


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- rectangles


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_ranges_are_tiled_by_contiguous_rectangles(shape):
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            seen = []
            rects = flat_range_blocks(shape, a, b)
            assert len(rects) <= 2 * len(shape) - 1
            for off, siz, start in rects:
                vals = full[tuple(slice(o, o + s) for o, s in zip(off, siz))].reshape(-1).tolist()
                assert vals == list(range(start, start + len(vals)))  # a contiguous run: a view of the shard
                seen += vals
            assert seen == list(range(a, b))


def test_grid_blocks_land_at_their_global_indices():
    """A 2D / 2.5D / 3D grid block (any local element -> flat global index, -1 padding; `shards.IndexSpec`) and any
    flat range of it (ZeRO-1 over the grid) become rectangles that put every element at its index."""
    from scaletrain.train.shards import IndexSpec, index_blocks

    full = (4, 6)
    g = torch.arange(24).view(full)
    # two row pieces, a corner, padding, then a run of consecutive indices across a row end
    index = torch.cat([g[1, 2:5], g[3, 2:5], g[2, 5:6], torch.tensor([-1, -1]), g[0, 4:6], g[1, 0:2]])
    for a, b in [(0, 13), (1, 5), (3, 9), (6, 7), (7, 9), (8, 12)]:
        cover = torch.full((24,), -5, dtype=torch.long)
        for blk in index_blocks(IndexSpec(index, full), index[a:b].clone(), a, b):
            cover.view(full)[tuple(slice(o, o + n) for o, n in zip(blk.offsets, blk.sizes))] = blk.views[0]
        want = torch.full((24,), -5, dtype=torch.long)
        held = index[a:b][index[a:b] >= 0]
        want[held] = held
        assert torch.equal(cover, want), (a, b)


@pytest.mark.parametrize("spec, local_shape, n", [
    (ShardSpec(0, full=10), (3, 3), 4),  # vocabulary padded to 12 rows over 4 ranks
    (ShardSpec(0, parts=3), (6, 4), 2),  # fused q, k, v, each split over 2 ranks
    (ShardSpec(1), (4, 2), 3),  # row-parallel: split along the input dimension
])
def test_shard_blocks_put_every_element_where_the_tp_plan_does(spec, local_shape, n):
    gshape = spec.global_shape(local_shape, n)
    for rank in range(n):
        index = spec.global_index(local_shape, rank, n)  # flat index in the whole tensor, -1 for padding
        local = index.double().view(local_shape)
        numel = local.numel()
        for a, b in [(0, numel), (1, numel - 1), (2, 7), (5, 5)]:
            cover = torch.zeros(gshape, dtype=torch.long)
            for blk in local_blocks(spec, rank, n, local_shape, local.reshape(-1)[a:b].clone(), a, b):
                region = tuple(slice(o, o + s) for o, s in zip(blk.offsets, blk.sizes))
                want = torch.arange(math.prod(gshape)).view(gshape)[region]
                assert torch.equal(blk.views[0].long(), want)
                cover[region] += 1
            expect = index[a:b]
            assert int(cover.sum()) == int((expect >= 0).sum())


# --------------------------------------------------------------------------- a run's files


def test_checkpoint_files_resume_bitwise_and_resume_record(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *_sets(RUN)]) == 0
    capsys.readouterr()
    step2 = out / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in step2.iterdir()) == ["COMPLETE", "__0_0.distcp", "index.json", "meta.json"]
    meta, index = json.loads((step2 / "meta.json").read_text()), json.loads((step2 / "index.json").read_text())
    assert meta["step"] == 2 and meta["format"] == ckpt.FORMAT and meta["world_size"] == 1
    assert meta["config"]["model"]["d_model"] == TINY["model.d_model"]
    t = index["tensors"]["model/blocks.0.attn.qkv.weight"]
    assert t["shape"] == [96, 32] and t["dtype"] == "float64" and len(t["chunks"]) == 1
    assert len(t["chunks"][0]["sha256"]) == 64
    assert {"optim/wte.weight/exp_avg", "optim/wte.weight/exp_avg_sq", "optim/wte.weight/step"} <= set(index["tensors"])
    marker = json.loads((step2 / "COMPLETE").read_text())
    assert marker["sha256"]["meta.json"] == hashlib.sha256((step2 / "meta.json").read_bytes()).hexdigest()
    config_before = (out / "config.yaml").read_text()

    # resume with a new learning rate and more steps: config.yaml stays, resumes.jsonl records what changed
    assert main(["train", "--out", str(out), *_sets({**RUN, "train.steps": 3, "train.lr": 1e-3})]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert (out / "config.yaml").read_text() == config_before
    record = json.loads((out / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["from_step"] == 2 and record["checkpoint"] == "step_00000002"
    assert record["changed"] == {"train.lr": [3e-3, 1e-3], "train.steps": [2, 3]} and "layout" not in record
    from scaletrain.report.run_data import load_run

    run = load_run(out)  # the config in effect: config.yaml with the resumes' changes
    assert (run.cfg.train.lr, run.cfg.train.steps) == (1e-3, 3)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]

    # the state read back is the state written, bitwise
    from harness import make_config

    from scaletrain.train import resume
    from scaletrain.train.trainer import Trainer

    t = Trainer(make_config({**RUN, "train.steps": 3}), None)
    resume.load_engine(t.engine, out / "checkpoints" / "step_00000003")
    stored = ckpt.read_tensors(out / "checkpoints" / "step_00000003", "")
    live = {k: e.blocks[0].views[0] for k, e in resume.save_entries(t.engine, {}).items()}
    assert live.keys() == {k for k in stored if not k.startswith("rng/")}
    for k, v in live.items():
        assert torch.equal(v.to(stored[k].dtype), stored[k]), k


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad") / "run"
    assert main(["train", "--out", str(out), *_sets(RUN)]) == 0
    return out


def _fails(argv: list[str], capsys, *fragments: str) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # refused by the argument parser (cli.py: one line, exit 2)
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: "), err
    for f in fragments:
        assert f in err, (f, err)
    return err


def test_other_run_and_other_layout_are_refused_naming_the_values(run_dir, capsys):
    before = _snapshot(run_dir)
    _fails(["train", "--out", str(run_dir), *_sets({**RUN, "model.d_model": 64, "train.seed": 7})], capsys,
           "belongs to another run", "model.d_model 32 vs 64", "train.seed 1234 vs 7")
    _fails(["train", "--out", str(run_dir), *_sets({**RUN, "parallel.tp": 2}), "--nproc", "2"], capsys,
           "was written with layout dp=1 tp=1 pp=1", "this run's layout is dp=1 tp=2 pp=1", "(2 processes)",
           "parallel.tp 1 vs 2", "--reshard")
    assert _snapshot(run_dir) == before


def test_corrupt_truncated_tampered_and_old_checkpoints_exit_2_and_nothing_is_deleted(run_dir, tmp_path, capsys):
    import shutil

    _fails(["checkpoint", "inspect", str(tmp_path)], capsys, "is not a scaletrain run")
    index = json.loads((run_dir / "checkpoints" / "step_00000002" / "index.json").read_text())
    chunk = index["tensors"]["model/wte.weight"]["chunks"][0]
    at = chunk["offset"] + chunk["length"] - 64  # inside the embedding's values (sample reads only model/ tensors)
    cases = {
        "truncated": ("__0_0.distcp", lambda b: b[:at], "truncated"),
        "flipped": ("__0_0.distcp", lambda b: b[:at] + bytes([b[at] ^ 1]) + b[at + 1:], "fails its SHA-256 check"),
        "tampered meta": ("meta.json", lambda b: b.replace(b'"step": 2', b'"step": 5'), "meta.json fails its SHA-256"),
    }
    for name, (fname, change, fragment) in cases.items():
        run = tmp_path / name.replace(" ", "-")
        shutil.copytree(run_dir, run)
        path = run / "checkpoints" / "step_00000002" / fname
        path.write_bytes(change(path.read_bytes()))
        before = _snapshot(run)
        sets = _sets({**RUN, "train.steps": 3})
        _fails(["train", "--out", str(run), *sets], capsys, fragment)
        _fails(["checkpoint", "inspect", str(run)], capsys, fragment)
        _fails(["sample", "--out", str(run)], capsys, fragment)
        assert _snapshot(run) == before, name
    old = tmp_path / "old" / "checkpoints" / "step_00000004"
    old.mkdir(parents=True)
    (old / "rank00000.pt").write_bytes(b"x")
    (old / "COMPLETE").write_text("ok\n")
    _fails(["checkpoint", "inspect", str(old)], capsys, "old per-rank format")


def test_export_convert_and_sample_bad_options(run_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(["export", str(run_dir), "--to", str(blocker / "hf")], capsys, "cannot be written")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    _fails(["export", str(run_dir), "--to", str(full)], capsys, "exists and is not an empty directory")
    _fails(["checkpoint", "convert", str(run_dir), "--to", str(full)], capsys, "not an empty directory")
    assert (full / "keep.txt").read_text() == "mine" and len(list(full.iterdir())) == 1
    _fails(["checkpoint", "convert", str(run_dir), "--to", str(tmp_path / "c"), "--layout", "dq=2"], capsys,
           "unknown key 'dq'")
    _fails(["checkpoint", "convert", str(run_dir), "--to", str(tmp_path / "c"), "--set", "train.lr=1"], capsys,
           "convert changes only the layout")
    for bad in (["--temperature", "nan"], ["--temperature", "-1"], ["--tokens", "0"], ["--top-k", "0"]):
        _fails(["sample", "--out", str(run_dir), *bad], capsys, "must be")
    moe = tmp_path / "moe"
    assert main(["train", "--out", str(moe), *_sets({**RUN, "train.steps": 1, "model.moe.experts": 2})]) == 0
    capsys.readouterr()
    _fails(["export", str(moe), "--to", str(tmp_path / "hf")], capsys, "model.moe.experts (2)")
    assert not (tmp_path / "hf").exists()


def test_sample_takes_the_newest_run_of_a_folder_and_greedy_is_deterministic(run_dir, tmp_path, capsys):
    import shutil

    runs = tmp_path / "demo"
    shutil.copytree(run_dir, runs / "20240101-000000")
    assert main(["sample", "--out", str(runs), "--temperature", "0", "--tokens", "8"]) == 0
    got = capsys.readouterr()
    assert "20240101-000000, the run with the newest checkpoint" in got.err
    assert main(["sample", "--out", str(run_dir), "--temperature", "0", "--tokens", "8"]) == 0
    assert capsys.readouterr().out == got.out and got.out.startswith("def ")
