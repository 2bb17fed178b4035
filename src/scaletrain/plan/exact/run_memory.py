"""Exact memory of our own runs: what `scaletrain train` will measure as `mem_params`, `mem_grads`,
`mem_optim` and `mem_activations`, predicted before any process starts.

Model states (exact to the byte). The engine's module is built on the meta device through the same
passes as `parallel.parallelize.build_engine`, minus the collectives: the plain GPT, the tensor-parallel
plan (`parallel.tp_plan.gpt_plan`: Megatron-LM, arXiv 1909.08053) applied by shape from its table
(column / row splits, the vocabulary padded to t*ceil(V/t)), the pipeline stage of each pp rank
(`parallel.pipeline.stage.PipelineStages`, the same partition), then the dtype. Its parameters are then
counted the way the optimizer holds them:

- ZeRO 0 (`ReplicatedOptimizer`): parameters numel x element size; gradients in flat buckets of the
  gradient dtype (fp32 for bf16/fp16: mixed precision keeps fp32 gradient buffers, Micikevicius et al.,
  arXiv 1710.03740); optimizer state of the configured optimizer per parameter (AdamW: exp_avg and
  exp_avg_sq, plus a float32 `step` scalar per tensor, float64 when the default dtype is; Adafactor
  arXiv 1804.04235 and SM3 arXiv 1901.11150 from their own `shard_layout` over the whole tensor), plus
  the fp32 master copies under mixed precision.
- ZeRO 1-3 (Rajbhandari et al., arXiv 1910.02054): `parallel.zero.predict_bytes`, computed from the
  optimizer's own grouping, padding and pieces.

Each category is the maximum over ranks (pp stages differ; dp ranks differ by padding), as the trainer
reports it.

Activations (`mem_activations`, the bytes of distinct storages autograd saves for backward in the first
forward, parameters excluded): a count, term by term, of what our `model.gpt.GPT` and the parallel layers
save (see `layer_saved_bytes`), exact for dropout 0 with flash attention on CPU, times the
(microbatch, chunk) pairs the pipeline schedule holds at once (the schedule's own action list). The
element counts are those of Korthikanti et al. (arXiv 2205.05198, eqs. 1-6); the bytes differ by our
kernels (see docs/tensor_parallel.md, "Activation memory"). Mixture-of-experts blocks replace the MLP's
terms by what `model.moe.MoE` saves (router logits and probabilities in fp32, the dispatched
(E, G, K, C) slots, expert hidden activations and outputs, slot tables; `moe_layer_extra_bytes`), exact
for every router and layout (ep, tp, pp) without router noise, random routing or expert dropout.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from scaletrain.config import Config, ModelConfig
from scaletrain.plan.analytic import offload_costs
from scaletrain.plan.catalog import ModelSpec
from scaletrain.plan.exact import tp_nd_memory
from scaletrain.plan.exact.cp_memory import (
    cp_core_extra,
    cp_rope_extra,
    dp_cp_ranks,
    expert_rank,
    loader_ids_bytes,
    loader_targets_bytes,
)
from scaletrain.plan.exact.gathered import gathered_param_bytes
from scaletrain.plan.exact.stash_memory import stash_bytes

_TORCH = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
LOW = ("bf16", "fp16")


# --------------------------------------------------------------------------- the module on meta


def _shard_tp_on_meta(model: nn.Module, cfg: Config, t: int) -> None:
    """Give every parameter the per-rank shape `apply_tp_plan` gives it (the same table), in place.

    Parameters are replaced under the same attribute names, so registration order, and hence the ZeRO
    buckets and the optimizer's parameter list, are those of the real pass. All tp ranks get equal shapes
    (the vocabulary is padded to a multiple of t)."""
    from scaletrain.parallel.tensor_parallel import copy_layout, padded_vocab
    from scaletrain.parallel.tp_plan import Column, Row, VocabEmbedding, VocabHead, gpt_plan, resolve_plan

    converted: dict[int, nn.Parameter] = {}

    def swap(module: nn.Module, attr: str, shape: tuple[int, ...]) -> None:
        old = getattr(module, attr, None)
        if old is None:
            return
        if id(old) not in converted:
            converted[id(old)] = nn.Parameter(torch.empty(shape, device="meta", dtype=old.dtype))
            converted[id(old)]._st_global_shape = tuple(old.shape)  # Adafactor/SM3 statistics are of this shape
        setattr(module, attr, converted[id(old)])

    for name, style in resolve_plan(model, gpt_plan(cfg.model)):
        mod = model.get_submodule(name)
        if isinstance(style, Column):  # grouped-query kv: at most n_kv_heads pieces, copied when tp is larger
            pieces = copy_layout(t, style.shards)[0]
            swap(mod, "weight", (mod.out_features // pieces, mod.in_features))
            swap(mod, "bias", (mod.out_features // pieces,))
        elif isinstance(style, Row):
            swap(mod, "weight", (mod.out_features, mod.in_features // t))
        elif isinstance(style, VocabEmbedding):
            swap(mod, "weight", (padded_vocab(mod.num_embeddings, t) // t, mod.embedding_dim))
        elif isinstance(style, VocabHead):
            swap(mod, "weight", (padded_vocab(mod.out_features, t) // t, mod.in_features))


def _experts(cfg: Config) -> int:
    moe = getattr(cfg.model, "moe", None)
    return getattr(moe, "experts", 0) if moe is not None else 0


def _shard_experts_on_meta(model: nn.Module, ep: int) -> None:
    """`parallel.experts.apply_ep` by shape: each expert weight keeps its first 1/ep along dim 0."""
    from scaletrain.model.moe import Experts

    for mod in model.modules():
        if isinstance(mod, Experts):
            for name, p in list(mod.named_parameters(recurse=False)):
                shape = (p.shape[0] // ep, *p.shape[1:])
                local = nn.Parameter(torch.empty(shape, device="meta", dtype=p.dtype))
                local._st_expert, local._st_global_shape = True, tuple(p.shape)  # own optimizer (edp), statistics
                setattr(mod, name, local)


def pipeline_partition(cfg: Config):
    """The partition `split_pp` uses (uniform unless the config asks otherwise; `time` is not predictable
    before a run and falls back to the parameter balance)."""
    from scaletrain.parallel.pipeline import partition as part

    S, L = cfg.parallel.pp * cfg.parallel.virtual_stages, cfg.model.n_layers
    how = getattr(cfg.parallel, "partition", "uniform")
    if how == "params" or how == "time":
        return part.balance(part.param_costs(cfg.model), S)
    if how == "uniform":
        return part.uniform(L, S)
    if how == "ends":
        return part.ends(L, S)
    return part.Partition(tuple(int(x) for x in str(how).split(",")))


def stage_ids(cfg: Config, pp_rank: int) -> list[int]:
    from scaletrain.parallel.pipeline.schedules import rank_chunk_to_stage

    p, v = cfg.parallel.pp, cfg.parallel.virtual_stages
    return [rank_chunk_to_stage(pp_rank, c, p, cfg.parallel.schedule) for c in range(v)]


def engine_module_on_meta(cfg: Config, pp_rank: int = 0) -> nn.Module:
    """The module a rank of pipeline rank `pp_rank` trains, on the meta device, through the passes of
    `build_engine` (GPT, tensor-parallel shapes, pipeline stage, dtype); no process group needed."""
    from scaletrain.model.gpt import gpt_on_meta

    model = gpt_on_meta(cfg.model)
    if cfg.model.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    model.to(_TORCH[cfg.train.dtype])
    if cfg.parallel.tp > 1 and cfg.parallel.tp_mode != "1d":  # 2d / 2.5d / 3d: the engine's own pass
        tp_nd_memory.shard_meta(model, cfg)
    elif cfg.parallel.tp > 1:
        _shard_tp_on_meta(model, cfg, cfg.parallel.tp)
    if _experts(cfg) and cfg.parallel.ep > 1:
        _shard_experts_on_meta(model, cfg.parallel.ep)
    if cfg.parallel.pp > 1:
        from scaletrain.parallel.pipeline.stage import PipelineStages

        p, v = cfg.parallel.pp, cfg.parallel.virtual_stages
        ids = stage_ids(cfg, pp_rank)
        bounds = pipeline_partition(cfg).bounds
        shards = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
        model = PipelineStages(model, ids, [bounds[s] for s in ids], p * v, shards)
    return model


# --------------------------------------------------------------------------- model states


def _step_bytes() -> int:
    return 8 if torch.get_default_dtype() == torch.float64 else 4  # AdamW's `step` scalar per tensor


def optimizer_state_bytes(cfg: Config, params: list[torch.Tensor], state_elem: int) -> int:
    """Bytes of the configured optimizer's state for these (local) parameters (ZeRO 0). Adafactor / SM3 keep
    their row / column statistics of the whole matrix on every tensor-parallel rank (`_st_global_shape` of a
    tp-split meta parameter) and their element-wise states for the local elements."""
    from scaletrain.optim import optimizer_spec, state_elements
    from scaletrain.parallel.zero_factored import state_sizes

    o = cfg.optim
    spec = optimizer_spec(o.name)
    total = 0
    for p in params:
        numel = p.numel()
        if not spec.factored:  # AdamW's two moments and step; SGD's momentum buffer only when momentum is on
            total += state_elements(spec, numel, o.momentum > 0) * state_elem
            total += _step_bytes() if spec.step_tensor else 0
            continue
        shape = getattr(p, "_st_global_shape", tuple(p.shape))
        sizes = state_sizes(o.name, shape, numel, beta1=o.use_beta1, momentum=o.momentum > 0)
        total += sum(sizes.values()) * state_elem
    return total


def _zero_bytes(cfg: Config, module: nn.Module, params: list[nn.Parameter]) -> dict[str, int]:
    """ZeRO's bytes on the fullest dp rank. With expert parallelism the dense parameters are sharded over dp and
    the experts over edp (dp / ep ranks; dp rank d is edp rank d // ep): the two are added rank by rank."""
    from scaletrain.parallel.zero import predict_bytes_per_rank

    par, o = cfg.parallel, cfg.optim
    if par.offload == "nvme":  # ZeRO-Infinity: only staging buffers are resident (parallel/zero_nvme.py)
        return nvme_state_bytes(cfg, module)
    kw = dict(optimizer=o.name, beta1=o.use_beta1, momentum=o.momentum > 0)
    experts = [p for p in params if getattr(p, "_st_expert", False)]
    if not experts:
        dp = dp_cp_ranks(par) * (par.tp_depth if par.tp_mode == "2.5d" else 1)  # 2.5d: dp x depth (tp2p5d.py)
        ranks = predict_bytes_per_rank(module, par.zero, dp, par.bucket_mb, par.offload, **kw)
        return {k: max(r[k] for r in ranks) for k in ranks[0]}
    dense = [p for p in params if not getattr(p, "_st_expert", False)]
    n = dp_cp_ranks(par)  # dense parameters over dp x cp, experts over edp x cp (parallel/experts.py)
    d = predict_bytes_per_rank(module, par.zero, n, par.bucket_mb, par.offload, params=dense, **kw)
    e = predict_bytes_per_rank(module, par.zero, n // par.ep, par.bucket_mb, par.offload, params=experts, **kw)
    return {k: max(d[r][k] + e[expert_rank(par, r)][k] for r in range(n)) for k in d[0]}


def nvme_shards(cfg: Config, module: nn.Module | None = None) -> tuple[list[int], int, bool, int]:
    """ZeRO-Infinity: (shard elements per unit, element size, low precision, gradient element size) of a config, from
    the same grouping the engine uses, on the meta device."""
    from scaletrain.parallel.zero import group_params

    if module is None:
        module = engine_module_on_meta(cfg, 0)
    n = dp_cp_ranks(cfg.parallel)
    shards = [max(1, math.ceil(sum(p.numel() for p in g) / n)) for g in group_params(module, 3, cfg.parallel.bucket_mb)]
    low = cfg.train.dtype in LOW
    e = _TORCH[cfg.train.dtype].itemsize
    return shards, e, low, 4 if low else e


def nvme_state_bytes(cfg: Config, module: nn.Module | None = None) -> dict[str, int]:
    """The resident params / grads / optim bytes of an nvme run (`offload_costs.resident_bytes`)."""
    from scaletrain.config.sizes import NVME_STEP_CHUNK as STEP_CHUNK

    shards, e, low, ge = nvme_shards(cfg, module)
    return offload_costs.resident_bytes(shards, e, low, ge, cfg.parallel.nvme_prefetch, cfg.parallel.nvme_grads,
                                        STEP_CHUNK)


def nvme_file_bytes(cfg: Config) -> int:
    """Bytes of one rank's offload files (`offload_costs.file_bytes`)."""
    shards, e, low, ge = nvme_shards(cfg)
    return offload_costs.file_bytes(shards, e, low, ge, cfg.parallel.nvme_grads)


def nvme_io(cfg: Config) -> dict[str, int]:
    """The bytes one rank reads and writes per step (`offload_costs.io_per_step`), as the trainer logs them beside
    the measured ones: `plan_nvme_read_bytes`, `plan_nvme_write_bytes`."""
    shards, e, low, ge = nvme_shards(cfg)
    read, write = offload_costs.io_per_step(shards, e, low, ge, cfg.grad_accum, cfg.parallel.nvme_grads)
    return {"plan_nvme_read_bytes": read, "plan_nvme_write_bytes": write}


def model_state_bytes(cfg: Config) -> dict[str, int]:
    """(params, grads, optim) bytes per rank as the trainer reports them (max over ranks), exact."""
    stages = model_state_bytes_per_stage(cfg)
    return {k: max(s[k] for s in stages) for k in ("params", "grads", "optim")}


def model_state_bytes_per_stage(cfg: Config) -> list[dict[str, int]]:
    """(params, grads, optim) bytes of each pipeline stage's fullest rank (max over its dp and tp ranks)."""
    par = cfg.parallel
    low = cfg.train.dtype in LOW
    out = []
    for r in range(par.pp):
        module = engine_module_on_meta(cfg, r)
        params = [p for p in module.parameters() if p.requires_grad]
        if par.zero >= 1:
            got = _zero_bytes(cfg, module, params)
        else:
            elem = params[0].element_size()
            numel = sum(p.numel() for p in params)
            master = 4 if low else elem
            got = {"params": numel * elem, "grads": numel * master,
                   "optim": optimizer_state_bytes(cfg, params, master)
                   + (numel * 4 if low else 0)}
        out.append({k: int(got[k]) for k in ("params", "grads", "optim")})
    return out


# --------------------------------------------------------------------------- activations


def _sizes(cfg: Config) -> dict:
    from scaletrain.config.sizes import ffn_size, kv_heads

    m, par, dtype = cfg.model, cfg.parallel, cfg.train.dtype
    t = par.tp
    low = dtype in LOW
    e = _TORCH[dtype].itemsize
    nkv, hd = kv_heads(m), m.d_model // m.n_heads
    cp = par.cp if par.cp > 1 else 1  # context parallelism: a rank holds T / cp positions of every sequence
    return dict(
        n=cfg.train.micro_batch * m.seq_len // cp, T=m.seq_len, Tl=m.seq_len // cp, cp=cp,
        ring=cp > 1 and par.cp_mode == "ring", ulysses=cp > 1 and par.cp_mode == "ulysses",
        c=m.d_model, f=ffn_size(m), nh=m.n_heads,
        hd=hd, t=t, sp=par.sequence_parallel and t > 1, e=e, low=low,
        # grouped-query attention (q and kv projections): the key (and value) width as the division by t sees it,
        # kv heads x hd x t / min(t, kv heads) (a kv head is copied on t / kv heads ranks when t is larger)
        gqa=nkv != m.n_heads, kv=nkv * hd * t // min(t, nkv),
        e32=4 if low else e,  # layer-norm inputs and statistics, attention log-sum-exp, loss: fp32 when low
        bias=int(m.bias), V=m.vocab_size, Vt=(t * math.ceil(m.vocab_size / t)) // t,
        autocast=cfg.train.precision == "autocast-bf16",
    )


def autocast_layer_saved_bytes(cfg: Config, recompute: str = "none") -> int:
    """`layer_saved_bytes` under train.precision=autocast-bf16 (tp = 1, dropout 0; `predicts_activations`).

    The residual stream stays fp32: per token the two norms' inputs (2c) and statistics (4) in fp32, then each
    linear layer's input is cast to bf16 and that copy is saved (c for qkv, c for the GELU MLP's fc; SwiGLU's gate
    and up cast it twice: activation casts are not cached); in bf16 the qkv output (3c), the attention output (c,
    the projection's input), the MLP's 2f (GELU) or 4f (SwiGLU); the flash kernel's log-sum-exp in fp32 (nh).
    Per block and micro-batch the bf16 copy of every weight that autocast caches for the forward (attention 4c²,
    MLP 2cf or 3cf). RoPE: rotated q and k plus the projection's input copy (3c) and the cos/sin tables, in bf16.
    Grouped-query attention: q and kv outputs (c + 2kv) for the qkv output, one more cast of the input (q and kv
    each cast it), the weights' copies 2c² + 2kv·c for 4c², RoPE's extra `_rope_extra`.
    Full / every:k recomputation keeps the fp32 block input only."""
    s = _sizes(cfg)
    n, c, f, nh, gqa, kv = s["n"], s["c"], s["f"], s["nh"], s["gqa"], s["kv"]
    if recompute in ("full", "every"):
        return n * c * 4
    swiglu = cfg.model.mlp == "swiglu"
    casts = (3 if swiglu else 2) + gqa  # grouped-query attention: q and kv cast the input each
    replicated = n * (2 * c * 4 + 4 * 4 + casts * c * 2)
    core = (c + 2 * kv if gqa else 3 * c) * 2 + c * 2 + (0 if recompute == "attn-core" else nh * 4)
    split = n * (core + (4 if swiglu else 2) * f * 2)
    weights = 2 * ((2 * c + 2 * kv if gqa else 4 * c) * c + (3 if swiglu else 2) * c * f)
    total = replicated + split + weights
    if cfg.model.position == "rope":
        total += n * _rope_extra(s, False, recompute) * 2 + 2 * s["T"] * s["hd"] * 2
    return total


def _rope_extra(s: dict, dropout: bool, recompute: str) -> int:
    """Elements per token (split over tp) that RoPE adds to a block's saved tensors: the rotated q and k and the
    projection's input, now a copy of the attention output (rotated q is contiguous per head) unless selective
    recomputation drops the latter; with grouped-query attention the q projection's output is no longer saved (only
    the rotation reads it), while the kv output still is (v is a view of it). With the math kernel or the explicit
    attention (dropout) the rotated q and k replace what was saved anyway: nothing."""
    if dropout and recompute != "attn-core":
        return 0
    copy = 0 if recompute == "attn-core" else s["c"]
    return s["kv"] + copy if s["gqa"] else 2 * s["c"] + copy


def layer_saved_bytes(cfg: Config, recompute: str = "none") -> int:
    """Bytes one transformer block saves for backward for one microbatch, as our GPT does it.

    Per token, elements (e bytes each; t = tp, divided by t for the split tensors and, with sequence
    parallelism, for all of them):
      replicated: ln1 and ln2 inputs (2c; fp32 copies under bf16/fp16, FP32LayerNorm), their mean and
      rstd (4, fp32 under bf16/fp16), the qkv and MLP inputs (2c; with sp the shards the column layers
      keep, Korthikanti Sec. 4.2.2);
      split over tp: the qkv output (3c: q, k, v are views of it; grouped-query attention: the q and kv outputs,
      c + 2 kv, kv = n_kv_heads x hd, a copied kv head counted on each rank holding it), the attention output (c,
      also the projection's input), the log-sum-exp of the flash kernel (nh; fp32 under bf16/fp16), the MLP's
      2f (GELU: fc output and GELU output) or 4f (SwiGLU: gate, SiLU, up, product).
    Per block and microbatch under bf16/fp16: the fp32 copies of the two norms' weights (and biases).
    RoPE: rotated q and k plus the projection's input, now a copy (3c per token, split; `_rope_extra` for
    grouped-query attention and selective recomputation), and the cos/sin tables cast to the activation dtype,
    (T x hd/2) x 4 (in fp64 the shared float64 tables instead,
    counted once per stage forward, `rope_table_bytes`). Dropout > 0 switches the CPU attention to the
    math kernel, which saves scaled copies of q, k, v (3c), the probabilities, their mask and the dropped
    probabilities (3 nh T per token; fp32 under bf16/fp16) and no log-sum-exp; the two residual dropouts
    save their masks (2c).

    `recompute`: `full` keeps the block input only (the block is a checkpoint); `selective` recomputes
    the attention core, which drops the log-sum-exp; `every:k` is accounted for per segment by the caller.
    """
    if cfg.parallel.tp_mode != "1d" and cfg.parallel.tp > 1:  # 2d / 2.5d / 3d
        return tp_nd_memory.layer_saved_bytes(cfg, recompute)
    s = _sizes(cfg)
    if s["autocast"]:
        return autocast_layer_saved_bytes(cfg, recompute)
    n, c, f, nh, t, e, e32 = s["n"], s["c"], s["f"], s["nh"], s["t"], s["e"], s["e32"]
    qkv = c + 2 * s["kv"] if s["gqa"] else 3 * c  # the projections' outputs q, k, v are views of
    rep = t if s["sp"] else 1
    if recompute in ("full", "every"):
        if cfg.memory.offload_activations:
            return 0
        numel = n * c // rep
        if cfg.memory.partition_checkpoints and t > 1:
            numel = t * math.ceil(numel / t) // t  # this rank's padded slice
        return numel * e
    mlp = (4 if cfg.model.mlp == "swiglu" else 2) * f
    dropout = cfg.model.dropout > 0
    glob = cfg.model.dropout_impl == "global"  # layout-independent masks: bool, explicit attention
    mask = 1 if glob else e  # bytes per element of a saved dropout mask (torch's CPU dropout keeps x's dtype)
    # ring attention applies its dropout masks inside its blocks and keeps what a flash kernel keeps (cp_memory.py)
    explicit = dropout and glob and recompute != "attn-core" and not s["ring"]
    if explicit:
        # explicit attention: q, k, v (views of the qkv output, 3c), the probabilities, their bool mask and the
        # dropped probabilities (nh T each); the causal mask (T x T bool, per block, below); projection input (c)
        core = 3 * c * e + nh * s["T"] * (2 * e + 1) + c * e
    elif dropout and recompute != "attn-core" and not s["ring"]:
        # math kernel (fp32 under bf16/fp16): scaled q, k and v copies (3c), the probabilities, their
        # dropout mask and the dropped probabilities (3 nh T); no log-sum-exp; the projection's input is
        # a copy of the output (c)
        core = 3 * c * e32 + 3 * nh * s["T"] * e32 + c * e
    else:
        core = qkv * e + c * e + (0 if recompute == "attn-core" else nh * e32)
    core += cp_core_extra(s, explicit, recompute)
    replicated = n * (2 * c * e32 + 4 * e32 + 2 * c * e) // rep
    split = n * (core + mlp * e) // t
    total = replicated + split + (s["T"] ** 2 if explicit else 0)
    if s["low"]:
        total += 2 * (1 + s["bias"]) * c * 4
    if dropout:
        total += n * 2 * c * mask // rep  # the masks of the two residual dropouts
    if cfg.model.position == "rope":  # rotated q and k, the projection's input a copy (`_rope_extra`); the cos/sin
        tables = 0 if e == 8 else 2 * s["Tl"] * s["hd"] * e  # tables cast to the activations' dtype (this rank's)
        # ring attention runs the flash kernel's blocks even with dropout; Ulysses keeps no extra (cp_memory.py)
        rope = _rope_extra(s, dropout and not s["ring"], recompute)
        total += n * (rope if recompute == "attn-core" else cp_rope_extra(s, rope)) * e // t + tables
    if cfg.memory.offload_activations:
        # recompute none: every saved tensor with autograd history goes to the host; the norms' statistics
        # and the log-sum-exp (outputs without a gradient) and the rope tables stay
        lse = 0 if dropout or recompute == "attn-core" else nh * e32
        return n * 4 * e32 // rep + n * lse // t + (tables if cfg.model.position == "rope" else 0)
    return total


def outside_saved_bytes(cfg: Config, first: bool, last: bool, tied_copy: bool) -> int:
    """What one microbatch saves outside the blocks on a stage holding the embeddings (`first`) and/or
    the head and loss (`last`).

    First: the token ids (without tp the embedding saves the view of the loader's int64 batch of the
    whole global batch, (global_batch, seq_len + 1); with tp the local ids and the out-of-range mask,
    9 bytes per token), the positions (int64 arange, learned positions). Last: ln_f input and statistics
    (and fp32 weight copies under bf16/fp16), the head input, then the loss: without tp the log-softmax
    (V per token, fp32 or wider), the flattened targets (int64) and the total weight (a scalar); with tp
    the local softmax (V'/t per token), the local targets (int64) and their mask (bool). A pipeline's
    last stage that does not hold the embedding saves its copy of the tied weight (a buffer, not a
    parameter) per microbatch."""
    if cfg.parallel.tp_mode != "1d" and cfg.parallel.tp > 1:  # 2d / 2.5d / 3d
        return tp_nd_memory.outside_saved_bytes(cfg, first, last, tied_copy)
    s = _sizes(cfg)
    n, c, t, e, e32 = s["n"], s["c"], s["t"], s["e"], s["e32"]
    rep = t if s["sp"] else 1
    total = 0
    if first:
        if t > 1:
            total += 9 * n
        else:
            total += loader_ids_bytes(cfg, s)
        if cfg.model.position == "learned":
            total += 8 * s["Tl"]
        if cfg.model.dropout > 0:  # the embedding dropout's mask (bool with the global implementation)
            total += n * c * (1 if cfg.model.dropout_impl == "global" else e) // rep
    if last and s["autocast"]:  # fp32 ln_f; the head's bf16 input and weight copies; the loss on fp32 logits
        total += n * (c * 4 + 2 * 4 + c * 2) + s["V"] * c * 2 + n * s["V"] * 4 + 8 * n + 4
    elif last:
        total += n * (c * e32 + 2 * e32 + c * e) // rep
        if s["low"]:
            total += (1 + s["bias"]) * c * 4
        if t > 1:
            total += n * s["Vt"] * e32 + 9 * n
        else:
            total += n * s["V"] * e32 + loader_targets_bytes(cfg, s) + e32
        if tied_copy:
            total += s["Vt"] * c * e
    return total


def moe_layer_extra_bytes(cfg: Config) -> int:
    """Bytes an MoE block saves for one microbatch beyond the dense block of `layer_saved_bytes` (negative
    when smaller): our `model.moe.MoE` replaces the MLP (its 2f or 4f per token go) by, per microbatch of
    n = G·S tokens in G dispatch groups of S, with E experts, K capacity slots, k choices per token,
    e bytes per element and r = the router's (fp32, fp64 in fp64 runs):

    - router: logits and softmax probabilities (G, S, E) and the log-sum-exp of the z-loss (G, S), r each;
      under bf16/fp16 the fp32 copies of the input (n, C) and of the router weight (C, E) (the block's
      MLP input in the activation dtype is then not saved: the dispatch gathers from a padded copy);
    - token choice (topk, switch): the chosen experts and their scatter indices (2 k n int64), the
      f_i of the balancing loss (G, E; r), the slot tokens (G, E K + 1) int64 and the slot weights
      (G, E K + 1; r, or a (G, E, K) copy in e under bf16/fp16); topk also its gate softmax (n k; r);
    - expert choice: the chosen tokens (G, E, K) int64 and their weights (G, E, K; r, or e when cast);
    - dispatch and experts: the padded input (G, S + 1, C), the dispatched slots reshaped (E, G K, C),
      the expert hidden 2 (GELU) or 4 (SwiGLU) x (E, G K, F) and the expert output (E, G, K, C), e each.

    Exact for dropout 0 without router noise or random routing (`predicts_activations`); expert
    parallelism moves the same slots (the all-to-all saves nothing), tp replicates the layer, and under sequence
    parallelism each tp rank runs it on the n / t tokens of its shard."""
    from scaletrain.config.sizes import capacity, experts_per_token

    s, m = _sizes(cfg), cfg.model
    moe = m.moe
    e, c, f, n = s["e"], s["c"], s["f"], s["n"]
    dense_mlp = n * (4 if m.mlp == "swiglu" else 2) * f * e // s["t"]  # what the dense block's MLP saved
    if s["sp"]:
        n //= s["t"]  # sequence parallelism: each rank routes the tokens of its sequence shard
    r = max(e, 4)
    E, S = moe.experts, moe.group_tokens
    G = n // S
    k = experts_per_token(moe)
    K = capacity(S, E, k, moe.capacity_factor)
    hidden = 4 if m.mlp == "swiglu" else 2
    total = r * (2 * n * E + n)
    if s["low"]:
        total += 4 * n * c + 4 * c * E - n * c * e
    if moe.router == "expert_choice":
        total += 8 * G * E * K + (e if s["low"] else r) * G * E * K
    else:
        total += 16 * n * k + r * G * E + 8 * G * (E * K + 1)
        total += e * G * E * K if s["low"] else r * G * (E * K + 1)
        if moe.router == "topk":
            total += r * n * k
    total += e * (G * (S + 1) * c + 2 * E * G * K * c + hidden * E * G * K * f)
    return total - dense_mlp


def op_kept_bytes(cfg: Config, moe: bool = False) -> int:
    """What recompute=ops:<kinds> keeps in torch's selective-checkpoint cache for one block and microbatch beyond
    the block input (memory/op_policy.py): the outputs of its matmuls and / or fused attention kernels.

    `matmul`, per token (n per microbatch; t = tp): the column-parallel outputs (qkv 3c, the MLP's f or SwiGLU's 2f)
    split over t; the two row-parallel outputs, c each and whole (the partial sums, all-reduced in place or
    reduce-scattered into another tensor; under sp still the full sequence); with dropout in training the unfused
    attention's q kᵀ (nh T) and its product with v (c), split over t: in the activation dtype with the
    layout-independent masks, in fp32 or wider with torch's math kernel. Autocast-bf16: every matmul output in bf16.
    An MoE block replaces the MLP's (its f or 2f, and c) by the router's logits (n x E, fp32 or wider; n / t tokens
    per rank under sp) and the experts' batched matmuls: hidden (E, G K, F) once (GELU) or twice (SwiGLU) and the
    output (E, G K, C). `attention` (dropout 0): the fused kernel's output (c) and log-sum-exp (nh; fp32 under
    bf16/fp16), split over t."""
    from scaletrain.config.parse import parse_recompute
    from scaletrain.config.sizes import capacity, experts_per_token

    ops = parse_recompute(cfg.memory.recompute).ops
    s, m = _sizes(cfg), cfg.model
    n, c, f, nh, t, e32 = s["n"], s["c"], s["f"], s["nh"], s["t"], s["e32"]
    e = 2 if s["autocast"] else s["e"]
    mlp = 2 * f if m.mlp == "swiglu" else f
    dropout = m.dropout > 0
    total = 0
    if "matmul" in ops:
        total += n * (3 * c // t + c) * e  # qkv, the attention's projection
        if dropout:  # unfused attention: scores and their product with v
            total += n * (nh * s["T"] + c) // t * (e if m.dropout_impl == "global" else e32)
        if moe:
            E, S = m.moe.experts, m.moe.group_tokens
            tokens = n // t if s["sp"] else n
            G, k = tokens // S, experts_per_token(m.moe)
            K = capacity(S, E, k, m.moe.capacity_factor)
            total += tokens * E * max(e, 4) + E * G * K * (mlp + c) * e
        else:
            total += n * (mlp // t + c) * e  # the MLP's column and row layers
    if "attention" in ops and not dropout:
        total += n * (c * e + nh * e32) // t
    return total


def _block_bytes(cfg: Config, lo: int, hi: int) -> int:
    """Saved bytes of blocks lo..hi-1 (global indices) for one microbatch (MoE blocks counted as such)."""
    from scaletrain.config.parse import parse_recompute
    from scaletrain.config.sizes import is_moe_layer

    mode = parse_recompute(cfg.memory.recompute)
    if mode.kind == "every":
        return math.ceil((hi - lo) / mode.k) * layer_saved_bytes(cfg, "every")
    moe = [_experts(cfg) > 0 and is_moe_layer(cfg.model, i) for i in range(lo, hi)]
    if mode.kind == "ops":
        return (hi - lo) * layer_saved_bytes(cfg, "full") + sum(op_kept_bytes(cfg, x) for x in moe)
    if mode.kind == "nth":  # blocks 0, k, 2k, ... are full checkpoints, the others keep everything
        kept = [i % mode.k != 0 for i in range(lo, hi)]
        return sum(layer_saved_bytes(cfg, "none") + (moe_layer_extra_bytes(cfg) if x else 0) if keep
                   else layer_saved_bytes(cfg, "full") for keep, x in zip(kept, moe))
    total = (hi - lo) * layer_saved_bytes(cfg, mode.kind)
    if mode.kind != "full" and any(moe):
        total += sum(moe) * moe_layer_extra_bytes(cfg)
    return total


def chunk_saved_bytes(cfg: Config, stage: int, lo: int, hi: int) -> int:
    """Saved bytes of one microbatch through global pipeline stage `stage` holding blocks lo..hi-1."""
    S = cfg.parallel.pp * cfg.parallel.virtual_stages
    first, last = stage == 0, stage == S - 1
    tied_copy = last and not first and cfg.model.tie_embeddings and cfg.parallel.pp > 1 and \
        0 not in stage_ids(cfg, (S - 1) % cfg.parallel.pp)
    if cfg.model.reversible:
        return reversible_chunk_bytes(cfg, last) + outside_saved_bytes(cfg, first, last, tied_copy)
    return _block_bytes(cfg, lo, hi) + outside_saved_bytes(cfg, first, last, tied_copy) + \
        rope_table_bytes(cfg, lo, hi)


def reversible_chunk_bytes(cfg: Config, last: bool) -> int:
    """What a chunk of reversible blocks keeps for one microbatch, whatever its depth (model/reversible.py): its
    last output, the stream (B, T, C) (a sequence shard with sp), from which backward rebuilds every block's
    input; nothing per block (the forward runs without autograd, RoPE tables included). On the last stage in
    fp32 / fp64 the final norm saves that same tensor as its input (counted in `outside_saved_bytes`); under
    bf16 / fp16 the norm saves an fp32 copy instead, so the output counts as well."""
    s = _sizes(cfg)
    if last and not s["low"]:
        return 0
    return s["n"] * s["c"] * s["e"] // (s["t"] if s["sp"] else 1)


def rope_table_bytes(cfg: Config, lo: int = 0, hi: int = 1) -> int:
    """RoPE's float64 cos/sin tables (T x hd/2 each), computed once per forward of a stage and saved
    as such in fp64 (no cast), shared by every block of blocks lo..hi-1 that is not a checkpoint; block checkpoints
    (full, every:k, ops:..., nth:k's blocks 0, k, 2k, ...) do not keep them."""
    from scaletrain.config.parse import parse_recompute

    if cfg.model.position != "rope" or _sizes(cfg)["e"] != 8:
        return 0
    mode = parse_recompute(cfg.memory.recompute)
    if mode.kind in ("none", "attn-core") or (mode.kind == "nth" and any(i % mode.k for i in range(lo, hi))):
        return 8 * _sizes(cfg)["Tl"] * (cfg.model.d_model // cfg.model.n_heads)
    return 0


def activation_bytes(cfg: Config) -> int:
    """`mem_activations` of the run: the max over pipeline ranks of the peak, over the schedule's order,
    of the saved bytes of the (microbatch, chunk) pairs held (the executor measures it so on the first
    step); without pipeline parallelism one microbatch through the whole model."""
    return max(activation_bytes_per_stage(cfg))


def activation_bytes_per_stage(cfg: Config) -> list[int]:
    """`activation_bytes` of each pipeline rank (one entry without pipeline parallelism)."""
    par = cfg.parallel
    if par.pp == 1:
        return [chunk_saved_bytes(cfg, 0, 0, cfg.model.n_layers) if cfg.model.n_layers else 0]
    from scaletrain.parallel.pipeline.schedules import Op, build_schedule, unfold

    bounds = pipeline_partition(cfg).bounds
    m = par.microbatches or cfg.grad_accum
    out = []
    for r, folded in enumerate(build_schedule(par.schedule, par.pp, m, par.virtual_stages)):
        actions = unfold(folded)  # DualPipeV's overlapped slot: its forward, then its backward
        ids = stage_ids(cfg, r)
        per_chunk = [chunk_saved_bytes(cfg, s, *bounds[s]) for s in ids]
        split = {(a.microbatch, a.chunk) for a in actions if a.op is Op.BACKWARD_WEIGHT}
        held = peak = 0
        for a in actions:
            if a.op is Op.FORWARD:
                held += per_chunk[a.chunk]
                peak = max(peak, held)
            elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) or (
                    a.op is Op.BACKWARD_INPUT and (a.microbatch, a.chunk) not in split):
                held -= per_chunk[a.chunk]
        out.append(peak)
    return out


def predicts_activations(cfg: Config) -> bool:
    """Whether `activation_bytes` models this run: not with activation compression, FP8 layers or torch.compile, not
    under autocast-bf16 with tp > 1, dropout or activation offload, nor for MoE layers with router noise, random
    routing, expert dropout, the hierarchical gate or the importance loss (their extra saved tensors are not
    counted)."""
    if cfg.memory.compress != "none":
        return False
    if cfg.train.precision == "fp8":
        return False  # the FP8 layers' saved tensors are not modelled here (the planner's FP8 term: plan/analytic)
    if cfg.train.compile:
        return False  # inductor's fused kernels save other tensors than eager ops
    m, mem = cfg.model, cfg.memory
    if cfg.train.precision == "autocast-bf16" and (cfg.parallel.tp > 1 or m.dropout > 0 or mem.offload_activations):
        return False  # autocast modelled without tensor parallelism, dropout and activation offload (docs/gpu.md)
    moe = cfg.model.moe
    if _experts(cfg) and (moe.groups > 1 or moe.aux_loss != "switch"):
        return False  # the hierarchical gate's and the importance loss's saved tensors are not modelled
    return not _experts(cfg) or (moe.router_noise == 0 and not moe.random_routing and moe.expert_dropout == 0)


# --------------------------------------------------------------------------- the prediction the trainer logs


def implementation_activation_bytes(m: ModelSpec, batch: int, elem: int) -> float:
    """Bytes our `scaletrain.model.gpt.GPT` saves for backward for one forward of `batch` sequences
    (distinct storages seen by `saved_tensors_hooks`, parameters excluded) when the token ids are one
    (batch, seq_len) int64 tensor that is also the target: the count of `activation_bytes` for a plain
    single-process forward, without the trainer's loader batch. `elem` is 4 (fp32), 8 (fp64) or 2 (bf16)."""
    cfg = Config(model=ModelConfig(
        n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=m.seq_len, vocab_size=m.vocab_size,
        d_ff=m.d_ff, mlp=m.mlp, position=m.position, tie_embeddings=m.tie_embeddings, bias=m.bias,
        dropout=0.1 if m.dropout else 0.0, n_kv_heads=m.n_kv_heads, qkv_bias=m.qkv_bias))
    cfg.train.dtype = {4: "fp32", 8: "fp64", 2: "bf16"}[elem]
    cfg.train.micro_batch = cfg.train.global_batch = batch
    loader_batch = 8 * batch * (m.seq_len + 1)  # the trainer's ids are views of it; here ids are targets
    return activation_bytes(cfg) - loader_batch


def predict_run(cfg: Config) -> dict:
    """The planner's memory prediction for a scaletrain run config, per rank, in bytes: what the trainer
    will log as `mem_params`, `mem_grads`, `mem_optim` (exact to the byte, for every layout the engine
    runs: dp, ZeRO 0-3 with padding and offload, tp with the padded vocabulary, pp stages, fp32 / fp64 /
    bf16 / fp16 with fp32 masters and gradient buffers, AdamW / Adafactor / SM3) and `mem_activations`
    (exact without dropout, within 10% with it; left out with activation compression, which is not
    modelled, and for MoE layers with router noise, random routing or expert dropout). MoE layers: exact
    for every router, dtype and layout (`moe_layer_extra_bytes`). See the module docstring.
    """
    states = model_state_bytes(cfg)
    out = {f"plan_mem_{k}": int(v) for k, v in states.items()}
    gathered = gathered_param_bytes(cfg, [engine_module_on_meta(cfg, r) for r in range(cfg.parallel.pp)]) \
        if cfg.parallel.zero == 3 else None
    if gathered is not None:
        out["plan_mem_params_gathered"] = gathered
    if predicts_activations(cfg):
        out["plan_mem_activations"] = int(activation_bytes(cfg))
    out.update(stash_bytes(cfg, model_state_bytes_per_stage(cfg)))  # PipeDream's stashed weight versions
    return out
