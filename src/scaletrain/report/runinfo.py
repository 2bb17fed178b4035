"""What a run was: the command, world size, versions and the device of every rank (`OUT/run_info.json`),
and the memory every rank measured after its first step (`OUT/memory_ranks.json`).

Both are gathered from all ranks with one `all_gather_object` each (collective: every rank calls them at
the same point) and written by rank 0. `run_info.json` keeps one entry per invocation (`sessions`): a run
resumed with another command or on other machines shows each. The HTML report reads both files.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RUN_INFO = "run_info.json"
MEMORY_RANKS = "memory_ranks.json"
COMMAND_ENV = "SCALETRAIN_COMMAND"  # the user's command line, set by `scaletrain train` before it launches ranks


def user_command() -> str:
    """The command that started this run: the launcher's (inherited through COMMAND_ENV), else this process's."""
    if os.environ.get(COMMAND_ENV):
        return os.environ[COMMAND_ENV]
    prog = sys.argv[0] if sys.argv else "python"
    if prog == "scaletrain" or prog.endswith(("/scaletrain", "scaletrain/__main__.py")):
        prog = "scaletrain"
    return shlex.join([prog, *sys.argv[1:]])


def set_user_command(args) -> None:
    """Remember the `scaletrain train` command for the ranks it launches (they inherit the environment): the
    parsed arguments written back as one command line, so it reads the same however options were spelled."""
    argv = ["scaletrain", "train"]
    if getattr(args, "config", None):
        argv += ["--config", args.config]
    for item in getattr(args, "set", []):
        argv += ["--set", item]
    if getattr(args, "nproc", None) is not None:
        argv += ["--nproc", str(args.nproc)]
    argv += ["--out", str(args.out)]
    os.environ[COMMAND_ENV] = shlex.join(argv)


def device_name(device: torch.device) -> str:
    """A human name of the device: the GPU's product name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def versions() -> dict[str, str]:
    from scaletrain.version import __version__

    out = {"python": platform.python_version(), "torch": torch.__version__, "scaletrain": __version__,
           "platform": platform.platform()}
    if torch.version.cuda:
        out["cuda"] = str(torch.version.cuda)
    return out


def gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (collective over the world when distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def record_run_info(out: Path, rank: int, device: torch.device, launcher: str, fp8: dict | None = None) -> None:
    """Append this invocation to OUT/run_info.json (collective; rank 0 writes). `fp8` (train.precision=fp8): this
    rank's recipe, GEMM kind and FP8 layers (parallel/fp8.py); the session keeps them with every rank's layers."""
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "device": str(device),
          "device_name": device_name(device)}
    if fp8 is not None:
        me["fp8_layers"] = list(fp8["layers"])
    ranks = gather(me)
    if rank != 0:
        return
    path = out / RUN_INFO
    sessions: list = []
    if path.exists():
        try:
            sessions = list(json.loads(path.read_text()).get("sessions", []))
        except (ValueError, AttributeError):
            sessions = []  # an unreadable file from a killed write: start the list again
    sessions.append({"command": user_command(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                     "launcher": launcher, "world_size": len(ranks), "ranks": ranks, "versions": versions()})
    if fp8 is not None:  # the layers that ran in FP8 on any rank, in model order (pipeline stages hold a part each)
        layers = {n for r in ranks for n in r.pop("fp8_layers")}
        sessions[-1]["fp8"] = {**fp8, "layers": sorted(layers, key=_block_order)}
    _write_json(path, {"sessions": sessions})


def _block_order(name: str) -> tuple[int, int]:
    """`blocks.3.mlp.fc` -> (3, its place in a block: attention's layers first, then the MLP's)."""
    _, i, rel = name.split(".", 2)
    order = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.gate", "mlp.up", "mlp.proj")
    return int(i), order.index(rel) if rel in order else len(order)


def record_rank_memory(out: Path, rank: int, step: int, local: dict[str, Any], peak: int) -> None:
    """Each rank's measured bytes per category (and peak) after its first step (collective; rank 0 writes)."""
    mine = {"rank": rank, "step": step, **{k: v for k, v in local.items() if k.startswith("mem_")},
            "mem_peak": int(peak)}
    rows = gather(mine)
    if rank == 0:
        _write_json(out / MEMORY_RANKS, {"ranks": rows})
