"""What every asynchronous mode's runner shares with the synchronous trainer: the run signature a checkpoint
must match, `config.yaml` and `resumes.jsonl`, `metrics.jsonl` (trimmed on resume), the progress bar and the
reporting hooks, and the store of the default process group (counters, the launcher's death notices).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.config.run import current_config
from scaletrain.config.schema import ASYNC_KEYS
from scaletrain.errors import CheckpointError, UserError
from scaletrain.guards import AppendLines
from scaletrain.report.observers import RunObservers
from scaletrain.train.progress import Progress
from scaletrain.train.resume import differences, record_resume, record_start, trim_metrics
from scaletrain.train.runners import rank_checkpoint as ckpt

# the synchronisation settings that shape a runner's saved state (ps_tolerate_loss only changes what the
# coordinator does when a worker dies)
SYNC_KEYS = ("sync", *(k for k in ASYNC_KEYS if k != "ps_tolerate_loss"))


def run_signature(cfg: Config) -> dict[str, Any]:
    """What an asynchronous runner's checkpoint must agree with to be resumed by this config (the layout is fixed:
    these checkpoints are per rank and are not resharded; rank_checkpoint.py)."""
    p, t = cfg.parallel, cfg.train
    return {
        "model": cfg.to_dict()["model"],
        "layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero},
        "seed": t.seed, "global_batch": t.global_batch, "micro_batch": t.micro_batch, "dtype": t.dtype,
        "data_source": cfg.data.source, "optim": cfg.to_dict()["optim"],
    }


def async_signature(cfg: Config) -> dict[str, Any]:
    """The run signature plus the synchronisation settings that change the state being saved."""
    sig = run_signature(cfg)
    sig["sync"] = {k: getattr(cfg.parallel, k) for k in SYNC_KEYS}
    return sig


def find_resume(out: Path | None, cfg: Config) -> tuple[Path | None, dict[str, Any]]:
    """The newest complete checkpoint in `out` matching this run (None if there is none); CheckpointError if one
    exists but belongs to another run, or if only incomplete ones exist (no COMPLETE: an interrupted save), as on the
    synchronous path (checkpoint_dirs.usable_latest)."""
    if out is None:
        return None, {}
    found, _ = ckpt.usable_latest(out / "checkpoints")  # only incomplete ones, or a file there: CheckpointError
    if found is None:
        return None, {}
    meta = ckpt.read_meta(found)
    want = async_signature(cfg)
    diff = differences({k: meta.get(k) for k in want}, want)
    if diff:
        listed = "; ".join(f"{k}: checkpoint {a}, this run {b}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {found} does not match this run ({listed}); an asynchronous run's "
                              f"checkpoints are per rank and cannot be resharded: use another --out, or the run's "
                              f"own config {out / 'config.yaml'}")
    return found, meta


def refuse_reshard(cfg: Config, reshard: bool, init_from: str | Path | None = None) -> None:
    """UserError for what the per-rank checkpoints of the asynchronous runners cannot do."""
    if reshard:
        raise UserError(f"--reshard needs parallel.sync=bsp, got parallel.sync={cfg.parallel.sync}: an asynchronous "
                        "run's checkpoints are per rank (servers' shards, workers' replicas) and keep their layout")
    if init_from is not None:
        raise UserError(f"--init-from needs parallel.sync=bsp, got parallel.sync={cfg.parallel.sync}")


def check_async_run(out: Path, cfg: Config, reshard: bool, init_from: str | Path | None = None) -> None:
    """Before launching an asynchronous run: refuse --reshard / --init-from, and a checkpoint in `out` that this
    config cannot resume (another run, another layout or sync mode, or a parallel.sync=bsp checkpoint)."""
    refuse_reshard(cfg, reshard, init_from)
    _, notes = ckpt.usable_latest(Path(out) / "checkpoints")
    found, _ = find_resume(out, cfg)
    for note in notes:  # as the synchronous path says it (train/runner.py)
        print(f"note: {note}; resuming from {found}, the newest complete checkpoint", flush=True)


def record_config(out: Path, cfg: Config, resume_step: int) -> None:
    """As the synchronous trainer does (train/resume.py): a fresh start writes `config.yaml`; a resume keeps it
    (the config the run started with) and appends what this invocation changed to `resumes.jsonl`."""
    if not resume_step or not (out / "config.yaml").exists():
        record_start(out, cfg.to_yaml())
    else:
        record_resume(out, resume_step, differences(current_config(out), cfg.to_dict()))


def observers(cfg: Config, out: Path | None, rank: int, device, world: int, step: int):
    """The trainer's reporting hooks (run_info.json, TensorBoard, the HTML report; report/observers.py) for an
    asynchronous runner. Collective: every rank of the job constructs them at the same point."""
    if out is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)  # run_info.json is written before the first checkpoint or metric
    return RunObservers(SimpleNamespace(cfg=cfg, out=out, rank=rank, device=device, step=step,
                                        mesh=SimpleNamespace(world_size=world)))


class Metrics:
    """`OUT/metrics.jsonl` on the logging rank: rows of steps <= the resume step are kept, later ones rewritten;
    each row also goes to the run's observers (TensorBoard)."""

    def __init__(self, out: Path | None, cfg: Config, resume_step: int, progress: bool, obs=None):
        self.obs = obs
        self.f = None
        self.bar = None
        self.rows: list[dict[str, Any]] = []  # every row this invocation wrote (kept for tests and benchmarks)
        self.log_every, self.steps = cfg.train.log_every, cfg.train.steps
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        record_config(out, cfg, resume_step)
        trim_metrics(out, resume_step)
        self.f = AppendLines(out / "metrics.jsonl")  # a full disk: one line, the earlier rows intact (guards.py)
        if progress:
            self.bar = Progress(cfg.train.steps, resume_step)

    def write(self, row: dict[str, Any]) -> None:
        step = row["step"]
        self.rows.append(row)
        if self.f is not None and (step % self.log_every == 0 or step == self.steps):
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()
            if self.obs is not None:
                self.obs.log(row)
        if self.bar is not None:
            self.bar.update(step, row)

    def sync(self) -> None:
        if self.f is not None:
            os.fsync(self.f.fileno())

    def checkpoint(self, step: int) -> None:
        if self.obs is not None:
            self.obs.checkpoint(step, None)

    def close(self) -> None:
        if self.obs is not None:
            self.obs.stop()
        if self.bar is not None:
            self.bar.close()
        if self.f is not None:
            self.f.close()
            self.f = None


def default_store(unwrap: bool = False):
    """The store of the default process group (None in a single process); with `unwrap`, the store under its
    prefixes, where keys written by the launcher (which hosts it) are visible."""
    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    while unwrap and isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store
