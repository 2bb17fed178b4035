"""Collectives of the 2D / 2.5D / 3D tensor-parallel layers, with byte accounting, and the autograd operators
built from them.

Every collective takes its group (None: one rank, nothing to do) and adds the bytes this rank sends to a
`CommStats` under a kind `tp.<collective>`. The counts use the ring conventions of `scaletrain.distributed.comm`
(all-reduce 2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)/n of the full buffer) and, for the
broadcasts and reduces of SUMMA (Van de Geijn & Watts, 1997), (n-1)/n of the buffer per call on every member:
over the q calls of one SUMMA product each rank is the root once, and a pipelined (chain) broadcast or reduce
moves (n-1) buffers in the group per call, so each rank sends (q-1) blocks over the product, the same as an
all-gather (reduce-scatter) of the q blocks. These are the per-processor volumes the Optimus (arXiv 2104.05343),
Tesseract (arXiv 2105.14500) and 3D (arXiv 2105.14450) papers count; `plan.analytic.tp_nd` writes them per layer.

Autograd operators (forward / backward):
    gather_vec     all-gather along a dim / reduce-scatter      (vectors split over a group: 2d biases, norms)
    sum_grad       identity / all-reduce of the gradient        (vectors replicated over a group: 3d)
    scatter_rows   reduce-scatter along dim 0 / all-gather      (the vocabulary-parallel embedding's output)
    value_sum      value all-reduced, gradient of the local part only (the loss of the rank's sequences)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scaletrain.distributed.comm import CommStats, all_gather_single, group_size, reduce_scatter_single


def _count(stats: CommStats | None, kind: str, nbytes: float) -> None:
    if stats is not None:
        stats.add(f"tp.{kind}", nbytes)


def _bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def broadcast(x: torch.Tensor, src: int, group, stats: CommStats | None, async_op: bool = False):
    """Broadcast in place from group member `src` (its index in the group); returns the work when async."""
    n = group_size(group)
    if n == 1:
        return None
    _count(stats, "broadcast", (n - 1) / n * _bytes(x))
    return dist.broadcast(x, src=dist.get_global_rank(group, src), group=group, async_op=async_op)


def reduce(x: torch.Tensor, dst: int, group, stats: CommStats | None, async_op: bool = False):
    """Sum `x` over the group into member `dst`'s `x` (other members' buffers are scratch)."""
    n = group_size(group)
    if n == 1:
        return None
    _count(stats, "reduce", (n - 1) / n * _bytes(x))
    return dist.reduce(x, dst=dist.get_global_rank(group, dst), group=group, async_op=async_op)


def all_reduce(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    n = group_size(group)
    if n > 1:
        _count(stats, "all_reduce", 2 * (n - 1) / n * _bytes(x))
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, group, stats: CommStats | None) -> torch.Tensor:
    """Concatenate the members' `x` along `dim`, in member order."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    _count(stats, "all_gather", (n - 1) / n * _bytes(out))
    all_gather_single(out.view(-1), x.view(-1), group=group)  # gloo wants 1-D buffers
    dim = dim % x.dim()
    return out.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(x: torch.Tensor, dim: int, group, stats: CommStats | None) -> torch.Tensor:
    """Sum `x` over the group and keep this member's chunk along `dim` (chunk index = member index)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    _count(stats, "reduce_scatter", (n - 1) / n * _bytes(chunks))
    reduce_scatter_single(out.view(-1), chunks.view(-1), group=group)
    return out


# --------------------------------------------------------------------------- autograd operators


class _GatherVec(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, stats):
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return all_gather(x, dim, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


def gather_vec(x: torch.Tensor, group, stats: CommStats | None, dim: int = 0) -> torch.Tensor:
    """All-gather along `dim` (a parameter split over `group`); backward reduce-scatters its gradient."""
    return x if group_size(group) == 1 else _GatherVec.apply(x, dim, group, stats)


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group, ctx.stats), None, None


def sum_grad(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    """Identity (a parameter replicated over `group`); backward sums its gradient over the group."""
    return x if group_size(group) == 1 else _SumGrad.apply(x, group, stats)


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return reduce_scatter(x, 0, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, 0, ctx.group, ctx.stats), None, None


def scatter_rows(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    """Sum over `group` and keep this member's block of rows (dim 0); backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterRows.apply(x, group, stats)


class _ValueSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, total):
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def value_sum(x: torch.Tensor, groups: list, stats: CommStats | None) -> torch.Tensor:
    """A scalar whose value is `x` summed over the groups (in turn) and whose gradient is that of the local x:
    the loss of the whole micro-batch on every rank, each rank's backward from its own sequences only."""
    total = x.detach().clone()
    for g in groups:
        all_reduce(total, g, stats)
    return _ValueSum.apply(x, total)
