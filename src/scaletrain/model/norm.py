"""Normalisation layers of the plain GPT: LayerNorm (Ba et al., arXiv 1607.06450) or RMSNorm (Zhang & Sennrich,
arXiv 1910.07467, as in LLaMA, arXiv 2302.13971), chosen by `model.norm`.

RMSNorm: y = x / sqrt(mean(x²) + eps) · g (+ b with model.bias), computed in fp32 for bf16 / fp16 inputs (the
statistics of a 16-bit activation would lose precision) and returned in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)  # (B, T, C)
        h = h * self.weight.to(h.dtype)
        if self.bias is not None:
            h = h + self.bias.to(h.dtype)
        return h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


def make_norm(cfg) -> nn.Module:
    """The normalisation layer `model.norm` asks for, over d_model."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
