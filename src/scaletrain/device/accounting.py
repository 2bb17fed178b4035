"""Measured memory by category: parameters, gradients, optimizer state, saved activations, peak.

On every device the first three are counted from tensor storage (bytes of distinct storages, so a tied
or viewed tensor counts once). Saved activations are counted with `torch.autograd.graph.saved_tensors_hooks`
during one forward pass: the bytes of distinct storages that autograd keeps for backward, excluding
storages that belong to parameters (those are already counted as parameters); passes with saved-tensor
hooks of their own (recomputation, offload, compression) report what they keep to the counter instead
(`count_saved`, `count_kept`), so the count is what is really kept. Peak is the CUDA allocator's
`max_memory_allocated` on GPUs and the process's peak resident set size on CPU (which also includes the
Python interpreter and libraries; documented as such). `TensorPeak` measures the peak of tensor storages
alive during a region on any device (for benchmarks; a Python call per op). See docs/memory.md.
"""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind `t` (stable when the storage is resized, as ZeRO-3 does)."""
    return t.untyped_storage()._cdata


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (meta and empty tensors count 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta" or t.numel() == 0:
            continue
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


class SavedTensorCounter:
    """Counts bytes saved for backward while active (distinct storages, parameters excluded).

    Saved-tensor hooks nest and only the innermost sees a tensor, so passes that install their own hooks
    (recomputation, offload, compression) report what they keep through `count_saved` / `count_kept`,
    which reach every counter whose `active()` context is open: the count is what is really kept.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.exclude = {_storage_key(p) for p in exclude}
        self.storages: dict[object, int] = {}
        self.host_storages: dict[object, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = _storage_key(t)
            if key not in self.exclude:
                self.storages[key] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        """Bytes kept on the compute device (on CPU runs: in the process, outside offload buffers)."""
        return sum(self.storages.values())

    @property
    def host_bytes(self) -> int:
        """Bytes moved to host buffers by activation offload."""
        return sum(self.host_storages.values())

    @contextmanager
    def active(self):
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield self
        finally:
            _ACTIVE.remove(self)


# Counters whose `active()` context is open. Like autograd's own stack of saved-tensor hooks this is
# dynamic scope, not configuration: it only lets inner hooks report to the counters around them.
_ACTIVE: list[SavedTensorCounter] = []


def count_saved(t: torch.Tensor) -> None:
    """An inner saved-tensor hook keeps `t` itself: count it in every open counter."""
    for counter in _ACTIVE:
        counter.pack(t)


def count_kept(key: object, nbytes: int, host: bool = False) -> None:
    """An inner hook keeps `nbytes` in place of a saved tensor (an encoding, a shard, a host copy).

    `key` identifies the kept buffer (counted once however often it is reported); `host=True` for
    bytes moved off the device by offload.
    """
    for counter in _ACTIVE:
        (counter.host_storages if host else counter.storages)[key] = int(nbytes)


def uncount_kept(key: object) -> None:
    """A buffer reported by `count_kept` is no longer kept (its owner handed it on): drop it from every open
    counter. Used by reversible blocks, which keep only the last output of a chain (model/reversible.py)."""
    for counter in _ACTIVE:
        counter.storages.pop(key, None)


def add_memory_report(engine: Any, report: Callable[[], dict[str, float]]) -> None:
    """Register a pass's own measurement (offloaded bytes, compression ratio, ...) for the trainer's
    memory fields; `memory_reports(engine)` merges them."""
    reports = getattr(engine, "memory_reports", None)
    if reports is None:
        reports = engine.memory_reports = []
    reports.append(report)


def memory_reports(engine: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for report in getattr(engine, "memory_reports", None) or ():
        out.update(report())
    return out


class TensorPeak(TorchDispatchMode):
    """Peak bytes of tensor storages created while active and alive at once (CPU or GPU).

    Every op's outputs are looked at; a storage first seen as an output is a new allocation, counted
    until it is freed (a finalizer on the storage object, which PyTorch keeps alive as long as the
    storage). Storages first seen as inputs existed before and are not counted; views and in-place
    results share a storage already seen. Used around a forward/backward it measures what the CUDA
    allocator's `max_memory_allocated` would show above the model states: saved activations, the
    recomputation of checkpointed blocks, temporaries. Costs a Python call per op.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in _tensors((args, kwargs)):
            self._seen.add(_storage_key(t))
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            key = _storage_key(t)
            if key in self._seen or t.device.type == "meta":
                continue
            self._seen.add(key)
            n = t.untyped_storage().nbytes()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t.untyped_storage(), self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
