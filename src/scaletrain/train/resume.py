"""Resume and save a run's full training state; what must match, what is a layout change, what may change.

A run's config keys fall into three kinds (docs/checkpoints.md):
- identity — `model.*`, `optim.*`, `train.seed`, `train.global_batch`, `train.dtype`, `data.source`,
  `data.val_fraction`: a checkpoint of another value belongs to another run; refused, naming both values.
- layout — `parallel.*` (but `timeout_s`, `offload_dir`, `nvme_prefetch`), `train.micro_batch`, `memory.*` (but
  `budget_gb`): how the run is executed.
  A change needs `--reshard` (refused otherwise, naming both layouts); with it the state is read into the new
  layout and training continues exactly (every tensor is stored by name and global shape, `train/state.py`).
- everything else (`train.steps`, `train.lr`, schedules, logging, checkpointing, ...) may change on a resume.

A resume never rewrites the run's `config.yaml` (the config it started with); each resume appends one line to
`OUT/resumes.jsonl` with the step it resumed from and every key whose value changed (old and new). Each
checkpoint's own `meta.json` holds the full config of the run that wrote it.

Entry points (used by `Trainer`, `checkpoint convert`, and anything that restarts runs):
`resume(trainer, reshard)`, `save(trainer)`, `load_engine(engine, directory, ...)`, `save_entries(...)`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from scaletrain.config import Config, flatten
from scaletrain.config.run import HISTORY
from scaletrain.errors import CheckpointError
from scaletrain.train import announce, ckpt_index
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import state as st

IDENTITY = ("model.", "optim.", "train.seed", "train.global_batch", "train.dtype", "data.source",
            "data.val_fraction")
LAYOUT = ("parallel.", "train.micro_batch", "memory.")
NOT_LAYOUT = ("parallel.timeout_s", "parallel.offload_dir", "parallel.nvme_prefetch", "memory.budget_gb")


def kind(key: str) -> str:
    """identity, layout or free (see the module docstring)."""
    if key.startswith(IDENTITY):
        return "identity"
    if key.startswith(LAYOUT) and key not in NOT_LAYOUT:
        return "layout"
    return "free"


def differences(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two resolved configs (as dicts): key -> (saved, current)."""
    a, b = flatten(saved), flatten(current)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def describe_layout(config: dict[str, Any], world: int) -> str:
    """`dp=2 tp=1 pp=1 zero=3 micro_batch=4 (2 processes)`: dp, tp, pp and every layout key off its default."""
    flat, default = flatten(config), flatten(Config().to_dict())
    parts = []
    for key, value in flat.items():
        if kind(key) != "layout":
            continue
        short = key.split(".")[-1]
        if short in ("dp", "tp", "pp") or value != default.get(key):
            parts.append(f"{short}={value}")
    return f"{' '.join(parts)} ({world} process{'es' if world != 1 else ''})"


def check_compatible(found: Path, meta: dict[str, Any], cfg: Config, world: int, reshard: bool) -> dict:
    """Refuse a checkpoint of another run, or of another layout without `reshard`; returns the differences."""
    diffs = differences(meta["config"], cfg.to_dict())
    other = {k: v for k, v in diffs.items() if kind(k) == "identity"}
    if other:
        listed = ", ".join(f"{k} {_fmt(a)} vs {_fmt(b)}" for k, (a, b) in other.items())
        raise CheckpointError(f"checkpoint {found} belongs to another run ({listed}, checkpoint vs this run); use "
                              f"another --out, or the run's own config")
    layout = {k: v for k, v in diffs.items() if kind(k) == "layout"}
    if (layout or meta["world_size"] != world) and not reshard:
        listed = ", ".join(f"{k} {_fmt(a)} vs {_fmt(b)}" for k, (a, b) in layout.items())
        raise CheckpointError(
            f"checkpoint {found} was written with layout {describe_layout(meta['config'], meta['world_size'])}, this "
            f"run's layout is {describe_layout(cfg.to_dict(), world)}" + (f" ({listed})" if listed else "")
            + ": add --reshard to continue under the new layout")
    return diffs


# --------------------------------------------------------------------------- engine state


def save_entries(engine, streams: dict[str, dict[str, Any]]) -> dict[str, st.Entry]:
    """Everything this rank writes: model, masters, optimizer state, 2BW's older version, its random streams."""
    return {**st.engine_entries(engine), **st.rng_entries(streams)}


def load_engine(engine, directory: Path, streams: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Read a checkpoint into a freshly built engine of any layout (and the random streams of `streams` that the
    checkpoint has); returns the streams it did not have. No collectives: each rank reads what it holds."""
    index = ckpt_index.read_index(directory)
    available = set(index["tensors"])
    # No optimizer state at all: the run never stepped (fp16 skipped every step so far for overflow), so the
    # optimizer's lazily made state does not exist yet either; it is made by the first step that is taken.
    stepped = any(k.startswith("optim/") for k in available)
    if stepped:
        st.prepare_load(engine)
    entries = {**st.engine_entries(engine, stale=False, load=True), **st.stale_entries_for_load(engine, available)}
    if not stepped:
        entries = {k: e for k, e in entries.items() if not k.startswith("optim/")}
    missing = []
    for name, state in (streams or {}).items():
        got = {k: e for k, e in st.rng_entries({name: state}).items() if k in available}
        if not got:
            missing.append(name)
        entries.update(got)
    from scaletrain.train import dcp_io  # torch.distributed.checkpoint: imported when a checkpoint is read

    try:
        dcp_io.load_entries(directory, entries, index)
    except (ValueError, RuntimeError) as e:  # DCP's planner on chunks that do not fit
        raise CheckpointError(f"checkpoint {directory} does not fit this model: {str(e).splitlines()[0][:200]}") \
            from None
    st.after_load_sync(engine)
    return missing


def trainer_meta(trainer) -> dict[str, Any]:
    """The trainer's scalars (the same on every rank): skipped steps, loss scaler, noise-scale averages."""
    return {"skipped": trainer.skipped,
            "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
            "noise_scale": trainer.noise.state_dict() if trainer.noise is not None else None}


def checkpoint_meta(cfg: Config, world: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {"world_size": world, "layout": describe_layout(cfg.to_dict(), world), "config": cfg.to_dict(),
            "trainer": extra, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


# --------------------------------------------------------------------------- the trainer


def save(trainer) -> None:
    """Write the trainer's checkpoint of its current step (collective; maybe in the background)."""
    entries = save_entries(trainer.engine, {trainer.rng_stream: trainer.rng})
    meta = checkpoint_meta(trainer.cfg, trainer.mesh.world_size, trainer_meta(trainer))
    trainer.saver.save(trainer.step, entries, meta)


def resume(trainer, reshard: bool = False, init_from: str | Path | None = None) -> Path | None:
    """Resume `trainer` from the newest complete checkpoint in its output directory (if any) and record the
    resume; a fresh start writes the run's config.yaml, and with `init_from` (a Hugging Face directory) starts
    from its weights. Returns the checkpoint resumed from."""
    found, _ = ckpt.usable_latest(trainer.ckpt_root)  # the launcher named what it passes over (runner.check_run)
    cfg, world = trainer.cfg, trainer.mesh.world_size
    diffs: dict[str, tuple[Any, Any]] = {}
    meta: dict[str, Any] = {}
    if found is not None:
        meta = ckpt.read_meta(found)
        diffs = check_compatible(found, meta, cfg, world, reshard)
        error, missing = None, []
        try:
            missing = load_engine(trainer.engine, found, streams={trainer.rng_stream: trainer.rng})
        except CheckpointError as e:
            error = e
        fresh_streams = _agree(error, bool(missing))
        restore_trainer(trainer, meta)
        if fresh_streams and _torch_dropout(cfg) and trainer.rank == 0:
            sys.stderr.write(f"scaletrain: warning: {fresh_streams} rank(s) have no random stream in {found} (another "
                             "layout): their model.dropout_impl=torch masks continue from a fresh stream\n")
    elif init_from is not None:
        from scaletrain.interop.hf import read_hf_weights
        from scaletrain.interop.hf_config import read_hf_config

        weights = read_hf_weights(Path(init_from), cfg.model)
        st.load_model_tensors(trainer.engine, weights)
        if trainer.rank == 0:
            announce.initialised(Path(init_from), str(read_hf_config(Path(init_from)).get("model_type", "?")), weights)
    trainer._barrier()
    if trainer.rank == 0:
        trainer.out.mkdir(parents=True, exist_ok=True)
        if found is None:
            record_start(trainer.out, cfg.to_yaml())
        else:
            if not (trainer.out / "config.yaml").exists():
                write_text(trainer.out / "config.yaml", _yaml(meta["config"]))
            extra: dict[str, Any] = {"checkpoint": found.name}
            if any(kind(k) == "layout" for k in diffs) or meta["world_size"] != world:
                extra["layout"] = {"from": meta["layout"], "to": describe_layout(cfg.to_dict(), world)}
                announce.resharded(found, extra["layout"]["from"], extra["layout"]["to"])
            record_resume(trainer.out, trainer.step, diffs, **extra)
        trim_metrics(trainer.out, trainer.step)
    return found


def _agree(error: CheckpointError | None, missing: bool) -> int:
    """Every rank reads its own chunks, so a corrupted one may fail a single rank: all ranks learn whether any
    failed; the failing rank raises its error, the others stop quietly (exit 2) instead of failing on its absence.
    Returns how many ranks found no random stream of theirs in the checkpoint."""
    import torch.distributed as dist

    flags = [(error is not None, missing)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, (error is not None, missing))
        if any(f[0] for f in flags) and error is None:
            raise SystemExit(2)
    if error is not None:
        raise error
    return sum(f[1] for f in flags)


def restore_trainer(trainer, meta: dict[str, Any]) -> None:
    extra = meta.get("trainer") or {}
    trainer.step = int(meta["step"])
    trainer.skipped = int(extra.get("skipped", 0))
    if trainer.scaler is not None and extra.get("scaler"):
        trainer.scaler.load_state_dict(extra["scaler"])
    if trainer.noise is not None and extra.get("noise_scale"):
        trainer.noise.load_state_dict(extra["noise_scale"])


def _torch_dropout(cfg: Config) -> bool:
    m = cfg.model
    return m.dropout_impl == "torch" and (m.dropout > 0 or m.moe.expert_dropout > 0)


def _yaml(config: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` at once (a temporary file renamed over it)."""
    import os

    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


def trim_metrics(out: Path, step: int) -> None:
    """Keep the lines of `out/metrics.jsonl` of steps <= `step` (those a resumed run will not redo); none when
    `step` is 0."""
    path = out / "metrics.jsonl"
    kept: list[str] = []
    if step and path.exists():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:
                break  # a line cut by a kill ends the valid part
    write_text(path, "".join(x + "\n" for x in kept))


def record_start(out: Path, config_text: str) -> None:
    """A run starting afresh in `out`: its `config.yaml`, and no resume history (those of checkpoints that are
    gone)."""
    write_text(out / "config.yaml", config_text)
    (out / HISTORY).unlink(missing_ok=True)


def record_resume(out: Path, step: int, changed: dict[str, tuple[Any, Any]], **extra: Any) -> None:
    """Append a resume from `step` and the config keys it changed ({key: (old, new)}) to `out/resumes.jsonl`."""
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "from_step": step, **extra,
              "changed": {k: [a, b] for k, (a, b) in changed.items()}}
    with open(out / HISTORY, "a") as f:
        f.write(json.dumps(record) + "\n")
