"""Where a rank's pieces of a tensor sit in the whole tensor: rectangular blocks in global coordinates.

Every parallel layout holds a parameter (and its optimizer state) in one of three ways, or a composition:
whole; split along one dimension by tensor or expert parallelism (`parallel.tp_plan.ShardSpec`: `parts`
stacked blocks per rank, padding rows beyond `full`); or as a flat range [a, b) of the row-major elements of
the local tensor (ZeRO's flat shards, Rajbhandari et al., arXiv 1910.02054). The checkpoint stores each tensor
by its name and global shape as a set of rectangular chunks (torch.distributed.checkpoint's model), so this
module turns the three forms into rectangles:

- `flat_range_blocks(shape, a, b)`: the flat range as at most 2 x ndim - 1 rectangles, each of them a
  contiguous run of the range (so its data is a plain view of the flat shard);
- `spec_blocks(spec, rank, n, offsets, sizes)`: a rectangle of the local tensor cut at the boundaries of the
  spec's stacked parts and moved to its place in the whole tensor; padding rows are dropped.

`Block` is one rectangle with the local tensors that hold its values (one to read when saving; every
copy, e.g. a parameter and its offloaded master, to write when loading).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

Rect = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass
class Block:
    """One rectangle of a global tensor held by this rank: `offsets` and `sizes` in the global tensor, and
    the local tensors (views of live storage, each of shape `sizes`) that hold its values."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    views: list[torch.Tensor] = field(default_factory=list)


def flat_range_blocks(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Rectangles (offsets, sizes, start) tiling the row-major flat range [a, b) of a tensor of `shape`, in order;
    `start` is the flat index where the rectangle begins (its elements are the flat run [start, start + numel))."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= a <= b <= math.prod(shape):
        raise ValueError(f"flat range [{a}, {b}) is outside a tensor of shape {shape}")
    return list(_rects(shape, a, b)) if a < b else []


def _rects(shape: tuple[int, ...], a: int, b: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    if not shape:  # a scalar: the range is [0, 1)
        yield (), (), a
        return
    inner = math.prod(shape[1:])
    rest0 = (0,) * (len(shape) - 1)
    if a % inner:  # a partial first row
        row = a // inner
        end = min(b, (row + 1) * inner)
        for off, siz, start in _rects(shape[1:], a - row * inner, end - row * inner):
            yield (row, *off), (1, *siz), start + row * inner
        a = end
    if a >= b:
        return
    r0, r1 = a // inner, b // inner  # a is at a row start now
    if r1 > r0:  # whole rows
        yield (r0, *rest0), (r1 - r0, *shape[1:]), r0 * inner
        a = r1 * inner
    if a < b:  # a partial last row
        for off, siz, start in _rects(shape[1:], 0, b - r1 * inner):
            yield (r1, *off), (1, *siz), start + r1 * inner


def spec_blocks(spec, rank: int, n: int, offsets: tuple[int, ...], sizes: tuple[int, ...],
                local_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """The rectangle (`offsets`, `sizes`) of rank `rank`'s local tensor (of `local_shape`, split over `n` ranks by
    `spec`: a ShardSpec, or None for a whole tensor) as rectangles of the global tensor:
    (global offsets, sizes, start, length), where [start, start + length) is the rectangle's range along the split
    dimension relative to its own start (the part of the local rectangle that lands there)."""
    if spec is None:
        return [(tuple(offsets), tuple(sizes), 0, 0)]
    d = spec.dim
    k = local_shape[d] // spec.parts  # rows of one part on one rank
    out = []
    lo, hi = offsets[d], offsets[d] + sizes[d]
    s = lo
    while s < hi:
        j = s // k
        e = min(hi, (j + 1) * k)
        g0 = j * k * n + rank * k + (s - j * k)
        g1 = g0 + (e - s)
        if spec.full is not None:
            g1 = min(g1, spec.full)
        if g1 > g0:
            off = list(offsets)
            siz = list(sizes)
            off[d], siz[d] = g0, g1 - g0
            out.append((tuple(off), tuple(siz), s - lo, g1 - g0))
        s = e
    return out


@dataclass
class IndexSpec:
    """A local tensor whose elements sit at given flat indices of the whole tensor (`index`, row-major per local
    element, -1 for padding): the blocks of 2D / 2.5D / 3D tensor parallelism (`parallel/tensor_nd/`)."""

    index: torch.Tensor
    full_shape: tuple[int, ...]

    def global_shape(self, local_shape: tuple[int, ...], n: int) -> tuple[int, ...]:
        return tuple(self.full_shape)


def index_blocks(spec: IndexSpec, flat: torch.Tensor, a: int, b: int) -> list[Block]:
    """The elements [a, b) of a local tensor placed by `spec` (`flat`: their values, flat) as rectangles of the
    whole tensor: maximal runs of consecutive global indices within one row of the last dimension."""
    shape = tuple(spec.full_shape)
    last = shape[-1] if shape else 1
    idx = spec.index[a:b]
    if idx.numel() == 0:
        return []
    valid = idx >= 0
    brk = torch.ones_like(valid)
    brk[1:] = (idx[1:] != idx[:-1] + 1) | (idx[1:] % last == 0) | ~valid[:-1]
    starts = torch.nonzero(brk & valid).flatten().tolist()
    ends = torch.nonzero(brk[1:] | ~valid[1:]).flatten().add(1).tolist() + [idx.numel()]
    out, e = [], 0
    for i in starts:
        while ends[e] <= i:
            e += 1
        j = ends[e]
        g = int(idx[i])
        off = tuple(int(x) for x in torch.unravel_index(torch.tensor(g), shape)) if shape else ()
        sizes = (1,) * (len(shape) - 1) + (j - i,) if shape else ()
        out.append(Block(off, sizes, [flat[i:j].view(sizes)]))
    return out


def global_shape(spec, local_shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The whole tensor's shape for a local tensor of `local_shape` split by `spec` (None: whole) over n ranks."""
    return tuple(local_shape) if spec is None else tuple(spec.global_shape(tuple(local_shape), n))


def local_blocks(spec, rank: int, n: int, shape: tuple[int, ...], data: torch.Tensor, a: int = 0,
                 b: int | None = None) -> list[Block]:
    """The global blocks of a rank's local tensor of `shape` (split by `spec` over n ranks; None: whole): `data` is
    the local tensor itself, or (with `b`) the flat tensor holding the values of its flat range [a, b), a ZeRO shard
    piece."""
    shape = tuple(int(s) for s in shape)
    if isinstance(spec, IndexSpec):
        return index_blocks(spec, data.reshape(-1) if b is None else data, a, math.prod(shape) if b is None else b)
    if b is None:
        rects, flat = [((0,) * len(shape), shape, 0)], None
    else:
        rects, flat = flat_range_blocks(shape, a, b), data
    out: list[Block] = []
    for off, siz, start in rects:
        view = data if flat is None else flat[start - a: start - a + math.prod(siz)].view(siz)
        for g_off, g_siz, s, length in spec_blocks(spec, rank, n, off, siz, shape):
            part = view if spec is None else view.narrow(spec.dim, s, length)
            out.append(Block(g_off, g_siz, [part]))
    return out
