"""validate()'s rules for the training loop's keys: the learning-rate schedule, clipping, the device, what a NaN loss
does, and the gradient noise scale (McCandlish et al., arXiv 1812.06162; train/noise_scale.py).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.rules import rule
from scaletrain.config.schema import DEVICES, LR_SCHEDULES, MISSING_ROWS, ON_NAN, Config, or_list


@rule("values")
def loop(cfg: Config, world_size: int | None) -> list[str]:
    """train.on_nan, the learning-rate schedule (train/schedule.py), clipping and the device."""
    t = cfg.train
    errors = []
    if t.on_nan not in ON_NAN:
        errors.append(f"train.on_nan must be {or_list(ON_NAN)}, got {t.on_nan!r}")
    if t.lr_schedule not in LR_SCHEDULES:
        errors.append(f"train.lr_schedule must be {or_list(LR_SCHEDULES)}, got {t.lr_schedule!r}")
    if t.min_lr < 0 or t.min_lr > t.lr:
        errors.append(f"train.min_lr ({t.min_lr}) must be in [0, train.lr ({t.lr})]")
    if t.grad_clip < 0:
        errors.append(f"train.grad_clip must be >= 0, got {t.grad_clip}")
    if t.device not in DEVICES:
        errors.append(f"train.device must be {or_list(DEVICES)}, got {t.device!r}")
    return errors


@rule("combinations")
def noise_scale(cfg: Config, world_size: int | None) -> list[str]:
    """train.log_noise_scale measures one micro-batch's gradient; layouts where that is not on one rank fail."""
    p, t = cfg.parallel, cfg.train
    if not t.log_noise_scale:
        return []
    errors = []
    if t.micro_batch >= t.global_batch:
        errors.append(f"train.log_noise_scale needs train.micro_batch ({t.micro_batch}) < train.global_batch "
                      f"({t.global_batch}): the small batch of the estimate is one micro-batch")
    if p.pp > 1 and cfg.model.tie_embeddings:
        errors.append(f"train.log_noise_scale with parallel.pp ({p.pp}) > 1 needs model.tie_embeddings=false: the "
                      "tied embedding's micro-batch gradient is split between the first and the last stage")
    if p.ep > 1 and t.micro_batch * p.ep >= t.global_batch:
        errors.append(f"train.log_noise_scale with parallel.ep ({p.ep}) needs train.micro_batch ({t.micro_batch}) x "
                      f"ep < train.global_batch ({t.global_batch}): an expert's small batch is ep micro-batches")
    return errors


@rule("combinations")
def replicas(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.replicas (train/runners/replicas.py): fault-tolerant replica groups of one process, of two
    data-parallel ranks (plain dp or ZeRO-1/2/3 inside the group), of two expert-parallel ranks (MoE, ep=2), of two
    tensor-parallel ranks or of two 1F1B pipeline stages."""
    p, t = cfg.parallel, cfg.train
    if p.missing_rows not in MISSING_ROWS:
        return [f"parallel.missing_rows must be {or_list(MISSING_ROWS)}, got {p.missing_rows!r}"]
    if p.replicas == 1:
        return []
    if p.replicas < 1:
        return [f"parallel.replicas must be >= 1, got {p.replicas}"]
    if p.dp % p.replicas:
        return [f"parallel.replicas ({p.replicas}) must divide parallel.dp ({p.dp})"]
    errors = []
    dps = p.dp // p.replicas  # data-parallel ranks per group; a group's processes: dps x tp
    ep_group = p.ep == 2 and dps == 2 and p.tp == 1 and p.pp == 1 and p.cp == 1  # ep2 over the group's 2 dp ranks
    if p.pp > 2 or (p.ep > 1 and not ep_group) or p.cp > 1 or p.tp > 2 or (p.tp > 1 and dps > 1) or (
            p.pp > 1 and dps * p.tp > 1):
        errors.append(f"parallel.replicas ({p.replicas}): a replica group is data-parallel only (one process or 2 "
                      f"data-parallel ranks), 2 expert-parallel ranks (dp = 2 x replicas, ep=2), 2 tensor-parallel "
                      f"ranks or 2 pipeline stages (got dp/replicas={dps}, tp={p.tp}, pp={p.pp}, ep={p.ep}, "
                      f"cp={p.cp}): context parallelism, other ep and groups of more than 2 processes are not built "
                      "inside a group")
    elif ep_group and p.zero:
        errors.append(f"parallel.replicas ({p.replicas}) with ep=2 groups needs parallel.zero=0 (got zero={p.zero}): "
                      "the experts are already sharded over the group's 2 ranks; ZeRO of the dense part inside an ep "
                      "group is not built")
    elif p.pp > 1 and (p.schedule != "1f1b" or p.virtual_stages != 1 or p.zero or p.partition == "time"):
        errors.append(f"parallel.replicas ({p.replicas}) with pp={p.pp} groups needs parallel.schedule=1f1b, "
                      f"parallel.virtual_stages=1, parallel.zero=0 and a parallel.partition other than time (got "
                      f"schedule={p.schedule}, virtual_stages={p.virtual_stages}, zero={p.zero}, "
                      f"partition={p.partition}): only plain 1F1B stages are built and tested inside a group, and a "
                      "restarted group must cut the model where the live one did")
    elif p.tp > 1 and (p.zero or p.sequence_parallel or p.tp_mode != "1d"):
        errors.append(f"parallel.replicas ({p.replicas}) with tp={p.tp} groups needs parallel.zero=0, "
                      f"parallel.sequence_parallel=false and parallel.tp_mode=1d (got zero={p.zero}, "
                      f"sequence_parallel={str(p.sequence_parallel).lower()}, tp_mode={p.tp_mode}): only plain "
                      "Megatron tensor parallelism is built inside a group")
    elif dps * p.tp == 1 and p.zero:
        errors.append(f"parallel.replicas ({p.replicas}) = parallel.dp: one process per group has nothing to shard "
                      f"(got zero={p.zero}); for ZeRO groups set parallel.dp = 2 x replicas")
    elif dps > 2:
        errors.append(f"parallel.replicas ({p.replicas}) with {dps} processes per group (dp={p.dp}) needs groups of "
                      "2 ranks: larger groups are not built (the replay would need the ring order of gloo's "
                      "reduce-scatter)")
    elif dps == 2 and p.zero == 3 and t.fp8_all_gather:
        errors.append(f"parallel.replicas ({p.replicas}) with ZeRO-3 groups needs train.fp8_all_gather=false: the "
                      "replay computes with the exact parameters, not their float8 all-gather")
    procs = dps * p.tp * p.pp
    if p.missing_rows == "reassign" and procs > 1:
        errors.append(f"parallel.missing_rows=reassign with {procs} processes per replica group (dp/replicas={dps}, "
                      f"tp={p.tp}, pp={p.pp}, ep={p.ep}) is refused: reassigned rows are built and tested for groups "
                      "of one process (parallel.dp = parallel.replicas); use parallel.missing_rows=skip")
    if procs > 1 and (t.dtype not in ("fp32", "fp64") or cfg.optim.name != "adamw"):
        errors.append(f"parallel.replicas ({p.replicas}) with {procs} processes per group needs train.dtype "
                      f"fp32/fp64 and optim.name=adamw (got dtype={t.dtype}, optim={cfg.optim.name}): the heal of a "
                      "group's rank sends AdamW state and no loss scaler")
    if p.sync != "bsp":
        errors.append(f"parallel.replicas > 1 is for parallel.sync=bsp (got {p.sync!r}): the asynchronous modes "
                      "supervise their own workers")
    if p.heal_attempts < 1:
        errors.append(f"parallel.heal_attempts must be >= 1, got {p.heal_attempts}: the number of consecutive failed "
                      "heals after which the lighthouse excludes a replica group")
    if p.offload != "none" or p.heartbeat_s <= 0:
        errors.append(f"parallel.replicas > 1 needs parallel.offload=none and parallel.heartbeat_s > 0 (the bound "
                      f"within which a dead group is dropped); got offload={p.offload}, heartbeat_s={p.heartbeat_s}")
    if t.dtype == "fp16":
        errors.append("parallel.replicas > 1 does not support train.dtype=fp16 (its loss scaler's per-step state is "
                      "not in the quorum's replay)")
    dropout = cfg.model.dropout > 0 or (cfg.model.moe.experts and cfg.model.moe.expert_dropout > 0)
    if (cfg.model.moe.experts or dropout) and dps * p.tp * p.pp > 1 and not ep_group:
        errors.append(f"parallel.replicas ({p.replicas}): MoE and dropout are built for groups of one process and ep=2 "
                      f"groups only (got dp/replicas={dps}, tp={p.tp}, pp={p.pp}, zero={p.zero}): not tested with "
                      "2 data-parallel ranks (any ZeRO stage), tp or pp inside a group")
    if dropout and cfg.model.dropout_impl != "global":
        errors.append(f"parallel.replicas > 1 with dropout needs model.dropout_impl=global (got "
                      f"{cfg.model.dropout_impl}): torch's masks depend on the process's RNG, which a healed group and "
                      "the replay cannot redraw")
    if t.on_nan != "stop" or t.log_noise_scale or t.eval_every:
        errors.append("parallel.replicas > 1 needs train.on_nan=stop, no train.log_noise_scale and "
                      "train.eval_every=0")
    if t.tensorboard or t.profile_steps:
        errors.append(f"parallel.replicas > 1 writes no TensorBoard events or profiler traces (got "
                      f"train.tensorboard={str(t.tensorboard).lower()}, train.profile_steps={t.profile_steps!r}): its "
                      "groups train without an output folder; the report and metrics.jsonl have the run")
    return errors
