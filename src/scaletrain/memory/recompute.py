"""Activation recomputation (checkpointing) as a pass over whatever blocks the engine's module holds.

`memory.recompute` modes:

- `none`: autograd keeps every activation it needs.
- `full` (Chen et al., arXiv 1604.06174): each block keeps only its input; its forward runs again in
  backward to rebuild the rest. Costs about one extra forward of the blocks.
- `selective` (Korthikanti et al., arXiv 2205.05198): only the attention core
  softmax(QKᵀ/√d)V (with its dropout) is recomputed: the s×s tensors that dominate the activation
  memory of the standard kernel at a few percent of the FLOPs. With a flash kernel (our CPU default
  without dropout) the core keeps only its log-sum-exp, so the saving is that much smaller.
- `every:k` (Chen et al. Sec. 4.1, the √n trade-off): the blocks form segments of k consecutive
  blocks; only a segment's input is kept, and the whole segment is recomputed in its backward. L/k
  segment inputs plus one segment's activations during its recomputation; k ≈ √L minimises the sum.
  `every:1` is `full`.

Options on the kept checkpoints (block or segment inputs):

- `memory.partition_checkpoints` (ZeRO-R Pa, Rajbhandari et al., arXiv 1910.02054 Sec. 6.1): with tp > 1
  the block input is replicated on every tensor-parallel rank; each rank keeps only its 1/tp slice and
  the tp group all-gathers the input when backward recomputes the block.
- `memory.offload_activations` (ZeRO-R Pa+cpu): the kept checkpoints live in host memory (pinned on
  CUDA) between forward and backward. With `recompute=none`, every tensor a block saves is offloaded
  instead (what `torch.autograd.graph.save_on_cpu` does, with the accounting below).

Mechanics: each block's `forward` (or the model's `attn_core` method for `selective`) is replaced on
the instance by a call through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; parameter
names, state dicts and whatever layers a tensor-parallel pass swapped into the blocks are untouched.
The checkpoint stores its inputs through the saved-tensor hooks active around it, so partitioning and
offload are saved-tensor hooks placed around that call and see only the checkpoint's inputs. The RNG
state is stashed and restored by the checkpoint, so dropout masks are the same in the recomputation
and gradients are bit-identical to `none`. What the hooks keep is reported to the activation counter
of `device.accounting` (`count_kept`), so `mem_activations` is the bytes really kept on the device.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from scaletrain.config.parse import parse_recompute
from scaletrain.device.accounting import add_memory_report, count_kept, count_saved
from scaletrain.distributed.comm import all_gather_single
from scaletrain.errors import ConfigError
from scaletrain.memory.contiguous import Arena, Held, engine_arena, hold_copy
from scaletrain.model.dropout import GlobalDropout, dropout_context
from scaletrain.model.moe import MoE

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- hooks on kept checkpoints


@dataclass
class OffloadStats:
    """Bytes in host buffers: alive now and the most alive at once (the `mem_activations_host` field)."""

    live: int = 0
    peak: int = 0
    tensors: int = 0

    def _add(self, buf: Any, n: int | None = None) -> None:
        """Count `buf` (a tensor, or the holder of an arena slot of `n` bytes) until it is freed."""
        n = buf.untyped_storage().nbytes() if n is None else n
        self.live += n
        self.peak = max(self.peak, self.live)
        self.tensors += 1
        weakref.finalize(buf, self._sub, n)

    def _sub(self, n: int) -> None:
        self.live -= n


def _is_activation(t: torch.Tensor) -> bool:
    """Float tensors computed by the forward (or received with requires_grad): not parameters, not inputs."""
    base = t._base if t._base is not None else t
    if isinstance(base, nn.Parameter) or t.dtype not in _FLOATS or t.device.type == "meta":
        return False
    return base.grad_fn is not None or base.requires_grad


class _Shard:
    """This tp rank's 1/tp slice of a replicated tensor, padded to a multiple of tp (in an arena slot with
    memory.contiguous)."""

    def __init__(self, t: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int, arena: Arena | None = None):
        flat = t.detach().reshape(-1)
        per = -(-flat.numel() // size)
        piece = flat[rank * per:(rank + 1) * per]
        self.held = Held(arena.take((per,), t.dtype, t.device)) if arena is not None else None
        self._data = None if self.held is not None else torch.empty(per, dtype=t.dtype, device=t.device)
        self.data.zero_()[:piece.numel()] = piece
        self.shape, self.numel, self.group, self.size = t.shape, flat.numel(), group, size
        self.nbytes = per * t.element_size()

    @property
    def data(self) -> torch.Tensor:
        return self.held.tensor if self.held is not None else self._data

    def gather(self, data: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.size * data.numel(), dtype=data.dtype, device=data.device)
        all_gather_single(full, data.contiguous(), group=self.group)
        return full[:self.numel].view(self.shape)


class _Host:
    """A copy of a tensor in host memory (pinned when it comes from a GPU), restored for backward; in an arena
    slot with memory.contiguous."""

    def __init__(self, t: torch.Tensor, stats: OffloadStats, arena: Arena | None = None):
        self.device = t.device
        pin = t.device.type == "cuda"
        self.nbytes = t.numel() * t.element_size()
        if arena is not None:
            self.held = hold_copy(t, arena, torch.device("cpu"), pin, keep_order=False)
            stats._add(self.held, self.nbytes)
            return
        self.held = None
        self._data = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        self._data.copy_(t.detach(), non_blocking=pin)
        stats._add(self._data)

    @property
    def data(self) -> torch.Tensor:
        return self.held.tensor if self.held is not None else self._data

    def restore(self) -> torch.Tensor:
        return self.data.to(self.device, non_blocking=True)


class CheckpointHooks:
    """Saved-tensor hooks for the tensors a checkpoint keeps: partition across tp, then offload to host.

    Only tensors for which `_is_activation` holds are transformed; the rest pass through and are
    counted as they are. A tensor saved twice in one region (e.g. q, k, v views of one qkv output when
    offloading without recomputation) is copied once per save: correct, only less compact.
    """

    def __init__(self, tp_group: dist.ProcessGroup | None, offload: bool, stats: OffloadStats,
                 arena: Arena | None = None, partner: CheckpointHooks | None = None):
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.offload, self.stats = offload, stats
        self.arena = arena  # memory.contiguous: kept checkpoints live in its slots (memory/contiguous.py)
        self.partner = partner  # hooks whose encoder these share (nth:k's offload-only hooks of the other blocks)
        self._encoder = None

    @property
    def encoder(self) -> Any:
        """memory.compress with bf16 / int8: the engine's `ActivationCompressor` (set by `apply_compress_pass`).
        These hooks are innermost, so the compressor's own never see what they keep: they encode it with it
        first and partition / offload / hold the encoding, as one process keeps it encoded."""
        return self.partner.encoder if self.partner is not None else self._encoder

    @encoder.setter
    def encoder(self, value: Any) -> None:
        self._encoder = value

    @property
    def active(self) -> bool:
        return self.offload or self.tp_size > 1 or self.arena is not None

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack) if self.active else nullcontext()

    def pack(self, t: torch.Tensor) -> Any:
        if not _is_activation(t):
            count_saved(t)
            return t
        if self.encoder is not None:
            saved = self.encoder.encode(t)
            if saved.encoded is not None:
                return _MovedEncoding(saved, self._keep(saved.encoded.data))
        return self._keep(t)

    def _keep(self, t: torch.Tensor) -> Any:
        """`t` partitioned over tp, offloaded and / or held in the arena, reported to the activation counter."""
        shard = _Shard(t, self.tp_group, self.tp_size, self.tp_rank, self.arena) if self.tp_size > 1 else None
        data = shard.data if shard is not None else t
        if self.offload:
            host = _Host(data, self.stats, self.arena)
            count_kept(("host", id(host)), host.nbytes, host=True)
            return (shard, host)
        if shard is None:  # memory.contiguous alone: the checkpoint is copied into the arena
            held = hold_copy(t, self.arena)
            count_kept(("arena", id(held)), held.nbytes)
            return held
        count_kept(("shard", id(shard)), shard.nbytes)
        return (shard, None)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _MovedEncoding):
            return packed.restore()
        return _restore(packed)


def _restore(packed: Any) -> torch.Tensor:
    """What `CheckpointHooks._keep` returned, back as the tensor it was given."""
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, Held):
        return packed.tensor
    shard, host = packed
    data = host.restore() if host is not None else shard.data
    return shard.gather(data) if shard is not None else data


class _MovedEncoding:
    """A saved tensor's encoding (`compress._Saved`) whose payload (the bf16 / int8 values) was partitioned,
    offloaded or put in an arena; the scales (int8: one per block, a small fraction) stay where they are."""

    def __init__(self, saved: Any, payload: Any):
        enc = saved.encoded
        self.view, self.scale, self.dtype, self.version = saved.view, enc.scale, enc.dtype, enc.version
        self.payload = payload
        if enc.scale is not None:
            count_kept(("gist-scale", id(self)), enc.scale.numel() * enc.scale.element_size())

    def restore(self) -> torch.Tensor:
        from scaletrain.memory.compress import _Encoded, _Saved

        enc = _Encoded(_restore(self.payload), self.scale, self.dtype, self.version)
        return _Saved(encoded=enc, view=self.view).unpack()


# ----------------------------------------------------------------------------- wrapping the blocks


class _Checkpointed:
    """`fn` through a non-reentrant checkpoint, with the hooks around it that see the kept inputs.

    Mixture-of-experts layers among `modules` change Python state in their forward (statistics, the
    row offset of their keyed random streams); the recomputation runs with the offset the forward had
    and then puts both back, so routing noise is replayed exactly and nothing is counted twice.
    """

    def __init__(self, fn: Callable, hooks: CheckpointHooks, modules: list[nn.Module] = (),
                 ops: frozenset[str] = frozenset()):
        self.fn, self.hooks = fn, hooks
        self.moes = [m for mod in modules for m in mod.modules() if isinstance(m, MoE)]
        # layout-independent dropout: its masks depend on the (step, micro-batch row) context of the forward
        # (nothing to replay when all its dropouts have p = 0; the checkpoint then needs no context_fn)
        self.dropout = next((c for mod in modules if (c := dropout_context(mod)) is not None and _drops(mod)), None)
        self.ops = ops  # memory.recompute=ops:...: the op kinds whose outputs torch's selective checkpointing keeps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.fn(*args, **kwargs)
        extra = {"context_fn": self._contexts} if self.moes or self.dropout is not None or self.ops else {}
        with self.hooks.context():  # outermost for the checkpoint's own input saver, so it sees only the inputs
            return checkpoint(self.fn, *args, use_reentrant=False, **extra, **kwargs)

    def _contexts(self):
        """(forward, recompute) contexts for one checkpointed call. The recompute context may be entered more
        than once (zero bubble's B and W passes each unpack the saved tensors), so it is a re-enterable object.
        With an op policy, torch's selective-checkpoint dispatch modes run inside them (memory/op_policy.py)."""
        record = _RecordState(self)
        replay = _ReplayState(self)
        replay.record = record
        if not self.ops:
            return record, replay
        from scaletrain.memory.op_policy import op_contexts

        caching, cached = op_contexts(self.ops)
        return _Nested(record, caching), _Nested(replay, cached)


class _Nested:
    """Context managers entered in order and left in reverse, as one (re-enterable when they are)."""

    def __init__(self, *contexts: Any):
        self.contexts = contexts

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def _drops(module: nn.Module) -> bool:
    return any(isinstance(m, GlobalDropout) and m.p > 0 for m in module.modules())


class _RecordState:
    """Entered once around the checkpointed forward: remember the MoE keys and the dropout context it ran with."""

    def __init__(self, owner: _Checkpointed):
        self.owner, self.keys, self.dropout = owner, {}, None

    def __enter__(self):
        self.keys = {id(m): m.key for m in self.owner.moes}
        if self.owner.dropout is not None:
            self.dropout = self.owner.dropout.state()

    def __exit__(self, *exc) -> None:
        return None


class _ReplayState:
    """Entered around each recomputation: run with the recorded state, then put the current state back."""

    def __init__(self, owner: _Checkpointed):
        self.owner = owner
        self.record: _RecordState | None = None
        self.saved: list = []

    def __enter__(self):
        o, rec = self.owner, self._recorded()
        self.saved.append(([(m.key, copy.copy(m.stats)) for m in o.moes],
                           o.dropout.state() if o.dropout is not None else None))
        for m in o.moes:
            m.key = rec.keys[id(m)]
        if o.dropout is not None:
            o.dropout.restore(rec.dropout)

    def __exit__(self, *exc) -> None:
        o = self.owner
        moe_state, dropout_state = self.saved.pop()
        for m, (key, stats) in zip(o.moes, moe_state):
            m.key, m.stats = key, stats
        if dropout_state is not None:
            o.dropout.restore(dropout_state)

    def _recorded(self) -> _RecordState:
        return self.record


def _offloaded(fn: Callable, hooks: CheckpointHooks, *args: Any, **kwargs: Any) -> Any:
    with hooks.context():
        return fn(*args, **kwargs)


class _Segment:
    """k consecutive blocks recomputed together (every:k). The first block runs all of them inside
    one checkpoint and returns the segment's output; each later block, called next with exactly that
    output, passes it through. A block called any other way (alone, out of order) runs itself.

    Inside the segment the later blocks are called as modules, so their hooks (e.g. ZeRO-3's parameter
    gathering) run in the forward and again in the recomputation; their pass-through calls run them a
    second time, which costs a gather but changes no value."""

    def __init__(self, blocks: list[nn.Module], hooks: CheckpointHooks):
        self.blocks, self.hooks = blocks, hooks
        self.forwards = [b.forward for b in blocks]
        self.checkpointed = _Checkpointed(self.run, hooks, blocks)
        self.output: torch.Tensor | None = None
        self.next = 0
        self.inside = False

    def run(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.inside = True
        try:
            x = self.forwards[0](x, *args, **kwargs)  # the first block's hooks ran around the outer call
            for b in self.blocks[1:]:
                x = b(x, *args, **kwargs)
        finally:
            self.inside = False
        return x

    def forward(self, index: int, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.inside:
            return self.forwards[index](x, *args, **kwargs)
        if index == 0:
            if not torch.is_grad_enabled():
                self.output = None
                return self.forwards[0](x, *args, **kwargs)
            out = self.checkpointed(x, *args, **kwargs)
            self.output, self.next = out, 1
            return out
        if self.output is not None and x is self.output and self.next == index:
            self.next += 1
            if self.next == len(self.forwards):
                self.output = None
            return x
        return self.forwards[index](x, *args, **kwargs)


def block_runs(module: nn.Module) -> list[list[nn.Module]]:
    """The transformer blocks of a GPT or a pipeline stage, as runs that are called one after another.

    A GPT's `blocks` are one run. A pipeline stage holding several chunks (`bounds`, [lo, hi) global
    block indices per chunk, blocks keyed by global index) has one run per chunk: an every:k segment
    must not span two chunks, which run at different times.
    """
    return [[b for _, b in run] for run in indexed_block_runs(module)]


def indexed_block_runs(module: nn.Module) -> list[list[tuple[int, nn.Module]]]:
    """`block_runs` with each block's global index in the whole model (nth:k picks blocks by it, so a pipeline
    stage checkpoints the blocks one process does)."""
    blocks = getattr(module, "blocks", None)
    if blocks is None:
        raise ConfigError(f"memory.recompute: {type(module).__name__} has no `blocks` to checkpoint")
    bounds = getattr(module, "bounds", None)
    if isinstance(blocks, nn.ModuleDict) and bounds is not None:
        return [[(i, blocks[str(i)]) for i in range(lo, hi)] for lo, hi in bounds]
    if isinstance(blocks, nn.ModuleDict):
        return [[(int(k) if k.isdigit() else i, b) for i, (k, b) in enumerate(blocks.items())]]
    return [list(enumerate(blocks))]


def apply_recompute(engine: Any, mem: Any, tp_group: Any = None) -> OffloadStats:
    """Wrap the engine's blocks for `mem.recompute` (the run's `MemoryConfig`), with checkpoints offloaded to the
    host (`mem.offload_activations`) or partitioned over `tp_group` (`mem.partition_checkpoints`; None: not
    partitioned).

    Works on whatever `engine.module.blocks` holds (a whole GPT, a pipeline stage's chunks, blocks whose
    Linear layers a tensor-parallel pass replaced). Returns the offload statistics (also reported to the
    trainer as `mem_activations_host` when offloading).
    """
    mode = parse_recompute(mem.recompute)
    tp_group = tp_group if mem.partition_checkpoints and mode.checkpoints_blocks else None
    stats = OffloadStats()
    arena = engine_arena(engine) if getattr(mem, "contiguous", False) else None
    hooks = CheckpointHooks(tp_group, mem.offload_activations, stats, arena)
    engine.checkpoint_hooks = hooks  # the compression pass gives them its encoder (memory/compress.py)
    runs = indexed_block_runs(engine.module)
    if mode.kind == "attn-core":
        cores = [m for m in engine.module.modules() if callable(getattr(m, "attn_core", None))]
        if not cores:
            raise ConfigError(f"memory.recompute={mem.recompute}: the model has no attn_core to recompute")
        for m in cores:
            m.attn_core = _Checkpointed(m.attn_core, hooks, [m])
    elif mode.kind == "every":
        for run in runs:
            for start in range(0, len(run), mode.k):
                seg = _Segment([b for _, b in run[start:start + mode.k]], hooks)
                for i, (_, b) in enumerate(run[start:start + mode.k]):
                    b.forward = functools.partial(seg.forward, i)
    else:
        if mode.kind == "ops":
            check_op_policy(mem.recompute)
        # what a block that is not a checkpoint saves is offloaded, never partitioned: it is not replicated over tp
        plain = hooks if tp_group is None else CheckpointHooks(None, mem.offload_activations, stats, arena, hooks)
        for index, b in (ib for run in runs for ib in run):
            if mode.kind in ("full", "ops") or (mode.kind == "nth" and index % mode.k == 0):
                b.forward = _Checkpointed(b.forward, hooks, [b], mode.ops)
            elif mem.offload_activations:  # none (and nth's other blocks): offload everything the block saves
                b.forward = functools.partial(_offloaded, b.forward, plain)
    if mem.offload_activations:
        add_memory_report(engine, lambda: {"mem_activations_host": stats.peak})
    return stats


def check_op_policy(spec: str) -> None:
    """memory.recompute=ops:... needs a torch whose selective checkpointing shows the policy each op's output."""
    import inspect

    from torch.utils.checkpoint import SelectiveCheckpointContext

    if "op_output" not in inspect.signature(SelectiveCheckpointContext.__init__).parameters:
        raise ConfigError(f"memory.recompute={spec} needs a torch whose selective activation checkpointing passes "
                          f"each op's output to the policy (SelectiveCheckpointContext.op_output); torch "
                          f"{torch.__version__} does not")
