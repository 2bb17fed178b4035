"""validate()'s rules for asynchronous and relaxed data parallelism (`parallel.sync`; docs/async.md): parameter
servers with bounded staleness (Li et al., OSDI 2014; Ho et al., NIPS 2013), Hogwild (arXiv 1106.5730), local SGD
(arXiv 1808.07217) and DiLoCo (arXiv 2311.08105), and straggler injection.

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.parse import parse_slow_ranks
from scaletrain.config.rules import rule
from scaletrain.config.schema import ASYNC_KEYS, OUTER_MODES, SYNC_MODES, Config, ParallelConfig, or_list
from scaletrain.errors import ConfigError


@rule("combinations")
def sync(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.sync, its modes' own keys, and what an asynchronous run is made to work with."""
    p = cfg.parallel
    if p.sync not in SYNC_MODES:
        return [f"parallel.sync must be one of {', '.join(SYNC_MODES)}, got {p.sync!r}"]
    errors: list[str] = []
    try:
        parse_slow_ranks(p.slow_ranks, p.dp)
    except ConfigError as e:
        errors.append(str(e))
    default = ParallelConfig()
    for key, mode in ASYNC_KEYS.items():
        if getattr(p, key) != getattr(default, key) and p.sync != mode:
            errors.append(f"parallel.{key} ({getattr(p, key)}) is used only with parallel.sync={mode}, "
                          f"got parallel.sync={p.sync}")
    if p.servers < 1:
        errors.append(f"parallel.servers must be >= 1, got {p.servers}")
    if p.staleness < -1:
        errors.append(f"parallel.staleness must be >= -1 (-1 = unbounded, ASP), got {p.staleness}")
    if p.local_steps < 1:
        errors.append(f"parallel.local_steps (H) must be >= 1, got {p.local_steps}")
    if p.outer not in OUTER_MODES:
        errors.append(f"parallel.outer must be {or_list(OUTER_MODES)}, got {p.outer!r}")
    if not p.outer_lr > 0 or not 0 <= p.outer_momentum < 1:
        errors.append(f"parallel.outer_lr ({p.outer_lr}) must be > 0 and parallel.outer_momentum "
                      f"({p.outer_momentum}) in [0, 1)")
    return errors if p.sync == "bsp" else errors + _asynchronous(cfg, world_size)


def _asynchronous(cfg: Config, world_size: int | None) -> list[str]:
    """An asynchronous mode: each worker holds the whole model; what is not wired to its workers is refused."""
    p, t = cfg.parallel, cfg.train
    mode = f"parallel.sync={p.sync}"
    errors = [f"{mode} needs {name}={ok}, got {value}: each worker holds the whole model and its own optimizer (or "
              "none, with ps)"
              for name, value, ok in (("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1), ("parallel.zero", p.zero, 0),
                                      ("parallel.ep", p.ep, 1)) if value != ok]
    if t.dtype not in ("fp32", "fp64"):
        errors.append(f"{mode} needs train.dtype fp32 or fp64, got {t.dtype}: updates are applied one worker at a "
                      "time, without the synchronous overflow decision of mixed precision")
    if cfg.model.moe.experts:
        errors.append(f"{mode} needs a dense model, got model.moe.experts={cfg.model.moe.experts}")
    if t.log_noise_scale:
        errors.append(f"train.log_noise_scale needs parallel.sync=bsp, got {mode}")
    if t.profile_steps:
        errors.append(f"train.profile_steps needs parallel.sync=bsp, got {mode}: an asynchronous run's steps are not "
                      "one process's steps")
    if t.precision != "dtype" or t.compile:
        errors.append(f"{mode} needs train.precision=dtype and train.compile=false, got {t.precision} and "
                      f"{str(t.compile).lower()}: autocast and compiled blocks are not wired to the workers' flat "
                      "parameter buffers")
    if t.on_nan != "stop":
        errors.append(f"{mode} needs train.on_nan=stop, got {t.on_nan}: a skipped step has no asynchronous meaning")
    if p.sync == "hogwild" and t.device == "cuda":
        errors.append("parallel.sync=hogwild shares the parameters in host memory: it needs train.device cpu or auto "
                      "(hogwild always runs on the CPU)")
    if p.ps_tolerate_loss and p.staleness != -1:
        errors.append(f"parallel.ps_tolerate_loss needs parallel.staleness=-1 (ASP), got {p.staleness}: with bounded "
                      "staleness the job stops when a worker dies")
    if p.sync == "ps" and world_size is not None:
        if p.servers >= world_size:
            errors.append(f"parallel.servers ({p.servers}) must be smaller than the number of processes "
                          f"({world_size}): the others are the workers")
        elif p.dp + p.servers != world_size:
            errors.append(f"parallel.dp ({p.dp}) workers + parallel.servers ({p.servers}) = {p.dp + p.servers} "
                          f"does not match the number of processes ({world_size})")
    return errors
