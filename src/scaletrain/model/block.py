"""The layers of a transformer block (Vaswani et al., arXiv 1706.03762; GPT-2's pre-norm order): causal
self-attention through `scaled_dot_product_attention` with RoPE as an option (arXiv 2104.09864, model/rope.py),
multi-head or grouped-query (Ainslie et al., arXiv 2305.13245; multi-query, Shazeer arXiv 1911.02150, with one
key/value head), optional biases on the query/key/value projections only (Qwen2, arXiv 2407.10671), the GELU MLP
(exact or tanh-approximated GELU, arXiv 1606.08415) or SwiGLU (arXiv 2002.05202), and the pre-norm `Block`.
`model/gpt.py` stacks the blocks into the GPT; a reversible block (model/reversible.py) reuses them on half the width.

Shapes: B batch, T sequence, C = d_model, nh query heads, nkv key/value heads, hs = C / nh head size.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.config import ModelConfig
from scaletrain.config.sizes import ffn_size, is_moe_layer, kv_heads
from scaletrain.model.dropout import DropoutContext, GlobalDropout
from scaletrain.model.moe import MoE
from scaletrain.model.norm import make_norm
from scaletrain.model.rope import apply_rope


def make_dropout(cfg: ModelConfig, context: DropoutContext, roles: tuple[str, ...], p: float | None = None):
    """`model.dropout_impl`: `global` (layout-independent masks, model/dropout.py) or torch's nn.Dropout."""
    p = cfg.dropout if p is None else p
    return GlobalDropout(p, context, roles) if cfg.dropout_impl == "global" else nn.Dropout(p)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention's key/value heads for its query heads: (B, nkv, T, hs) -> (B, nkv x groups, T, hs),
    head j of the result being key/value head j // groups (query heads [g x groups, (g + 1) x groups) share head g).
    The one place the sharing is spelled out: the explicit attention below uses it, scaled_dot_product_attention does
    the same with enable_gqa, and a layout that moves heads between ranks (context parallelism) can call it."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class CausalSelfAttention(nn.Module):
    """Causal self-attention. Multi-head attention projects q, k and v with one fused `qkv` layer (q, k, v stacked,
    heads contiguous); grouped-query attention (n_kv_heads < n_heads) projects q with `q` and the shared keys and
    values with `kv` (k then v, nkv heads each), so that tensor parallelism can split or copy the key/value heads
    apart from the query heads (parallel/tp_plan.py)."""

    def __init__(self, cfg: ModelConfig, context: DropoutContext | None = None):
        super().__init__()
        context = context or DropoutContext()
        self.n_heads, self.n_kv_heads = cfg.n_heads, kv_heads(cfg)
        self.head_dim = cfg.d_model // cfg.n_heads
        bias = cfg.bias or cfg.qkv_bias
        if self.n_kv_heads == self.n_heads:
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=bias)
        else:
            self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)
            self.kv = nn.Linear(cfg.d_model, 2 * self.n_kv_heads * self.head_dim, bias=bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        # attention-probability dropout with layout-independent masks needs the probabilities themselves
        self.attn_dropout = make_dropout(cfg, context, ("head", "seq", "seq")) \
            if cfg.dropout > 0 and cfg.dropout_impl == "global" else None
        self.resid_dropout = make_dropout(cfg, context, ("seq", "feature"))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, hs), k and v (B, nkv, T, hs). The local head counts follow the layers' widths, so
        column-parallel projections with fewer heads per rank need no change here."""
        B, T, _ = x.shape
        hs = self.head_dim
        if self.n_kv_heads == self.n_heads:
            qkv = self.qkv(x)  # (B, T, 3 * nh_local * hs)
            q, k, v = qkv.view(B, T, 3, qkv.shape[-1] // (3 * hs), hs).permute(2, 0, 3, 1, 4)
            return q, k, v
        q = self.q(x)
        q = q.view(B, T, q.shape[-1] // hs, hs).transpose(1, 2)
        kv = self.kv(x)  # (B, T, 2 * nkv_local * hs)
        k, v = kv.view(B, T, 2, kv.shape[-1] // (2 * hs), hs).permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.attn_core(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, q.shape[1] * self.head_dim)
        return self.resid_dropout(self.proj(y))

    def attn_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ / √hs + causal mask) v with attention dropout: the part selective recomputation
        recomputes (Korthikanti et al., arXiv 2205.05198), so a pass can wrap this one method. k and v may have
        fewer heads than q (grouped-query attention): `repeat_kv`'s sharing."""
        groups = q.shape[1] // k.shape[1]
        if self.attn_dropout is not None and self.training:  # explicit: the mask is a function of global indices
            T = q.shape[-2]
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
            att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
            return self.attn_dropout(att) @ v
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, enable_gqa=groups > 1)


class MLP(nn.Module):
    """GELU MLP: fc (C -> 4C), GELU (exact, or its tanh approximation with model.activation=gelu_tanh), proj
    (4C -> C)."""

    def __init__(self, cfg: ModelConfig, context: DropoutContext | None = None):
        super().__init__()
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.fc = nn.Linear(cfg.d_model, ffn_size(cfg), bias=cfg.bias)
        self.proj = nn.Linear(ffn_size(cfg), cfg.d_model, bias=cfg.bias)
        self.dropout = make_dropout(cfg, context or DropoutContext(), ("seq", "feature"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


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
                           make_dropout=lambda p, roles: make_dropout(cfg, context, roles, p),
                           activation=cfg.activation)
        else:
            self.mlp = SwiGLU(cfg, context) if cfg.mlp == "swiglu" else MLP(cfg, context)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.mlp(self.ln2(x))
