"""validate()'s rules for the memory savers and the numeric formats: recomputation (arXiv 1604.06174, 2205.05198),
partitioned / offloaded checkpoints (ZeRO-R, arXiv 1910.02054), activation compression (Gist), contiguous arenas,
the memory budget, mixed precision with loss scaling (arXiv 1710.03740), autocast (arXiv 1905.12322) and FP8 training
(arXiv 2209.05433; which layers convert: memory/fp8_layers.py).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.parse import parse_modes, parse_recompute, parse_steps
from scaletrain.config.rules import rule
from scaletrain.config.schema import DTYPES, FP8_GEMMS, FP8_RECIPES, PRECISIONS, Config, TrainConfig, or_list
from scaletrain.errors import ConfigError
from scaletrain.memory.fp8_layers import filter_errors


@rule("values")
def precision(cfg: Config, world_size: int | None) -> list[str]:
    """train.dtype and the fp16 loss scaler's settings (memory/precision.py)."""
    t = cfg.train
    errors = []
    if t.dtype not in DTYPES:
        errors.append(f"train.dtype must be one of {', '.join(DTYPES)}, got {t.dtype!r}")
    if t.loss_scale <= 0 or t.loss_scale_min <= 0 or not 0 < t.loss_scale_backoff < 1:
        errors.append(f"train.loss_scale ({t.loss_scale}) and train.loss_scale_min ({t.loss_scale_min}) must be "
                      f"positive and train.loss_scale_backoff ({t.loss_scale_backoff}) in (0, 1)")
    if t.loss_scale_window < 1 or t.loss_scale_hysteresis < 1:
        errors.append(f"train.loss_scale_window ({t.loss_scale_window}) and train.loss_scale_hysteresis "
                      f"({t.loss_scale_hysteresis}) must be >= 1")
    return errors


@rule("values")
def checkpoints(cfg: Config, world_size: int | None) -> list[str]:
    """memory.recompute and memory.compress parse; partitioned checkpoints need checkpoints to partition."""
    p, mem = cfg.parallel, cfg.memory
    errors = []
    for parse, value in ((parse_recompute, mem.recompute), (parse_modes, mem.compress)):
        try:
            parse(value)
        except ConfigError as e:
            errors.append(str(e))
    try:
        blocks = parse_recompute(mem.recompute).checkpoints_blocks
    except ConfigError:
        blocks = True  # reported above
    if mem.partition_checkpoints and not blocks:
        errors.append(f"memory.partition_checkpoints needs memory.recompute full, every:k or nth:k (block "
                      f"checkpoints to partition), got {mem.recompute!r}")
    if mem.partition_checkpoints and p.sequence_parallel:
        errors.append("memory.partition_checkpoints: with parallel.sequence_parallel block inputs are already split")
    return errors


@rule("combinations")
def op_policy(cfg: Config, world_size: int | None) -> list[str]:
    """memory.recompute=ops:... keeps its outputs in torch's selective-checkpoint cache (memory/op_policy.py): the
    savers that work through saved-tensor hooks cannot reach it, and the cache allows one recomputation per forward."""
    mem, p = cfg.memory, cfg.parallel
    try:
        mode = parse_recompute(mem.recompute)
    except ConfigError:
        return []
    if mode.kind != "ops":
        return []
    try:
        compress = bool(parse_modes(mem.compress))
    except ConfigError:
        compress = False  # reported by `checkpoints`
    why = "the outputs it keeps are held by torch's selective-checkpoint cache, which saved-tensor hooks do not see"
    errors = [f"memory.recompute={mem.recompute} with {key}={value} is not available: {why}"
              for key, value, on in (("memory.offload_activations", mem.offload_activations, mem.offload_activations),
                                     ("memory.compress", mem.compress, compress),
                                     ("memory.contiguous", mem.contiguous, mem.contiguous)) if on]
    if p.tp > 1 and p.tp_mode != "1d":
        errors.append(f"memory.recompute={mem.recompute} with parallel.tp_mode={p.tp_mode} is not available: the grid "
                      "layers' broadcasts write into a tensor the cache holds on the sending rank only, so the ranks "
                      "would disagree on which collectives the recomputation runs again")
    if cfg.train.compile:
        errors.append(f"memory.recompute={mem.recompute} with train.compile=true is not available: the policy counts "
                      "and tracks the kept outputs as the ops run, which a captured graph does not do")
    if p.pp > 1 and p.schedule in ("zb-h1", "zb-v", "dualpipev"):
        errors.append(f"memory.recompute={mem.recompute} with parallel.schedule={p.schedule} is not available: zero "
                      "bubble's input and weight passes recompute a checkpoint once each, and torch's selective "
                      "checkpointing replays its saved outputs once (use full, every:k or nth:k)")
    return errors


@rule("combinations")
def autocast(cfg: Config, world_size: int | None) -> list[str]:
    """train.precision, and the contradictions of autocast-bf16 (memory/autocast.py, docs/gpu.md)."""
    t = cfg.train
    if t.precision not in PRECISIONS:
        return [f"train.precision must be one of {', '.join(PRECISIONS)}, got {t.precision!r}"]
    if t.precision != "autocast-bf16":
        return []
    errors = []
    if t.dtype != "fp32":
        errors.append(f"train.precision=autocast-bf16 keeps fp32 parameters and casts inside autocast: it needs "
                      f"train.dtype=fp32, got train.dtype={t.dtype}")
    untested = [f"{k}={v}" for k, v, default in (
        ("parallel.tp_mode", cfg.parallel.tp_mode, "1d"), ("model.reversible", cfg.model.reversible, False),
        ("memory.contiguous", cfg.memory.contiguous, False)) if v != default]
    if untested:
        errors.append(f"train.precision=autocast-bf16 with {', '.join(untested)} is not available: not proven equal "
                      "to the single-process run yet (use train.dtype=bf16)")
    if cfg.model.moe.experts:
        errors.append(f"train.precision=autocast-bf16 with model.moe.experts={cfg.model.moe.experts} is not "
                      "available: the MoE layer combines the experts' (bf16) outputs into a tensor of its input's "
                      "dtype and routes on logits autocast would round to bf16; use train.dtype=bf16")
    return errors


FP8_KEYS = ("fp8_recipe", "fp8_layers", "fp8_gemm", "fp8_all_gather")
"""The train.* keys that only train.precision=fp8 reads."""


@rule("values")
def fp8_values(cfg: Config, world_size: int | None) -> list[str]:
    """train.fp8_recipe and train.fp8_gemm are in their sets (memory/fp8.py)."""
    t = cfg.train
    errors = []
    if t.fp8_recipe not in FP8_RECIPES:
        errors.append(f"train.fp8_recipe must be {or_list(FP8_RECIPES)}, got {t.fp8_recipe!r}")
    if t.fp8_gemm not in FP8_GEMMS:
        errors.append(f"train.fp8_gemm must be {or_list(FP8_GEMMS)}, got {t.fp8_gemm!r}")
    return errors


# train.precision=fp8 is refused with these settings: (condition on the config, the key, reason)
FP8_REFUSED = (
    (lambda c: c.train.dtype == "fp16", "train.dtype",
     "fp16 needs loss scaling for the gradients, and the FP8 recipes scale each gradient tensor themselves; use "
     "train.dtype=fp32 (autocast-bf16 around the FP8 layers) or bf16"),
    (lambda c: c.train.dtype == "fp64", "train.dtype",
     "the FP8 GEMMs dequantize and accumulate in fp32 (emulated) or on tensor cores, so nothing would be fp64; use "
     "train.dtype=fp32 or bf16 (scaletrain verify: --dtype fp32 with a bf16-sized --rtol)"),
    (lambda c: c.model.moe.experts > 0, "model.moe.experts",
     "the experts' batched GEMMs are not converted to FP8 and their routing is not proven under FP8 rounding"),
    (lambda c: c.parallel.tp_mode != "1d", "parallel.tp_mode",
     "the grid's layers split weights along both dimensions and their FP8 scales are not reduced over the grid"),
    (lambda c: c.model.reversible, "model.reversible",
     "reversible blocks recompute their inputs in a custom backward that is not proven with FP8 layers"),
    (lambda c: c.memory.contiguous, "memory.contiguous", "not proven equal to the single-process FP8 run"),
    (lambda c: c.parallel.offload == "nvme", "parallel.offload",
     "ZeRO-Infinity materialises its units from files, not proven with FP8 layers"),
)


@rule("combinations")
def fp8(cfg: Config, world_size: int | None) -> list[str]:
    """train.precision=fp8: the dtypes and layouts it works with, its layer filter (memory/fp8_layers.py); its keys
    set without it would be ignored."""
    t = cfg.train
    if t.precision != "fp8":
        default = TrainConfig()
        stray = [f"train.{k}={getattr(t, k)}" for k in FP8_KEYS if getattr(t, k) != getattr(default, k)]
        return [f"{', '.join(stray)} has no effect without train.precision=fp8"] if stray else []
    errors = [f"train.precision=fp8 with {key}={_text(cfg, key)} is not available: {why}"
              for applies, key, why in FP8_REFUSED if applies(cfg)]
    return errors + filter_errors(cfg.model, t) + fp8_all_gather_errors(cfg)


def fp8_all_gather_errors(cfg: Config) -> list[str]:
    """train.fp8_all_gather (parallel/zero_fp8.py): what it gathers in float8 and the layouts it is proven with."""
    t, p = cfg.train, cfg.parallel
    if not t.fp8_all_gather:
        return []
    refused = (
        (p.zero != 3, f"parallel.zero={p.zero}", "only ZeRO-3 all-gathers parameters (use parallel.zero=3)"),
        (t.fp8_recipe != "tensorwise", f"train.fp8_recipe={t.fp8_recipe}",
         "rowwise GEMMs cast the weight along different dimensions, so no one float8 weight serves them (torchao "
         "gathers float8 for tensorwise only)"),
        (p.tp > 1, f"parallel.tp={p.tp}",
         "the gathered weight's scale would need the amax over the tensor-parallel shards too; not proven"),
        (p.offload != "none", f"parallel.offload={p.offload}", "not proven with offloaded parameter shards"),
    )
    return [f"train.fp8_all_gather=true with {what} is not available: {why}" for bad, what, why in refused if bad]


@rule("combinations")
def contiguous(cfg: Config, world_size: int | None) -> list[str]:
    """memory.contiguous needs something for its arenas to hold (memory/contiguous.py); counting allocations on CPU
    and profiling the same step would nest two profilers."""
    mem, p, t = cfg.memory, cfg.parallel, cfg.train
    errors = []
    if mem.contiguous and mem.recompute.strip().lower() == "none" and not mem.offload_activations and p.zero < 2:
        errors.append(f"memory.contiguous has nothing to hold with memory.recompute=none, no activation offload and "
                      f"parallel.zero={p.zero}: it arranges activation checkpoints and ZeRO-2/3's transient gradient "
                      "buffers (plain data parallelism and ZeRO-1 already keep their gradient buckets for the whole "
                      "run)")
    window = t.profile_steps.strip()
    if mem.count_allocations and window and t.device != "cuda":
        try:
            first, last = parse_steps(window)
        except ConfigError:  # report/rules.py reports the syntax error itself
            first, last = 0, -1
        if first <= 2 <= last:
            errors.append(f"memory.count_allocations counts step 2 with torch.profiler on CPU, which "
                          f"train.profile_steps ({window}) also records: profilers do not nest (profile other "
                          "steps, or count on CUDA)")
    return errors


@rule("combinations")
def budget(cfg: Config, world_size: int | None) -> list[str]:
    """memory.budget_gb is a finite number of GiB, 0 for none (memory/budget.py)."""
    b = cfg.memory.budget_gb
    if not b >= 0 or b == float("inf"):
        return [f"memory.budget_gb must be a finite number >= 0 (0 = no budget), got {b}"]
    return []


@rule("final")
def compress_segments(cfg: Config, world_size: int | None) -> list[str]:
    """Lossy activation compression with recompute=every:k under pp: a segment's input is kept compressed and its
    blocks are recomputed from it, so the segments must be the ones one process has (k blocks from block 0): a
    chunk must start at a multiple of k (docs/memory.md)."""
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


def _text(cfg: Config, dotted: str) -> str:
    """A config value as the command line writes it (`true`, `2d`)."""
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return str(node).lower() if isinstance(node, bool) else str(node)
