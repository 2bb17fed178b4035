"""Memory per GPU by category: parameters, gradients, optimizer states, activations and buffers of the most
loaded rank.

- Model states per ZeRO stage (Rajbhandari et al., arXiv 1910.02054 Sec. 5: (2+2+K)Psi, Pos 4Psi + K Psi/Nd,
  Pos+g 2Psi + (2+K)Psi/Nd, Pos+g+p (2+2+K)Psi/Nd; expert parameters shard over dp/ep); offload moves the
  optimizer state (and with ZeRO-3 the parameters) off the GPU (ZeRO-Offload arXiv 2101.06840, ZeRO-Infinity
  arXiv 2104.07857). Adafactor / SM3 keep their factored statistics whole on every rank.
- Activations per layer from Korthikanti et al. (arXiv 2205.05198 eqs. 1-6: sbh(34 + 5as/h) without
  parallelism, sbh(10 + 24/t + 5as/(ht)) with tp, sbh/t (34 + 5as/h) with tp + sp, 34 sbh/t with selective
  recompute, 2sbh(/t) per layer with full recompute), written term by term so that SwiGLU, GQA, dropout-free
  models, flash attention and fp32 elements follow; mixture-of-experts layers (GShard arXiv 2006.16668) save
  their dispatched slots; times the microbatch-chunks each pipeline rank holds (`stages.peak_chunk_bytes`).
- Buffers: ZeRO-3's gathered layers, DDP buckets, pipeline send/recv buffers, the reserved CUDA context and
  workspaces, and allocator fragmentation (ZeRO-R's M_D).
"""

from __future__ import annotations

import functools
import math

from scaletrain.optim.registry import optimizer_spec
from scaletrain.plan.analytic import context
from scaletrain.plan.analytic.inputs import DTYPES, Assumptions, Layout, Recompute, Training, recompute_policy
from scaletrain.plan.analytic.params import StageParams, block_kinds, factored_statistics, param_counts
from scaletrain.plan.analytic.stages import Stages, inflight_count, is_moe_block, peak_chunk_bytes
from scaletrain.plan.catalog import ModelSpec


@functools.lru_cache(maxsize=4096)
def layer_activation_bytes(m: ModelSpec, tokens: float, t: int, sp: bool, recompute: str, attention: str,
                           elem: int) -> float:
    """Bytes one layer keeps for backward for `tokens` tokens of one microbatch (Korthikanti eq. 1-6).

    Term by term (e = bytes per element, masks 1 byte, per token): replicated over tp unless sp:
    ln1 input e.h, qkv input e.h, ln2 input e.h, mlp input e.h, two dropout masks h;
    split over tp: Q,K e(h+kv), V e.kv, attention output e.h, MLP 2e.f (gelu: fc out, gelu out;
    swiglu: 4e.f); attention core (standard, split over tp): softmax e.as, dropout mask as, dropout
    output e.as. With e=2, f=4h, kv=h and dropout this is exactly sbh(10 + 24/t + 5as/(ht)).
    """
    h, f, a, s = m.width, m.ffn, m.n_heads, m.seq_len
    kv = m.kv_heads * m.head_dim
    drop = 1 if m.dropout else 0
    if recompute == "full":
        return elem * h * tokens / (t if sp else 1)  # the block input only (2sbh in 16-bit)
    mlp_elems = (4 if m.mlp == "swiglu" else 2) * f
    rep = 4 * elem * h + 2 * drop * h
    split = elem * (h + 2 * kv) + elem * h
    if attention == "standard" and recompute != "attn-core":
        core = (elem * (1 + drop) + drop) * a * s
    else:
        core = 4 * a  # flash attention / attn-core: only the fp32 log-sum-exp per head and token
    dense = tokens * ((rep / t if sp else rep) + (split + core) / t)
    frac = m.n_moe_layers / m.n_layers
    moe = frac * moe_layer_bytes_per_token(m, elem) / (t if sp else 1)  # sp: each tp rank routes its shard
    return dense + tokens * ((1 - frac) * elem * mlp_elems / t + moe)


@functools.lru_cache(maxsize=4096)
def ops_kept_bytes(m: ModelSpec, tokens: float, t: int, sp: bool, ops: frozenset[str], attention: str,
                   elem: int) -> float:
    """What `recompute=ops:<kinds>` keeps of one block beyond its input, for `tokens` tokens of one microbatch: the
    outputs of the listed op kinds (the engine's memory/op_policy.py; `plan.exact.run_memory.op_kept_bytes` counts our
    block exactly). `matmul`, per token: the column-parallel outputs (q, k, v: h + 2kv; the MLP's f, or 2f for
    SwiGLU) split over tp, the two row-parallel outputs (h each) whole - the partial sums the all-reduce (or, with
    sequence parallelism, the reduce-scatter) reads; with standard attention the scores (a s) and their product with
    v (h), split over tp; an MoE block keeps the router's logits (E, fp32) and the experts' hidden and output per
    slot in place of the MLP's. `attention` (flash): the kernel's output (h) and fp32 log-sum-exp (a), split over
    tp."""
    h, f, a, s = m.width, m.ffn, m.n_heads, m.seq_len
    kv = m.kv_heads * m.head_dim
    mlp = (2 if m.mlp == "swiglu" else 1) * f
    frac = m.n_moe_layers / m.n_layers
    kept = 0.0
    if "matmul" in ops:
        kept += elem * ((h + 2 * kv) / t + h)  # q, k, v and the attention's projection
        if attention == "standard":
            kept += elem * (a * s + h) / t
        moe = m.n_experts * max(elem, 4) / (t if sp else 1) + m.expert_slots_per_token * (mlp + h) * elem
        kept += (1 - frac) * elem * (mlp / t + h) + (frac * moe if m.n_experts else 0.0)
    if "attention" in ops and attention == "flash":
        kept += (elem * h + max(elem, 4) * a) / t
    return tokens * kept


def moe_layer_bytes_per_token(m: ModelSpec, elem: int) -> float:
    """What an MoE layer saves in place of the MLP's hidden activations, per token (replicated over tp):
    per expert slot (capacity_factor x k of them) the dispatched input, the expert hidden (2f or 4f) and
    the expert output; per token a padded copy of the input, the router's fp32 logits and probabilities
    and log-sum-exp (2E + 1), and 2k int64 indices (chosen experts, slots). `plan.exact.run_memory.
    moe_layer_extra_bytes` counts our layer's tensors exactly (with the slot tables' rounding)."""
    r = max(elem, 4)
    slots = m.expert_slots_per_token
    hidden = (4 if m.mlp == "swiglu" else 2) * m.ffn
    return slots * elem * (hidden + 2 * m.width) + elem * m.width + r * (2 * m.n_experts + 1) + 16 * m.top_k


def optimizer_bytes(m: ModelSpec, train: Training) -> tuple[float, float]:
    """(bytes per parameter sharded by ZeRO, bytes per parameter kept whole on every rank) of the
    optimizer state. AdamW: K = 12 under bf16/fp16 (fp32 master, m, v; ZeRO paper), 2x the element size
    otherwise. Adafactor / SM3: the fp32 master under bf16/fp16, an optional first moment, and their
    factored statistics (replicated)."""
    pb, _, _, k_default = DTYPES[train.dtype]
    if train.optimizer_k is not None:
        return train.optimizer_k, 0.0
    if not optimizer_spec(train.optimizer).factored:  # AdamW: K of the dtype
        return k_default, 0.0
    state = 4 if pb == 2 else pb
    master = 4 if pb == 2 else 0
    return master + state * train.first_moment, state * factored_statistics(m)


def memory_model_states(psi: float, dp: int, zero: int, param_b: float = 2, grad_b: float = 2,
                        k: float = 12, psi_expert: float = 0.0, edp: int = 1) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per device under ZeRO stage `zero` (arXiv 1910.02054 Sec. 5.1).

    Expert parameters are replicated over `edp` = dp / ep ranks only, so they shard over edp.
    """
    def shard(n: float, on: bool) -> float:
        return psi / dp + psi_expert / edp if on else n

    full = psi + psi_expert
    params = shard(full, zero >= 3) * param_b
    grads = shard(full, zero >= 2) * grad_b
    optim = shard(full, zero >= 1) * k
    return params, grads, optim


def rank_activation_bytes(m: ModelSpec, train: Training, lay: Layout, mbs: int, st: Stages) -> list[float]:
    """Activation bytes one rank of every group of pipeline ranks (`Stages.groups`) holds at its peak: its chunks'
    blocks under the checkpointing policy times the microbatch-chunks the schedule keeps on it
    (`stages.peak_chunk_bytes`), plus the blocks a checkpoint brings back whole while they are recomputed; on the
    first stage the embedding output (+ dropout mask) per in-flight microbatch, on the last the final norm and head
    inputs plus fp32 logits for the loss, 4sbv/t (Korthikanti Sec. 4.3)."""
    _, _, eb, _ = DTYPES[train.dtype]
    t, p, v, s, h = lay.tp, lay.pp, lay.virtual_stages, m.seq_len, m.d_model
    tokens = lay.micro_batch * s / lay.cp  # context parallelism: a rank holds T / cp tokens (context.py)
    # (the grid modes split every activation over the t ranks: Korthikanti's fully partitioned form, as with sp)
    sp = lay.sequence_parallel or lay.tp_mode != "1d"
    attention = context.attention_kind(lay, train.attention)  # cp: the kernel the ring / Ulysses core runs
    sp_div = t if sp else 1
    pol = recompute_policy(lay.recompute)
    kinds = block_kinds(m)  # dense, MoE block
    kept = [_block_bytes(x, tokens, t, sp, pol, attention, eb) for x in kinds]  # a block that is kept
    whole = [layer_activation_bytes(x, tokens, t, sp, "none", attention, eb) for x in kinds]
    ckpt = layer_activation_bytes(m, tokens, t, sp, "full", attention, eb)  # a checkpoint's input
    out = []
    for g in st.groups:
        r = g.rank
        if m.reversible:  # a chunk keeps its output stream; one layer's activations live while it is rebuilt
            acts = peak_chunk_bytes(lay.schedule, p, mbs, v, r, [tokens * eb * h / sp_div] * v) + max(kept)
        else:
            chunk_bytes = [_chunk_bytes(m, st, c, pol, kept, ckpt) for c in g.stages]
            acts = peak_chunk_bytes(lay.schedule, p, mbs, v, r, chunk_bytes)
            if pol.kind != "none" and pol.kind != "attn-core":  # the blocks a checkpoint recomputes live whole
                acts += (pol.k if pol.kind == "every" else 1) * max(whole)
        if r == 0:
            acts += tokens * (eb + (1 if m.dropout else 0)) * h / sp_div * min(inflight_count(
                lay.schedule, p, mbs, v, 0), mbs)
        if r == st.last_rank:
            acts += tokens * (2 * eb * h / sp_div + 4 * m.vocab_size / t)
        out.append(acts)
    return out


def _block_bytes(m: ModelSpec, tokens: float, t: int, sp: bool, pol: Recompute, attention: str, elem: int) -> float:
    """What one block keeps for backward under the policy when it is not a whole-block checkpoint of nth:k: the block
    input and the kept op outputs for ops:..., its input for full and every:k, everything else for none/attn-core."""
    if pol.kind == "ops":
        return layer_activation_bytes(m, tokens, t, sp, "full", attention, elem) + ops_kept_bytes(
            m, tokens, t, sp, pol.ops, attention, elem)
    if pol.kind in ("full", "every"):
        return layer_activation_bytes(m, tokens, t, sp, "full", attention, elem)
    return layer_activation_bytes(m, tokens, t, sp, "attn-core" if pol.kind == "attn-core" else "none", attention,
                                  elem)


def _chunk_bytes(m: ModelSpec, st: Stages, stage: int, pol: Recompute, kept: list[float], ckpt: float) -> float:
    """Bytes one microbatch leaves in stage `stage`'s blocks: every:k one input per segment of k blocks (as many as
    the engine's segments of the stage); nth:k block inputs for the blocks 0, k, 2k, ... of the model and whole blocks
    for the others; the other policies `kept` per dense / MoE block."""
    n, moe = st.blocks[stage], st.moe[stage]
    if pol.kind == "every":
        return math.ceil(n / pol.k) * ckpt
    if pol.kind == "nth":
        lo = sum(st.blocks[:stage])
        return sum(ckpt if pol.checkpointed(i) else kept[is_moe_block(m, i)] for i in range(lo, lo + n))
    return (n - moe) * kept[0] + moe * kept[1]


def rank_memory(m: ModelSpec, train: Training, lay: Layout, a: Assumptions, ranks: list[StageParams],
                acts: list[float], mbs: int, stage_ranks: list[int] | None = None) -> dict[str, float]:
    """Bytes per category (and their total) on the most loaded rank: of the pipeline ranks (its parameters `ranks[i]`
    and activations `acts[i]`, pipeline rank `stage_ranks[i]`), the one with the most bytes. PipeDream's stashed
    weight versions (`pipedream.stash_copies` frozen copies of the stage's weights) count as parameters."""
    pb, gb, eb, _ = DTYPES[train.dtype]
    gb, pb = train.grad_bytes or gb, train.param_bytes or pb
    k, k_whole = optimizer_bytes(m, train)
    t, p, h = lay.tp, lay.pp, m.d_model
    dp = lay.dp * lay.cp  # gradients and ZeRO shards over dp x cp (context parallelism)
    edp = dp // lay.ep
    tokens = lay.micro_batch * m.seq_len / lay.cp
    sp_div = t if lay.sequence_parallel or lay.tp_mode != "1d" else 1
    pc = param_counts(m)
    rows = []
    for st, stage_acts in zip(ranks, acts):
        params, grads, optim = memory_model_states(st.dense, dp, lay.zero, pb, gb, k, st.expert, edp)
        if lay.schedule == "pipedream" and stage_ranks is not None:
            from scaletrain.parallel.pipeline.pipedream import stash_copies

            params += stash_copies(p, stage_ranks[len(rows)], lay.vertical_sync) * st.total * pb
        optim += (st.dense + st.expert) * k_whole
        if lay.offload != "none":
            optim = 0.0
        buffers = 0.0
        if lay.zero == 3 and not lay.reshards:  # the stage's parameters all gathered at once (16-bit): with pp for
            buffers += st.total * pb  # the step, without resharding from the end of the forward
            if lay.offload == "params":
                params = 0.0
        elif lay.zero == 3:  # two gathered layers (current + prefetch) in 16-bit
            per_layer = pc.layer_per_rank(t, lay.ep)
            buffers += 2 * per_layer * pb
            if lay.offload == "params":
                params = 0.0
        if lay.offload == "nvme":  # ZeRO-Infinity: only staging buffers stay (offload_costs.resident_bytes)
            from scaletrain.config.sizes import NVME_STEP_CHUNK as STEP_CHUNK

            params = grads = optim = 0.0
            layer_shard = pc.layer_per_rank(t, lay.ep) / dp
            buffers += 3 * layer_shard * (pb + gb) + 3 * min(STEP_CHUNK, layer_shard) * (k + gb)
        if dp > 1 and lay.zero < 3:
            buffers += 2 * a.bucket_bytes
        if p > 1:  # send/recv buffers of one activation each way
            buffers += 2 * tokens * h * eb / sp_div
        rows.append((params, grads, optim, stage_acts, buffers))
    params, grads, optim, act_bytes, buffers = max(rows, key=sum)
    core = params + grads + optim + act_bytes + buffers
    buffers += a.reserved_bytes + a.fragmentation * core
    memory = {"params": params, "grads": grads, "optimizer": optim, "activations": act_bytes,
              "buffers": buffers}
    memory["total"] = sum(memory.values())
    return memory
