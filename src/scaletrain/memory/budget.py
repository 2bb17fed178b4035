"""A memory budget per process (`memory.budget_gb`): checked before launch with the planner, enforced on what runs.

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

Before launch (`check_before_launch`): the planner's resident bytes per rank (`planned_resident`: `plan_mem_*` of
`plan.predict_run`, plus under ZeRO-3 the step's working set of two gathered units and three flat gradients) must
fit the budget; if they do not, the error gives the numbers and, when parallel.zero=3 with parallel.offload=nvme
would fit, says so with its numbers. With offload=nvme the offload folder must exist (unless it is the default
under --out), be writable, and have room for the shard files of every local rank.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

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


def resident_meter(cfg, env=None) -> ResidentMeter | None:
    """The run's meter: with memory.budget_gb > 0 or parallel.offload=nvme (whose point is what stays resident)."""
    if cfg.memory.budget_gb <= 0 and cfg.parallel.offload != "nvme":
        return None
    return_freed_memory()
    with torch.device("meta"):  # torch loads its meta-kernel tables on first use (~70 MB): library, not run
        torch.nn.Linear(2, 2)(torch.empty(1, 2))
    plan = None
    if cfg.memory.budget_gb > 0:
        try:
            plan = sum(planned_resident(cfg).values())
        except (ValueError, KeyError, ZeroDivisionError):
            plan = None
    return ResidentMeter(int(cfg.memory.budget_gb * GIB), plan)


# --------------------------------------------------------------------------- before launch


def planned_resident(cfg) -> dict[str, int]:
    """The planner's resident bytes per rank by category: the exact run planner's params, grads, optim and
    activations, and under ZeRO-3 the step's working set (`offload_nvme.working_bytes`)."""
    from scaletrain.plan import predict_run

    plan = predict_run(cfg)
    out = {k.removeprefix("plan_mem_"): int(v) for k, v in plan.items()}
    if cfg.parallel.zero == 3:
        from scaletrain.memory.offload_nvme import working_bytes
        from scaletrain.parallel.zero import group_params
        from scaletrain.plan.exact import run_memory

        module = run_memory.engine_module_on_meta(cfg, 0)
        units = [cfg.parallel.dp * -(-sum(p.numel() for p in g) // cfg.parallel.dp)
                 for g in group_params(module, 3, cfg.parallel.bucket_mb)]
        e = run_memory._TORCH[cfg.train.dtype].itemsize
        out["working"] = working_bytes(units, e, 4 if cfg.train.dtype in run_memory.LOW else e)
    return out


def _gib(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / GIB:.3f}" for k, v in parts.items())


def check_budget(cfg) -> None:
    """Refuse a config whose planned resident bytes exceed memory.budget_gb, naming the planner's numbers."""
    budget = int(cfg.memory.budget_gb * GIB)
    if budget <= 0:
        return
    parts = planned_resident(cfg)
    need = sum(parts.values())
    if need <= budget:
        return
    hint = ""
    if cfg.parallel.offload != "nvme":
        import copy

        from scaletrain.config import validate
        from scaletrain.errors import ConfigError

        alt = copy.deepcopy(cfg)
        alt.parallel.zero, alt.parallel.offload = 3, "nvme"
        try:
            validate(alt)
            alt_need = sum(planned_resident(alt).values())
        except ConfigError:
            alt_need = None
        if alt_need is not None and alt_need <= budget:
            hint = (f"; with parallel.zero=3 parallel.offload=nvme it needs {alt_need / GIB:.3f} GiB and fits "
                    "(docs/memory.md)")
        elif alt_need is not None:
            hint = f"; even with parallel.zero=3 parallel.offload=nvme it needs {alt_need / GIB:.3f} GiB"
    raise UserError(f"memory.budget_gb ({cfg.memory.budget_gb:g} GiB): the planner puts this run at "
                    f"{need / GIB:.3f} GiB per rank ({_gib(parts)} GiB){hint}")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_offload_dir(cfg, out: Path | None, local_ranks: int) -> None:
    """offload=nvme: the folder exists (a user's) or can be made (the default under --out), is writable, and has
    room for the shard files of `local_ranks` ranks (the planner's bytes per rank)."""
    from scaletrain.memory.offload_nvme import planned_file_bytes, resolve_offload_dir

    if cfg.parallel.offload != "nvme":
        return
    given = cfg.parallel.offload_dir
    target = Path(resolve_offload_dir(cfg, out).parallel.offload_dir)
    if given:
        if not target.exists():
            raise UserError(f"parallel.offload_dir {target} does not exist (create it, or leave it empty for "
                            "OUT/offload)")
        if not target.is_dir():
            raise UserError(f"parallel.offload_dir {target} is not a folder")
    probe = target if target.exists() else _existing_ancestor(target)
    if not probe.is_dir():
        raise UserError(f"parallel.offload_dir {target}: {probe} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise UserError(f"parallel.offload_dir {target} is not writable ({e.strerror or e})") from None
    per_rank = planned_file_bytes(cfg)
    need, free = per_rank * local_ranks, shutil.disk_usage(probe).free
    if need > free:
        raise UserError(f"parallel.offload_dir {target} has {free / GIB:.2f} GiB free; the offload files of "
                        f"{local_ranks} rank(s) need {need / GIB:.2f} GiB ({per_rank / GIB:.2f} GiB per rank)")


def check_before_launch(cfg, out: Path | None, local_ranks: int) -> None:
    """Everything memory-related that can be refused before any process starts."""
    check_offload_dir(cfg, out, local_ranks)
    check_budget(cfg)


def local_world_size(default: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))
