"""The grid of 2D / 2.5D / 3D tensor parallelism: its shape, one rank's place and groups in it, and placements.

The t ranks of a tensor-parallel group form the grid `arange(t).view(depth, q, q)`; a rank's local tp rank
r = k q^2 + i q + j gives its depth k, row i and column j:

    2d   (Optimus, Xu et al., arXiv 2104.05343):     depth 1, q x q = t        (SUMMA on one q x q layer)
    2.5d (Tesseract, Wang et al., arXiv 2105.14500): depth d, d x q x q = t    (d SUMMA layers, weights replicated)
    3d   (Bian et al., arXiv 2105.14450):            depth q, q x q x q = t    (all-gather / reduce-scatter cube)

The groups come from the Mesh (`ParallelDims.tp_subgroups`, named by what they are): `row` = this rank's grid
row (same k, i; every j), `col` = its grid column (same k, j; every i), `dep` = its depth fibre (same i, j), and
in 3d the planes `dep_row` (every k and j; same i) and `dep_col` (every k and i; same j). Members are in
increasing rank order, so a member's index in `row` is j, in `col` i, in `dep` k, in `dep_row` k q + j and in
`dep_col` k q + i.

A `Placement` says which elements of a plain-model tensor a rank holds: a sequence of (dim, n, axis, parts) chunk
steps, each keeping chunk `coord[axis]` of n along dim (`parts` > 1: each of the fused q / k / v blocks is chunked
separately, so a rank's rows are [q_c; k_c; v_c] as the model's `view(B, T, 3, heads, hs)` expects), after an
optional zero padding of dim 0 (a vocabulary rounded up to a multiple of the grid). The same placement slices the
initialised full weights into the rank's shard, gives the meta-device shape for the planner, and — applied to
`arange(numel)` — the global index of every local element for gathering the full state. One source of truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.grid import GridShape, grid_shape

AXES = ("k", "i", "j")


def shape_of(par) -> GridShape:
    """The grid of validated parallel dims (a `ParallelConfig` or the mesh's `ParallelDims`: tp, tp_mode, tp_depth)
    with tp_mode 2d, 2.5d or 3d; the arithmetic is `distributed.grid`'s."""
    shape = grid_shape(par.tp_mode, par.tp, par.tp_depth)
    if shape is None:
        raise ValueError(f"parallel.tp ({par.tp}) is not a {par.tp_mode} grid")
    return shape


# --------------------------------------------------------------------------- placements


@dataclass(frozen=True)
class Step:
    dim: int
    n: int
    axis: str  # k, i or j
    parts: int = 1


@dataclass(frozen=True)
class Placement:
    """Which elements of the plain tensor a rank holds (module docstring)."""

    steps: tuple[Step, ...]
    pad_rows: int | None = None  # dim 0 zero-padded (or `fill`-padded) to this many rows first

    def take(self, full: torch.Tensor, coords: dict[str, int], fill: float | int = 0) -> torch.Tensor:
        x = full
        if self.pad_rows is not None and self.pad_rows > x.shape[0]:
            pad = torch.full((self.pad_rows - x.shape[0], *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
            x = torch.cat([x, pad], 0)
        for s in self.steps:
            size = x.shape[s.dim]
            blocks = x.unflatten(s.dim, (s.parts, s.n, size // (s.parts * s.n)))
            x = blocks.select(s.dim + 1, coords[s.axis]).flatten(s.dim, s.dim + 1)
        return x

    def local_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        if self.pad_rows is not None:
            shape[0] = max(shape[0], self.pad_rows)
        for s in self.steps:
            shape[s.dim] //= s.n
        return tuple(shape)

    def global_index(self, full_shape: tuple[int, ...], coords: dict[str, int]) -> torch.Tensor:
        """For each local element (row-major), its flat index in the plain tensor, or -1 for padding."""
        index = torch.arange(math.prod(full_shape), dtype=torch.long).view(full_shape)
        return self.take(index, coords, fill=-1).reshape(-1)


def chunk(dim: int, n: int, axis: str, parts: int = 1) -> Step:
    return Step(dim, n, axis, parts)


def padded(rows: int, multiple: int) -> int:
    """`rows` rounded up to a multiple of `multiple` (a vocabulary split over the grid)."""
    return multiple * math.ceil(rows / multiple)


# --------------------------------------------------------------------------- one rank's grid


@dataclass
class Grid:
    """One rank's place in the grid and the groups it communicates on (module docstring). Groups of one
    rank are None (nothing to communicate)."""

    shape: GridShape
    k: int
    i: int
    j: int
    row: object = None
    col: object = None
    dep: object = None
    dep_row: object = None
    dep_col: object = None
    stats: CommStats | None = None

    @property
    def q(self) -> int:
        return self.shape.q

    @property
    def coords(self) -> dict[str, int]:
        return {"k": self.k, "i": self.i, "j": self.j}

    @classmethod
    def from_mesh(cls, mesh, stats: CommStats | None) -> Grid:
        shape = shape_of(mesh.dims)
        c = shape.coords(mesh.local_rank("tp"))
        names = {"row": "tp_row", "col": "tp_col", "dep": "tp_dep", "dep_row": "tp_dep_row", "dep_col": "tp_dep_col"}
        groups = {field: mesh.group(name) if name in mesh.groups else None for field, name in names.items()}
        return cls(shape, c["k"], c["i"], c["j"], stats=stats, **groups)
