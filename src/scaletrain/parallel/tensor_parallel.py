"""Tensor and sequence parallelism (Megatron-LM) on torch.distributed collectives.

Shoeybi et al., "Megatron-LM", arXiv 1909.08053: a linear layer is split by output columns
(`ColumnParallelLinear`) or by input rows (`RowParallelLinear`); attention is split by heads and the MLP
column-then-row, so each sub-layer needs one all-reduce in forward and one in backward, placed by the
paper's conjugate operators
    f: identity forward, all-reduce backward      (enters the tensor-parallel region)
    g: all-reduce forward, identity backward      (leaves it)
The embedding and the output layer are split over the vocabulary (`VocabParallelEmbedding`,
`VocabParallelHead`) and the cross-entropy is computed from the vocabulary shards with two all-reduces of
one or two numbers per token (`vocab_parallel_cross_entropy`), never gathering the logits. A vocabulary that tp
does not divide is padded to a multiple of tp; the padded logits are masked to -inf so they never change
the loss, and the padded rows stay zero.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198
(sequence parallelism): the layer norms and dropouts between the sub-layers run on sequence shards, and
f / g become an all-gather / reduce-scatter pair along the sequence (`f_sp`, `f_sp_linear`, `g_sp`). As in the
paper (Sec. 4.2.2) the column-parallel linear saves only its sequence shard for backward and all-gathers
it again there, overlapped with the input-gradient GEMM.

Dropout (the paper's RNG tracker): `RNGTracker` switches between the stream shared by the tp ranks
(replicated regions) and a per-tp-rank stream (regions split over heads or, with sequence parallelism,
over the sequence).

Activations are batch-first, (B, T, C); the sequence dimension is dim 1. Every collective takes the
group as an argument and adds its bytes to a `CommStats` (kinds "tp.all_reduce", "tp.all_gather",
"tp.reduce_scatter", ring factors as in `scaletrain.distributed.comm`). A group of None means tp = 1 and every
collective is the identity. The table-driven `apply_tp_plan` and the engine pass `apply_tp` (the GPT's plan) are
in `scaletrain.parallel.tp_plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.distributed.comm import CommStats, all_gather_single, group_size, reduce_scatter_single
from scaletrain.errors import UserError
from scaletrain.memory.autocast import forward_compute_dtype
from scaletrain.model.init import name_seed

# --------------------------------------------------------------------------- collectives


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _count(stats: CommStats | None, kind: str, nbytes: float) -> None:
    if stats is not None:
        stats.add(kind, nbytes)


def all_reduce_(x: torch.Tensor, group, stats: CommStats | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over the tp group (identity when the group is trivial)."""
    n = group_size(group)
    if n > 1:
        _count(stats, "tp.all_reduce", 2 * (n - 1) / n * x.numel() * x.element_size())
        dist.all_reduce(x, op=op, group=group)
    return x


class _Pending:
    """A started collective; `wait()` returns its finished result."""

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


def start_gather_seq(x: torch.Tensor, group, stats: CommStats | None, async_op: bool = False) -> _Pending:
    """All-gather (B, T/n, ...) shards along the sequence into (B, T, ...)."""
    n = group_size(group)
    if n == 1:
        return _Pending(None, lambda: x)
    x = x.contiguous()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    _count(stats, "tp.all_gather", (n - 1) / n * out.numel() * out.element_size())
    work = all_gather_single(out.view(-1), x.view(-1), group=group, async_op=async_op)  # gloo wants 1-D
    return _Pending(work if async_op else None, lambda: out.movedim(0, 1).flatten(1, 2))  # (B, n*T/n, ...)


def start_reduce_scatter_seq(x: torch.Tensor, group, stats: CommStats | None, async_op: bool = False) -> _Pending:
    """Sum (B, T, ...) over the group and keep this rank's sequence shard (B, T/n, ...)."""
    n = group_size(group)
    if n == 1:
        return _Pending(None, lambda: x)
    B, T = x.shape[:2]
    chunks = x.reshape(B, n, T // n, *x.shape[2:]).movedim(1, 0).contiguous()  # (n, B, T/n, ...)
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    _count(stats, "tp.reduce_scatter", (n - 1) / n * chunks.numel() * chunks.element_size())
    work = reduce_scatter_single(out.view(-1), chunks.view(-1), group=group, async_op=async_op)
    return _Pending(work if async_op else None, lambda: out)


def seq_shard(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of `x` along `dim` (no communication)."""
    n = group_size(group)
    return x if n == 1 else x.chunk(n, dim)[group_rank(group)]


# --------------------------------------------------------------------------- the conjugate operators


class f(torch.autograd.Function):  # noqa: N801 - the paper's name
    """Megatron's f (enters a tensor-parallel region): identity forward, all-reduce of the gradient backward.

    The all-reduce is in place: our layers put f right before a matmul, whose backward allocates the
    gradient that reaches f, so no other node holds it.
    """

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous(), ctx.group, ctx.stats), None, None


class g(torch.autograd.Function):  # noqa: N801 - the paper's name
    """Megatron's g (leaves a tensor-parallel region): all-reduce forward (of partial sums), identity backward."""

    @staticmethod
    def forward(ctx, x, group, stats):
        out = x if x.is_contiguous() else x.contiguous()
        all_reduce_(out, group, stats)  # in place: x is a fresh matmul / embedding output no node saved
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class g_sp(torch.autograd.Function):  # noqa: N801 - takes g's place under sequence parallelism
    """Sequence parallelism's g-bar (Korthikanti et al. Sec. 4.2.2): reduce-scatter along the sequence
    forward (partial sums -> summed sequence shard), all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return start_reduce_scatter_seq(x, group, stats).wait()

    @staticmethod
    def backward(ctx, grad):
        return start_gather_seq(grad, ctx.group, ctx.stats).wait(), None, None


class f_sp(torch.autograd.Function):  # noqa: N801 - takes f's place under sequence parallelism
    """Sequence parallelism's g (Korthikanti et al. Sec. 4.2.2), in f's place: all-gather along the
    sequence forward, reduce-scatter of the gradient backward. Used at the entry of a module that needs
    the whole sequence (`enter_hook`); column-parallel layers fuse it instead (`f_sp_linear`)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return start_gather_seq(x, group, stats).wait()

    @staticmethod
    def backward(ctx, grad):
        return start_reduce_scatter_seq(grad, ctx.group, ctx.stats).wait(), None, None


class f_sp_linear(torch.autograd.Function):  # noqa: N801 - f_sp fused with the column-parallel matmul
    """y = x W^T + b on the whole sequence, saving only this rank's sequence shard of x for backward
    (Korthikanti et al. Sec. 4.2.2): backward all-gathers the shard again for dW = dy^T x, overlapped with
    dx = dy W. Either x_shard is all-gathered here (x_full None; dx is then reduce-scattered, overlapped
    with dW), or x_full was gathered by `f_sp` at a module's entry (dx flows back to it whole)."""

    @staticmethod
    def forward(ctx, x_full, x_shard, weight, bias, group, stats):
        ctx.group, ctx.stats, ctx.has_bias, ctx.gathers = group, stats, bias is not None, x_full is None
        # under autocast (train.precision=autocast-bf16) F.linear computes in the autocast dtype; backward runs
        # outside the region and casts as autocast's cast nodes would (memory/autocast.py)
        ctx.compute = forward_compute_dtype(x_shard)
        ctx.save_for_backward(x_shard, weight)
        x = start_gather_seq(x_shard, group, stats).wait() if x_full is None else x_full
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        need_w = ctx.needs_input_grad[2]
        gathering = start_gather_seq(x_shard, ctx.group, ctx.stats, async_op=True) if need_w else None
        w = weight if ctx.compute is None else weight.to(ctx.compute)
        dx = dy.matmul(w).to(x_shard.dtype)  # (B, T, in); summed over tp in the input's dtype
        if ctx.gathers:
            dx = start_reduce_scatter_seq(dx, ctx.group, ctx.stats, async_op=True)
        dw = db = None
        if need_w:
            x = gathering.wait()
            x = x if ctx.compute is None else x.to(ctx.compute)
            dw = dy.flatten(0, -2).t().matmul(x.flatten(0, -2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.flatten(0, -2).sum(0).to(weight.dtype)
        if ctx.gathers:
            return None, dx.wait(), dw, db, None, None
        return dx, None, dw, db, None, None


def enter_hook(group, sequence_parallel: bool, stats: CommStats | None) -> Callable:
    """A forward pre-hook applying f (f_sp with sequence parallelism) to a module's first input, once for
    all the column-parallel layers inside it that read that input (SwiGLU's gate and up share one
    all-reduce in backward), or because the module needs the whole sequence (our attention reads T from
    its input). The result is tagged so those layers apply no f of their own; with sequence parallelism
    it carries its shard, which they save instead of the whole sequence."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        if sequence_parallel:
            full = f_sp.apply(x, group, stats)
            full._st_seq_shard = x
        else:
            full = f.apply(x, group, stats)
        full._st_tp_entered = True
        return (full, *rest)

    return hook


def all_reduce_grad_hook(group, stats: CommStats | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor hook summing a replicated parameter's gradient over tp (it saw only a sequence shard)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return all_reduce_(grad.clone(), group, stats)

    return hook


def sum_copies_hook(group, piece: int, pieces: int, stats: CommStats | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor hook summing a parameter's gradient over the tp ranks holding copies of the same piece of it (grouped-
    query attention with tp > n_kv_heads: each key/value head sits on tp / n_kv_heads ranks, each of which sees only
    its own query heads' part of the gradient). One all-reduce over tp of a (pieces, *shape) buffer in which every
    rank fills its piece's row: each row sums exactly the ranks of that piece."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        buf = grad.new_zeros((pieces, *grad.shape))
        buf[piece] = grad
        return all_reduce_(buf, group, stats)[piece]

    return hook


def mark_replicated(p: nn.Parameter, group, sequence_parallel: bool, stats: CommStats | None) -> None:
    """A parameter every tp rank holds in full: its gradient norm counts once (tp rank 0), and under
    sequence parallelism its per-shard gradients are summed over tp so all ranks stay identical."""
    if getattr(p, "_st_tp_replicated", False):
        return
    p._st_tp_replicated = True
    if group_rank(group) > 0:
        p._st_norm_owner = False
    if sequence_parallel and group_size(group) > 1:
        p.register_hook(all_reduce_grad_hook(group, stats))


# --------------------------------------------------------------------------- layers


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise UserError(f"{what} ({a}) is not divisible by tp ({b})")
    return a // b


def _rows(full: torch.Tensor, rank: int, n: int, parts: int) -> torch.Tensor:
    """Rank's rows of `full` (dim 0) when it is `parts` blocks stacked (e.g. q, k, v): its slice of each."""
    return torch.cat([p.chunk(n, 0)[rank] for p in full.chunk(parts, 0)], 0)


def copy_layout(n: int, shards: int) -> tuple[int, int]:
    """(pieces, copies): a tensor cut into at most `shards` pieces over n tp ranks (`shards` 0: n pieces). With
    n > shards, each piece sits on copies = n / shards consecutive ranks (rank r holds piece r // copies)."""
    pieces = n if not shards or shards >= n else shards
    if n % pieces:
        raise UserError(f"tp ({n}) is not divisible by the {shards} pieces of a column-parallel layer")
    return pieces, n // pieces


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) A_r^T + b_r: the weight split by output features, the output left split (gather_output
    is never needed in our blocks). `parts` > 1 keeps fused projections correct: for qkv (parts=3) rank r
    holds [q_r; k_r; v_r], i.e. its heads of each of q, k and v. `shards` caps the pieces: grouped-query
    attention's kv (parts=2, shards=n_kv_heads) is split by key/value heads, and with tp > n_kv_heads each head
    is copied on the tp / n_kv_heads ranks whose query heads use it, its gradient summed over them
    (`sum_copies_hook`; the copies beyond the first do not count in the gradient norm)."""

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True, parts: int = 1,
                 shards: int = 0, sequence_parallel: bool = False, stats: CommStats | None = None, device=None,
                 dtype=None):
        super().__init__()
        self.group, self.stats, self.sequence_parallel, self.parts = group, stats, sequence_parallel, parts
        n = group_size(group)
        self.pieces, self.copies = copy_layout(n, shards)
        self.piece = group_rank(group) // self.copies
        self.in_features, self.out_features = in_features, out_features
        local = parts * _divide(out_features // parts, self.pieces, "column-parallel output features")
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        if self.copies > 1:
            for p in (self.weight, self.bias):
                if p is not None:
                    p.register_hook(sum_copies_hook(group, self.piece, self.pieces, stats))
                    if group_rank(group) % self.copies:
                        p._st_norm_owner, p._st_tp_copy = False, True  # the piece's first rank counts it

    @classmethod
    @torch.no_grad()
    def from_dense(cls, linear: nn.Linear, group, parts: int = 1, **kw) -> ColumnParallelLinear:
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None, parts=parts,
                device=w.device, dtype=w.dtype, **kw)
        m.weight.copy_(_rows(w, m.piece, m.pieces, parts))
        if m.bias is not None:
            m.bias.copy_(_rows(linear.bias, m.piece, m.pieces, parts))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(x, "_st_tp_entered", False):  # f / f_sp already applied at a module's entry (enter_hook)
            if self.sequence_parallel:
                return f_sp_linear.apply(x, x._st_seq_shard, self.weight, self.bias, self.group, self.stats)
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            return f_sp_linear.apply(None, x, self.weight, self.bias, self.group, self.stats)
        return F.linear(f.apply(x, self.group, self.stats), self.weight, self.bias)

    def extra_repr(self) -> str:
        copies = f", copies={self.copies}" if self.copies > 1 else ""
        return f"in={self.in_features}, out={self.out_features}/{self.pieces}, parts={self.parts}{copies}"


class RowParallelLinear(nn.Module):
    """y = g(x_r A_r^T) + b: the weight split by input features, the input already split (the output of a
    column-parallel layer), the bias replicated and added once after the sum."""

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True,
                 sequence_parallel: bool = False, stats: CommStats | None = None, device=None, dtype=None):
        super().__init__()
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _divide(in_features, group_size(group), "row-parallel input features")
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.bias is not None:
            mark_replicated(self.bias, group, sequence_parallel, stats)

    @classmethod
    @torch.no_grad()
    def from_dense(cls, linear: nn.Linear, group, **kw) -> RowParallelLinear:
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                device=w.device, dtype=w.dtype, **kw)
        m.weight.copy_(w.chunk(group_size(group), 1)[group_rank(group)])
        if m.bias is not None:
            m.bias.copy_(linear.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = (g_sp if self.sequence_parallel else g).apply(y, self.group, self.stats)
        # the bias in the output's dtype: under autocast a whole nn.Linear adds it in bf16, and so does this one
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{group_size(self.group)}, out={self.out_features}"


def padded_vocab(vocab_size: int, n: int) -> int:
    """The vocabulary rounded up to a multiple of the tp size (the extra rows are padding)."""
    return n * math.ceil(vocab_size / n)


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary: rank r holds rows [r V'/n, (r+1) V'/n) of the table padded
    to V' = n ceil(V/n) rows (the padding rows are zero and never looked up). Each rank embeds the tokens
    of its range, zeros for the others, and g sums the ranks (reduce-scatter along the sequence with
    sequence parallelism)."""

    def __init__(self, vocab_size: int, dim: int, group, *, sequence_parallel: bool = False,
                 stats: CommStats | None = None, device=None, dtype=None):
        super().__init__()
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel
        n = group_size(group)
        self.vocab_size, self.embedding_dim = vocab_size, dim
        self.per_rank = padded_vocab(vocab_size, n) // n
        self.vocab_start = group_rank(group) * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim, device=device, dtype=dtype))

    @classmethod
    @torch.no_grad()
    def from_dense(cls, emb: nn.Embedding, group, **kw) -> VocabParallelEmbedding:
        w = emb.weight
        m = cls(emb.num_embeddings, emb.embedding_dim, group, device=w.device, dtype=w.dtype, **kw)
        m.weight.copy_(vocab_shard(w, m.vocab_start, m.per_rank))
        return m

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.per_rank)
        out = F.embedding((idx - self.vocab_start).masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C), zero where another rank owns the id
        return (g_sp if self.sequence_parallel else g).apply(out, self.group, self.stats)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size} ({self.per_rank} per rank from {self.vocab_start}), dim={self.embedding_dim}"


@torch.no_grad()
def vocab_shard(full: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of `full`, zero-padded past its end."""
    out = torch.zeros(rows, *full.shape[1:], dtype=full.dtype, device=full.device)
    take = full[start: start + rows]
    out[: take.shape[0]] = take
    return out


class VocabParallelHead(nn.Module):
    """The output layer split over the vocabulary (a column-parallel linear without bias): returns this
    rank's logits (B, T, V'/n), which `vocab_parallel_cross_entropy` consumes without gathering. May share
    its weight with a `VocabParallelEmbedding` (tied embeddings)."""

    def __init__(self, dim: int, vocab_size: int, group, *, weight: nn.Parameter | None = None,
                 sequence_parallel: bool = False, stats: CommStats | None = None, device=None, dtype=None):
        super().__init__()
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel
        n = group_size(group)
        self.vocab_size, self.in_features = vocab_size, dim
        self.per_rank = padded_vocab(vocab_size, n) // n
        self.vocab_start = group_rank(group) * self.per_rank
        self.weight = weight if weight is not None else nn.Parameter(
            torch.empty(self.per_rank, dim, device=device, dtype=dtype))

    @classmethod
    @torch.no_grad()
    def from_dense(cls, linear: nn.Linear, group, weight: nn.Parameter | None = None, **kw) -> VocabParallelHead:
        if linear.bias is not None:
            raise UserError("a vocab-parallel output layer must have no bias")
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, group, weight=weight, device=w.device, dtype=w.dtype,
                **kw)
        if weight is None:
            m.weight.copy_(vocab_shard(w, m.vocab_start, m.per_rank))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return f_sp_linear.apply(None, x, self.weight, None, self.group, self.stats)
        return F.linear(f.apply(x, self.group, self.stats), self.weight)

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(local logits, targets) -> sum of token losses, the full loss on every tp rank."""
        return VocabParallelLoss(self.group, self.vocab_start, self.vocab_size, self.stats)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, vocab={self.vocab_size} ({self.per_rank} per rank from {self.vocab_start})"


# --------------------------------------------------------------------------- vocab-parallel cross-entropy


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary shards (Megatron-LM Sec. 3): the max and then
    [sum of exp, target logit] are all-reduced over tp (two messages of one or two numbers per token).
    Backward is softmax - onehot on the local shard; the softmax is the only tensor saved."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, stats):
        n_local = logits.shape[-1]
        real = vocab_size - vocab_start  # columns of this shard that are real tokens (the rest is padding)
        if real < n_local:
            logits = logits.clone()
            logits[:, max(real, 0):] = float("-inf")
        m = logits.max(dim=-1).values
        all_reduce_(m, group, stats, op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~mine, 0)
        picked = torch.where(mine, shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp_()
        both = torch.stack([exp.sum(dim=-1), picked])
        all_reduce_(both, group, stats)
        sum_exp, picked = both[0], both[1]
        exp.div_(sum_exp.unsqueeze(-1))  # softmax
        ctx.save_for_backward(exp, local_t, mine)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int,
                                 vocab_size: int, stats: CommStats | None = None) -> torch.Tensor:
    """Cross-entropy of every token, (N, V'/n) local logits and (N,) global target ids -> (N,) losses,
    identical on every tp rank. Columns at or past `vocab_size` (padding) are excluded."""
    return _VocabParallelCE.apply(logits, target, vocab_start, vocab_size, group, stats)


class VocabParallelLoss:
    """The engine's loss_fn under tp: the sum of token losses of this rank's tokens. tp ranks hold the same
    tokens and each returns the full sum, so the trainer's sum over dp counts every token once and reports
    the single-process loss; backward gives each rank exactly its shard's logit gradients."""

    def __init__(self, group, vocab_start: int, vocab_size: int, stats: CommStats | None = None):
        self.group, self.vocab_start, self.vocab_size, self.stats = group, vocab_start, vocab_size, stats

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        losses = vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), self.group,
                                              self.vocab_start, self.vocab_size, self.stats)
        return losses.sum()


# --------------------------------------------------------------------------- dropout streams


class RNGTracker:
    """Which random stream dropout draws from (Megatron's RNG tracker, made resumable).

    Shared mode is the trainer's own stream, identical on the tp ranks of a (dp, pp) rank, for regions
    whose activations are replicated over tp. Entering split mode (a region split over heads, or over the
    sequence with sequence parallelism) draws one number from the shared stream (the same on every tp
    rank, so the shared streams stay in step) and seeds the device generator from (that number, tp rank);
    leaving it restores the shared stream. Split streams are thus different per tp rank and a pure function
    of the checkpointed shared state, so a resumed run draws the same masks without extra state.
    Modes nest (push / pop), e.g. a replicated dropout inside a head-split attention module.
    """

    def __init__(self, tp_rank: int, device: torch.device):
        self.tp_rank = tp_rank
        self.device = torch.device(device)
        self._stack: list[str] = []
        self._shared_state: torch.Tensor | None = None

    @property
    def mode(self) -> str:
        return self._stack[-1] if self._stack else "shared"

    def _generator(self) -> torch.Generator:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index or 0]
        return torch.default_generator

    def _switch(self, to: str) -> None:
        gen = self._generator()
        if to == "split":
            draw = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator))
            self._shared_state = gen.get_state()
            gen.manual_seed(name_seed(draw, f"tp{self.tp_rank}"))
        else:
            gen.set_state(self._shared_state)
            self._shared_state = None

    def push(self, mode: str) -> None:
        if mode not in ("shared", "split"):
            raise ValueError(f"unknown RNG mode {mode!r}")
        before = self.mode
        self._stack.append(mode)
        if mode != before:
            self._switch(mode)

    def pop(self) -> None:
        left = self._stack.pop()
        if left != self.mode:
            self._switch(self.mode)

    def reset(self) -> None:
        """Back to the shared stream (after an exception left a region open)."""
        while self._stack:
            self.pop()

    @contextmanager
    def region(self, mode: str):
        self.push(mode)
        try:
            yield
        finally:
            self.pop()

    def attach(self, module: nn.Module, mode: str) -> None:
        """Run `module`'s forward in `mode`."""
        module.register_forward_pre_hook(lambda m, args: self.push(mode))
        module.register_forward_hook(lambda m, args, out: self.pop(), always_call=True)
