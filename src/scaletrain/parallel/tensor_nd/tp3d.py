"""3D tensor parallelism: Bian, Xu, Wang & You, "Maximizing Parallelism in Distributed Training for Huge Neural
Networks", arXiv 2105.14450, on a q x q x q cube.

Rank (k, i, j) (depth, row, column; `grid.py`). The paper's processor (i, j, l) holds X_ijl and A_lji, all-gathers
X over j, A over i and reduce-scatters Y over l; here the weight axis is the depth k, and the input-gather and
output-scatter axes alternate between the grid row and column from one linear to the next (the paper's
alternating layout, Colossal-AI's "swap_in_out_group"):

    residual stream (the input of qkv / fc / the head, the output of the projections)
                     sequences block k q + j of q^2, hidden block i of q
    type A linear (qkv, fc, SwiGLU gate and up, head), W (out x in): rank holds output piece k of output block j
                     (q / k / v blocked separately), input block i: W is out/q^2 x in/q
                     forward: all-gather X along the row (sequences block k), all-gather W along the depth (output
                     block j), Y = X W^T, reduce-scatter Y along the column: sequences block k q + i, output block j
    type B linear (the projections): rank holds output piece k of output block i, input block j
                     forward: all-gather X along the column, W along the depth, reduce-scatter along the row:
                     back to the residual layout
    backward of both: all-gather dY along the output group, re-gather X and W, dX = dY W reduce-scattered along the
                     input group, dW = dY^T X reduce-scattered along the depth.
    attention        local: its sequences, heads block j of q (the type A layout of qkv's output)
    layer norm       hidden block i: mean and variance all-reduced along the column (common.py)
    vectors          (biases, norm weights, positions) block of their features, replicated over the plane of the
                     q^2 ranks holding that block (type A bias: the depth-column plane, everything on the residual
                     stream: the depth-row plane); their gradients are all-reduced over the plane (Colossal-AI's
                     choice; the paper does not treat them).
    embedding / head table (V' x h, V' = V rounded up to a multiple of q^2)
                     vocabulary piece j q + k of q^2, hidden block i: the head is a type A linear, the embedding looks
                     up all ids in its piece and reduce-scatters along the depth-row plane (sequences block k q + j).
    loss             logits are sequences block k q + i x vocabulary block j: vocabulary-parallel cross-entropy
                     along the row, the value summed over the depth-column plane.

Deviation: the paper's (and Colossal-AI's) backward reuses the gathered X and W of the forward; we keep only the
rank's own blocks and all-gather them again in backward (two more all-gathers per linear, each the size of the
forward's), so that a layer's saved activations are 1/q^3 of one process's, as the paper's memory analysis
counts, rather than 1/q^2 for the gathered inputs. As in 2D, the vocabulary is padded rather than required
divisible, and each rank's loss is all-reduced (value only) for the trainer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.parallel.tensor_nd.comm import all_gather, reduce_scatter, scatter_rows, sum_grad
from scaletrain.parallel.tensor_nd.common import GridLayerNorm, GridLoss, shard_param, vocab_lookup
from scaletrain.parallel.tensor_nd.grid import Grid, Placement, chunk, padded

ROLES = ("A", "B")


def weight_placement(q: int, role: str, parts: int = 1) -> Placement:
    out_axis, in_axis = ("j", "i") if role == "A" else ("i", "j")
    return Placement((chunk(0, q, out_axis, parts), chunk(0, q, "k"), chunk(1, q, in_axis)))


def bias_placement(q: int, role: str, parts: int = 1) -> Placement:
    return Placement((chunk(0, q, "j" if role == "A" else "i", parts),))


def residual_vector_placement(q: int, dim: int = 0) -> Placement:
    return Placement((chunk(dim, q, "i"),))


def table_placement(q: int, vocab: int) -> Placement:
    return Placement((chunk(0, q, "j"), chunk(0, q, "k"), chunk(1, q, "i")), pad_rows=padded(vocab, q * q))


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, g_in, g_out, g_dep, stats):
        ctx.save_for_backward(x, w)
        ctx.groups, ctx.stats = (g_in, g_out, g_dep), stats
        xg = all_gather(x.reshape(-1, x.shape[-1]), 0, g_in, stats)
        wg = all_gather(w, 0, g_dep, stats)
        y = reduce_scatter(xg @ wg.t(), 0, g_out, stats)
        return y.view(*x.shape[:-1], wg.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        g_in, g_out, g_dep = ctx.groups
        stats = ctx.stats
        dyg = all_gather(dy.reshape(-1, dy.shape[-1]), 0, g_out, stats)
        xg = all_gather(x.reshape(-1, x.shape[-1]), 0, g_in, stats)
        wg = all_gather(w, 0, g_dep, stats)
        dx = reduce_scatter(dyg @ wg, 0, g_in, stats)
        dw = reduce_scatter(dyg.t() @ xg, 0, g_dep, stats)
        return dx.view_as(x), dw, None, None, None, None


def _mark_replica(p: nn.Parameter, owner: bool) -> nn.Parameter:
    if not owner:
        p._st_norm_owner = False  # a copy: its gradient norm counts on the plane's first member only
    return p


class Linear3D(nn.Module):
    """A type A or type B linear layer on the cube (module docstring)."""

    def __init__(self, dense: nn.Linear, grid: Grid, role: str, parts: int = 1):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role must be A or B, got {role!r}")
        self.grid, self.role, self.parts = grid, role, parts
        self.in_features, self.out_features = dense.in_features, dense.out_features
        g = grid
        self.g_in, self.g_out = (g.row, g.col) if role == "A" else (g.col, g.row)
        self.plane = g.dep_col if role == "A" else g.dep_row
        self.weight = shard_param(dense.weight, weight_placement(g.q, role, parts), g.coords)
        owner = g.k == 0 and (g.i == 0 if role == "A" else g.j == 0)
        self.bias = _mark_replica(shard_param(dense.bias, bias_placement(g.q, role, parts), g.coords), owner) \
            if dense.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        y = _Linear3D.apply(x, self.weight, self.g_in, self.g_out, g.dep, g.stats)
        if self.bias is not None:
            y = y + sum_grad(self.bias, self.plane, g.stats)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, role={self.role}, parts={self.parts}"


class Head3D(nn.Module):
    """The output layer, a type A linear without bias over the padded vocabulary (may share the table)."""

    def __init__(self, dense: nn.Linear, grid: Grid, weight: nn.Parameter | None = None):
        super().__init__()
        self.grid, self.vocab_size = grid, dense.out_features
        self.weight = weight if weight is not None else shard_param(
            dense.weight, table_placement(grid.q, dense.out_features), grid.coords)

    @property
    def vocab_start(self) -> int:
        return self.grid.j * self.weight.shape[0] * self.grid.q  # vocabulary block j of q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        return _Linear3D.apply(x, self.weight, g.row, g.col, g.dep, g.stats)


class Embedding3D(nn.Module):
    """Token embedding: vocabulary piece j q + k, hidden block i; all ids looked up, the depth-row plane sums the
    pieces and keeps sequences block k q + j."""

    def __init__(self, dense: nn.Embedding, grid: Grid):
        super().__init__()
        self.grid, self.vocab_size = grid, dense.num_embeddings
        self.weight = shard_param(dense.weight, table_placement(grid.q, dense.num_embeddings), grid.coords)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.grid
        out = vocab_lookup(idx, self.weight, (g.j * g.q + g.k) * self.weight.shape[0])
        return scatter_rows(out, g.dep_row, g.stats)


class Position3D(nn.Module):
    """Learned positions (T, h): hidden block i, replicated over the depth-row plane."""

    def __init__(self, dense: nn.Embedding, grid: Grid):
        super().__init__()
        self.grid = grid
        self.weight = _mark_replica(shard_param(dense.weight, residual_vector_placement(grid.q, 1), grid.coords),
                                    grid.k == 0 and grid.j == 0)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(pos, sum_grad(self.weight, self.grid.dep_row, self.grid.stats))


class Plan3D:
    """How the GPT's modules become 3D layers, and where this rank's pieces sit (see tp2d.Plan2D)."""

    def __init__(self, grid: Grid, micro_batch: int, d_model: int):
        self.grid, self.h = grid, d_model
        self.block = micro_batch // (grid.q * grid.q)

    def residual_rows(self) -> tuple[int, int]:
        g = self.grid
        return (g.k * g.q + g.j) * self.block, self.block

    def attention_rows(self) -> tuple[int, int]:
        g = self.grid
        return (g.k * g.q + g.i) * self.block, self.block

    def feature_block(self) -> int:
        return self.grid.i

    def head_block(self) -> int:
        return self.grid.j


    def linear(self, dense: nn.Linear, role: str, parts: int = 1) -> nn.Module:
        return Linear3D(dense, self.grid, role, parts)

    def norm(self, ln: nn.LayerNorm) -> nn.Module:
        g = self.grid
        owner = g.k == 0 and g.j == 0

        def vec(t: nn.Parameter) -> nn.Parameter:
            return _mark_replica(shard_param(t, residual_vector_placement(g.q), g.coords), owner)

        return GridLayerNorm(ln, vec(ln.weight), vec(ln.bias) if ln.bias is not None else None, g.col,
                             lambda p: sum_grad(p, g.dep_row, g.stats), g.stats)

    def embedding(self, emb: nn.Embedding) -> nn.Module:
        return Embedding3D(emb, self.grid)

    def position(self, emb: nn.Embedding) -> nn.Module:
        return Position3D(emb, self.grid)

    def head(self, dense: nn.Linear, tied: nn.Parameter | None) -> nn.Module:
        return Head3D(dense, self.grid, tied)

    def loss(self, head: nn.Module) -> GridLoss:
        g = self.grid
        row0, rows = self.attention_rows()  # logits have the type A layout
        return GridLoss(g.row, head.vocab_start, head.vocab_size, row0, rows, [g.dep_col], g.stats)
