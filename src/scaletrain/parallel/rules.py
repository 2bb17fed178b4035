"""validate()'s rules for the layout: ZeRO stages, resharding after forward and offload (arXiv 1910.02054;
ZeRO-Infinity arXiv 2104.07857), tensor parallelism, 1D (Megatron-LM, arXiv 1909.08053; sequence parallelism arXiv
2205.05198) and 2D / 2.5D / 3D (arXiv 2104.05343, 2105.14500, 2105.14450), and train.compile (`parallel/compile.py`).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free: the one
torch import is that of `compile_backend_errors`, made only for a config with train.compile=true.
"""

from __future__ import annotations

from scaletrain.config.rules import rule
from scaletrain.config.schema import OFFLOADS, PRECISIONS, TP_MODES, ZERO_STAGES, Config, or_list
from scaletrain.config.sizes import ffn_size
from scaletrain.optim.registry import OPTIMIZERS


@rule("values")
def zero(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.zero and parallel.offload name a stage and a kind of offload."""
    p = cfg.parallel
    errors = []
    if p.zero not in ZERO_STAGES:
        errors.append(f"parallel.zero must be {or_list(ZERO_STAGES)}, got {p.zero}")
    if p.offload not in OFFLOADS:
        errors.append(f"parallel.offload must be {or_list(OFFLOADS)}, got {p.offload!r}")
    return errors


@rule("combinations")
def offload(cfg: Config, world_size: int | None) -> list[str]:
    """ZeRO-Offload's kinds need the stages that shard what they move."""
    p = cfg.parallel
    errors = []
    if p.offload == "optimizer" and p.zero == 0:
        errors.append("parallel.offload=optimizer needs parallel.zero >= 1 (the offloaded optimizer is sharded)")
    if p.offload == "params" and p.zero != 3:
        errors.append(f"parallel.offload=params needs parallel.zero=3, got parallel.zero={p.zero}")
    return errors


@rule("combinations")
def reshard_after_forward(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.reshard_after_forward is ZeRO-3's choice (parallel/zero.py); the pipeline and ZeRO-Infinity paths
    each have one way of holding the gathered parameters."""
    p = cfg.parallel
    value = p.reshard_after_forward
    if value is None:
        return []
    if p.zero != 3:
        return [f"parallel.reshard_after_forward={str(value).lower()} needs parallel.zero=3, got parallel.zero="
                f"{p.zero}: only ZeRO-3 gathers parameters for the forward, so there is nothing to release or keep"]
    if value and p.pp > 1:
        return [f"parallel.reshard_after_forward=true with parallel.pp ({p.pp}) > 1 is not available: pipeline stages "
                "keep their ZeRO-3 parameters gathered for the whole step, as the schedule interleaves the "
                "micro-batches' forwards and backwards (leave it unset or false)"]
    if not value and p.offload == "nvme":
        return ["parallel.reshard_after_forward=false with parallel.offload=nvme is not available: ZeRO-Infinity "
                "streams each unit's parameters from files just in time and frees them after use"]
    return []


@rule("combinations")
def nvme(cfg: Config, world_size: int | None) -> list[str]:
    """ZeRO-Infinity offload (parallel.offload=nvme); the folder itself is checked before launch
    (`offload_nvme.check_offload_dir`), where --out is known."""
    p = cfg.parallel
    if p.offload != "nvme":
        changed = [f"parallel.{k}={v!r}" for k, v, default in (("offload_dir", p.offload_dir, ""),
                   ("nvme_prefetch", p.nvme_prefetch, 2), ("nvme_grads", p.nvme_grads, True)) if v != default]
        return [f"{', '.join(changed)} needs parallel.offload=nvme, got parallel.offload={p.offload!r}"] if changed \
            else []
    errors = []
    if p.zero != 3:
        errors.append(f"parallel.offload=nvme needs parallel.zero=3, got parallel.zero={p.zero}")
    if p.nvme_prefetch < 1:
        errors.append(f"parallel.nvme_prefetch must be >= 1, got {p.nvme_prefetch}")
    spec = OPTIMIZERS.get(cfg.optim.name)
    if spec is None or not spec.streamed:
        errors.append(f"parallel.offload=nvme streams AdamW's step shard by shard; optim.name={cfg.optim.name!r} "
                      "is not available with it")
    for name, value in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep)):
        if value > 1:
            errors.append(f"parallel.offload=nvme is not available with parallel.{name} ({value}) > 1: the engine "
                          "builds and streams one dp group's units of the plain model")
    return errors


@rule("combinations")
def tensor_parallel(cfg: Config, world_size: int | None) -> list[str]:
    """Megatron tensor parallelism splits heads, hidden and MLP sizes over tp (the grid modes: `tensor_grid`)."""
    m, p = cfg.model, cfg.parallel
    errors = []
    if p.tp > 1:
        for what, value in (("model.n_heads", m.n_heads), ("model.d_model", m.d_model),
                            ("the MLP hidden size model.d_ff", ffn_size(m))):
            if value % p.tp and p.tp_mode == "1d":
                errors.append(f"{what} ({value}) is not divisible by parallel.tp ({p.tp})")
        if world_size is not None and p.tp > world_size:
            errors.append(f"parallel.tp ({p.tp}) is larger than the number of processes ({world_size})")
    if p.sequence_parallel and m.seq_len % p.tp:
        errors.append(f"parallel.sequence_parallel needs model.seq_len ({m.seq_len}) divisible by "
                      f"parallel.tp ({p.tp})")
    return errors


@rule("combinations")
def tensor_grid(cfg: Config, world_size: int | None) -> list[str]:
    """2D / 2.5D / 3D tensor parallelism (parallel/tensor_nd/, docs/tensor_parallel.md): the grid's shape and what it
    splits; the combinations not made to work with it are `grid_refusals`."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
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
    from scaletrain.distributed.grid import grid_shape  # (only for the grid modes: start-up stays small)

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
    if m.n_heads % q:
        errors.append(f"model.n_heads ({m.n_heads}) is not divisible by the grid side q ({q}) of "
                      f"parallel.tp_mode={mode}")
    for what, value in (("model.d_model", m.d_model), ("the MLP hidden size model.d_ff", ffn_size(m))):
        if value % (q * q):
            errors.append(f"{what} ({value}) is not divisible by q x q ({q * q}) of parallel.tp_mode={mode}")
    return errors + grid_refusals(cfg)


def grid_refusals(cfg: Config) -> list[str]:
    """What a 2D / 2.5D / 3D grid is not made to work with, each refused with its reason."""
    p, m, t, mem = cfg.parallel, cfg.model, cfg.train, cfg.memory
    mode = p.tp_mode
    why = f"with parallel.tp_mode={mode} is not available"
    errors = []
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
    if p.pp > 1 and p.schedule in ("zb-h1", "zb-v", "dualpipev", "2bw"):
        errors.append(f"parallel.schedule={p.schedule} {why}: zero-bubble's split backward would run the grid's "
                      "backward collectives twice, and 2BW's weight versions are not wired to it")
    if m.moe.experts:
        errors.append(f"model.moe.experts ({m.moe.experts}) > 0 {why}: experts are not split over the grid")
    spec = OPTIMIZERS.get(cfg.optim.name)
    if spec is None or spec.factored or not spec.sharded:
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


# train.compile=true is refused with these settings: key -> (condition on the config, reason)
COMPILE_REFUSED = {
    "parallel.schedule": (lambda c: c.parallel.pp > 1 and c.parallel.schedule in ("zb-h1", "zb-v", "dualpipev"),
                          "the zero-bubble schedule splits each block's backward into an input pass and a weight pass, "
                          "while a compiled block has one backward (it would run twice, retaining its graph)"),
    "parallel.tp": (lambda c: c.parallel.tp > 1,
                    "the tensor-parallel layers' collectives inside each block break its graph, and the pieces "
                    "recompile per block until torch.compile falls back to eager; compile is made to work with dp, "
                    "ZeRO 0-3 and pp"),
    "model.moe.experts": (lambda c: c.model.moe.experts > 0,
                          "mixture-of-experts routing has data-dependent shapes and Python-side statistics"),
    "model.dropout": (lambda c: c.model.dropout > 0 or c.model.moe.expert_dropout > 0,
                      "layout-independent dropout keys its masks by Python values that change every micro-batch "
                      "(recompiling the blocks), and torch's compiled dropout draws from another stream than eager"),
    "memory.compress": (lambda c: c.memory.compress != "none",
                        "activation compression packs saved tensors with saved-tensor hooks inside the blocks"),
    "memory.offload_activations": (lambda c: c.memory.offload_activations,
                                   "activation offload moves saved tensors with saved-tensor hooks inside the blocks"),
    "memory.partition_checkpoints": (lambda c: c.memory.partition_checkpoints,
                                     "partitioned checkpoints gather with saved-tensor hooks inside the blocks"),
    "model.reversible": (lambda c: c.model.reversible,
                         "reversible blocks recompute their inputs in a custom backward that compile is not proven "
                         "with"),
    "memory.contiguous": (lambda c: c.memory.contiguous,
                          "the contiguous arenas hand out saved tensors through hooks inside the blocks"),
    "parallel.tp_mode": (lambda c: c.parallel.tp_mode != "1d",
                         "the 2D / 2.5D / 3D layers' collectives inside each block break its graph"),
}


@rule("combinations")
def compile_blocks(cfg: Config, world_size: int | None) -> list[str]:
    """One line per setting train.compile=true is refused with, and an unknown torch.compile backend (docs/gpu.md).
    With an unknown train.precision only memory/rules.py speaks."""
    if not cfg.train.compile or cfg.train.precision not in PRECISIONS:
        return []
    from scaletrain.parallel.compile import compile_backend_errors  # torch's registry of backends: torch is needed

    errors = compile_backend_errors()
    for key, (applies, why) in COMPILE_REFUSED.items():
        if applies(cfg):
            errors.append(f"train.compile=true with {key}={_value(cfg, key)} is not available: {why}")
    return errors


def _value(cfg: Config, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
