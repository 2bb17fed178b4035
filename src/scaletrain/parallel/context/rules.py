"""validate()'s rules for context parallelism (`parallel.cp`, `parallel.cp_mode`; ring attention arXiv 2310.01889,
DeepSpeed-Ulysses arXiv 2309.14509): the sequence and heads it splits, and what it is not made to work with, each
refused with its reason (docs/context_parallel.md; they appear in docs/verify.md's generated refusal table).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.rules import rule
from scaletrain.config.schema import CP_MODES, CP_UNSUPPORTED_RECOMPUTE, Config, or_list


@rule("values")
def cp_mode(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.cp_mode names a mode."""
    if cfg.parallel.cp_mode not in CP_MODES:
        return [f"parallel.cp_mode must be {or_list(CP_MODES)}, got {cfg.parallel.cp_mode!r}"]
    return []


@rule("combinations")
def context_parallel(cfg: Config, world_size: int | None) -> list[str]:
    """What parallel.cp > 1 splits: 2 x cp sequence chunks (ring) or cp chunks and the heads of a tp rank (ulysses),
    each tp rank's sequence-parallel shard, MoE dispatch groups inside a chunk; then `cp_refusals`."""
    m, p = cfg.model, cfg.parallel
    if p.cp <= 1 or p.cp_mode not in CP_MODES:
        return []
    errors = []
    T, cp, tp = m.seq_len, p.cp, p.tp
    chunks = 2 * cp if p.cp_mode == "ring" else cp
    if T % chunks:
        what = "2 x parallel.cp" if p.cp_mode == "ring" else "parallel.cp"
        errors.append(f"parallel.cp_mode={p.cp_mode} splits each sequence into {what} = {chunks} chunks: "
                      f"model.seq_len ({T}) is not divisible by {chunks}")
        return errors
    if p.sequence_parallel and tp > 1 and (T // cp) % tp:
        errors.append(f"parallel.sequence_parallel with parallel.cp ({cp}) needs the tokens of a cp rank, "
                      f"model.seq_len ({T}) / parallel.cp ({cp}) = {T // cp}, divisible by parallel.tp ({tp})")
    if p.cp_mode == "ulysses":
        heads = [("model.n_heads", m.n_heads)]
        kv = getattr(m, "n_kv_heads", 0) or 0  # grouped-query attention (when the model has the field)
        if kv:
            heads.append(("model.n_kv_heads", kv))
        for what, value in heads:
            local = value // min(tp, value)  # a rank's heads (a key/value head is copied when tp exceeds them)
            if value % min(tp, value) == 0 and local % cp:
                per = (f"{what} ({value})" if tp == 1 else f"{what} ({value}) / parallel.tp ({tp}) = {local}"
                       if tp <= value else f"{what} ({value}) copied over parallel.tp ({tp}) leaves 1 per rank, which")
                errors.append(f"parallel.cp_mode=ulysses splits the heads of a rank over parallel.cp ({cp}): {per} "
                              f"is not divisible by {cp}")
    e = m.moe
    if e.experts and e.group_tokens >= 1:
        chunk = T // chunks
        shard = T // (cp * tp) if p.sequence_parallel and tp > 1 else chunk
        if chunk % e.group_tokens or shard % e.group_tokens:
            errors.append(f"parallel.cp ({cp}) with MoE needs model.moe.group_tokens ({e.group_tokens}) to divide the "
                          f"contiguous tokens of a cp rank ({min(chunk, shard)} per chunk): each rank routes the "
                          "dispatch groups of its own tokens")
    return errors + cp_refusals(cfg)


def cp_refusals(cfg: Config) -> list[str]:
    """What parallel.cp > 1 is not made to work with, each refused with its reason."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    why = f"with parallel.cp ({p.cp}) > 1 is not available"
    errors = []
    if p.tp_mode != "1d":
        errors.append(f"parallel.tp_mode={p.tp_mode} {why}: the 2D / 2.5D / 3D grids split the sequence their own way "
                      "(use tp_mode=1d with sequence parallelism)")
    if p.sync != "bsp":
        errors.append(f"parallel.sync={p.sync} {why}: the asynchronous modes replicate whole models per worker")
    if m.dropout > 0 and m.dropout_impl == "torch":
        errors.append(f"model.dropout_impl=torch {why}: the attention blocks of a sequence are spread over ranks, "
                      "use the layout-independent model.dropout_impl=global")
    if t.compile:
        errors.append(f"train.compile=true {why}: the ring's point-to-point messages and Ulysses' all-to-alls inside "
                      "each block break its graph")
    if t.log_noise_scale:
        errors.append(f"train.log_noise_scale {why}: a rank's micro-batch gradient holds only its part of each "
                      "sequence, not a small-batch sample")
    policy = cfg.memory.recompute.split(":")[0]
    if policy in CP_UNSUPPORTED_RECOMPUTE:
        errors.append(f"memory.recompute={cfg.memory.recompute} {why}: the policy's checkpoints around the ring's and "
                      "Ulysses' messages are not modelled nor tested (use none, attn-core, full or every:k)")
    elif p.pp > 1 and p.schedule in ("zb-h1", "zb-v", "dualpipev") and policy in ("full", "every"):
        errors.append(f"parallel.schedule={p.schedule} with memory.recompute={cfg.memory.recompute} {why}: zero "
                      "bubble's weight pass recomputes a checkpointed block once per weight group, sending the "
                      "block's cp messages again each time (use attn-core recomputation or another schedule)")
    if p.schedule == "pipedream":
        errors.append(f"parallel.schedule=pipedream {why}: not proven against PipeDream's one-process version-log "
                      "replay (use 2bw or another schedule)")
    if p.pp > 1 and p.partition == "time":
        errors.append(f"parallel.partition=time {why}: its profile runs one rank's blocks alone, and their attention "
                      "needs the cp peers (use uniform, params or block counts)")
    return errors
