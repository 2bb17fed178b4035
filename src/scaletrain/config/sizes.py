"""Sizes the model config implies, read by the model, the passes, the planner and validate() alike: the MLP hidden
size (4C for GELU, LLaMA's rounding of 8C/3 for SwiGLU, arXiv 2002.05202 / 2302.13971) and the config of a
reversible block's halves (RevNet, arXiv 1707.04585). Torch-free, like the rest of config/."""

from __future__ import annotations

import dataclasses
import math

from scaletrain.config.schema import ModelConfig


def ffn_size(cfg: ModelConfig) -> int:
    """MLP hidden size: 4C for GELU; for SwiGLU 2/3 of 4C rounded up to a multiple of 64 (LLaMA)."""
    if cfg.d_ff:
        return cfg.d_ff
    if cfg.mlp == "swiglu":
        return 64 * math.ceil(8 * cfg.d_model / 3 / 64)
    return 4 * cfg.d_model


def half_config(cfg: ModelConfig) -> ModelConfig:
    """The config a reversible block's sub-layers are built with: width d_model / 2 (an explicit d_ff is kept)."""
    return dataclasses.replace(cfg, d_model=cfg.d_model // 2)
