"""validate()'s rules for the model's keys (`model.*`, `model.moe.*`): the shapes a GPT can be built with, grouped-query
attention (arXiv 2305.13245) and its tensor-parallel split, RoPE's base and Llama 3 scaling, the GELU variant and
query/key/value biases, mixture of experts (GShard arXiv 2006.16668, Switch arXiv 2101.03961) and reversible blocks
(RevNet arXiv 1707.04585).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.parse import parse_recompute
from scaletrain.config.rules import rule
from scaletrain.config.schema import (
    ACTIVATIONS,
    AUX_LOSSES,
    DROPOUT_IMPLS,
    MLPS,
    NORMS,
    POSITIONS,
    ROPE_SCALING_TYPES,
    ROUTERS,
    Config,
    RopeScalingConfig,
    or_list,
)
from scaletrain.config.sizes import ffn_size, half_config, kv_heads
from scaletrain.errors import ConfigError


@rule("inputs")
def dense_router(cfg: Config, world_size: int | None) -> list[str]:
    """model.moe.router names a router even in a dense model (with experts, `moe` below says it); model.moe.aux_loss
    names a loss."""
    e = cfg.model.moe
    errors = []
    if e.experts == 0 and e.router not in ROUTERS:
        errors.append(f"model.moe.router must be one of {', '.join(ROUTERS)}, got {e.router!r}")
    if e.aux_loss not in AUX_LOSSES:
        errors.append(f"model.moe.aux_loss must be {or_list(AUX_LOSSES)}, got {e.aux_loss!r}")
    elif e.experts == 0 and (e.aux_loss != "switch" or e.groups != 1):
        errors.append(f"model.moe.aux_loss={e.aux_loss} / groups={e.groups} set in a dense model: they need "
                      "model.moe.experts > 0")
    return errors


@rule("values")
def shape(cfg: Config, world_size: int | None) -> list[str]:
    """Heads, position encoding, MLP and dropout of the plain model (model/gpt.py)."""
    m = cfg.model
    errors = []
    if m.d_model % m.n_heads:
        errors.append(f"model.d_model ({m.d_model}) is not divisible by model.n_heads ({m.n_heads})")
    if m.position == "rope" and (m.d_model // m.n_heads) % 2:
        errors.append(f"rope needs an even head size, got d_model/n_heads = {m.d_model // m.n_heads}")
    if m.mlp not in MLPS:
        errors.append(f"model.mlp must be {or_list(MLPS)}, got {m.mlp!r}")
    if m.position not in POSITIONS:
        errors.append(f"model.position must be {or_list(POSITIONS)}, got {m.position!r}")
    if not 0.0 <= m.dropout < 1.0:
        errors.append(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.dropout_impl not in DROPOUT_IMPLS:
        errors.append(f"model.dropout_impl must be {or_list(DROPOUT_IMPLS)}, got {m.dropout_impl!r}")
    return errors


@rule("values")
def attention(cfg: Config, world_size: int | None) -> list[str]:
    """Key/value heads (grouped-query attention), RoPE base and scaling, the GELU variant (model/block.py)."""
    m, r = cfg.model, cfg.model.rope_scaling
    errors = []
    if not 0 <= m.n_kv_heads <= m.n_heads:
        errors.append(f"model.n_kv_heads must be between 0 (= model.n_heads) and model.n_heads ({m.n_heads}), "
                      f"got {m.n_kv_heads}")
    elif m.n_heads % kv_heads(m):
        errors.append(f"model.n_heads ({m.n_heads}) is not divisible by model.n_kv_heads ({m.n_kv_heads}): each "
                      "key/value head serves the same number of query heads")
    if m.activation not in ACTIVATIONS:
        errors.append(f"model.activation must be {or_list(ACTIVATIONS)}, got {m.activation!r}")
    if not m.rope_theta > 0:
        errors.append(f"model.rope_theta must be > 0, got {m.rope_theta}")
    if r.type not in ROPE_SCALING_TYPES:
        errors.append(f"model.rope_scaling.type must be {or_list(ROPE_SCALING_TYPES)}, got {r.type!r}")
    elif r.type == "llama3":
        if not (r.factor >= 1 and 0 < r.low_freq_factor < r.high_freq_factor
                and r.original_max_position_embeddings > 0):
            errors.append(f"model.rope_scaling (llama3) needs factor >= 1 ({r.factor}), 0 < low_freq_factor "
                          f"({r.low_freq_factor}) < high_freq_factor ({r.high_freq_factor}) and "
                          f"original_max_position_embeddings > 0 ({r.original_max_position_embeddings})")
    else:
        off = [f"model.rope_scaling.{k} ({getattr(r, k)})" for k, v in vars(RopeScalingConfig()).items()
               if k != "type" and getattr(r, k) != v]
        if off:
            errors.append(f"{', '.join(off)} set with model.rope_scaling.type=none, which ignores it")
    return errors


@rule("combinations")
def attention_combinations(cfg: Config, world_size: int | None) -> list[str]:
    """What the attention variants are refused with: settings another key makes meaningless, and how the key/value
    heads split over tensor parallelism (each rank holds whole heads; with tp > n_kv_heads each key/value head is
    copied to the tp / n_kv_heads ranks whose query heads use it)."""
    m, p = cfg.model, cfg.parallel
    errors = []
    if m.position != "rope" and (m.rope_theta != 10000.0 or m.rope_scaling.type != "none"):
        errors.append(f"model.rope_theta ({m.rope_theta}) / model.rope_scaling.type ({m.rope_scaling.type}) set with "
                      f"model.position={m.position}, which has no rotary embedding")
    if m.activation != "gelu" and m.mlp != "gelu":
        errors.append(f"model.activation={m.activation} with model.mlp={m.mlp}: the activation is the GELU MLP's "
                      "(SwiGLU uses SiLU)")
    if m.qkv_bias and m.bias:
        errors.append("model.qkv_bias=true with model.bias=true: every linear layer has a bias already")
    kv = kv_heads(m)
    if kv != m.n_heads and p.tp > 1 and 0 < kv <= m.n_heads and m.n_heads % kv == 0:
        if p.tp_mode != "1d":
            errors.append(f"model.n_kv_heads ({m.n_kv_heads}) with parallel.tp_mode={p.tp_mode}: grouped-query "
                          "attention is split by the 1d (Megatron) tensor parallelism only")
        elif kv % p.tp and p.tp % kv:
            errors.append(f"model.n_kv_heads ({m.n_kv_heads}) and parallel.tp ({p.tp}): one must divide the other "
                          "(each rank holds whole key/value heads, or one head shared with tp / n_kv_heads ranks)")
    return errors


@rule("combinations")
def norm(cfg: Config, world_size: int | None) -> list[str]:
    """model.norm names a layer of model/norm.py."""
    if cfg.model.norm not in NORMS:
        return [f"model.norm must be {or_list(NORMS)}, got {cfg.model.norm!r}"]
    return []


@rule("combinations")
def moe(cfg: Config, world_size: int | None) -> list[str]:
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
    errors += shazeer_gating(cfg)
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


@rule("combinations")
def reversible(cfg: Config, world_size: int | None) -> list[str]:
    """What model.reversible=true is refused with, one reason each (model/reversible.py; empty when it is off)."""
    m, p, mem = cfg.model, cfg.parallel, cfg.memory
    if not m.reversible:
        return []
    errors: list[str] = []
    if m.d_model % 2:
        return [f"model.reversible splits the stream into two halves: model.d_model ({m.d_model}) must be even"]
    half = half_config(m)
    if half.d_model % m.n_heads:
        errors.append(f"model.reversible: each half of model.d_model ({m.d_model}) has {half.d_model} features, "
                      f"not divisible by model.n_heads ({m.n_heads})")
    elif m.position == "rope" and (half.d_model // m.n_heads) % 2:
        errors.append(f"model.reversible with rope needs an even head size, got d_model/2/n_heads = "
                      f"{half.d_model // m.n_heads}")
    if p.tp > 1 and ffn_size(half) % p.tp:  # (the halves' width follows from n_heads % tp, checked by validate)
        errors.append(f"model.reversible: the halves' MLP hidden size ({ffn_size(half)}) is not divisible by "
                      f"parallel.tp ({p.tp})")
    try:
        kind = parse_recompute(mem.recompute).kind
    except ConfigError:  # memory/rules.py reports the syntax error itself
        kind = "none"
    if kind in ("full", "every", "nth", "ops"):
        errors.append(f"memory.recompute={mem.recompute} with model.reversible: reversible blocks keep no "
                      "activations for a checkpoint to drop (use none, or attn-core to bound the reverse pass)")
    if mem.offload_activations:
        errors.append("memory.offload_activations with model.reversible: reversible blocks keep no activations to "
                      "offload")
    if mem.compress.strip().lower() not in ("", "none"):
        errors.append(f"memory.compress={mem.compress} with model.reversible: reversible blocks save nothing for "
                      "backward to encode")
    if p.pp > 1 and p.schedule in ("zb-h1", "zb-v", "dualpipev"):
        errors.append(f"parallel.schedule={p.schedule} with model.reversible: the reverse pass rebuilds a block's "
                      "input and its weight gradients together, so zero bubble cannot defer the weight part")
    return errors


@rule("combinations")
def share_blocks(cfg: Config, world_size: int | None) -> list[str]:
    """What model.share_blocks=true (model/gpt.py's share_block_weights) is refused with: it is made to work and
    tested on one process, data parallelism, ZeRO-1/2/3, 1d tensor parallelism (with and without sequence parallelism),
    expert and context parallelism (parallel/shared_blocks.py, tests/test_share_blocks.py); what is refused has its
    reason."""
    m, p = cfg.model, cfg.parallel
    if not m.share_blocks:
        return []
    errors = []
    if m.reversible:
        errors.append("model.share_blocks with model.reversible: reversible blocks have their own half-width "
                      "structure, sharing is built for plain pre-norm blocks")
    if m.dropout > 0:
        errors.append(f"model.share_blocks with model.dropout={m.dropout}: a shared block's dropout site would draw "
                      "the same mask in every layer")
    if m.moe.experts > 0 and m.moe.every != 1:
        errors.append(f"model.share_blocks with model.moe.every={m.moe.every}: block 0's MLP is shared by every "
                      "layer, so every must be 1 (WideNet)")
    if m.moe.experts > 0 and (m.moe.router_noise > 0 or m.moe.random_routing):
        errors.append("model.share_blocks with model.moe.router_noise > 0 or model.moe.random_routing: the shared "
                      "layer's random streams are keyed by its layer, so every layer would draw the same draws")
    if p.tp > 1 and p.tp_mode != "1d":
        errors.append(f"model.share_blocks with parallel.tp_mode={p.tp_mode}: only 1d tensor parallelism is "
                      "verified to shard a shared block once; use parallel.tp_mode=1d")
    if p.pp > 1:
        errors.append(f"model.share_blocks with parallel.pp={p.pp}: the shared block would be copied on every "
                      "stage, and its gradients are not summed across the pipeline group (only the tied embedding's)")
    if p.offload == "nvme":
        errors.append("model.share_blocks with parallel.offload=nvme: ZeRO-Infinity keeps each block's parameters "
                      "in files of their own, so a weight every block shares would be stored once per block")
    if p.sync != "bsp":
        errors.append(f"model.share_blocks with parallel.sync={p.sync}: only synchronous (bsp) training")
    return errors


def shazeer_gating(cfg: Config) -> list[str]:
    """model.moe.aux_loss=importance and model.moe.groups (arXiv 1701.06538; model/moe_gating.py), with experts."""
    e = cfg.model.moe
    errors: list[str] = []
    if e.importance_loss_weight < 0 or e.load_loss_weight < 0:
        errors.append(f"model.moe.importance_loss_weight ({e.importance_loss_weight}) and load_loss_weight "
                      f"({e.load_loss_weight}) must be >= 0")
    if e.groups < 1:
        return [*errors, f"model.moe.groups must be >= 1 (1 = flat), got {e.groups}"]
    if e.experts % e.groups:
        errors.append(f"model.moe.groups ({e.groups}) must divide model.moe.experts ({e.experts})")
        return errors
    importance = e.aux_loss == "importance"
    if (importance or e.groups > 1) and e.router != "topk":
        what = "aux_loss=importance" if importance else f"groups={e.groups}"
        errors.append(f"model.moe.{what} is built on the noisy top-k gate (Shazeer): needs model.moe.router=topk, "
                      f"got {e.router!r}")
        return errors
    sizes = [e.groups, e.experts // e.groups] if e.groups > 1 else [e.experts]
    if e.groups > 1 and not all(e.top_k <= n for n in sizes):
        errors.append(f"model.moe.groups={e.groups}: top_k ({e.top_k}) groups of {e.groups} and top_k experts of "
                      f"each group's {e.experts // e.groups} are chosen, so top_k must be <= both")
    if e.groups > 1 and e.random_routing:
        errors.append(f"model.moe.random_routing with model.moe.groups={e.groups}: GShard's random routing drops a "
                      "flat second expert, which the two-level gate does not have")
    if importance and e.load_loss_weight > 0:
        if e.router_noise <= 0:
            errors.append(f"model.moe.load_loss_weight ({e.load_loss_weight}) is built on the probability that the "
                          "noise keeps an expert selected: needs model.moe.router_noise > 0 (or load_loss_weight=0)")
        elif not all(n > e.top_k for n in sizes):
            errors.append(f"model.moe.load_loss_weight ({e.load_loss_weight}): the load loss compares each gate value "
                          f"with the (top_k + 1)-th, so each gate needs more than top_k ({e.top_k}) choices, got "
                          f"{' and '.join(map(str, sizes))}")
    return errors
