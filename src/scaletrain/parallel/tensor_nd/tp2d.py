"""2D tensor parallelism: Optimus (Xu, Li, Gong & You, "An Efficient 2D Method for Training Super-Large Deep
Learning Models", arXiv 2104.05343), SUMMA on a q x q grid. Also the layers of each depth layer of 2.5D (tp2p5d.py).

What rank (i, j) holds (row i, column j of its depth layer; B sequences of T tokens per micro-batch, hidden h):

    activations      every (rows, T, features) tensor as block (i, j): sequences block i of q (of the depth layer's
                     B/d in 2.5d), features block j of q (heads block j in attention). Nothing is replicated.
    linear W (out x in)   block (j, i): rows of output block j (q / k / v each blocked for the fused projection),
                     columns of input block i, i.e. block (i, j) of A = W^T in Y = X A (the paper's layout).
    its bias, layer-norm weight and bias, position table (h wide)
                     block j of q, then piece i of q of it (h / q^2 per rank): all-gathered along the grid column
                     before use, the gradient reduce-scattered back (the paper's and Colossal-AI's choice: no
                     parameter is replicated).
    embedding and head table (V' x h, V' = V rounded up to a multiple of q)
                     block (i, j): vocabulary block i, hidden block j; one tensor when tied.

Per layer (the paper's Sec. 3 algorithms):
    linear   forward Y = X A by SUMMA (q broadcasts of X blocks along rows, of W blocks along columns);
             backward dX = dY A^T (W broadcast along columns, partial dX reduced along rows) and dA = X^T dY (X
             broadcast along rows, partial dA reduced along columns): 6 collectives of q steps, the paper's count.
             The forward operands are not kept gathered: only the rank's own X block is saved.
    norm     mean and variance all-reduced along the row (the hidden blocks of the same sequences).
    attention  local to the rank: its sequences, its q-th of the heads (heads divisible by q).
    embedding  each rank looks up all the micro-batch's ids in its vocabulary block (zeros elsewhere), and the
             column reduce-scatters the sum over vocabulary blocks along the sequences (all-gather backward).
    head     logits L = X E^T by SUMMA (E broadcast along columns, partial logits reduced along rows): rank (i, j)
             gets sequences block i x vocabulary block j, and the vocabulary-parallel cross-entropy runs along
             the row (two all-reduces of one or two numbers per token, Megatron's).

Deviations: the layer norm's variance is two-pass (common.py); a rank's loss is all-reduced (value only) over the
column so every rank returns the micro-batch's loss for the trainer; the vocabulary is padded to a multiple of q
with masked logits (as our 1D layers do) instead of requiring V divisible by q.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.parallel.tensor_nd.comm import gather_vec, scatter_rows
from scaletrain.parallel.tensor_nd.common import GridLayerNorm, GridLoss, shard_param, vocab_lookup
from scaletrain.parallel.tensor_nd.grid import Grid, Placement, chunk, padded
from scaletrain.parallel.tensor_nd.summa import summa_ab, summa_abt, summa_atb


def weight_placement(q: int, parts: int = 1) -> Placement:
    """W (out, in): output block j (each of `parts` fused blocks separately), input block i."""
    return Placement((chunk(0, q, "j", parts), chunk(1, q, "i")))


def vector_placement(q: int, dim: int = 0, parts: int = 1) -> Placement:
    """A vector (or the hidden dim of a table) h wide: block j, then piece i of it."""
    return Placement((chunk(dim, q, "j", parts), chunk(dim, q, "i")))


def table_placement(q: int, vocab: int) -> Placement:
    """Embedding / head table (V, h): padded to V' rows, vocabulary block i, hidden block j."""
    return Placement((chunk(0, q, "i"), chunk(1, q, "j")), pad_rows=padded(vocab, q))


class _Linear2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, g):
        ctx.save_for_backward(x, w)
        ctx.g = g
        y = summa_ab(x.reshape(-1, x.shape[-1]), w, g, lambda a, b: a @ b.t())  # Y_ij = sum_l X_il W_lj^T
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        g = ctx.g
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = summa_abt(dy2, w, g, lambda a, b: a @ b)  # dX_ic = sum_l dY_il W_cl
        dw = summa_atb(x2, dy2, g, lambda a, b: b.t() @ a)  # dW_rj = sum_l dY_lj^T X_lr
        return dx.view_as(x), dw, None


class _Head2D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, e, g):
        ctx.save_for_backward(x, e)
        ctx.g = g
        logits = summa_abt(x.reshape(-1, x.shape[-1]), e, g, lambda a, b: a @ b.t())  # L_ic = sum_l X_il E_cl^T
        return logits.view(*x.shape[:-1], e.shape[0])

    @staticmethod
    def backward(ctx, dl):
        x, e = ctx.saved_tensors
        g = ctx.g
        x2, dl2 = x.reshape(-1, x.shape[-1]), dl.reshape(-1, dl.shape[-1])
        dx = summa_ab(dl2, e, g, lambda a, b: a @ b)  # dX_ij = sum_l dL_il E_lj
        de = summa_atb(dl2, x2, g, lambda a, b: a.t() @ b)  # dE_rj = sum_l dL_lr^T X_lj
        return dx.view_as(x), de, None


class Linear2D(nn.Module):
    """A linear layer on the q x q grid (module docstring); `parts` = 3 for the fused q / k / v projection."""

    def __init__(self, dense: nn.Linear, grid: Grid, parts: int = 1):
        super().__init__()
        self.grid, self.parts = grid, parts
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.weight = shard_param(dense.weight, weight_placement(grid.q, parts), grid.coords)
        self.bias = shard_param(dense.bias, vector_placement(grid.q, 0, parts), grid.coords) \
            if dense.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Linear2D.apply(x, self.weight, self.grid)
        if self.bias is not None:
            y = y + gather_vec(self.bias, self.grid.col, self.grid.stats)
        return y

    def extra_repr(self) -> str:
        q = self.grid.q
        return f"in={self.in_features}/{q}, out={self.out_features}/{q}, parts={self.parts}"


class Head2D(nn.Module):
    """The output layer: logits of sequences block i x vocabulary block j by SUMMA; may share its table with
    `Embedding2D` (tied)."""

    def __init__(self, dense: nn.Linear, grid: Grid, weight: nn.Parameter | None = None):
        super().__init__()
        self.grid, self.vocab_size = grid, dense.out_features
        self.weight = weight if weight is not None else shard_param(
            dense.weight, table_placement(grid.q, dense.out_features), grid.coords)

    @property
    def vocab_start(self) -> int:
        return self.grid.j * self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Head2D.apply(x, self.weight, self.grid)


class Embedding2D(nn.Module):
    """Vocabulary-parallel token embedding: vocabulary block i, hidden block j; the column sums the blocks and
    keeps sequences block i. `rows` selects this depth layer's sequences of the micro-batch (2.5d)."""

    def __init__(self, dense: nn.Embedding, grid: Grid, rows: tuple[int, int] | None = None):
        super().__init__()
        self.grid, self.rows, self.vocab_size = grid, rows, dense.num_embeddings
        self.weight = shard_param(dense.weight, table_placement(grid.q, dense.num_embeddings), grid.coords)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            idx = idx[self.rows[0]: self.rows[0] + self.rows[1]]
        out = vocab_lookup(idx, self.weight, self.grid.i * self.weight.shape[0])
        return scatter_rows(out, self.grid.col, self.grid.stats)


class Position2D(nn.Module):
    """Learned positions (T, h): hidden block j, piece i; gathered along the column for use."""

    def __init__(self, dense: nn.Embedding, grid: Grid):
        super().__init__()
        self.grid = grid
        self.weight = shard_param(dense.weight, vector_placement(grid.q, 1), grid.coords)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(pos, gather_vec(self.weight, self.grid.col, self.grid.stats, dim=1))


class Plan2D:
    """How the GPT's modules become 2D layers, and where this rank's pieces sit (used by the pass in
    `tensor_nd.__init__`). 2.5D (tp2p5d.Plan2p5D) is this plan on each depth layer."""

    def __init__(self, grid: Grid, micro_batch: int, d_model: int):
        self.grid, self.h = grid, d_model
        self.layer_rows = micro_batch // grid.shape.depth  # sequences of this depth layer
        self.block = self.layer_rows // grid.q  # sequences of this rank
        self.row0 = grid.k * self.layer_rows + grid.i * self.block  # its first sequence in the micro-batch

    # where this rank's activations sit in the global tensors (for dropout masks and the loss)
    def residual_rows(self) -> tuple[int, int]:
        """(first sequence, sequences) of the residual stream's block (also the attention's in 2D)."""
        return self.row0, self.block

    def attention_rows(self) -> tuple[int, int]:
        return self.row0, self.block

    def feature_block(self) -> int:
        """Which of the q hidden blocks the residual stream holds (the heads block in attention)."""
        return self.grid.j

    def head_block(self) -> int:
        return self.grid.j


    # the layers
    def linear(self, dense: nn.Linear, role: str, parts: int = 1) -> nn.Module:
        return Linear2D(dense, self.grid, parts)

    def norm(self, ln: nn.LayerNorm) -> nn.Module:
        g = self.grid
        w = shard_param(ln.weight, vector_placement(g.q), g.coords)
        b = shard_param(ln.bias, vector_placement(g.q), g.coords) if ln.bias is not None else None
        return GridLayerNorm(ln, w, b, g.row, lambda p: gather_vec(p, g.col, g.stats), g.stats)

    def embedding(self, emb: nn.Embedding) -> nn.Module:
        return Embedding2D(emb, self.grid)

    def position(self, emb: nn.Embedding) -> nn.Module:
        return Position2D(emb, self.grid)

    def head(self, dense: nn.Linear, tied: nn.Parameter | None) -> nn.Module:
        return Head2D(dense, self.grid, tied)

    def loss_value_groups(self) -> list:
        """Groups over which the loss of the rank's sequences is summed: the column (the other sequences)."""
        return [self.grid.col]

    def loss(self, head: nn.Module) -> GridLoss:
        g = self.grid
        return GridLoss(g.row, head.vocab_start, head.vocab_size, self.row0, self.block, self.loss_value_groups(),
                        g.stats)
