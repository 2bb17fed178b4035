"""A rank's training state as named global tensors: what the layout-independent checkpoint stores.

Every tensor of the training state gets a name that does not depend on the layout and its global shape, and
this rank's share of it is a list of `shards.Block`s (rectangles of the global tensor with the live local
tensors holding them). Names, for the plain model's parameter names `p` (`blocks.0.attn.qkv.weight`):

    model/p              the parameter, in the training dtype
    master/p             its fp32 master copy (bf16 / fp16 training, Micikevicius et al., arXiv 1710.03740)
    optim/p/exp_avg      AdamW's moments (arXiv 1711.05101), exp_avg_sq; `step` (0-d, float64)
    optim/p/row, col     Adafactor's factored second moment (arXiv 1804.04235), `v` for vectors, `m`, `step`
    optim/p/acc0, acc1   SM3's per-dimension accumulators (arXiv 1901.11150), `m`, `step`
    stale/p              PipeDream-2BW's older weight version W(t) (arXiv 2006.09503)
    rng/<stream>/torch   a random stream's state (per data-parallel x pipeline rank, see Trainer)

The factored statistics are those of the whole parameter (row/col of the global matrix, accumulators of length
global dim d), as the unsharded optimizers hold them: ZeRO and tensor parallelism replicate them on every rank
that holds part of the parameter (`parallel.zero_factored`). Element-wise state (moments, `v`, `m`) and masters
sit where the parameter's elements sit.

`engine_entries(engine)` reads the layout from the engine's own structures: ZeRO's flat groups and pieces
(`parallel.zero`), the tensor- and expert-parallel split marks on parameters (`_st_tp_shard`, `_st_ep_shard`),
the replicated optimizer, `ShardedFactored`, ZeRO-Infinity's files (`parallel.zero_nvme`), the pipeline's 2BW
weight versions. An optimizer of another kind gets its branch in `engine_entries` (and in `prepare_load` if it must
allocate state before a load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from scaletrain.train.shards import Block, IndexSpec, global_shape, local_blocks


@dataclass
class Entry:
    """One named global tensor: its shape and dtype, this rank's blocks of it, and what to run after they were
    loaded (for values held outside tensors, such as an optimizer's integer step count)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: list[Block] = field(default_factory=list)
    after_load: Callable[[], None] | None = None


def placement(p: torch.Tensor) -> tuple[Any, int, int]:
    """(spec, rank, n): how a local parameter is split by tensor or expert parallelism (spec None: whole)."""
    mark = getattr(p, "_st_tp_shard", None) or getattr(p, "_st_ep_shard", None)
    if mark is None and getattr(p, "_st_nd_index", None) is not None:  # a 2D / 2.5D / 3D grid block
        return IndexSpec(p._st_nd_index, tuple(p._st_nd[1])), 0, 1
    return mark if mark is not None else (None, 0, 1)


def _gshape(p: torch.Tensor) -> tuple[int, ...]:
    spec, _, n = placement(p)
    return global_shape(spec, tuple(p.shape), n)


class _Collector:
    """Builds the entries of one rank; blocks of one name from several holders are concatenated."""

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.entries: dict[str, Entry] = {}

    def add(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, blocks: list[Block],
            after_load: Callable[[], None] | None = None) -> None:
        e = self.entries.get(key)
        if e is None:
            self.entries[key] = Entry(tuple(shape), dtype, list(blocks), after_load)
            return
        if e.shape != tuple(shape):
            raise ValueError(f"{key}: shapes {e.shape} and {tuple(shape)} on one rank")
        e.blocks += blocks
        if after_load is not None:
            prev = e.after_load
            e.after_load = after_load if prev is None else (lambda a=prev, b=after_load: (a(), b()))

    def whole(self, key: str, p: torch.Tensor, data: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """`data`: a tensor shaped like the local parameter `p`, placed like it."""
        spec, r, n = placement(p)
        self.add(key, _gshape(p), dtype or data.dtype, local_blocks(spec, r, n, tuple(p.shape), data))

    def piece(self, key: str, p: torch.Tensor, a: int, b: int, data: torch.Tensor,
              dtype: torch.dtype | None = None) -> None:
        """`data`: the flat values of the local parameter's flat range [a, b)."""
        spec, r, n = placement(p)
        blocks = local_blocks(spec, r, n, tuple(p.shape), data, a, b) if b > a else []
        self.add(key, _gshape(p), dtype or data.dtype, blocks)

    def statistic(self, key: str, shape: tuple[int, ...], data: torch.Tensor) -> None:
        """A whole statistic of a parameter (replicated on every rank that holds it)."""
        self.add(key, shape, data.dtype, [Block((0,) * len(shape), tuple(shape), [data.view(shape)])])

    def scalar(self, key: str, get: Callable[[], float], put: Callable[[float], None]) -> None:
        """A number held outside tensors (a step count): saved as a 0-d float64 tensor."""
        holder = torch.tensor(float(get()), dtype=torch.float64)
        self.add(key, (), torch.float64, [Block((), (), [holder])], lambda: put(float(holder)))


# --------------------------------------------------------------------------- optimizers


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The replicated / ZeRO optimizers behind the engine's optimizer (expert parallelism has two)."""
    return list(optimizer.parts)


def _scalar_dtype() -> torch.dtype:
    """The dtype torch's AdamW gives its step counter (float64 when that is the default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _ensure_torch_state(opt: torch.optim.Optimizer) -> None:
    """Create the (zero) state a torch / scaletrain optimizer makes on its first step, so a load has targets."""
    from scaletrain.optim.base import PerParameterOptimizer

    for group in opt.param_groups:
        for t in group["params"]:
            if opt.state.get(t):
                continue
            if isinstance(opt, PerParameterOptimizer):
                opt._init_state(t, group)
            elif isinstance(opt, torch.optim.AdamW):
                if group.get("amsgrad"):
                    raise ValueError("AdamW with amsgrad is not checkpointed")
                opt.state[t] = {"step": torch.tensor(0.0, dtype=_scalar_dtype()),
                                "exp_avg": torch.zeros_like(t, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(t, memory_format=torch.preserve_format)}
            else:
                raise ValueError(f"optimizer {type(opt).__name__} is not checkpointed")


def prepare_load(engine) -> None:
    """Allocate every state tensor a load writes into: optimizer state that is created lazily on the first step."""
    from scaletrain.parallel.zero_factored import ShardedFactored

    for part in optimizer_parts(engine.optimizer):
        if _is_nvme(part):
            continue  # its load buffers are made by `_nvme_entries`
        if not isinstance(part.opt, ShardedFactored):
            _ensure_torch_state(part.opt)


def _torch_optimizer_state(c: _Collector, opt: torch.optim.Optimizer,
                           holders: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]]) -> None:
    """The state of a torch / scaletrain optimizer. `holders`: (parameter, the tensor the optimizer updates for it,
    flat range [a, b) of the parameter it covers or None for the whole parameter)."""
    for p, t, rng in holders:
        name = c.names[id(p)]
        st = opt.state[t]
        for key, value in st.items():
            full = f"optim/{name}/{key}"
            if key == "step":
                if isinstance(value, torch.Tensor):
                    c.scalar(full, lambda v=value: float(v), lambda x, v=value: v.fill_(x))
                else:
                    c.scalar(full, lambda s=st: s["step"], lambda x, s=st: s.__setitem__("step", int(x)))
            elif key in ("row", "col") or key.startswith("acc"):
                c.statistic(full, _statistic_shape(key, _gshape(p)), value)
            elif rng is None:
                c.whole(full, p, value)
            else:
                c.piece(full, p, rng[0], rng[1], value)


def _statistic_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Global shape of a factored statistic of a parameter of global `shape` (the unsharded optimizer's)."""
    if key == "row":
        return tuple(shape[:-1])
    if key == "col":
        return tuple(shape[:-2]) + tuple(shape[-1:])
    d = int(key[3:])
    return (shape[d],) if shape else (1,)


def _factored_state(c: _Collector, opt, pieces: list[tuple[torch.Tensor, int, int]]) -> None:
    """`ShardedFactored` (parallel/zero_factored.py): statistics of the whole parameter, element-wise state of
    the piece [a, b) of the local parameter, one step count `t` for all."""
    for i, (p, a, b) in enumerate(pieces):
        name = c.names[id(p)]
        for key, value in opt.state[i].items():
            full = f"optim/{name}/{key}"
            if key in ("row", "col") or key.startswith("acc"):
                c.statistic(full, _statistic_shape(key, _gshape(p)), value)
            else:
                c.piece(full, p, a, b, value)
        c.scalar(f"optim/{name}/step", lambda: opt.t, lambda x: setattr(opt, "t", int(x)))


def _replicated_entries(c: _Collector, o) -> None:
    from scaletrain.parallel.zero_factored import ShardedFactored

    if o.masters is not None:
        for p, m in zip(o.params, o.masters):
            c.whole(f"master/{c.names[id(p)]}", p, m)
    if isinstance(o.opt, ShardedFactored):
        _factored_state(c, o.opt, [(p, 0, p.numel()) for p in o.params])
        return
    targets = o.masters or o.params
    _torch_optimizer_state(c, o.opt, [(p, t, None) for p, t in zip(o.params, targets)])


def _zero_entries(c: _Collector, z) -> None:
    from scaletrain.parallel.zero_factored import ShardedFactored

    low = z.main_grads  # bf16 / fp16: fp32 masters
    for g in z.groups:
        for pc in g.pieces:
            name = c.names[id(pc.param)]
            if z.stage == 3:
                c.piece(f"model/{name}", pc.param, pc.a, pc.b, g.param_shard[pc.lo: pc.hi])
            if low:
                c.piece(f"master/{name}", pc.param, pc.a, pc.b, g.master[pc.lo: pc.hi])
    if isinstance(z.opt, ShardedFactored):
        pieces = []
        for g in z.groups:
            mine = {id(pc.param): pc for pc in g.pieces}
            for p in g.params:
                pc = mine.get(id(p))
                pieces.append((p, pc.a, pc.b) if pc else (p, 0, 0))
        _factored_state(c, z.opt, pieces)
        return
    holders = [(pc.param, t, (pc.a, pc.b)) for g in z.groups for pc, t in zip(g.pieces, g.piece_params)]
    _torch_optimizer_state(c, z.opt, holders)


def _nvme_entries(c: _Collector, z, load: bool) -> None:
    """ZeRO-Infinity (`parallel/zero_nvme.py`) keeps its shards in files: its `state_dict()` (in-memory ZeRO-3's
    form: a flat parameter / master shard per unit, AdamW state per piece) is mapped to our names when saving;
    when loading, the blocks are read into buffers of that form and written to the files by its
    `load_state_dict()` once all are in (the `after_load` of one entry)."""
    units = [(k, g) for k, g in enumerate(z.groups)]
    order = {id(t): (k, pc) for k, g in units for t, pc in zip(g.piece_params, g.pieces)}
    pieces = [order[id(t)] for pg in z.opt.param_groups for t in pg["params"]]
    low = z.master_cat == "masters"
    step = torch.zeros((), dtype=torch.float64)
    if load:
        flat = lambda dtype: [torch.zeros(g.shard, dtype=dtype) for _, g in units]  # noqa: E731
        sd = {"stage": 3, "dp": z.n, "param_shards": flat(z.groups[0].full.dtype),
              "adam": {"param_groups": z.opt.state_dict()["param_groups"], "state": {}}}
        if low:
            sd["masters"] = flat(torch.float32)
        moments = [flat(z.grad_dtype) for _ in range(2)]
        for i, (k, pc) in enumerate(pieces):
            sd["adam"]["state"][i] = {"step": step, "exp_avg": moments[0][k][pc.lo: pc.hi],
                                      "exp_avg_sq": moments[1][k][pc.lo: pc.hi]}
    else:
        sd = z.state_dict()
    adam = sd["adam"]["state"]
    loaded_steps: list[torch.Tensor] = []  # the blocks the pieces' step counts are read into
    for i, (k, pc) in enumerate(pieces):
        name = c.names[id(pc.param)]
        c.piece(f"model/{name}", pc.param, pc.a, pc.b, sd["param_shards"][k][pc.lo: pc.hi])
        if low:
            c.piece(f"master/{name}", pc.param, pc.a, pc.b, sd["masters"][k][pc.lo: pc.hi])
        if i in adam:
            for key in ("exp_avg", "exp_avg_sq"):
                c.piece(f"optim/{name}/{key}", pc.param, pc.a, pc.b, adam[i][key])
            c.scalar(f"optim/{name}/step", lambda st=adam[i]: float(st["step"]), lambda x: None)
            loaded_steps.append(c.entries[f"optim/{name}/step"].blocks[-1].views[0])
    if load and pieces:
        def commit() -> None:  # runs after the whole read (`after_load`), in any order among the entries
            t = float(loaded_steps[0]) if loaded_steps else 0.0  # one counter for all pieces in ZeRO-Infinity
            for i in adam:  # a step tensor per piece, as the in-memory optimizer has
                adam[i] = {**adam[i], "step": torch.tensor(t)}
            z.load_state_dict(sd)

        first = f"model/{c.names[id(pieces[0][1].param)]}"
        prev = c.entries[first].after_load
        c.entries[first].after_load = commit if prev is None else (lambda: (prev(), commit()))


def after_load_sync(engine) -> None:
    """After a load: copies of the parameters the optimizers keep in the parameters' own dtype (CPU-offloaded
    shards) take the loaded values (they are not stored separately)."""
    from scaletrain.parallel.zero import ZeroOptimizer

    with torch.no_grad():
        for part in optimizer_parts(engine.optimizer):
            if not isinstance(part, ZeroOptimizer) or part.main_grads:
                continue
            for g in part.groups:
                src = g.param_shard if part.stage == 3 else g.own(g.full)
                if g.master is not None and g.master.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
                    g.master.copy_(src)


# --------------------------------------------------------------------------- the engine


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the plain model (a tied parameter under its first name)."""
    return {id(p): n for n, p in module.named_parameters()}


def _is_nvme(part) -> bool:
    from scaletrain.parallel.zero_nvme import NvmeZeroOptimizer

    return isinstance(part, NvmeZeroOptimizer)


def engine_entries(engine, stale: bool = True, load: bool = False) -> dict[str, Entry]:
    """This rank's model, master, optimizer and 2BW entries (see the module docstring). `load`: entries to load
    into (an optimizer whose state is not resident gives buffers that it takes over after the load)."""
    from scaletrain.parallel.zero import ZeroOptimizer

    c = _Collector(param_names(engine.module))
    zero3 = set()
    for part in optimizer_parts(engine.optimizer):
        if _is_nvme(part):
            _nvme_entries(c, part, load)
            zero3.update(id(p) for g in part.groups for p in g.params)
        elif isinstance(part, ZeroOptimizer):
            _zero_entries(c, part)
            if part.stage == 3:
                zero3.update(id(p) for g in part.groups for p in g.params)
        else:
            _replicated_entries(c, part)
    for name, p in engine.module.named_parameters():
        if id(p) not in zero3:
            c.whole(f"model/{name}", p, p.data)
    versions = getattr(engine.pipeline, "versions", None)
    if stale and versions is not None:  # state_dict(): refuses while the next batch is in flight (undrained)
        for p, s in zip(versions.params, versions.state_dict()):
            c.whole(f"stale/{c.names[id(p)]}", p, s)
    return c.entries


def stale_entries_for_load(engine, available: set[str]) -> dict[str, Entry]:
    """2BW: allocate the older weight version and return its entries when the checkpoint has it (a checkpoint of
    a synchronous schedule has none: the first step then uses W(t) for both versions, as a fresh 2BW run does)."""
    versions = getattr(engine.pipeline, "versions", None)
    if versions is None:
        return {}
    names = param_names(engine.module)
    if not all(f"stale/{names[id(p)]}" in available for p in versions.params):
        versions.stale = None
        return {}
    versions.stale = [torch.empty_like(p.data) for p in versions.params]
    versions.in_flight = False
    c = _Collector(names)
    for p, s in zip(versions.params, versions.stale):
        c.whole(f"stale/{names[id(p)]}", p, s)
    return c.entries


@torch.no_grad()
def load_model_tensors(engine, tensors: dict[str, torch.Tensor]) -> None:
    """Set the model's parameters (and their masters and copies) from whole tensors by plain name (a new run
    started from other weights: optimizer state stays fresh)."""
    entries = {k: e for k, e in engine_entries(engine, stale=False, load=True).items()
               if k.split("/")[0] in ("model", "master")}
    for key, e in entries.items():
        full = tensors[key.partition("/")[2]]
        for b in e.blocks:
            src = full[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))]
            for v in b.views:
                v.copy_(src)
    for e in entries.values():
        if e.after_load is not None:
            e.after_load()
    after_load_sync(engine)


def rng_entries(streams: dict[str, dict[str, Any]]) -> dict[str, Entry]:
    """Random stream states (`rng/<stream>/torch`, and `cuda`), whole on each rank that has the stream."""
    out: dict[str, Entry] = {}
    for stream, state in streams.items():
        for kind in ("torch", "cuda"):
            if kind in state:
                t = state[kind]
                out[f"rng/{stream}/{kind}"] = Entry((t.numel(),), t.dtype, [Block((0,), (t.numel(),), [t])])
    return out

