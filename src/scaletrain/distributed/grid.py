"""The shapes of 2D / 2.5D / 3D tensor-parallel grids (Optimus arXiv 2104.05343, Tesseract arXiv 2105.14500, 3D
arXiv 2105.14450), without torch: the planner and `validate()` use them, so `scaletrain plan` starts without
importing torch; the grids themselves are in `scaletrain.parallel.tensor_nd.grid`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GridShape:
    mode: str
    depth: int
    q: int

    @property
    def size(self) -> int:
        return self.depth * self.q * self.q

    @property
    def row_blocks(self) -> int:
        """Blocks of sequences a micro-batch is split into: q (2d), d q (2.5d), q^2 (3d)."""
        return {"2d": self.q, "2.5d": self.depth * self.q, "3d": self.q * self.q}[self.mode]

    def coords(self, r: int) -> dict[str, int]:
        """(k, i, j) of local tp rank r."""
        return {"k": r // (self.q * self.q), "i": (r // self.q) % self.q, "j": r % self.q}


def _root(n: int, power: int) -> int | None:
    r = round(n ** (1.0 / power)) if n > 0 else 0
    for c in (r - 1, r, r + 1):
        if c > 0 and c**power == n:
            return c
    return None


def grid_shape(mode: str, tp: int, depth: int = 1) -> GridShape | None:
    """The grid of `tp` ranks in `mode`, or None when tp is not q^2 (2d), depth q^2 (2.5d) or q^3 (3d)."""
    if mode == "2d":
        q = _root(tp, 2)
        return GridShape(mode, 1, q) if q else None
    if mode == "2.5d":
        q = _root(tp // depth, 2) if depth >= 1 and tp % depth == 0 else None
        return GridShape(mode, depth, q) if q else None
    if mode == "3d":
        q = _root(tp, 3)
        return GridShape(mode, q, q) if q else None
    return None
