"""`validate()`: the one place where a run configuration is checked before any process starts or any output is
touched; every violated constraint raises `ConfigError` whose message names the values."""

from __future__ import annotations

from scaletrain.config.schema import ASYNC_KEYS, DTYPES, SCHEDULES, Config, ParallelConfig
from scaletrain.errors import ConfigError


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check every constraint of the resolved config; raise ConfigError naming the values.

    `world_size` is the number of processes the run will have (from --nproc or the launcher's
    environment); None skips that check (e.g. `config show`).
    """
    m, p, t, o, d, mem = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.data, cfg.memory
    errors: list[str] = _validate_hardening(cfg)

    def positive(name: str, value: float) -> None:
        if value <= 0:
            errors.append(f"{name} must be positive, got {value}")

    for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
        positive(f"model.{name}", getattr(m, name))
    for name in ("dp", "tp", "pp", "virtual_stages"):
        positive(f"parallel.{name}", getattr(p, name))
    for name in ("steps", "global_batch", "micro_batch", "lr"):
        positive(f"train.{name}", getattr(t, name))
    positive("parallel.bucket_mb", p.bucket_mb)
    positive("parallel.timeout_s", p.timeout_s)
    positive("train.eval_batches", t.eval_batches)
    positive("train.log_every", t.log_every)
    positive("train.keep_checkpoints", t.keep_checkpoints)
    for name in ("warmup_steps", "eval_every", "checkpoint_every"):
        if getattr(t, name) < 0:
            errors.append(f"train.{name} must be >= 0, got {getattr(t, name)}")
    if m.d_ff < 0:
        errors.append(f"model.d_ff must be >= 0 (0 = default), got {m.d_ff}")
    if errors:
        raise ConfigError("; ".join(errors))

    if m.d_model % m.n_heads:
        errors.append(f"model.d_model ({m.d_model}) is not divisible by model.n_heads ({m.n_heads})")
    if m.position == "rope" and (m.d_model // m.n_heads) % 2:
        errors.append(f"rope needs an even head size, got d_model/n_heads = {m.d_model // m.n_heads}")
    if m.mlp not in ("gelu", "swiglu"):
        errors.append(f"model.mlp must be gelu or swiglu, got {m.mlp!r}")
    if m.position not in ("learned", "rope"):
        errors.append(f"model.position must be learned or rope, got {m.position!r}")
    if not 0.0 <= m.dropout < 1.0:
        errors.append(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.dropout_impl not in ("global", "torch"):
        errors.append(f"model.dropout_impl must be global or torch, got {m.dropout_impl!r}")
    if t.dtype not in DTYPES:
        errors.append(f"train.dtype must be one of {', '.join(DTYPES)}, got {t.dtype!r}")
    if t.on_nan not in ("stop", "skip"):
        errors.append(f"train.on_nan must be stop or skip, got {t.on_nan!r}")
    if t.loss_scale <= 0 or t.loss_scale_min <= 0 or not 0 < t.loss_scale_backoff < 1:
        errors.append(f"train.loss_scale ({t.loss_scale}) and train.loss_scale_min ({t.loss_scale_min}) must be "
                      f"positive and train.loss_scale_backoff ({t.loss_scale_backoff}) in (0, 1)")
    if t.loss_scale_window < 1 or t.loss_scale_hysteresis < 1:
        errors.append(f"train.loss_scale_window ({t.loss_scale_window}) and train.loss_scale_hysteresis "
                      f"({t.loss_scale_hysteresis}) must be >= 1")
    if t.lr_schedule not in ("cosine", "constant"):
        errors.append(f"train.lr_schedule must be cosine or constant, got {t.lr_schedule!r}")
    if t.min_lr < 0 or t.min_lr > t.lr:
        errors.append(f"train.min_lr ({t.min_lr}) must be in [0, train.lr ({t.lr})]")
    if t.grad_clip < 0:
        errors.append(f"train.grad_clip must be >= 0, got {t.grad_clip}")
    if t.device not in ("auto", "cpu", "cuda"):
        errors.append(f"train.device must be auto, cpu or cuda, got {t.device!r}")
    if o.name not in ("adamw", "adafactor", "sm3", "sgd"):
        errors.append(f"optim.name must be adamw, adafactor, sm3 or sgd, got {o.name!r}")
    if o.momentum < 0 or o.momentum >= 1 or o.clip_threshold < 1 or not 0 < o.decay_rate <= 1:
        errors.append(f"optim.momentum ({o.momentum}) must be in [0, 1), optim.clip_threshold ({o.clip_threshold})"
                      f" >= 1 and optim.decay_rate ({o.decay_rate}) in (0, 1]")
    from scaletrain.memory.compress import parse_modes  # the memory passes own their syntax
    from scaletrain.memory.recompute import parse_recompute

    for parse, value in ((parse_recompute, mem.recompute), (parse_modes, mem.compress)):
        try:
            parse(value)
        except ConfigError as e:
            errors.append(str(e))
    if mem.partition_checkpoints and not mem.recompute.lower().startswith(("full", "every:")):
        errors.append(f"memory.partition_checkpoints needs memory.recompute full or every:k, got {mem.recompute!r}")
    if mem.partition_checkpoints and p.sequence_parallel:
        errors.append("memory.partition_checkpoints: with parallel.sequence_parallel block inputs are already split")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        errors.append(f"optim.beta1 ({o.beta1}) and optim.beta2 ({o.beta2}) must be in [0, 1)")
    if not o.lr_scale >= 0 or o.lr_scale == float("inf"):
        errors.append(f"optim.lr_scale must be a finite number >= 0 (0 = the optimizer's default), got {o.lr_scale}")
    if o.weight_decay < 0 or o.eps <= 0:
        errors.append(f"optim.weight_decay ({o.weight_decay}) must be >= 0 and optim.eps ({o.eps}) > 0")
    if not 0.0 < d.val_fraction < 0.5:
        errors.append(f"data.val_fraction must be in (0, 0.5), got {d.val_fraction}")

    split = t.micro_batch * p.dp
    if t.global_batch % split:
        errors.append(
            f"train.global_batch ({t.global_batch}) is not divisible by train.micro_batch ({t.micro_batch})"
            f" x parallel.dp ({p.dp}) = {split}"
        )
    if p.zero not in (0, 1, 2, 3):
        errors.append(f"parallel.zero must be 0, 1, 2 or 3, got {p.zero}")
    if p.offload not in ("none", "optimizer", "params", "nvme"):
        errors.append(f"parallel.offload must be none, optimizer, params or nvme, got {p.offload!r}")
    if p.schedule not in SCHEDULES:
        errors.append(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {p.schedule!r}")
    if p.microbatches < 0:
        errors.append(f"parallel.microbatches must be >= 0 (0 = automatic), got {p.microbatches}")
    if not errors:  # pipeline parallelism: the schedule's constraints on the resolved microbatch count
        from scaletrain.parallel.pipeline.check import validate_pipeline

        accum = cfg.grad_accum
        if p.microbatches and p.microbatches != accum:
            errors.append(
                f"parallel.microbatches ({p.microbatches}) must equal train.global_batch ({t.global_batch}) /"
                f" (train.micro_batch ({t.micro_batch}) x parallel.dp ({p.dp})) = {accum}, or be 0 (automatic)"
            )
        elif p.pp > 1:
            errors += validate_pipeline(m.n_layers, p.pp, p.virtual_stages, accum, p.schedule, p.partition)
            if p.zero == 3 and p.schedule == "2bw":
                errors.append("parallel.zero=3 with parallel.schedule=2bw is not available: PipeDream-2BW keeps its "
                              "two weight versions in the module's parameters, which ZeRO-3 holds only as shards")
        elif p.virtual_stages > 1 or p.schedule == "2bw":
            what = f"parallel.virtual_stages ({p.virtual_stages})" if p.virtual_stages > 1 else "parallel.schedule=2bw"
            errors.append(f"{what} needs parallel.pp > 1, got parallel.pp ({p.pp})")
    if p.offload == "optimizer" and p.zero == 0:
        errors.append("parallel.offload=optimizer needs parallel.zero >= 1 (the offloaded optimizer is sharded)")
    if p.offload == "params" and p.zero != 3:
        errors.append(f"parallel.offload=params needs parallel.zero=3, got parallel.zero={p.zero}")
    if p.tp > 1:  # tensor parallelism (Megatron-LM): heads, hidden and MLP sizes are split over tp
        from scaletrain.model.gpt import ffn_size

        for what, value in (("model.n_heads", m.n_heads), ("model.d_model", m.d_model),
                            ("the MLP hidden size model.d_ff", ffn_size(m))):
            if value % p.tp and p.tp_mode == "1d":  # the grid modes: _validate_tp_nd
                errors.append(f"{what} ({value}) is not divisible by parallel.tp ({p.tp})")
        if world_size is not None and p.tp > world_size:
            errors.append(f"parallel.tp ({p.tp}) is larger than the number of processes ({world_size})")
    if p.sequence_parallel and m.seq_len % p.tp:
        errors.append(f"parallel.sequence_parallel needs model.seq_len ({m.seq_len}) divisible by "
                      f"parallel.tp ({p.tp})")
    errors += _validate_moe(cfg)
    errors += _validate_noise_scale(cfg)
    errors += _validate_norm(cfg)
    errors += _validate_tp_nd(cfg)
    errors += _validate_reversible(cfg)
    errors += _validate_contiguous(cfg)
    errors += _validate_nvme(cfg)
    errors += _validate_report(cfg)
    errors += _validate_multinode(cfg)
    errors += _validate_fast_path(cfg)
    errors += _validate_async(cfg, world_size)
    errors += _validate_compress_segments(cfg) if not errors else []
    if world_size is not None and cfg.world_size != world_size and p.sync != "ps":
        errors.append(
            f"parallel.dp ({p.dp}) x parallel.tp ({p.tp}) x parallel.pp ({p.pp}) = {cfg.world_size}"
            f" does not match the number of processes ({world_size})"
        )
    if errors:
        raise ConfigError("; ".join(errors))
    return cfg


def _validate_compress_segments(cfg: Config) -> list[str]:
    """Lossy activation compression with recompute=every:k under pp: a segment's input is kept compressed and its
    blocks are recomputed from it, so the segments must be the ones one process has (k blocks from block 0): a
    chunk must start at a multiple of k (docs/memory.md)."""
    from scaletrain.memory.compress import parse_modes
    from scaletrain.memory.recompute import parse_recompute

    p, mem = cfg.parallel, cfg.memory
    mode = parse_recompute(mem.recompute)
    if p.pp == 1 or mode.kind != "every" or not parse_modes(mem.compress) & {"bf16", "int8"}:
        return []
    chunks = p.pp * p.virtual_stages
    if p.partition in ("params", "time"):
        return [f"memory.recompute={mem.recompute} with memory.compress={mem.compress} needs pipeline chunks that "
                f"start at multiples of {mode.k} blocks; parallel.partition={p.partition} decides them only at run "
                "time: give block counts (e.g. parallel.partition=2,2) or use recompute full"]
    counts = [cfg.model.n_layers // chunks] * chunks if p.partition == "uniform" else \
        [int(x) for x in p.partition.split(",")]
    starts = [sum(counts[:i]) for i in range(1, len(counts))]
    bad = [b for b in starts if b % mode.k]
    if bad:
        return [f"memory.recompute={mem.recompute} with memory.compress={mem.compress} under parallel.pp ({p.pp}): "
                f"pipeline chunks start at blocks {', '.join(map(str, starts))}, not all multiples of {mode.k}, so "
                "the segments differ from one process's and recompute from other compressed inputs; choose "
                "parallel.partition block counts that are multiples of k, or recompute full"]
    return []
def _validate_fast_path(cfg: Config) -> list[str]:
    """train.precision and train.compile: the values and the combinations they are made to work with (docs/gpu.md)."""
    from scaletrain.memory.autocast import PRECISIONS, precision_errors
    from scaletrain.parallel.compile import compile_errors

    if cfg.train.precision not in PRECISIONS:
        return [f"train.precision must be one of {', '.join(PRECISIONS)}, got {cfg.train.precision!r}"]
    return precision_errors(cfg) + compile_errors(cfg)


def _validate_hardening(cfg: Config) -> list[str]:
    """NaN and infinity in any float key, and the documented upper bound on train.steps (guards.py)."""
    from scaletrain.guards import MAX_STEPS, non_finite_keys

    errors = [f"{', '.join(bad)} must be finite" for bad in [non_finite_keys(cfg)] if bad]
    if cfg.train.steps > MAX_STEPS:
        errors.append(f"train.steps ({cfg.train.steps:,}) is above the limit of {MAX_STEPS:,}")
    if cfg.model.moe.experts == 0 and cfg.model.moe.router not in ROUTERS:  # with experts, _validate_moe says it
        errors.append(f"model.moe.router must be one of {', '.join(ROUTERS)}, got {cfg.model.moe.router!r}")
    if not cfg.data.source.strip():  # an empty path would read the current folder as the corpus
        errors.append("data.source must be builtin, a text file or folder, or a .bin token file; got ''")
    part = cfg.parallel.partition
    if cfg.parallel.pp == 1 and part not in ("uniform", "params", "time") and \
            not all(x.strip().isdigit() for x in part.split(",")):  # with pp > 1, validate_pipeline says it
        errors.append(f"parallel.partition must be uniform, params, time or block counts like 2,3,3; got {part!r}")
    return errors


def _validate_nvme(cfg: Config) -> list[str]:
    """ZeRO-Infinity offload (memory/offload_nvme.py) and the memory budget; the folder itself is checked before
    launch (`offload_nvme.check_offload_dir`), where --out is known."""
    p, mem = cfg.parallel, cfg.memory
    errors = []
    if not mem.budget_gb >= 0 or mem.budget_gb == float("inf"):
        errors.append(f"memory.budget_gb must be a finite number >= 0 (0 = no budget), got {mem.budget_gb}")
    if p.offload != "nvme":
        changed = [f"parallel.{k}={v!r}" for k, v, default in (("offload_dir", p.offload_dir, ""),
                   ("nvme_prefetch", p.nvme_prefetch, 2), ("nvme_grads", p.nvme_grads, True)) if v != default]
        if changed:
            errors.append(f"{', '.join(changed)} needs parallel.offload=nvme, got parallel.offload={p.offload!r}")
        return errors
    if p.zero != 3:
        errors.append(f"parallel.offload=nvme needs parallel.zero=3, got parallel.zero={p.zero}")
    if p.nvme_prefetch < 1:
        errors.append(f"parallel.nvme_prefetch must be >= 1, got {p.nvme_prefetch}")
    if cfg.optim.name != "adamw":
        errors.append(f"parallel.offload=nvme streams AdamW's step shard by shard; optim.name={cfg.optim.name!r} "
                      "is not available with it")
    for name, value in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep)):
        if value > 1:
            errors.append(f"parallel.offload=nvme is not available with parallel.{name} ({value}) > 1: the engine "
                          "builds and streams one dp group's units of the plain model")
    return errors


def _validate_noise_scale(cfg: Config) -> list[str]:
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


def _validate_norm(cfg: Config) -> list[str]:
    """model.norm names a layer of model/norm.py."""
    if cfg.model.norm not in ("layernorm", "rmsnorm"):
        return [f"model.norm must be layernorm or rmsnorm, got {cfg.model.norm!r}"]
    return []


def _validate_multinode(cfg: Config) -> list[str]:
    """Heartbeat and flight recorder bounds (scaletrain.multinode)."""
    p = cfg.parallel
    errors = []
    if not (p.heartbeat_s == 0 or 0.5 <= p.heartbeat_s < p.timeout_s):
        errors.append(f"parallel.heartbeat_s ({p.heartbeat_s}) must be 0 (off) or at least 0.5 and below "
                      f"parallel.timeout_s ({p.timeout_s})")
    if p.sync != "bsp" and p.heartbeat_s != ParallelConfig().heartbeat_s:
        errors.append(f"parallel.heartbeat_s ({p.heartbeat_s}) is used only with parallel.sync=bsp, got "
                      f"parallel.sync={p.sync}: asynchronous runs are not supervised by the heartbeat")
    if not 0 <= p.flight_recorder <= 100_000:
        errors.append(f"parallel.flight_recorder ({p.flight_recorder}) must be between 0 (off) and 100000 entries")
    return errors


SYNC_MODES = ("bsp", "ps", "hogwild", "local")


def _validate_async(cfg: Config, world_size: int | None) -> list[str]:
    """Asynchronous and relaxed data parallelism (parallel.sync; docs/async.md)."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    errors: list[str] = []
    if o.name == "sgd":  # plain SGD is implemented by the replicated (non-ZeRO, non-factored) optimizer path
        for name, value, ok in (("parallel.zero", p.zero, 0), ("parallel.tp", p.tp, 1), ("parallel.ep", p.ep, 1)):
            if value != ok:
                errors.append(f"optim.name=sgd needs {name}={ok}, got {value}: ZeRO's sharded optimizer and the "
                              "tensor/expert-parallel factored path implement adamw, adafactor and sm3")
    if p.sync not in SYNC_MODES:
        return errors + [f"parallel.sync must be one of {', '.join(SYNC_MODES)}, got {p.sync!r}"]
    from scaletrain.parallel.async_dp.straggler import parse_slow_ranks

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
    if p.outer not in ("avg", "diloco"):
        errors.append(f"parallel.outer must be avg or diloco, got {p.outer!r}")
    if not p.outer_lr > 0 or not 0 <= p.outer_momentum < 1:
        errors.append(f"parallel.outer_lr ({p.outer_lr}) must be > 0 and parallel.outer_momentum "
                      f"({p.outer_momentum}) in [0, 1)")
    if p.sync == "bsp":
        return errors
    mode = f"parallel.sync={p.sync}"
    for name, value, ok in (("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1), ("parallel.zero", p.zero, 0),
                            ("parallel.ep", p.ep, 1)):
        if value != ok:
            errors.append(f"{mode} needs {name}={ok}, got {value}: each worker holds the whole model and its own "
                          "optimizer (or none, with ps)")
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


TP_MODES = ("1d", "2d", "2.5d", "3d")


def _validate_tp_nd(cfg: Config) -> list[str]:
    """2D / 2.5D / 3D tensor parallelism (parallel/tensor_nd/, docs/tensor_parallel.md): the grid's shape, what it
    splits, and the combinations not made to work with it (each refused with its reason)."""
    from scaletrain.distributed.grid import grid_shape

    p, m, t, mem = cfg.parallel, cfg.model, cfg.train, cfg.memory
    mode = p.tp_mode
    if mode not in TP_MODES:
        return [f"parallel.tp_mode must be one of {', '.join(TP_MODES)}, got {mode!r}"]
    if mode != "2.5d" and p.tp_depth != 1:
        return [f"parallel.tp_depth ({p.tp_depth}) is the depth of parallel.tp_mode=2.5d; it must be 1 with "
                f"parallel.tp_mode={mode}"]
    if p.tp_depth < 1:
        return [f"parallel.tp_depth must be >= 1, got {p.tp_depth}"]
    if mode == "1d":
        return []
    shape = grid_shape(mode, p.tp, p.tp_depth)
    if shape is None:
        need = {"2d": "a square q x q", "2.5d": f"parallel.tp_depth ({p.tp_depth}) x q x q", "3d": "a cube q x q x q"}
        return [f"parallel.tp ({p.tp}) is not {need[mode]} for parallel.tp_mode={mode}"]
    errors: list[str] = []
    d, q, rows = shape.depth, shape.q, shape.row_blocks
    if q < 2:
        errors.append(f"parallel.tp_mode={mode} needs a grid side q >= 2, got parallel.tp ({p.tp})")
    if mode == "2.5d" and d < 2:
        errors.append("parallel.tp_mode=2.5d needs parallel.tp_depth >= 2 (depth 1 is parallel.tp_mode=2d)")
    if t.micro_batch % rows:
        errors.append(f"parallel.tp_mode={mode} splits each micro-batch into {rows} blocks of sequences: "
                      f"train.micro_batch ({t.micro_batch}) is not divisible by {rows}")
    from scaletrain.model.gpt import ffn_size

    if m.n_heads % q:
        errors.append(f"model.n_heads ({m.n_heads}) is not divisible by the grid side q ({q}) of "
                      f"parallel.tp_mode={mode}")
    for what, value in (("model.d_model", m.d_model), ("the MLP hidden size model.d_ff", ffn_size(m))):
        if value % (q * q):
            errors.append(f"{what} ({value}) is not divisible by q x q ({q * q}) of parallel.tp_mode={mode}")
    why = f"with parallel.tp_mode={mode} is not available"
    if p.sequence_parallel:
        errors.append(f"parallel.sequence_parallel {why}: it is 1d (Megatron) sequence parallelism, and the grid "
                      "modes already split every activation")
    if p.zero >= 2:
        errors.append(f"parallel.zero={p.zero} {why} (ZeRO-1 is): ZeRO-2/3's gradient and parameter hooks are not "
                      "wired to the grid's layers")
    if p.offload != "none":
        errors.append(f"parallel.offload={p.offload} {why}")
    if p.pp > 1 and mode != "2d":
        errors.append(f"parallel.pp ({p.pp}) > 1 {why} (parallel.tp_mode=2d is): 2.5d/3d stages are not wired "
                      "into the pipeline")
    if p.dp > 1 and mode != "2d":
        errors.append(f"parallel.dp ({p.dp}) > 1 {why} (parallel.tp_mode=2d is): dp x {mode} needs 16 or more "
                      "processes, more than any equivalence test runs")
    if p.pp > 1 and p.partition == "time":
        errors.append(f"parallel.partition=time {why}: its profile runs one rank's blocks alone, and a grid block "
                      "needs its row and column peers (use uniform, params or block counts)")
    if p.pp > 1 and p.schedule in ("zb-h1", "2bw"):
        errors.append(f"parallel.schedule={p.schedule} {why}: zero-bubble's split backward would run the grid's "
                      "backward collectives twice, and 2BW's weight versions are not wired to it")
    if m.moe.experts:
        errors.append(f"model.moe.experts ({m.moe.experts}) > 0 {why}: experts are not split over the grid")
    if cfg.optim.name != "adamw":
        errors.append(f"optim.name={cfg.optim.name} {why}: its factored statistics are placed for 1d shards only")
    if m.dropout > 0 and m.dropout_impl == "torch":
        errors.append(f"model.dropout_impl=torch {why}: use the layout-independent global dropout")
    if mem.partition_checkpoints or mem.offload_activations or mem.compress != "none":
        errors.append(f"memory.partition_checkpoints, memory.offload_activations and memory.compress {why}: "
                      "block inputs are split over the grid already")
    if t.log_noise_scale:
        errors.append(f"train.log_noise_scale {why}")
    if m.reversible:
        errors.append(f"model.reversible {why}: the grid's layers are not wired into the reverse pass")
    if mem.contiguous:
        errors.append(f"memory.contiguous {why}: its arenas are not wired to the grid's blocks")
    return errors


def _validate_reversible(cfg: Config) -> list[str]:
    """model.reversible: the halves' widths, and the modes that have nothing to act on (model/reversible.py)."""
    from scaletrain.model.reversible import refusals

    return refusals(cfg)


def _validate_contiguous(cfg: Config) -> list[str]:
    """memory.contiguous needs something to put in its arenas (memory/contiguous.py)."""
    from scaletrain.memory.contiguous import refusals

    return refusals(cfg)


def _validate_report(cfg: Config) -> list[str]:
    """train.profile_steps syntax and range; train.tensorboard needs the tensorboard package."""
    from scaletrain.report.profile import parse_steps

    t = cfg.train
    errors = []
    try:
        window = parse_steps(t.profile_steps)
    except ConfigError as e:
        errors.append(str(e))
    else:
        if window is not None and window[0] > t.steps:
            errors.append(f"train.profile_steps ({t.profile_steps}) starts after the last step (train.steps = "
                          f"{t.steps}): nothing would be profiled")
    if t.tensorboard:
        from scaletrain.report.tensorboard import available

        if not available():
            errors.append("train.tensorboard=true needs the tensorboard package: pip install 'scaletrain[tb]'")
    return errors


ROUTERS = ("topk", "switch", "expert_choice")


def _validate_moe(cfg: Config) -> list[str]:
    """Mixture-of-experts and expert-parallel constraints (see docs/moe.md)."""
    e, p, t = cfg.model.moe, cfg.parallel, cfg.train
    errors: list[str] = []
    if p.ep < 1:
        return [f"parallel.ep must be >= 1, got {p.ep}"]
    if e.experts < 0:
        return [f"model.moe.experts must be >= 0 (0 = dense), got {e.experts}"]
    if e.experts == 0:
        return [f"parallel.ep ({p.ep}) > 1 needs model.moe.experts > 0"] if p.ep > 1 else []
    if e.router not in ROUTERS:
        errors.append(f"model.moe.router must be one of {', '.join(ROUTERS)}, got {e.router!r}")
    if e.every < 1:
        errors.append(f"model.moe.every must be >= 1, got {e.every}")
    if not 1 <= e.top_k <= e.experts:
        errors.append(f"model.moe.top_k ({e.top_k}) must be between 1 and model.moe.experts ({e.experts})")
    if e.capacity_factor <= 0:
        errors.append(f"model.moe.capacity_factor must be > 0, got {e.capacity_factor}")
    if e.group_tokens < 1 or (t.micro_batch * cfg.model.seq_len) % e.group_tokens:
        errors.append(f"model.moe.group_tokens ({e.group_tokens}) must divide the tokens of a micro-batch, "
                      f"train.micro_batch ({t.micro_batch}) x model.seq_len ({cfg.model.seq_len})")
    if e.aux_loss_weight < 0 or e.z_loss_weight < 0 or e.router_noise < 0 or e.switch_init_scale < 0:
        errors.append(f"model.moe.aux_loss_weight ({e.aux_loss_weight}), z_loss_weight ({e.z_loss_weight}), "
                      f"router_noise ({e.router_noise}) and switch_init_scale ({e.switch_init_scale}) must be >= 0")
    if not 0.0 <= e.expert_dropout < 1.0:
        errors.append(f"model.moe.expert_dropout must be in [0, 1), got {e.expert_dropout}")
    if e.random_routing and (e.router != "topk" or e.top_k != 2):
        errors.append(f"model.moe.random_routing (GShard) needs router topk with top_k 2, got router {e.router!r} "
                      f"and top_k {e.top_k}")
    if e.experts % p.ep:
        errors.append(f"model.moe.experts ({e.experts}) is not divisible by parallel.ep ({p.ep})")
    if p.dp % p.ep:
        errors.append(f"parallel.ep ({p.ep}) must divide parallel.dp ({p.dp}): expert parallelism is carved from dp")
    if p.tp > 1 and p.sequence_parallel and (cfg.model.seq_len % p.tp == 0) and \
            (cfg.model.seq_len // p.tp) % e.group_tokens:
        errors.append(f"parallel.sequence_parallel with MoE needs model.moe.group_tokens ({e.group_tokens}) to divide "
                      f"the tokens of a sequence shard, model.seq_len ({cfg.model.seq_len}) / parallel.tp ({p.tp}): "
                      "each rank routes the dispatch groups of its own shard")
    return errors
