"""Resharding: a checkpoint written by one layout continues exactly under another (`--reshard`).

Each source layout trains steps 1-2 of a run and checkpoints at step 2 (fp64); each of its targets reads that
checkpoint under another layout and world size and trains step 3, then checkpoints again (in its own layout). The
target's step-3 loss and final parameters must equal those of the uninterrupted single-process run of the same
model, data and seed: |loss - ref| <= 1e-12 |ref| and, per parameter, max |p - ref| <= 1e-12 max |ref| (measured
worst 3.0e-13: the layouts differ from one process only in summation order; AdamW's eps-bounded steps on the
attention key bias, whose exact gradient is zero, are the largest). Every source reaches three targets, among them
a single process and another world size; sources are the issue's list: single, dp2 (ZeRO 0, 1, 3 + parameter
offload), tp2 + sp, pp2 1F1B, pp2 interleaved v2, dp2 x tp2, MoE with ep2, PipeDream-2BW. More pairs carry
Adafactor and SM3 (factored statistics) across tp, ZeRO and one process, a Llama-shaped model (RoPE, SwiGLU,
RMSNorm, untied head) from tp2 + sp to one process and to ZeRO-3, ZeRO-Infinity (shards in files) both ways, and
2D tensor parallelism (a 2 x 2 grid: blocks of both matrix dimensions) both ways.
PipeDream-2BW is compared with an independent implementation of its rule, and switching between 2BW and a
synchronous schedule with the rule that `--reshard` documents (the older version is dropped; entering 2BW starts
with W(t-1) = W(t)). The runs of five layouts (tp2 + sp, pp2 interleaved, ZeRO-Infinity, ep2, 2BW) save
asynchronously (`train.checkpoint_async`), so their checkpoints come from the staged copy and background writer.

A second family re-saves a checkpoint under another layout without training and compares every stored tensor
bitwise with the original: fp32 masters of bf16/fp16, the fp16 loss scaler, Adafactor's row/column/first moments,
SM3's accumulators and momentum, AdamW's moments and step counts.

To keep process start-up cheap, all runs of one world size share one set of processes (a module fixture), in
the order sources, then targets; single-process runs happen in this process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from harness import TINY, make_config, run_ranks, train_reference_rules

pytestmark = pytest.mark.usefixtures("one_thread")

REL = 1e-12
DENSE = {**TINY, "model.n_layers": 4, "train.steps": 3, "train.checkpoint_every": 2, "train.report": False}
REPORTED = ("target", "single", "tp2-sp")  # this target also writes the HTML run report (of the resharded run)
FACTORED = {**DENSE, "model.bias": False}  # see test_zero.py: a zero-gradient bias makes factored steps noise
FAMILIES = {
    "dense": DENSE,
    "moe": {**DENSE, "model.moe.experts": 4, "model.moe.every": 2},
    "ada": {**FACTORED, "optim.name": "adafactor", "optim.use_beta1": True},
    "sm3": {**FACTORED, "optim.name": "sm3", "optim.momentum": 0.5},
    # grouped-query: one key/value head, copied on both ranks under tp 2; Qwen2's q/k/v biases; Llama 3.1's RoPE
    "llama": {**DENSE, "model.position": "rope", "model.mlp": "swiglu", "model.norm": "rmsnorm", "model.bias": False,
              "model.tie_embeddings": False, "model.n_kv_heads": 1, "model.qkv_bias": True,
              "model.rope_theta": 500000.0, "model.rope_scaling.type": "llama3",
              "model.rope_scaling.original_max_position_embeddings": 16},
    "torchdrop": {**DENSE, "model.dropout": 0.1, "model.dropout_impl": "torch"},
    "bf16": {**DENSE, "train.dtype": "bf16"},
    "fp16": {**DENSE, "train.dtype": "fp16", "train.loss_scale": 1024.0},
}
LAYOUTS = {  # name: (family, parallel overrides)
    "single": ("dense", {}),
    "dp2": ("dense", {"parallel.dp": 2}),
    "dp2-zero1": ("dense", {"parallel.dp": 2, "parallel.zero": 1}),
    "dp2-zero3-offload": ("dense", {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "params"}),
    "dp2-zero3-nvme": ("dense", {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "nvme"}),
    "tp2-sp": ("dense", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "pp2-1f1b": ("dense", {"parallel.pp": 2, "parallel.schedule": "1f1b"}),
    "pp2-interleaved-v2": ("dense", {"parallel.pp": 2, "parallel.schedule": "interleaved",
                                     "parallel.virtual_stages": 2}),
    "dp2-tp2": ("dense", {"parallel.dp": 2, "parallel.tp": 2}),
    "dp4-zero2": ("dense", {"parallel.dp": 4, "parallel.zero": 2}),
    "tp4-2d": ("dense", {"parallel.tp": 4, "parallel.tp_mode": "2d"}),
    "tp2-pp2-zb": ("dense", {"parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "zb-h1"}),
    "pp2-dp2-zero3": ("dense", {"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 3, "parallel.schedule": "gpipe"}),
    "2bw": ("dense", {"parallel.pp": 2, "parallel.schedule": "2bw"}),
    "2bw-dp2": ("dense", {"parallel.pp": 2, "parallel.dp": 2, "parallel.schedule": "2bw"}),
    "2bw-tp2": ("dense", {"parallel.pp": 2, "parallel.tp": 2, "parallel.schedule": "2bw"}),
    "moe-single": ("moe", {}),
    "moe-ep2": ("moe", {"parallel.dp": 2, "parallel.ep": 2}),
    "moe-ep2-zero2": ("moe", {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 2}),
    "moe-ep2-tp2-zero1": ("moe", {"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2, "parallel.zero": 1}),
    "llama-tp2-sp": ("llama", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "llama-dp2-zero3": ("llama", {"parallel.dp": 2, "parallel.zero": 3}),
    "llama-single": ("llama", {}),
    "ada-tp2": ("ada", {"parallel.tp": 2}),
    "ada-dp2-zero2": ("ada", {"parallel.dp": 2, "parallel.zero": 2}),
    "ada-single": ("ada", {}),
    "sm3-dp2-zero1": ("sm3", {"parallel.dp": 2, "parallel.zero": 1}),
    "sm3-tp2-sp": ("sm3", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "sm3-single": ("sm3", {}),
    "torchdrop-single": ("torchdrop", {}),
    "torchdrop-dp2": ("torchdrop", {"parallel.dp": 2}),
    "bf16-dp2-zero1": ("bf16", {"parallel.dp": 2, "parallel.zero": 1}),
    "bf16-tp2": ("bf16", {"parallel.tp": 2}),
    "bf16-single": ("bf16", {}),
    "fp16-dp2-zero3": ("fp16", {"parallel.dp": 2, "parallel.zero": 3}),
    "fp16-single": ("fp16", {}),
}
CONTINUE = {  # source: targets (train step 3 under the target layout)
    "single": ["tp2-sp", "dp2-tp2", "pp2-interleaved-v2", "2bw"],
    "dp2": ["single", "pp2-1f1b", "dp4-zero2"],
    "dp2-zero1": ["single", "dp2-zero3-offload", "tp2-pp2-zb", "tp4-2d"],
    "tp4-2d": ["single", "dp4-zero2"],
    "dp2-zero3-offload": ["single", "tp2-sp", "dp2-tp2"],
    "tp2-sp": ["single", "pp2-interleaved-v2", "dp4-zero2", "dp2-zero3-nvme"],
    "dp2-zero3-nvme": ["single", "pp2-1f1b"],
    "pp2-1f1b": ["single", "dp2-zero1", "pp2-dp2-zero3"],
    "pp2-interleaved-v2": ["single", "dp2", "tp2-pp2-zb"],
    "dp2-tp2": ["single", "dp4-zero2", "tp2-pp2-zb"],
    "moe-ep2": ["moe-single", "moe-ep2-zero2", "moe-ep2-tp2-zero1"],
    "2bw": ["single", "2bw-dp2", "2bw-tp2"],
    "llama-tp2-sp": ["llama-single", "llama-dp2-zero3"],
    "ada-tp2": ["ada-dp2-zero2", "ada-single"],
    "sm3-dp2-zero1": ["sm3-single", "sm3-tp2-sp"],
}
CONVERT = {"dp2-zero1": ["tp2-sp"]}  # source: targets of `checkpoint convert` (its multi-process worker)
WARNED = {"torchdrop-single": ["torchdrop-dp2"]}  # torch's dropout: rank 1 has no stream in the checkpoint
RESAVE = {  # source: targets (read and write again, no training)
    "bf16-dp2-zero1": ["bf16-tp2", "bf16-single"],
    "fp16-dp2-zero3": ["fp16-single"],
    "ada-tp2": ["ada-dp2-zero2"],
    "sm3-dp2-zero1": ["sm3-tp2-sp"],
}


ASYNC_SAVES = {"tp2-sp", "pp2-interleaved-v2", "dp2-zero3-nvme", "moe-ep2", "2bw"}  # train.checkpoint_async


def _overrides(layout: str) -> dict:
    family, par = LAYOUTS[layout]
    return {**FAMILIES[family], **par, **({"train.checkpoint_async": True} if layout in ASYNC_SAVES else {})}


def _world(layout: str) -> int:
    o = _overrides(layout)
    return o.get("parallel.dp", 1) * o.get("parallel.tp", 1) * o.get("parallel.pp", 1)


def _run_jobs(rank: int, world: int, jobs: list) -> list:
    """Each job: (overrides, run dir, what, copy of) with what = source (steps 1-2), target (resume, step 3) or resave;
    a target's run dir starts as a copy of its source's (made by rank 0)."""
    import torch.distributed as dist

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for overrides, directory, what, copy_of in jobs:
        if what == "convert":  # `scaletrain checkpoint convert --layout ...` on this rank
            from scaletrain.commands.checkpoint import convert_worker, target_config
            from scaletrain.train import checkpoint as ckpt

            source = ckpt.latest(Path(copy_of) / "checkpoints")
            meta = ckpt.read_meta(source)
            cfg = target_config(meta, "", [f"{k}={v}" for k, v in overrides.items() if k.startswith("parallel.")])
            out.append(convert_worker(cfg, source, meta, Path(directory), DistEnv(rank, world, 0, "test")))
            continue
        if copy_of is not None:
            if rank == 0:
                shutil.copytree(copy_of, directory)
            if world > 1:
                dist.barrier()
        if what == "warned":  # keep what rank 0 says on stderr while resuming
            import contextlib

            with open(Path(directory) / f"stderr{rank}.txt", "w") as err, contextlib.redirect_stderr(err):
                t = Trainer(make_config(overrides), directory, DistEnv(rank, world, 0, "test"), reshard=True)
            t.save()  # and re-save under the new layout (compared bitwise below)
            out.append(None)
            continue
        t = Trainer(make_config(overrides), directory, DistEnv(rank, world, 0, "test") if world > 1 else None,
                    reshard=what != "source")
        if what == "resave":
            t.save()
            out.append(None)
            continue
        result = t.run(stop_after=2 if what == "source" else None)
        state = t.full_state()
        out.append((result.losses, state) if rank == 0 else None)
    return out


def _run(world: int, jobs: list) -> list:
    if not jobs:
        return []
    if world == 1:
        return _run_jobs(0, 1, jobs)
    return run_ranks(_run_jobs, world, jobs, timeout=300)[0]


# --------------------------------------------------------------------------- references


def _reference_for(source: str, target: str, cache: dict) -> tuple[dict, dict]:
    family = LAYOUTS[target][0]
    rules = tuple("2bw" if layout.startswith("2bw") else "sync" for layout in (source, source, target))
    key = (family, rules)
    if key not in cache:
        if rules == ("sync",) * 3:
            from harness import train_reference

            cache[key] = train_reference(FAMILIES[family])
        else:
            cache[key] = train_reference_rules(FAMILIES[family], rules)
    return cache[key]


# --------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train every source, copy its checkpoint for each target, run every target. Phases: single-process
    sources; world 2 (sources, then targets); world 4 (likewise); single-process targets."""
    root = tmp_path_factory.mktemp("reshard")
    sources = sorted(set(CONTINUE) | set(RESAVE) | set(WARNED))
    pairs = [("target", s, t) for s, ts in CONTINUE.items() for t in ts] + \
            [("resave", s, t) for s, ts in RESAVE.items() for t in ts] + \
            [("convert", s, t) for s, ts in CONVERT.items() for t in ts] + \
            [("warned", s, t) for s, ts in WARNED.items() for t in ts]
    assert all(_world(s) <= _world(t) or _world(t) == 1 for _, s, t in pairs)  # sources are ready in time
    results: dict[tuple[str, str, str], object] = {}
    for world, do_sources, do_targets in ((1, True, False), (2, True, True), (4, True, True), (1, False, True)):
        batch = [("source", s, s) for s in sources if do_sources and _world(s) == world]
        batch += [p for p in pairs if do_targets and _world(p[2]) == world]
        jobs = [({**_overrides(t), "train.report": (what, s, t) == REPORTED},
                 str(root / (s if what == "source" else f"{s}--{what}--{t}")), what,
                 None if what == "source" else str(root / s)) for what, s, t in batch]
        for key, out in zip(batch, _run(world, jobs)):
            results[key] = out
    return root, results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def test_every_source_continues_exactly_under_three_other_layouts(runs):
    root, results = runs
    refs: dict = {}
    worst = 0.0
    for source, targets in CONTINUE.items():
        # beyond the matrix: optimizers, RMSNorm, ZeRO-Infinity's shards in files
        extra = LAYOUTS[source][0] in ("ada", "sm3", "llama") or source in ("dp2-zero3-nvme", "tp4-2d")
        assert len(targets) >= 3 or extra
        if not extra:  # the matrix: single and another world size
            assert any(_world(t) == 1 for t in targets) or source == "single", source
            assert any(_world(t) != _world(source) for t in targets), source
        for target in targets:
            ref_losses, ref_state = _reference_for(source, target, refs)
            losses, state = results[("target", source, target)]
            assert list(losses) == [3], (source, target, losses)  # resumed from step 2, trained step 3
            err = abs(losses[3] - ref_losses[3]) / abs(ref_losses[3])
            assert err <= REL, f"{source} -> {target}: step 3 loss {losses[3]!r} vs {ref_losses[3]!r}"
            assert state.keys() == ref_state.keys()
            for name in ref_state:
                e = _rel(state[name], ref_state[name])
                assert e <= REL, f"{source} -> {target}: {name} differs by {e:.2e} of its largest value"
                worst = max(worst, e, err)
    print(f"worst relative difference {worst:.2e}")


def test_a_resharded_run_reports_its_current_layout(runs, capsys):
    """config.yaml keeps the layout the run started with; the run report reads it with resumes.jsonl's changes,
    so after one process -> tp2 it describes (and plots the memory of) the two tensor-parallel ranks."""
    import json

    import yaml

    from scaletrain.report.run_data import load_run

    root, _ = runs
    d = root / "single--target--tp2-sp"
    assert yaml.safe_load((d / "config.yaml").read_text())["parallel"]["tp"] == 1
    record = json.loads((d / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["changed"]["parallel.tp"] == [1, 2] and record["layout"]["to"].endswith("(2 processes)")
    run = load_run(d)
    assert run.cfg.parallel.tp == 2 and run.cfg.parallel.sequence_parallel
    assert [r["rank"] for r in run.memory_ranks] == [0, 1]
    assert (d / "report.html").stat().st_size > 0


def test_torch_dropout_streams_missing_after_a_reshard_are_reported(runs):
    """model.dropout_impl=torch: one process -> dp=2, data-parallel rank 1 has no stream in the checkpoint; rank 0
    says so on stderr (layout-independent dropout, the default, needs no stream)."""
    root, _ = runs
    said = (root / "torchdrop-single--warned--torchdrop-dp2" / "stderr0.txt").read_text()
    assert "1 rank(s) have no random stream" in said and "model.dropout_impl=torch" in said


def _stored(directory) -> dict[str, torch.Tensor]:
    from scaletrain.train import checkpoint as ckpt

    return ckpt.read_tensors(ckpt.latest(directory / "checkpoints"), "")


def test_resaving_under_another_layout_keeps_every_tensor_bitwise(runs):
    """Masters, moments, factored statistics, step counts and the loss scaler survive a change of layout (re-saved
    by a resumed Trainer, or by `checkpoint convert`'s worker on two ranks)."""
    from scaletrain.train import checkpoint as ckpt

    root, _ = runs
    triples = [("resave", s, t) for s, ts in RESAVE.items() for t in ts] + \
              [("convert", s, t) for s, ts in CONVERT.items() for t in ts] + \
              [("warned", s, t) for s, ts in WARNED.items() for t in ts]
    for what, source, target in triples:
        before = _stored(root / source)
        meta = ckpt.read_meta(ckpt.latest(root / source / "checkpoints"))
        kinds = {k.split("/")[0] for k in before}
        assert {"model", "optim"} <= kinds
        if LAYOUTS[source][0] in ("bf16", "fp16"):
            assert "master" in kinds and before["master/wte.weight"].dtype == torch.float32
        d = root / f"{source}--{what}--{target}"
        after = _stored(d)
        keep = {k for k in before if not k.startswith("rng/")}
        assert keep == {k for k in after if not k.startswith("rng/")}, (source, target)
        for k in keep:
            assert after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]), (source, target, k)
        if what == "warned":  # rank 0's torch stream carried bitwise; rank 1 started one of its own
            stream = "rng/dropout/dp0/pp0/torch"
            assert torch.equal(after[stream], before[stream]) and "rng/dropout/dp1/pp0/torch" in after
        new = ckpt.read_meta(ckpt.latest(d / "checkpoints"))
        assert new["config"]["parallel"] == make_config(_overrides(target)).to_dict()["parallel"]
        assert new["trainer"] == meta["trainer"] and new["step"] == meta["step"] == 2
        assert new["world_size"] == _world(target)
    # the fp16 source's loss scaler, as saved: what its logged steps imply (the paper's rule, tests/references.py)
    import json

    from references import LossScale

    meta = ckpt.read_meta(ckpt.latest(root / "fp16-dp2-zero3" / "checkpoints"))
    rows = [json.loads(line) for line in (root / "fp16-dp2-zero3" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] <= meta["step"]]
    t = make_config(_overrides("fp16-dp2-zero3")).train
    replay = LossScale(t.loss_scale, t.loss_scale_window, t.loss_scale_backoff, t.loss_scale_hysteresis,
                       t.loss_scale_min)
    for r in rows:
        assert r["loss_scale"] == replay.scale
        replay.after(r["skipped"])
    scaler = meta["trainer"]["scaler"]
    assert [r["step"] for r in rows] == [1, 2] and (scaler["scale"], scaler["good_steps"]) == (replay.scale,
                                                                                              replay.clean)


def test_sample_and_convert_read_zero3_and_expert_parallel_checkpoints(runs, tmp_path, capsys):
    """`scaletrain sample` on a dp=2 ZeRO-3 run (parameters held as flat shards, offloaded) and on an ep=2 MoE run
    (experts split over ranks); `checkpoint convert` of each to a single-process checkpoint (no process group)
    stores the same tensors bitwise, and sampling it gives the same greedy text."""
    from scaletrain.cli import main

    root, _ = runs
    for run in ("dp2-zero3-offload", "moe-ep2"):
        conv = tmp_path / f"{run}-single"
        assert main(["checkpoint", "convert", str(root / run), "--to", str(conv)]) == 0
        assert "train with --out" in capsys.readouterr().out
        before, after = _stored(root / run), _stored(conv)
        assert {k for k in before if not k.startswith("rng/")} == {k for k in after if not k.startswith("rng/")}
        assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("rng/"))
        texts = []
        for d in (root / run, conv):
            assert main(["sample", "--out", str(d), "--tokens", "12", "--temperature", "0"]) == 0
            texts.append(capsys.readouterr().out)
        assert texts[0] == texts[1] and texts[0].startswith("def ") and len(texts[0]) == len("def ") + 12 + 1


def test_sample_reads_a_checkpoint_of_every_layout(runs, capsys):
    """`scaletrain sample` (one process, no process group) from the step-2 checkpoint of each dense source: the
    synchronous layouts hold the same weights as the single-process run (to 1e-12), so greedy decoding gives the
    single run's text; PipeDream-2BW's weights differ (its own rule) and are sampled too."""
    from scaletrain.cli import main

    root, _ = runs
    texts = {}
    for run in ("single", "dp2", "dp2-zero1", "dp2-zero3-offload", "dp2-zero3-nvme", "tp2-sp", "pp2-1f1b",
                "pp2-interleaved-v2", "dp2-tp2", "2bw"):
        assert main(["sample", "--out", str(root / run), "--tokens", "12", "--temperature", "0"]) == 0
        texts[run] = capsys.readouterr().out
        assert texts[run].startswith("def ") and len(texts[run]) == len("def ") + 12 + 1, run
    assert {run: t for run, t in texts.items() if run != "2bw"} == {run: texts["single"] for run in texts
                                                                       if run != "2bw"}
