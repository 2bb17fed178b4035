"""Counting host synchronisations: every place the host waits for a tensor's value.

On a GPU the host runs ahead of the device until it needs a value: `.item()`, `float()`, `bool()` (an `if` on a
tensor), `.tolist()`, `.numpy()`, a device-to-host copy, an op whose output size depends on the data (`nonzero`,
boolean-mask indexing, `unique`), or an explicit `synchronize`. Each such point stalls the queue. `HostSyncs`
counts them in a region on any device (on CPU they are what would wait on a GPU): reads of values are seen where
every one of them goes through, `aten._local_scalar_dense` and the data-dependent ops below autograd (a dispatch
mode, forward and backward), device-to-host copies, plus `Tensor.tolist` and `torch.cuda.synchronize`
(`Tensor.numpy` works on host tensors only: the copy before it is what waits). Tensors that are
host-side by design (AdamW's step counters when not fused) can be excluded. Each event records a label (e.g. the
training step) and the innermost scaletrain source line that caused it, so a failing test names the culprit.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DATA_DEPENDENT = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "_local_scalar_dense")


@dataclass(frozen=True)
class Sync:
    what: str
    label: Any
    where: str


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/scaletrain/" in frame.filename and "/device/sync.py" not in frame.filename:
            return f"{frame.filename.split('/scaletrain/')[-1]}:{frame.lineno}"
    return "?"


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs(label=lambda: trainer.step) as s: ...` then `s.events` (a list of Sync)."""

    def __init__(self, label: Callable[[], Any] = lambda: None, exclude: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.label = label
        self.events: list[Sync] = []
        self._exclude = {id(t) for t in exclude}
        self._patched: list[tuple[Any, str, Any]] = []

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        self._exclude.update(id(t) for t in tensors)

    def _add(self, what: str) -> None:
        self.events.append(Sync(what, self.label(), _caller()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in DATA_DEPENDENT:
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and id(first) in self._exclude):
                self._add(name)
        elif name in ("_to_copy", "copy_"):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            out_cpu = (kwargs or {}).get("device") == torch.device("cpu") or (
                name == "copy_" and tensors and tensors[0].device.type == "cpu")
            if out_cpu and any(t.device.type == "cuda" for t in tensors) and not (kwargs or {}).get("non_blocking"):
                self._add(f"{name} to host")
        return func(*args, **(kwargs or {}))

    def _wrap(self, owner: Any, attr: str, what: str) -> None:
        original = getattr(owner, attr)
        counter = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and id(first) in counter._exclude):
                counter._add(what)
            return original(*args, **kwargs)

        self._patched.append((owner, attr, original))
        setattr(owner, attr, wrapped)

    def __enter__(self) -> HostSyncs:
        self._wrap(torch.Tensor, "tolist", "tolist")  # (`.numpy()` needs a host tensor: its copy is counted)
        self._wrap(torch.cuda, "synchronize", "cuda.synchronize")
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for owner, attr, original in reversed(self._patched):
                setattr(owner, attr, original)
            self._patched.clear()
