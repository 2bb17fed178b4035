"""ParallelDims (validated, frozen) and the Mesh of process groups it builds.

The rank grid is one line, `torch.arange(world).view(pp, dp, cp, tp)`: tp varies fastest so a tensor-parallel
group stays inside a node, pp is outermost. Context parallelism (cp, docs/context_parallel.md) sits next to tp,
inside dp (Megatron-core's order `tp-cp-ep-dp-pp`): after tp it moves the most bytes (a key/value chunk per layer
and ring step, or four all-to-alls per layer), on the critical path of every attention, so its ranks are kept as
close as tp's; dp reduces gradients once per step and overlaps them with backward. The cp ranks of one dp rank
hold the same parameters and different tokens, so gradients are reduced (and ZeRO shards) over `dp_cp`, the dp x
cp ranks of a (pp, tp) position, as FSDP over dp x cp in torchtitan; with experts over `edp_cp` (edp x cp).

Every group is created with the run's timeout, so a rank that dies or a mismatched collective fails within
`parallel.timeout_s` instead of hanging. A Mesh of size 1 needs no process group at all: every group is None and the
collectives in `scaletrain.distributed.comm` are no-ops, so the single-process run is the same code path with
trivial groups.

Expert parallelism is carved from dp rather than being a grid axis: `ep` groups (each dp group cut into
dp/ep runs of ep consecutive dp ranks, which split the experts) and `edp` groups (the ranks of a dp group
holding the same experts, over which expert gradients are reduced) are built as extra groups (docs/moe.md).

2D, 2.5D and 3D tensor parallelism (`parallel.tp_mode`, docs/tensor_parallel.md) arrange the t ranks of a tp group
as a grid, `arange(t).view(depth, rows, cols)`: (1, q, q) for 2d (Optimus, arXiv 2104.05343), (d, q, q) for 2.5d
(Tesseract, arXiv 2105.14500), (q, q, q) for 3d (Bian et al., arXiv 2105.14450). Its groups are named by what they
are, not by the coordinate that varies: `tp_row` is this rank's grid row (same depth and row, every column),
`tp_col` its grid column, `tp_dep` its depth fibre, `tp_dep_row` / `tp_dep_col` the planes of every depth and
column (row) through it (3d), and `dp_dep` the ranks holding the same 2.5d weights (every dp and depth
coordinate). `ParallelDims.tp_subgroups()` lists those a mode uses; `Mesh.build` creates them after the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from scaletrain.config.schema import TP_MODES
from scaletrain.distributed.grid import grid_shape
from scaletrain.errors import ConfigError

ORDER = ("pp", "dp", "cp", "tp")  # outermost to innermost
EXPERT_DIMS = ("ep", "edp")  # groups inside dp (expert parallelism), built after the grid's
# gradient-reduction groups under context parallelism: the grid axes (of the (pp, dp/ep, ep, cp, tp) view) they span
CP_GRAD_GROUPS = {"dp_cp": (1, 2, 3), "edp_cp": (1, 3)}
# the tp grid's groups: the axes of the (pp, dp, depth, row, col) view that vary inside each
TP_GRID_GROUPS = {"tp_row": (4,), "tp_col": (3,), "tp_dep": (2,), "tp_dep_row": (2, 4), "tp_dep_col": (2, 3),
                  "dp_dep": (1, 2)}
_TP_SUBGROUPS = {"1d": (), "2d": ("tp_row", "tp_col"), "2.5d": ("tp_row", "tp_col", "tp_dep", "dp_dep"),
                 "3d": ("tp_row", "tp_col", "tp_dep", "tp_dep_row", "tp_dep_col")}


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism, carved from dp: not a grid axis of its own
    tp_mode: str = "1d"  # 1d (Megatron), 2d, 2.5d, 3d: how the tp group is arranged (module docstring)
    tp_depth: int = 1  # d of 2.5d
    cp: int = 1  # context parallelism: each sequence split over cp ranks (parallel/context/)

    def __post_init__(self) -> None:
        for name in (*ORDER, "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.cp > 1 and self.tp_mode != "1d":
            raise ConfigError(f"parallel.cp ({self.cp}) > 1 needs parallel.tp_mode=1d, got {self.tp_mode}")
        if self.dp % self.ep:
            raise ConfigError(f"parallel.ep ({self.ep}) must divide parallel.dp ({self.dp})")
        if self.tp_mode not in TP_MODES:
            raise ConfigError(f"parallel.tp_mode must be one of {', '.join(TP_MODES)}, got {self.tp_mode!r}")
        d, r, c = self.tp_grid()
        if d * r * c != self.tp:
            raise ConfigError(f"parallel.tp ({self.tp}) is not a {self.tp_mode} grid (parallel.tp_depth "
                              f"{self.tp_depth}): 2d needs q*q, 2.5d tp_depth*q*q, 3d q*q*q ranks")

    @classmethod
    def from_config(cls, par) -> ParallelDims:
        """The dims of a `config.ParallelConfig`."""
        return cls(pp=par.pp, dp=par.dp, tp=par.tp, ep=par.ep, tp_mode=par.tp_mode, tp_depth=par.tp_depth,
                   cp=par.cp)

    def tp_grid(self) -> tuple[int, int, int]:
        """(depth, rows, columns) of the tp group's grid; (1, 1, tp) for 1d."""
        if self.tp_mode == "1d":
            return 1, 1, self.tp
        shape = grid_shape(self.tp_mode, self.tp, self.tp_depth)
        return (shape.depth, shape.q, shape.q) if shape is not None else (0, 0, 0)

    def tp_subgroups(self) -> tuple[str, ...]:
        """Names of the tp grid's groups this mode uses (module docstring)."""
        return _TP_SUBGROUPS[self.tp_mode]

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in ORDER)

    def grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(*self.sizes())

    def coords(self, rank: int) -> dict[str, int]:
        idx = (self.grid() == rank).nonzero()[0].tolist()
        return dict(zip(ORDER, idx))

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups along `dim`: lists of global ranks that differ only in that coordinate (for the tp grid's
        groups, `TP_GRID_GROUPS`, in the coordinates that vary inside it), each in increasing rank order."""
        if dim in EXPERT_DIMS:
            return self.expert_group_ranks(dim)
        if dim in CP_GRAD_GROUPS:  # dp x cp (edp x cp): every listed axis of the (pp, dp/ep, ep, cp, tp) view varies
            axes = CP_GRAD_GROUPS[dim]
            g = self.grid().view(self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)
            g = g.movedim(axes, tuple(range(5 - len(axes), 5)))
            return g.reshape(-1, math.prod(g.shape[5 - len(axes):])).tolist()
        if dim in TP_GRID_GROUPS:
            axes = TP_GRID_GROUPS[dim]
            g = self.grid().view(self.pp, self.dp, *self.tp_grid())  # cp = 1 (ParallelDims refuses the grid with cp)
            g = g.movedim(axes, tuple(range(5 - len(axes), 5)))
            return g.reshape(-1, math.prod(g.shape[5 - len(axes):])).tolist()
        axis = ORDER.index(dim)
        g = self.grid().movedim(axis, -1).reshape(-1, getattr(self, dim))
        return g.tolist()

    def expert_group_ranks(self, dim: str) -> list[list[int]]:
        """`ep`: each dp group cut into dp/ep groups of ep consecutive dp ranks (they split the experts);
        `edp` (expert data parallel): the ranks of one dp group holding the same experts, i.e. the same
        position in their ep group (expert gradients are reduced over these only)."""
        dp_groups = torch.tensor(self.group_ranks("dp")).view(-1, self.dp // self.ep, self.ep)  # (n, dp/ep, ep)
        g = dp_groups if dim == "ep" else dp_groups.transpose(1, 2)
        return g.reshape(-1, g.shape[-1]).tolist()


@dataclass
class Mesh:
    dims: ParallelDims
    rank: int = 0
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, dims: ParallelDims, timeout_s: float = 300.0) -> Mesh:
        """Create the groups of every dimension (collectively: all ranks must call this)."""
        if dims.world_size == 1:
            names = (*ORDER, *EXPERT_DIMS, *CP_GRAD_GROUPS)
            return cls(dims, 0, {n: None for n in names}, {n: [0] for n in names})
        if not dist.is_initialized():
            raise RuntimeError("Mesh.build needs torch.distributed to be initialised for world size > 1")
        if dist.get_world_size() != dims.world_size:
            raise ConfigError(f"layout needs {dims.world_size} processes, the job has {dist.get_world_size()}")
        rank = dist.get_rank()
        timeout = timedelta(seconds=timeout_s)
        groups: dict[str, dist.ProcessGroup | None] = {}
        members: dict[str, list[int]] = {}
        for dim in ORDER:
            for ranks in dims.group_ranks(dim):  # every rank creates every group, in the same order
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[dim], members[dim] = g, ranks
        for dim in EXPERT_DIMS:
            if dims.ep == 1:  # no expert parallelism: no extra groups; experts replicate like dense weights
                groups[dim], members[dim] = (None, [rank]) if dim == "ep" else (groups["dp"], members["dp"])
                continue
            for ranks in dims.group_ranks(dim):
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[dim], members[dim] = g, ranks
        for dim in dims.tp_subgroups():  # the 2d / 2.5d / 3d grid (module docstring)
            for ranks in dims.group_ranks(dim):
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[dim], members[dim] = g, ranks
        for dim, alias in (("dp_cp", "dp"), ("edp_cp", "edp")):  # gradient reduction over dp x cp (docstring)
            if dims.cp == 1:
                groups[dim], members[dim] = groups[alias], members[alias]
                continue
            for ranks in dims.group_ranks(dim):
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[dim], members[dim] = g, ranks
        return cls(dims, rank, groups, members)

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return self.groups[dim]

    def size(self, dim: str) -> int:
        if dim == "edp":
            return self.dims.dp // self.dims.ep
        if dim in TP_GRID_GROUPS or dim in CP_GRAD_GROUPS:
            return len(self.members[dim])
        return getattr(self.dims, dim)

    def local_rank(self, dim: str) -> int:
        return self.members[dim].index(self.rank)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def close(self) -> None:
        """Destroy the groups this mesh created, after every rank has met (all ranks call this together, when the
        run is over). A process that trains several layouts one after the other (the layout matrix's persistent
        ranks) would otherwise keep every layout's gloo groups: each holds its own connection-loop and worker
        threads, which keep waking up (measured: 40 idle groups cost a rank 4% of a core, and a matrix job of 88
        layouts had reached 484 threads per rank)."""
        if self.dims.world_size == 1 or not dist.is_initialized():
            return
        dist.barrier()
        seen: set[int] = set()
        for g in self.groups.values():
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                dist.destroy_process_group(g)
        self.groups = {name: None for name in self.groups}
