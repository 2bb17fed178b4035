"""Rotary position embeddings (Su et al., "RoFormer", arXiv 2104.09864) with a configurable base and Llama 3.1's
frequency scaling.

Pair i of a head of size hs turns by the angle t·ω_i at position t, with ω_i = θ^(-2i/hs) (`model.rope_theta`,
10000 in RoFormer, 500000 in Llama 3). `model.rope_scaling.type=llama3` (the Hugging Face `rope_type: llama3`, Llama
3.1, Grattafiori et al., arXiv 2407.21783) changes the frequencies before the angles are formed: with L the
pre-training context (`original_max_position_embeddings`), a frequency whose wavelength λ_i = 2π/ω_i exceeds
L / low_freq_factor is divided by `factor`, one whose wavelength is below L / high_freq_factor is kept, and in between
it is interpolated, ω'_i = (1 - s)·ω_i / factor + s·ω_i with s = (L / λ_i - low_freq_factor) / (high_freq_factor -
low_freq_factor); the attention scores are not rescaled.

Our rotation turns neighbouring features (2i, 2i + 1) of a head; Hugging Face's Llama turns (i, i + hs/2).
interop/hf.py permutes the rows of q and k between the two conventions, which leaves every score unchanged.
The tables are computed in float64 and cast to the activations' dtype where they are applied.
"""

from __future__ import annotations

import math

import torch

from scaletrain.config import ModelConfig


def inv_frequencies(head_dim: int, theta: float = 10000.0, scaling=None) -> torch.Tensor:
    """ω_i = θ^(-2i/hs) for i < hs/2 (float64), with the llama3 scaling when `scaling` (a RopeScalingConfig) says so."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None or scaling.type == "none":
        return inv
    L = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv
    s = (L / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - s) * inv / scaling.factor + s * inv
    long = wavelength > L / scaling.low_freq_factor  # low frequencies: slowed down by `factor`
    short = wavelength < L / scaling.high_freq_factor  # high frequencies: unchanged
    return torch.where(long, inv / scaling.factor, torch.where(short, inv, blended))


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0, scaling=None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles t·ω_i, each (T, hs/2), in float64, for t = 0..T-1 or the given global
    `positions` (context parallelism: a rank's tokens are some positions of the sequence)."""
    t = torch.arange(seq_len, dtype=torch.float64) if positions is None else positions.cpu().to(torch.float64)
    angles = torch.outer(t, inv_frequencies(head_dim, theta, scaling))
    return angles.cos(), angles.sin()


def model_rope_tables(cfg: ModelConfig, seq_len: int, head_dim: int,
                      positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of a model config (its base and scaling) for heads of `head_dim` (d_model / n_heads, or half of it
    in reversible blocks), at `positions` when given (context parallelism) else 0..seq_len-1."""
    return rope_tables(seq_len, head_dim, cfg.rope_theta, cfg.rope_scaling, positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, nh, T, hs) by the angles of their position.

    The result is a (B, nh, T, hs) tensor of its own, written pair by pair, not a view of a (..., hs/2, 2) stack:
    attention saves it for backward, and int8 activation compression scales blocks along the last dimension of
    the stored tensor (memory/compress.py). As a view of a stack its blocks would be pairs; under Ulysses context
    parallelism attention receives the all-to-all's (..., hs) tensor instead, whose blocks are heads, and the two
    layouts would round q and k differently. Same values and gradients, bit for bit, as the stacked form."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = x.new_empty(x.shape)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out
