"""Sizes the model config implies, read by the model, the passes, the planner and validate() alike: the MLP hidden
size (4C for GELU, LLaMA's rounding of 8C/3 for SwiGLU, arXiv 2002.05202 / 2302.13971), the key/value heads of
grouped-query attention (arXiv 2305.13245), the config of a reversible
block's halves (RevNet, arXiv 1707.04585), the mixture-of-experts layers and expert capacity (GShard, arXiv
2006.16668) and the chunk of ZeRO-Infinity's streamed optimizer step. Torch-free, like the rest of config/."""

from __future__ import annotations

import dataclasses
import math

from scaletrain.config.schema import ModelConfig

NVME_STEP_CHUNK = 1 << 18
"""parallel.offload=nvme: elements of a shard updated at once by the streamed optimizer step (one staging set holds
this many of each state); the engine (parallel/zero_nvme.py) and the planner's formulas read it here."""


def ffn_size(cfg: ModelConfig) -> int:
    """MLP hidden size: 4C for GELU; for SwiGLU 2/3 of 4C rounded up to a multiple of 64 (LLaMA)."""
    if cfg.d_ff:
        return cfg.d_ff
    if cfg.mlp == "swiglu":
        return 64 * math.ceil(8 * cfg.d_model / 3 / 64)
    return 4 * cfg.d_model


def kv_heads(cfg: ModelConfig) -> int:
    """Key/value heads: model.n_kv_heads, or n_heads when it is 0 (multi-head attention; grouped-query attention,
    arXiv 2305.13245, when fewer)."""
    return cfg.n_kv_heads or cfg.n_heads


def is_gqa(cfg: ModelConfig) -> bool:
    """Whether the attention shares key/value heads (separate `q` and `kv` projections instead of the fused `qkv`)."""
    return kv_heads(cfg) != cfg.n_heads


def half_config(cfg: ModelConfig) -> ModelConfig:
    """The config a reversible block's sub-layers are built with: width d_model / 2 (an explicit d_ff is kept)."""
    return dataclasses.replace(cfg, d_model=cfg.d_model // 2)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block `layer` uses an MoE layer: every `every`-th block (GShard: every other one)."""
    return cfg.moe.experts > 0 and (layer + 1) % cfg.moe.every == 0


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]


def capacity(group_tokens: int, experts: int, top_k: int, factor: float) -> int:
    """Slots per expert and group: ceil(factor · k · S / E), at least 1, at most S."""
    return min(group_tokens, max(1, math.ceil(factor * top_k * group_tokens / experts - 1e-9)))


def experts_per_token(moe) -> int:
    """Expert choices per token (k of the capacity): 1 for Switch, top_k² for the two-level hierarchical MoE
    (top_k groups, top_k experts in each; arXiv 1701.06538 appendix B), else top_k."""
    if moe.router == "switch":
        return 1
    return moe.top_k * moe.top_k if moe.groups > 1 else moe.top_k
