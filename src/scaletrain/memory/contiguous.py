"""Contiguous buffers for long-lived activations and gradients (ZeRO-R memory defragmentation), and a count of the
allocator calls of a training step.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054,
Sec. 6.3 (memory defragmentation): activation checkpoints and gradients live long (from the forward to the backward,
or until a reduction) while everything else a step allocates is short-lived; interleaved, the two fragment the
device memory, and a large request can fail with plenty of memory free in total. ZeRO copies checkpoints and
gradients into pre-allocated contiguous buffers as they are produced. `memory.contiguous=true` does that here:

- activation checkpoints (what `memory.recompute` keeps: block / segment inputs, the attention core's inputs for
  `selective`; also partitioned and host-offloaded checkpoints) are copied into slots of an `Arena` by the
  recomputation's saved-tensor hooks (`memory/recompute.py`), and the slot is handed back when autograd drops the
  checkpoint (after its backward);
- plain data parallelism and ZeRO-1 are left as they are: their flat gradient buckets already live for the whole
  run (`parallel/data_parallel.py`); over several ranks a step's first backward hands autograd's own gradient
  tensor to the hook, which copies it into the bucket and drops it at once: accumulating into a kept bucket view
  would allocate the same tensor, as an op output, and drop it as soon;
- ZeRO-2/3 (`parallel/zero.py`) take the transient full-bucket gradient buffers and reduce-scatter outputs of every
  micro-batch from the arena instead of allocating them.

An arena has one pool per (shape, dtype, device, pinned) with a free list of slots. A pool grows one slot at a time
while the first step runs; at the end of every step (`settle`, called by the engine after its forward/backward) a
pool with more than one buffer is replaced by a single contiguous buffer of as many slots as the step needed at
once (live slots are moved, so this also works while a pipeline schedule keeps the next batch in flight). From the
second step on nothing is allocated: `Arena.stats` counts buffers allocated (`buffers`) and those allocated after
settling (`grown_late`, 0 in every test). Values are copied, never changed: losses and gradients are bit-identical
to `memory.contiguous=false` (tests/test_contiguous.py).

`AllocationProbe` measures what this is for: the allocator calls of one steady-state step's forward and backward.
On CPU it counts the `[memory]` events of `torch.profiler` with `profile_memory=True` (each allocation and free the
c10 CPU allocator reports, on the training thread and autograd's); on CUDA the difference of
`torch.cuda.memory_stats()["allocation.all.allocated"]` (the caching allocator's allocation requests), with the
peak allocated and reserved bytes of the step beside it (reserved - allocated is the fragmentation the paper is
about; CPU has no caching allocator and no reserved bytes).

On CPU the same events also give the allocator's view of the planner's activations (docs/memory.md, "What "to the
byte" compares"): `mem_alloc_backward_start`, the bytes allocated in the measured forward/backward and still held when
its first backward operation starts (what the forward left for the backward), and `mem_alloc_peak`, the most it held
at once above what it held before; tests/test_memory_allocator.py compares them with `plan_mem_activations`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Key = tuple[tuple[int, ...], torch.dtype, str, bool]


@dataclass
class ArenaStats:
    buffers: int = 0  # buffers allocated over the run (slots while growing, then one per pool)
    grown_late: int = 0  # slots allocated after the pool had settled (a step needed more than the first)
    settled_bytes: int = 0  # bytes of the contiguous buffers
    peak_slots: dict[str, int] = field(default_factory=dict)


class Slot:
    """One slot of a pool. `tensor` is its data (a view of the pool's buffer); `release()` hands it back."""

    __slots__ = ("pool", "index", "__weakref__")

    def __init__(self, pool: _Pool, index: int):
        self.pool, self.index = pool, index

    @property
    def tensor(self) -> torch.Tensor:
        return self.pool.view(self.index)

    def release(self) -> None:
        if self.index >= 0:
            self.pool.give(self)
            self.index = -1


class _Pool:
    """Slots of one shape. Growing: one buffer per slot. Settled: one buffer of `capacity` slots."""

    def __init__(self, arena: Arena, key: Key):
        self.arena, self.key = arena, key
        self.shape, self.dtype, device, self.pin = key
        self.device = torch.device(device)
        self.numel = 1
        for d in self.shape:
            self.numel *= d
        self.buffers: list[torch.Tensor] = []  # growing: one per slot; settled: [the contiguous buffer]
        self.settled = False
        self.free: list[int] = []
        self.live: weakref.WeakSet[Slot] = weakref.WeakSet()
        self.peak = 0

    def _alloc(self, slots: int) -> torch.Tensor:
        self.arena.stats.buffers += 1
        return torch.empty(slots * self.numel, dtype=self.dtype, device=self.device, pin_memory=self.pin)

    def view(self, index: int) -> torch.Tensor:
        if self.settled:
            return self.buffers[0][index * self.numel:(index + 1) * self.numel].view(self.shape)
        return self.buffers[index].view(self.shape)

    def take(self) -> Slot:
        if self.free:
            index = self.free.pop()
        else:
            if self.settled:  # more at once than the first step needed: grow (counted, never expected)
                self.arena.stats.grown_late += 1
                self._unsettle()
            self.buffers.append(self._alloc(1))
            index = len(self.buffers) - 1
        slot = Slot(self, index)
        self.live.add(slot)
        self.peak = max(self.peak, len(self.live))
        return slot

    def give(self, slot: Slot) -> None:
        self.live.discard(slot)
        self.free.append(slot.index)

    def _unsettle(self) -> None:
        """Back to one buffer per slot (views of the old contiguous buffer keep it alive while used)."""
        whole = self.buffers[0]
        self.buffers = [whole[i * self.numel:(i + 1) * self.numel] for i in range(len(whole) // self.numel)]
        self.settled = False

    @torch.no_grad()
    def settle(self) -> None:
        """One contiguous buffer of `peak` slots; live slots move into it (their data copied, indices kept
        dense), free ones are forgotten."""
        if self.settled or not self.buffers:
            return
        capacity = max(self.peak, len(self.live))
        whole = self._alloc(capacity)
        live = sorted(self.live, key=lambda s: s.index)
        for i, slot in enumerate(live):
            whole[i * self.numel:(i + 1) * self.numel].copy_(self.view(slot.index).reshape(-1))
            slot.index = i
        self.buffers = [whole]
        self.settled = True
        self.free = list(range(capacity - 1, len(live) - 1, -1))
        self.arena.stats.settled_bytes += whole.numel() * whole.element_size()


class Arena:
    """Pools of fixed-shape slots allocated once and reused (module docstring)."""

    def __init__(self) -> None:
        self.pools: dict[Key, _Pool] = {}
        self.stats = ArenaStats()

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str,
             pin: bool = False) -> Slot:
        key = (tuple(shape), dtype, str(torch.device(device)), pin)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = _Pool(self, key)
        return pool.take()

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> Slot:
        slot = self.take((numel,), dtype, device)
        slot.tensor.zero_()
        return slot

    def settle(self) -> None:
        for key, pool in self.pools.items():
            pool.settle()
            self.stats.peak_slots[f"{tuple(key[0])}:{str(key[1]).removeprefix('torch.')}"] = pool.peak

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages the pools hold now."""
        storages = {b.untyped_storage()._cdata: b.untyped_storage().nbytes() for p in self.pools.values()
                    for b in p.buffers}
        return sum(storages.values())


class Held:
    """A slot held until this object is dropped: what a saved-tensor hook keeps for a checkpoint, so the slot goes
    back to its pool when autograd drops the checkpoint (after the backward that used it). Read the data through
    `tensor` each time (settling may move it)."""

    __slots__ = ("slot", "strides", "__weakref__")

    def __init__(self, slot: Slot, strides: tuple[int, ...] | None = None):
        self.slot, self.strides = slot, strides
        weakref.finalize(self, slot.release)

    @property
    def tensor(self) -> torch.Tensor:
        t = self.slot.tensor
        return t if self.strides is None else t.as_strided(t.shape, self.strides)

    @property
    def nbytes(self) -> int:
        return self.slot.pool.numel * self.slot.pool.dtype.itemsize


def hold_copy(t: torch.Tensor, arena: Arena, device: torch.device | None = None, pin: bool = False,
              keep_order: bool = True) -> Held:
    """`t` copied into a slot of `arena` (on `device`, default t's; pinned host memory with `pin`), laid out in t's
    dimension order (as `torch.empty_like` would, so the recomputation runs the same kernels on it), or contiguous
    with `keep_order=False` (as activation offload has always copied)."""
    strides = torch.empty_like(t, device="meta").stride() if keep_order else None
    held = Held(arena.take(t.shape, t.dtype, device if device is not None else t.device, pin), strides)
    held.tensor.copy_(t.detach(), non_blocking=pin)
    return held


def engine_arena(engine: Any) -> Arena:
    """The run's arena (one per engine), created on first use."""
    arena = getattr(engine, "arena", None)
    if arena is None:
        arena = engine.arena = Arena()
    return arena


def apply_contiguous(engine: Any) -> Arena:
    """The `build_engine` pass for `memory.contiguous` (after the optimizer is built): gradient buffers from the
    arena, and the arena settled after every forward/backward. Activation checkpoints were put in the same arena
    by `apply_recompute`, which runs earlier."""
    arena = engine_arena(engine)
    engine.optimizer.use_arena(arena)  # ZeRO-2/3 take their transient gradient buffers from it
    inner = engine.forward_backward

    def forward_backward(micro, scale):
        out = inner(micro, scale)
        arena.settle()
        return out

    engine.forward_backward = forward_backward
    from scaletrain.device.accounting import add_memory_report

    add_memory_report(engine, lambda: {"mem_arena_bytes": arena.nbytes})
    return arena


def apply_contiguous_and_probe(engine: Any, mem: Any, device: torch.device) -> None:
    """`build_engine`'s call: `memory.contiguous` and/or `memory.count_allocations` (of the run's MemoryConfig)."""
    if mem.contiguous:
        apply_contiguous(engine)
    if mem.count_allocations:
        AllocationProbe(engine, device)


# --------------------------------------------------------------------------- counting allocations


@dataclass
class AllocationCount:
    """Allocator calls during one measured region (and the peak bytes on CUDA)."""

    count: int = 0
    bytes: int = 0
    cuda_allocated_peak: int | None = None
    cuda_reserved_peak: int | None = None
    peak: int | None = None
    """CPU: the most bytes the region held at once above what it held at its start (allocations minus frees)."""
    backward_start: int | None = None
    """CPU: the bytes allocated in the region and still held when its first backward operation starts."""

    def fields(self) -> dict[str, int]:
        out = {"mem_alloc_count": self.count, "mem_alloc_bytes": self.bytes}
        if self.peak is not None:
            out.update(mem_alloc_peak=self.peak, mem_alloc_backward_start=self.backward_start)
        if self.cuda_allocated_peak is not None:
            out.update(mem_cuda_allocated_peak=self.cuda_allocated_peak,
                       mem_cuda_reserved_peak=self.cuda_reserved_peak)
        return out


def count_allocations(fn: Callable[[], Any], device: torch.device) -> tuple[Any, AllocationCount]:
    """Run `fn()` and count the allocator calls it makes (module docstring): (its result, the count)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_stats(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, cuda_count(before, torch.cuda.memory_stats(device))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = prof.profiler.kineto_results.events()
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    sizes = [e.nbytes() for e in memory if e.nbytes() > 0]
    backward = min((e.start_ns() for e in events if e.name().startswith("autograd::engine::evaluate_function")),
                   default=None)
    held = peak = 0
    at_backward = None
    for e in memory:  # allocations (> 0) and frees (< 0) in the order the allocator saw them
        if at_backward is None and backward is not None and e.start_ns() >= backward:
            at_backward = held
        held += e.nbytes()
        peak = max(peak, held)
    return out, AllocationCount(len(sizes), sum(sizes), peak=peak,
                                backward_start=at_backward if at_backward is not None else held)


def cuda_count(before: dict[str, int], after: dict[str, int]) -> AllocationCount:
    """The count between two `torch.cuda.memory_stats()` snapshots (the second taken after a peak reset at the
    first): allocation requests and bytes requested in between, peak allocated and reserved bytes."""
    return AllocationCount(
        count=after["allocation.all.allocated"] - before["allocation.all.allocated"],
        bytes=after["allocated_bytes.all.allocated"] - before["allocated_bytes.all.allocated"],
        cuda_allocated_peak=after["allocated_bytes.all.peak"], cuda_reserved_peak=after["reserved_bytes.all.peak"])


class AllocationProbe:
    """`memory.count_allocations`: counts the allocations of the engine's forward/backward on its `at`-th call
    (default 2: the first steady-state step) and reports them, maxed over ranks, through `report()`."""

    def __init__(self, engine: Any, device: torch.device, at: int = 2):
        self.device, self.at, self.calls = torch.device(device), at, 0
        self.result: AllocationCount | None = None
        inner = engine.forward_backward

        def forward_backward(micro, scale):
            self.calls += 1
            if self.calls != self.at:
                return inner(micro, scale)
            out, self.result = count_allocations(lambda: inner(micro, scale), self.device)
            return out

        engine.forward_backward = forward_backward
        engine.allocation_probe = self

    def report(self) -> dict[str, int]:
        """The measured fields, each the max over ranks ({} before the measured step; collective once measured,
        and every rank measures the same step)."""
        if self.result is None:
            return {}
        from scaletrain.distributed.comm import all_reduce_max_list

        fields = self.result.fields()  # maxed on the backend's device (the rank's GPU under NCCL)
        return {k: int(v) for k, v in zip(fields, all_reduce_max_list([float(v) for v in fields.values()]))}


def allocation_report(engine: Any) -> dict[str, int]:
    """The engine's allocation probe's fields ({} without a probe or before its step)."""
    probe = getattr(engine, "allocation_probe", None)
    return probe.report() if probe is not None else {}
