"""The memory budget (`memory.budget_gb`) before launch, from the planner's numbers, and the run's meter.

Before launch (`check_before_launch`): the planner's resident bytes per rank (`planned_resident`: `plan_mem_*` of
`plan.predict_run`, plus under ZeRO-3 the step's working set of two gathered units and three flat gradients) must
fit the budget; if they do not, the error gives the numbers and, when parallel.zero=3 with parallel.offload=nvme
would fit, says so with its numbers. With offload=nvme the offload folder must exist (unless it is the default
under --out), be writable, and have room for the shard files of every local rank.

During the run `memory/budget.py` measures each step and enforces the budget; `resident_meter` builds its meter with
the planner's prediction, which its error message names.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from scaletrain.errors import UserError
from scaletrain.memory.budget import GIB, ResidentMeter, return_freed_memory


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


def planned_resident(cfg) -> dict[str, int]:
    """The planner's resident bytes per rank by category: the exact run planner's params, grads, optim and
    activations, and under ZeRO-3 the step's working set (`offload_costs.working_bytes`)."""
    from scaletrain.plan import predict_run

    plan = predict_run(cfg)
    out = {k.removeprefix("plan_mem_"): int(v) for k, v in plan.items()}
    if cfg.parallel.zero == 3:
        from scaletrain.parallel.zero import group_params
        from scaletrain.plan.analytic.offload_costs import working_bytes
        from scaletrain.plan.exact import run_memory

        module = run_memory.engine_module_on_meta(cfg, 0)
        n = cfg.parallel.dp * cfg.parallel.cp  # ZeRO's group: dp x cp (context parallelism)
        units = [n * -(-sum(p.numel() for p in g) // n) for g in group_params(module, 3, cfg.parallel.bucket_mb)]
        e = run_memory._TORCH[cfg.train.dtype].itemsize
        out["working"] = working_bytes(units, e, 4 if cfg.train.dtype in run_memory.LOW else e)
        gathered = out.pop("params_gathered", None)
        if gathered is not None:  # the exact gathered peak (parallel.reshard_after_forward) for two gathered units
            out["working"] += gathered - sum(sorted(units, reverse=True)[:2]) * e
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
    from scaletrain.parallel.zero_nvme import resolve_offload_dir
    from scaletrain.plan.exact.run_memory import nvme_file_bytes

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
    per_rank = nvme_file_bytes(cfg)
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
