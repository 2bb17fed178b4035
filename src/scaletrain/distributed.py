"""Process-group setup from the environment of torchrun, SLURM, or our own local launcher.

`detect_env()` reads RANK / WORLD_SIZE / LOCAL_RANK (torchrun, and our launcher, which uses torchrun) or
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun). `init(...)` starts the default group with a timeout:
NCCL when CUDA is present, gloo otherwise, and picks the device (cuda:LOCAL_RANK or cpu).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun", "slurm" or "single"


def detect_env() -> DistEnv | None:
    """The surrounding job's ranks, or None when this is a plain single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "MASTER_ADDR" in env:
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                       "slurm")
    return None


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from scaletrain.errors import ConfigError

        raise ConfigError("train.device=cuda but no CUDA device is available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init(env: DistEnv, timeout_s: float, device: torch.device, store: dist.Store | None = None) -> None:
    """Initialise the default process group for `env` (no-op for a single process); `store`: an existing
    client of the job's store (scaletrain.multinode.job), else the env:// rendezvous makes one."""
    if env.world_size == 1 or dist.is_initialized():
        return
    if env.launcher == "slurm":
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("WORLD_SIZE", str(env.world_size))
        os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), store=store)


def shutdown(clean: bool = True) -> None:
    """Tear down the default group. After a clean run all ranks meet first: a rank that destroys its
    group while a peer still talks to it can make gloo abort the peer."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
