"""`validate()`: the one place where a run configuration is checked before any process starts or any output is
touched; every violated constraint raises `ConfigError` whose message names the values.

The checks of a feature live beside it (its torch-free `rules.py`, registered with `config.rules.rule`); this module
keeps the generic ones (finite numbers, positive sizes, the batch arithmetic, the number of processes) and runs
both, stage by stage (`config.rules.STAGES`).
"""

from __future__ import annotations

from collections.abc import Callable

from scaletrain.config import rules
from scaletrain.config.schema import Config
from scaletrain.errors import ConfigError
from scaletrain.guards import MAX_INT, MAX_STEPS, MIN_TIMEOUT_S, non_finite_keys, oversized_keys


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check every constraint of the resolved config; raise ConfigError naming the values.

    `world_size` is the number of processes the run will have (from --nproc or the launcher's
    environment); None skips that check (e.g. `config show`).
    """
    if rules.count() == 0:  # an internal error, never a silent pass: the rule modules were not imported
        raise RuntimeError("no validation rules are registered: scaletrain/__init__.py imports the features' "
                           "rules.py modules, which register them with scaletrain.config.rules")
    errors: list[str] = []
    for stage in rules.STAGES:
        if stage.needs_clean and errors:
            continue
        for check in (*_GENERIC.get(stage.name, ()), *rules.registered(stage.name)):
            errors += check(cfg, world_size)
        if stage.stops and errors:
            raise ConfigError("; ".join(errors))
    errors += _processes(cfg, world_size)
    if errors:
        raise ConfigError("; ".join(errors))
    return cfg


def _inputs(cfg: Config, world_size: int | None) -> list[str]:
    """NaN and infinity in any float key, the documented upper bound on train.steps (guards.py), positive sizes."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    errors = [f"{', '.join(bad)} must be finite" for bad in [non_finite_keys(cfg)] if bad]
    errors += oversized_keys(cfg)  # guards.py: before any rule multiplies them (10^30 layers would hang)
    if not 0 <= t.seed <= MAX_INT:
        errors.append(f"train.seed must be in [0, 2^63-1], got {t.seed}")
    if 0 < p.timeout_s < MIN_TIMEOUT_S:
        errors.append(f"parallel.timeout_s ({p.timeout_s:g}) is below the floor of {MIN_TIMEOUT_S:g} s: starting "
                      "the process group and a collective on a busy machine take seconds")
    if not m.norm_eps > 0:
        errors.append(f"model.norm_eps must be positive (it keeps the normalisation from dividing by zero), got "
                      f"{m.norm_eps}")
    if t.steps > MAX_STEPS:
        errors.append(f"train.steps ({t.steps:,}) is above the limit of {MAX_STEPS:,}")
    positive = [(f"model.{k}", getattr(m, k)) for k in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size")]
    positive += [(f"parallel.{k}", getattr(p, k)) for k in ("dp", "tp", "pp", "cp", "virtual_stages")]
    positive += [(f"train.{k}", getattr(t, k)) for k in ("steps", "global_batch", "micro_batch", "lr")]
    positive += [("parallel.bucket_mb", p.bucket_mb), ("parallel.timeout_s", p.timeout_s),
                 ("train.eval_batches", t.eval_batches), ("train.log_every", t.log_every),
                 ("train.keep_checkpoints", t.keep_checkpoints)]
    errors += [f"{name} must be positive, got {value}" for name, value in positive if value <= 0]
    for name in ("warmup_steps", "eval_every", "checkpoint_every"):
        if getattr(t, name) < 0:
            errors.append(f"train.{name} must be >= 0, got {getattr(t, name)}")
    if m.d_ff < 0:
        errors.append(f"model.d_ff must be >= 0 (0 = default), got {m.d_ff}")
    return errors


def _batch(cfg: Config, world_size: int | None) -> list[str]:
    """The global batch splits into micro-batches on every data-parallel rank."""
    p, t = cfg.parallel, cfg.train
    errors = []
    split = t.micro_batch * p.dp
    if t.global_batch % split:
        errors.append(f"train.global_batch ({t.global_batch}) is not divisible by train.micro_batch ({t.micro_batch})"
                      f" x parallel.dp ({p.dp}) = {split}")
    if p.microbatches < 0:
        errors.append(f"parallel.microbatches must be >= 0 (0 = automatic), got {p.microbatches}")
    return errors


def _microbatches(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.microbatches, when given, is the micro-batch count the batch arithmetic resolves to."""
    p, t = cfg.parallel, cfg.train
    if p.microbatches and p.microbatches != cfg.grad_accum:
        return [f"parallel.microbatches ({p.microbatches}) must equal train.global_batch ({t.global_batch}) /"
                f" (train.micro_batch ({t.micro_batch}) x parallel.dp ({p.dp})) = {cfg.grad_accum}, or be 0 "
                "(automatic)"]
    return []


def _processes(cfg: Config, world_size: int | None) -> list[str]:
    """The layout uses as many processes as the run has (ps adds its servers: parallel/async_dp/rules.py); checked
    after every stage, whatever they found."""
    p = cfg.parallel
    if world_size is not None and cfg.world_size != world_size and p.sync != "ps":
        cp = f" x parallel.cp ({p.cp})" if p.cp != 1 else ""
        return [f"parallel.dp ({p.dp}) x parallel.tp ({p.tp}) x parallel.pp ({p.pp}){cp} = {cfg.world_size}"
                f" does not match the number of processes ({world_size})"]
    return []


# the generic checks of each stage, run before the stage's registered rules (_processes runs after every stage)
_GENERIC: dict[str, tuple[Callable[[Config, int | None], list[str]], ...]] = {
    "inputs": (_inputs,), "values": (_batch,), "resolved": (_microbatches,)}
