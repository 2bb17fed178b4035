"""Asynchronous and relaxed data parallelism, selected by `parallel.sync` (docs/async.md).

- `ps` (`ps.py`): parameter servers with bounded staleness, BSP / SSP / ASP (Li et al., OSDI 2014; Ho et al.,
  NIPS 2013; BytePS, OSDI 2020), on gloo point-to-point messages.
- `hogwild` (`hogwild.py`): workers on one machine update parameters in shared memory without a lock, or with
  one (Niu et al., arXiv 1106.5730).
- `local` (`local_sgd.py`): local SGD, H steps alone then averaging (Lin et al., arXiv 1808.07217; Stich,
  arXiv 1805.09767), and DiLoCo's outer Nesterov step on the averaged change (Douillard et al., arXiv 2311.08105).

`versions.py` holds the version log of the asynchronous modes and `replay.py` the single-process replay that
proves what they applied. `bsp` is the synchronous trainer (`scaletrain.train.trainer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.config import Config

if TYPE_CHECKING:  # (torch-free at import: parallel/async_dp/rules.py is registered by scaletrain/__init__.py)
    from scaletrain.distributed.process_group import DistEnv


def make_trainer(cfg: Config, out: Path | None, env: DistEnv | None, progress: bool = False, reshard: bool = False,
                 init_from: str | Path | None = None):
    """The object that trains this run on this rank: the synchronous `Trainer`, or an asynchronous mode's runner
    with the same interface (`step`, `n_params`, `run() -> TrainResult`, `full_state()`). `reshard` and
    `init_from` are the Trainer's (train/resume.py); the asynchronous runners refuse them (UserError)."""
    sync = cfg.parallel.sync
    if sync != "bsp":
        from scaletrain.parallel.async_dp.common import refuse_reshard

        refuse_reshard(cfg, reshard, init_from)
    if sync == "ps":
        from scaletrain.parallel.async_dp.ps import PSRunner

        return PSRunner(cfg, out, env, progress)
    if sync == "local":
        from scaletrain.parallel.async_dp.local_sgd import LocalSGDRunner

        return LocalSGDRunner(cfg, out, env, progress)
    if sync == "hogwild":
        from scaletrain.parallel.async_dp.hogwild import HogwildRunner

        return HogwildRunner(cfg, out, env, progress)
    from scaletrain.train.trainer import Trainer

    return Trainer(cfg, out, env, progress=progress, reshard=reshard, init_from=init_from)
