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
  their dispatched slots; times the layers in flight of the pipeline schedule (`pipeline.inflight_chunks`).
- Buffers: ZeRO-3's gathered layers, DDP buckets, pipeline send/recv buffers, the reserved CUDA context and
  workspaces, and allocator fragmentation (ZeRO-R's M_D).
"""

from __future__ import annotations

from scaletrain.optim.registry import optimizer_spec
from scaletrain.plan.analytic import context
from scaletrain.plan.analytic.inputs import DTYPES, Assumptions, Layout, Training, recompute_kind
from scaletrain.plan.analytic.params import StageParams, factored_statistics, param_counts
from scaletrain.plan.analytic.pipeline import inflight_chunks
from scaletrain.plan.catalog import ModelSpec


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
    if attention == "standard" and recompute != "selective":
        core = (elem * (1 + drop) + drop) * a * s
    else:
        core = 4 * a  # flash attention / selective: only the fp32 log-sum-exp per head and token
    dense = tokens * ((rep / t if sp else rep) + (split + core) / t)
    frac = m.n_moe_layers / m.n_layers
    moe = frac * moe_layer_bytes_per_token(m, elem) / (t if sp else 1)  # sp: each tp rank routes its shard
    return dense + tokens * ((1 - frac) * elem * mlp_elems / t + moe)


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


def stage_activation_bytes(m: ModelSpec, train: Training, lay: Layout, mbs: int) -> tuple[float, float, float]:
    """(the blocks' activations a rank holds at the schedule's peak, the first stage's extra, the last stage's
    extra): the first stage keeps the embedding output (+ dropout mask) per in-flight microbatch, the last the
    final norm and head inputs plus fp32 logits for the loss, 4sbv/t (Korthikanti Sec. 4.3)."""
    _, _, eb, _ = DTYPES[train.dtype]
    t, p, v, s, h = lay.tp, lay.pp, lay.virtual_stages, m.seq_len, m.d_model
    tokens = lay.micro_batch * s / lay.cp  # context parallelism: a rank holds T / cp tokens (context.py)
    # (the grid modes split every activation over the t ranks: Korthikanti's fully partitioned form, as with sp)
    sp = lay.sequence_parallel or lay.tp_mode != "1d"
    kind, seg = recompute_kind(lay.recompute)
    attention = context.attention_kind(lay, train.attention)
    layer_act = layer_activation_bytes(m, tokens, t, sp, kind, attention, eb)
    layers_per_chunk = m.n_layers / (p * v)
    chunks = inflight_chunks(lay.schedule, p, mbs, v)
    acts = layer_act * layers_per_chunk * chunks / seg  # every:k keeps one input per segment of k blocks
    if kind == "full":  # one segment's full activations live while it is recomputed
        acts += seg * layer_activation_bytes(m, tokens, t, sp, "none", attention, eb)
    sp_div = t if sp else 1
    if m.reversible:  # a chunk keeps its output stream; one layer's activations live while it is rebuilt
        acts = chunks * tokens * eb * h / sp_div + layer_act
    first_extra = tokens * (eb + (1 if m.dropout else 0)) * h / sp_div * min(chunks, mbs)
    last_extra = tokens * (2 * eb * h / sp_div + 4 * m.vocab_size / t)
    return acts, first_extra, last_extra


def rank_memory(m: ModelSpec, train: Training, lay: Layout, a: Assumptions, first: StageParams,
                last: StageParams, mbs: int) -> dict[str, float]:
    """Bytes per category (and their total) on the most loaded rank: of the first and the last pipeline stage
    (parameters `first` and `last`), the one with the most bytes."""
    pb, gb, eb, _ = DTYPES[train.dtype]
    gb, pb = train.grad_bytes or gb, train.param_bytes or pb
    k, k_whole = optimizer_bytes(m, train)
    t, p, h = lay.tp, lay.pp, m.d_model
    dp = lay.dp * lay.cp  # gradients and ZeRO shards over dp x cp (context parallelism)
    edp = dp // lay.ep
    tokens = lay.micro_batch * m.seq_len / lay.cp
    sp_div = t if lay.sequence_parallel or lay.tp_mode != "1d" else 1
    acts, first_extra, last_extra = stage_activation_bytes(m, train, lay, mbs)
    pc = param_counts(m)
    rows = []
    stages = ((first, acts + first_extra + last_extra),) if p == 1 else \
        ((first, acts + first_extra), (last, acts + last_extra))
    for st, stage_acts in stages:
        params, grads, optim = memory_model_states(st.dense, dp, lay.zero, pb, gb, k, st.expert, edp)
        optim += (st.dense + st.expert) * k_whole
        if lay.offload != "none":
            optim = 0.0
        buffers = 0.0
        if lay.zero == 3 and p > 1:  # with pp the stage's parameters stay gathered for the step (16-bit)
            buffers += st.total * pb
            if lay.offload == "params":
                params = 0.0
        elif lay.zero == 3:  # two gathered layers (current + prefetch) in 16-bit
            per_layer = pc.layer_tp / t + pc.layer_rep + pc.layer_expert / lay.ep
            buffers += 2 * per_layer * pb
            if lay.offload == "params":
                params = 0.0
        if lay.offload == "nvme":  # ZeRO-Infinity: only staging buffers stay (offload_costs.resident_bytes)
            from scaletrain.config.sizes import NVME_STEP_CHUNK as STEP_CHUNK

            params = grads = optim = 0.0
            layer_shard = (pc.layer_tp / t + pc.layer_rep + pc.layer_expert / lay.ep) / dp
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
