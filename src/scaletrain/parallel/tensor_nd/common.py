"""Pieces shared by the 2D, 2.5D and 3D layers: the layer norm over a split hidden dimension, the vocabulary
lookup of a slice of the table, the vocabulary-parallel loss of a rank's sequences, and the sharding of a dense
parameter by its `Placement`.

Layer norm (Ba et al., arXiv 1607.06450) with the hidden dimension split over a group, as Optimus
(arXiv 2104.05343) and the 3D paper (arXiv 2105.14450) do it: the mean and then the variance of each token are
all-reduced over the group (two all-reduces of one number per token; we take the variance of the centred values,
a two-pass form that is stable in bf16, where Colossal-AI all-reduces E[x] and E[x^2]); backward all-reduces
the two sums the input gradient needs, sum(g) and sum(g * x_hat) (one all-reduce of two numbers per token). It
saves x_hat and 1/sigma. RMSNorm (arXiv 1910.07467) is the same without the mean: one all-reduce of sum(x^2)
forward and of sum(g * x_hat) backward. Under bf16 / fp16 it computes in fp32 and returns the input's dtype, as
the engine's `FP32LayerNorm` does.

The loss: each rank's logits are its block of sequences times its slice of the vocabulary, so the
cross-entropy is Megatron's vocabulary-parallel one (`tensor_parallel.vocab_parallel_cross_entropy`) over the
ranks holding the other slices of the same sequences; the sum over the rank's tokens is then all-reduced (value
only) over the ranks holding the other sequences, so every rank returns the micro-batch's loss, as the trainer
expects, while its backward covers its own tokens only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.distributed.comm import CommStats
from scaletrain.parallel.tensor_nd.comm import all_reduce, value_sum
from scaletrain.parallel.tensor_nd.grid import Placement
from scaletrain.parallel.tensor_parallel import vocab_parallel_cross_entropy

LOW = (torch.bfloat16, torch.float16)


class _SplitNorm(torch.autograd.Function):
    """x_hat = (x - mean) / sqrt(var + eps), mean and var over a hidden dim of `h` split over `group`; with
    center=False (RMSNorm) x_hat = x / sqrt(mean(x^2) + eps): one all-reduce forward, one number per token back."""

    @staticmethod
    def forward(ctx, x, h, eps, group, stats, center=True):
        xc = x - all_reduce(x.sum(-1, keepdim=True), group, stats).div_(h) if center else x
        v = all_reduce((xc * xc).sum(-1, keepdim=True), group, stats)
        rstd = v.div_(h).add_(eps).rsqrt_()
        xhat = xc * rstd
        ctx.save_for_backward(xhat, rstd)
        ctx.h, ctx.group, ctx.stats, ctx.center = h, group, stats, center
        return xhat

    @staticmethod
    def backward(ctx, g):
        xhat, rstd = ctx.saved_tensors
        gx = (g * xhat).sum(-1, keepdim=True)
        if not ctx.center:
            dx = (g - xhat * all_reduce(gx, ctx.group, ctx.stats).div_(ctx.h)) * rstd
            return dx, None, None, None, None, None
        sums = all_reduce(torch.cat([g.sum(-1, keepdim=True), gx], -1), ctx.group, ctx.stats).div_(ctx.h)
        dx = (g - sums[..., :1] - xhat * sums[..., 1:]) * rstd
        return dx, None, None, None, None, None


class GridLayerNorm(nn.Module):
    """LayerNorm (or RMSNorm, `model/norm.py`) of activations whose hidden dimension is split over `group`; `vec`
    turns the stored weight and bias into this rank's hidden chunk (a gather for 2d's split vectors, the identity
    with a gradient sum for 3d's replicated ones)."""

    def __init__(self, ln: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None, group, vec,
                 stats: CommStats | None):
        from scaletrain.model.norm import RMSNorm

        super().__init__()
        self.h, self.eps, self.center = ln.weight.shape[0], ln.eps, not isinstance(ln, RMSNorm)
        self.weight, self.bias = weight, bias
        self.group, self.vec, self.stats = group, vec, stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = x.dtype in LOW
        xhat = _SplitNorm.apply(x.float() if low else x, self.h, self.eps, self.group, self.stats, self.center)
        w = self.vec(self.weight)
        y = xhat * (w.float() if low else w)
        if self.bias is not None:
            b = self.vec(self.bias)
            y = y + (b.float() if low else b)
        return y.to(x.dtype) if low else y

    def extra_repr(self) -> str:
        return f"h={self.h}, local={self.weight.shape[0]}, eps={self.eps}, center={self.center}"


def vocab_lookup(idx: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Rows of `weight` (the table's rows [start, start + len)) for the ids in its range, zeros for the others."""
    outside = (idx < start) | (idx >= start + weight.shape[0])
    out = F.embedding((idx - start).masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class GridLoss:
    """The engine's loss_fn: sum of the cross-entropies of this rank's sequences (rows [row0, row0 + rows) of the
    micro-batch) from its vocabulary slice, all-reduced over the ranks of the other sequences (module
    docstring)."""

    def __init__(self, vocab_group, vocab_start: int, vocab_size: int, row0: int, rows: int, value_groups: list,
                 stats: CommStats | None):
        self.vocab_group, self.vocab_start, self.vocab_size = vocab_group, vocab_start, vocab_size
        self.row0, self.rows, self.value_groups, self.stats = row0, rows, value_groups, stats

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        mine = targets[self.row0: self.row0 + self.rows]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, -2), mine.flatten(), self.vocab_group,
                                              self.vocab_start, self.vocab_size, self.stats)
        return value_sum(losses.sum(), self.value_groups, self.stats)


def shard_param(full: torch.Tensor, placement: Placement, coords: dict[str, int]) -> nn.Parameter:
    """This rank's shard of a dense parameter, a new contiguous parameter that knows its placement."""
    with torch.no_grad():
        local = placement.take(full.detach(), coords).clone().contiguous()
    p = nn.Parameter(local, requires_grad=full.requires_grad)
    p._st_nd = (placement, tuple(full.shape))
    return p
