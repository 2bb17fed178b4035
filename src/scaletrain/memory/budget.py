"""A memory budget per process (`memory.budget_gb`): the resident bytes of every step, measured and enforced.

ZeRO-Infinity (Rajbhandari et al., arXiv 2104.07857) is about training what does not fit; this module makes
"fit" a number a run is held to.

What is measured (every step, `mem_resident` in metrics.jsonl, the max over ranks):
- CUDA: `torch.cuda.max_memory_allocated` over the step (peak reset when the step begins): every tensor on the
  device, parameters, gradients, optimizer state, activations, staging buffers, temporaries.
- CPU: the peak resident set size of the process over the step (`VmHWM`, reset when the step begins by writing 5
  to /proc/self/clear_refs) minus the resident set size when the trainer was created (the interpreter, torch and
  the libraries, which no memory technique changes) and minus the growth of its file-backed pages since then
  (`RssFile`: the memory-mapped token file and library code, clean pages the kernel can drop at any time). This
  is memory the operating system really gives the process: tensors, allocator caches, I/O staging buffers,
  thread stacks; the page cache of the offload files is the kernel's, not the process's, and is not counted.
  Without /proc/self/clear_refs (not Linux) the peak is the process's lifetime peak (`ru_maxrss`), which can
  only over-state the step's. Such runs also make glibc return freed large buffers to the system at once
  (`return_freed_memory`), so that RSS follows what is live.

A step whose measured bytes exceed the budget stops the run on every rank with a one-line error (exit 2) naming
the step, the bytes and the planner's prediction.

Before launch the planner's resident bytes per rank are checked against the budget (`plan/budget.py`, which also
builds the run's meter with the planner's prediction for the error message).
"""

from __future__ import annotations

import resource
import sys

import torch

from scaletrain.errors import UserError

GIB = 2**30


class BudgetExceeded(UserError):
    """A step held more memory than memory.budget_gb."""


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _lifetime_peak() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class ResidentMeter:
    """Measures the resident bytes of each step (see the module docstring) and enforces the budget."""

    def __init__(self, budget_bytes: int, plan_bytes: int | None = None):
        self.budget, self.plan = budget_bytes, plan_bytes
        self.baseline = _status_bytes("VmRSS") or _lifetime_peak()
        self.file_baseline = _status_bytes("RssFile") or 0
        self.exact = False

    def begin(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.exact = _reset_peak()

    def measure(self, device: torch.device) -> int:
        if device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(device))
        peak = _status_bytes("VmHWM") if self.exact else None
        files = max(0, (_status_bytes("RssFile") or 0) - self.file_baseline)  # mapped data and library pages
        return max(0, (peak if peak is not None else _lifetime_peak()) - self.baseline - files)

    def end(self, device: torch.device, step: int) -> dict[str, int]:
        local = self.measure(device)
        from scaletrain.distributed.comm import all_reduce_max_list

        worst = int(all_reduce_max_list([float(local)])[0])  # on the backend's device (the rank's GPU under NCCL)
        row = {"mem_resident": worst}
        if self.budget:
            row["mem_budget"] = self.budget
            if worst > self.budget:
                what = "max_memory_allocated" if device.type == "cuda" else "peak RSS growth"
                plan = f"; the planner predicted {self.plan / GIB:.3f} GiB" if self.plan else ""
                raise BudgetExceeded(f"memory.budget_gb ({self.budget / GIB:.3f} GiB): step {step} held "
                                     f"{worst / GIB:.3f} GiB resident ({what}, max over ranks){plan}; raise the "
                                     "budget or offload more (parallel.zero=3, parallel.offload=nvme)")
        return row


def return_freed_memory() -> bool:
    """glibc: serve every allocation of 128 KiB or more with its own mmap, so that freed tensors go back to the
    operating system at once. By default glibc raises that threshold after the first large free (up to 32 MiB)
    and keeps later frees in its heap, so a process that streams units through memory keeps the high-water
    mark of everything it ever freed. False where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError, TypeError):
        return False
