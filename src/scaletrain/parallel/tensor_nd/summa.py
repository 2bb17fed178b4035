"""SUMMA on one q x q layer of the grid: the three block products of 2D (Optimus) and 2.5D (Tesseract) layers.

Van de Geijn & Watts, "SUMMA: Scalable Universal Matrix Multiplication Algorithm" (1997), as Optimus (Xu et al.,
arXiv 2104.05343, Sec. 3) uses it for the forward and backward of a linear layer. Matrices are split into
q x q blocks, block (i, j) on the rank in grid row i and column j (`grid.Grid`); `row` is that rank's grid row
(members indexed by j), `col` its grid column (members indexed by i). For each l in 0..q-1:

    summa_ab   C_ij = sum_l mm(A_il, B_lj)   A_il broadcast along row i from column l, B_lj along column j from row l
    summa_abt  C_ic = sum_l mm(A_il, B_cl)   for each output column c: B_cl broadcast along column l from row c,
                                             the partial products reduced along row i to column c
    summa_atb  C_rj = sum_l mm(A_lr, B_lj)   for each output row r: A_lr broadcast along row l from column r,
                                             the partial products reduced along column j to row r

`mm` multiplies two blocks as stored (e.g. `x @ w.t()` for a weight kept as (out, in)), so the products
Y = X W^T, dX = dY W and dW = dY^T X of a linear layer, and those of the vocabulary head, are each one call
(tp2d.py). Broadcasts of step l + 1 are issued before the product of step l and the reduces run while the next
products are computed (gloo and NCCL run a group's collectives in issue order, and the row and column groups are
separate communicators). Each product moves (q - 1) blocks of each broadcast operand and (q - 1) blocks of the
reduced result per rank (comm.py's accounting). Sums are accumulated in the operands' dtype in the order
l = 0 .. q-1, which is not the order of one dense matmul: fp64 results agree to rounding (~1e-15).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scaletrain.parallel.tensor_nd.comm import broadcast, reduce
from scaletrain.parallel.tensor_nd.grid import Grid

MM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _bcast(x: torch.Tensor, mine: bool, src: int, group, g: Grid):
    buf = x if mine else torch.empty_like(x)
    return buf, broadcast(buf, src, group, g.stats, async_op=True)


def _wait(work) -> None:
    if work is not None:
        work.wait()


def summa_ab(a: torch.Tensor, b: torch.Tensor, g: Grid, mm: MM) -> torch.Tensor:
    """C_ij = sum_l mm(A_il, B_lj) (module docstring)."""
    a, b = a.contiguous(), b.contiguous()
    q = g.q

    def start(l: int):
        return _bcast(a, g.j == l, l, g.row, g), _bcast(b, g.i == l, l, g.col, g)

    out = None
    nxt = start(0)
    for l in range(q):
        (a_l, wa), (b_l, wb) = nxt
        if l + 1 < q:
            nxt = start(l + 1)
        _wait(wa)
        _wait(wb)
        part = mm(a_l, b_l)
        out = part if out is None else out.add_(part)
    return out


def summa_abt(a: torch.Tensor, b: torch.Tensor, g: Grid, mm: MM) -> torch.Tensor:
    """C_ic = sum_l mm(A_il, B_cl): B broadcast along columns, partials reduced along rows."""
    a, b = a.contiguous(), b.contiguous()
    q = g.q
    pending = []
    nxt = _bcast(b, g.i == 0, 0, g.col, g)
    for c in range(q):
        b_c, wb = nxt
        if c + 1 < q:
            nxt = _bcast(b, g.i == c + 1, c + 1, g.col, g)
        _wait(wb)
        part = mm(a, b_c).contiguous()
        pending.append((c, part, reduce(part, c, g.row, g.stats, async_op=True)))
    out = None
    for c, part, work in pending:
        _wait(work)
        if g.j == c:
            out = part
    return out


def summa_atb(a: torch.Tensor, b: torch.Tensor, g: Grid, mm: MM) -> torch.Tensor:
    """C_rj = sum_l mm(A_lr, B_lj): A broadcast along rows, partials reduced along columns."""
    a, b = a.contiguous(), b.contiguous()
    q = g.q
    pending = []
    nxt = _bcast(a, g.j == 0, 0, g.row, g)
    for r in range(q):
        a_r, wa = nxt
        if r + 1 < q:
            nxt = _bcast(a, g.j == r + 1, r + 1, g.row, g)
        _wait(wa)
        part = mm(a_r, b).contiguous()
        pending.append((r, part, reduce(part, r, g.col, g.stats, async_op=True)))
    out = None
    for r, part, work in pending:
        _wait(work)
        if g.i == r:
            out = part
    return out
