"""Test-only check that every collective's tensors live on the rank's device.

Under NCCL a collective accepts only CUDA tensors of the rank's own GPU; a tensor created without a device argument
(`torch.tensor([x])`, `torch.zeros(n)`) lands on the CPU and fails there, or worse, works on gloo in every CPU test.
On a CPU machine both devices are the CPU, so the check marks what would be wrong on a GPU: factory calls without
an explicit `device` tag their result (a TorchFunctionMode), and every c10d op that reaches the dispatcher (a
TorchDispatchMode: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, send / recv, ...) is checked for
tagged tensors and for tensors off `device`. Derived tensors (`.to(device)`, arithmetic) are untagged: the check
catches the common mistake, a scalar built on the host and handed to a collective.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.randn, torch.rand,
             torch.randint, torch.as_tensor, torch.linspace, torch.eye, torch.scalar_tensor, torch.from_numpy,
             torch.empty_strided}


def _origin() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/scaletrain/" in frame.filename:
            return f"{frame.filename.split('/scaletrain/')[-1]}:{frame.lineno}"
    return "?"


class _Tag(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in FACTORIES and (kwargs or {}).get("device") is None and isinstance(out, torch.Tensor):
            out._st_implicit_host = _origin()
        return out


class _Check(TorchDispatchMode):
    def __init__(self, device: torch.device, violations: list):
        super().__init__()
        self.device, self.violations = device, violations
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.seen += 1
            for t in tree_leaves((args, kwargs)):
                if not isinstance(t, torch.Tensor):
                    continue
                made = getattr(t, "_st_implicit_host", None)
                if made is not None or t.device != self.device:
                    self.violations.append((str(func), str(t.device), made or "", _origin()))
        return func(*args, **(kwargs or {}))


class CollectivePlacement:
    """`with CollectivePlacement(device) as p: ...`; then `p.violations` (op, tensor device, where the tensor was
    made without a device, where the collective was called) and `p.collectives` (how many were checked)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.violations: list[tuple[str, str, str, str]] = []
        self._tag, self._check = _Tag(), _Check(torch.device(device), self.violations)

    @property
    def collectives(self) -> int:
        return self._check.seen

    def __enter__(self) -> CollectivePlacement:
        self._tag.__enter__()
        self._check.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._check.__exit__(*exc)
        self._tag.__exit__(*exc)
