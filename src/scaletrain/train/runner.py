"""The choice of what trains a run, by `parallel.sync`: the synchronous `Trainer` (`bsp`) or an asynchronous mode's
runner (`train/runners/`: `ps`, `hogwild`, `local`; docs/async.md), and the check before launch that the run in
an output folder can be resumed by the config (each kind reads its own checkpoint format)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.config import Config
from scaletrain.distributed.process_group import DistEnv
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.checkpoint_dirs import check_root
from scaletrain.train.resume import check_compatible
from scaletrain.train.runners.common import check_async_run, refuse_reshard
from scaletrain.train.runners.hogwild import HogwildRunner
from scaletrain.train.runners.local_sgd import LocalSGDRunner
from scaletrain.train.runners.ps import PSRunner
from scaletrain.train.trainer import Trainer


def make_trainer(cfg: Config, out: Path | None, env: DistEnv | None, progress: bool = False, reshard: bool = False,
                 init_from: str | Path | None = None):
    """The object that trains this run on this rank: the synchronous `Trainer`, or an asynchronous mode's runner
    with the same interface (`step`, `n_params`, `run() -> TrainResult`, `full_state()`). `reshard` and
    `init_from` are the Trainer's (train/resume.py); the asynchronous runners refuse them (UserError)."""
    sync = cfg.parallel.sync
    if cfg.parallel.replicas > 1:  # one fault-tolerant replica group (train/runners/replicas.py)
        from scaletrain.train.runners.replicas import ReplicaRunner

        return ReplicaRunner(cfg, out, reshard=reshard, init_from=init_from)
    if sync != "bsp":
        refuse_reshard(cfg, reshard, init_from)
    if sync == "ps":
        return PSRunner(cfg, out, env, progress)
    if sync == "local":
        return LocalSGDRunner(cfg, out, env, progress)
    if sync == "hogwild":
        return HogwildRunner(cfg, out, env, progress)
    return Trainer(cfg, out, env, progress=progress, reshard=reshard, init_from=init_from)


def check_run(out: Path, cfg: Config, world: int, reshard: bool, init_from: str | Path | None = None) -> None:
    """Before launching: refuse (CheckpointError) if the newest checkpoint in `out` cannot be resumed by `cfg`."""
    check_root(Path(out) / "checkpoints")  # a file there: refused before anything is overwritten
    if cfg.parallel.sync != "bsp":  # per-rank checkpoints of the asynchronous runners (docs/async.md)
        check_async_run(Path(out), cfg, reshard, init_from)
        return
    found, notes = ckpt.usable_latest(Path(out) / "checkpoints")  # stops on a file or only incomplete ones
    for note in notes:
        print(f"note: {note}; resuming from {found}, the newest complete checkpoint", flush=True)
    if found is not None:
        check_compatible(found, ckpt.read_meta(found), cfg, world, reshard)
