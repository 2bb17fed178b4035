"""The layers of a transformer block (Vaswani et al., arXiv 1706.03762; GPT-2's pre-norm order): causal
self-attention through `scaled_dot_product_attention` with RoPE as an option (arXiv 2104.09864), the GELU MLP or
SwiGLU (arXiv 2002.05202), and the pre-norm `Block`. `model/gpt.py` stacks the blocks into the GPT; a reversible
block (model/reversible.py) reuses them on half the width.

Shapes: B batch, T sequence, C = d_model, nh heads, hs = C / nh head size.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.config import ModelConfig
from scaletrain.config.sizes import ffn_size, is_moe_layer
from scaletrain.model.dropout import DropoutContext, GlobalDropout
from scaletrain.model.moe import MoE
from scaletrain.model.norm import make_norm


def make_dropout(cfg: ModelConfig, context: DropoutContext, roles: tuple[str, ...], p: float | None = None):
    """`model.dropout_impl`: `global` (layout-independent masks, model/dropout.py) or torch's nn.Dropout."""
    p = cfg.dropout if p is None else p
    return GlobalDropout(p, context, roles) if cfg.dropout_impl == "global" else nn.Dropout(p)


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles t * base^(-2i/hs), each (T, hs/2), in float64, for t = 0..T-1 or the
    given global `positions` (context parallelism: a rank's tokens are some positions of the sequence)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    t = torch.arange(seq_len, dtype=torch.float64) if positions is None else positions.cpu().to(torch.float64)
    angles = torch.outer(t, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, nh, T, hs) by the angles of their position."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, context: DropoutContext | None = None):
        super().__init__()
        context = context or DropoutContext()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        # attention-probability dropout with layout-independent masks needs the probabilities themselves
        self.attn_dropout = make_dropout(cfg, context, ("head", "seq", "seq")) \
            if cfg.dropout > 0 and cfg.dropout_impl == "global" else None
        self.resid_dropout = make_dropout(cfg, context, ("seq", "feature"))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, 3 * nh_local * hs): the local head count follows the layer's width, so a
        # column-parallel qkv with fewer heads per rank needs no change here.
        qkv = self.qkv(x)
        n_local = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(B, T, 3, n_local, self.head_dim).permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.attn_core(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, n_local * self.head_dim)
        return self.resid_dropout(self.proj(y))

    def attn_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ / √hs + causal mask) v with attention dropout: the part selective recomputation
        recomputes (Korthikanti et al., arXiv 2205.05198), so a pass can wrap this one method."""
        if self.attn_dropout is not None and self.training:  # explicit: the mask is a function of global indices
            T = q.shape[-2]
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
            att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
            return self.attn_dropout(att) @ v
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


class MLP(nn.Module):
    """GELU MLP: fc (C -> 4C), GELU, proj (4C -> C)."""

    def __init__(self, cfg: ModelConfig, context: DropoutContext | None = None):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, ffn_size(cfg), bias=cfg.bias)
        self.proj = nn.Linear(ffn_size(cfg), cfg.d_model, bias=cfg.bias)
        self.dropout = make_dropout(cfg, context or DropoutContext(), ("seq", "feature"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer, arXiv 2002.05202): proj(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, context: DropoutContext | None = None):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, ffn_size(cfg), bias=cfg.bias)
        self.up = nn.Linear(cfg.d_model, ffn_size(cfg), bias=cfg.bias)
        self.proj = nn.Linear(ffn_size(cfg), cfg.d_model, bias=cfg.bias)
        self.dropout = make_dropout(cfg, context or DropoutContext(), ("seq", "feature"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); the MLP of every
    `model.moe.every`-th block is a mixture of experts when `model.moe.experts` > 0 (model/moe.py)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, context: DropoutContext | None = None):
        super().__init__()
        context = context or DropoutContext()
        self.ln1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, context)
        self.ln2 = make_norm(cfg)
        if is_moe_layer(cfg, layer):
            self.mlp = MoE(cfg.d_model, ffn_size(cfg), cfg.mlp, cfg.moe, cfg.dropout, layer,
                           make_dropout=lambda p, roles: make_dropout(cfg, context, roles, p))
        else:
            self.mlp = SwiGLU(cfg, context) if cfg.mlp == "swiglu" else MLP(cfg, context)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.mlp(self.ln2(x))
