"""Process-group setup from the environment of torchrun, SLURM, or our own local launcher.

`detect_env()` reads RANK / WORLD_SIZE / LOCAL_RANK (torchrun, and our launcher, which uses torchrun) or
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun). `pick_device` gives rank LOCAL_RANK the GPU cuda:LOCAL_RANK
(or the CPU); `init(...)` makes it the current device before anything is allocated and starts the default group
with a timeout: NCCL bound to that device when CUDA is present, gloo otherwise. Every group `mesh.Mesh` creates
carries the same timeout (`parallel.timeout_s`).
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
    """cpu, or cuda:LOCAL_RANK: one GPU per local rank (NCCL refuses two ranks on one GPU, so a local rank
    without a GPU of its own is an error, not a silent wrap-around)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    from scaletrain.errors import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"local rank {local_rank} has no GPU of its own: {count} CUDA device(s) visible "
                          "(start at most one process per GPU, or check CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank)


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
    bind = {}
    if device.type == "cuda":
        # before anything is allocated: NCCL communicators, the current stream and every tensor created with
        # device=cuda go to this rank's GPU; binding the default group to it (device_id) creates its NCCL
        # communicator eagerly and lets barrier() know the device instead of guessing
        torch.cuda.set_device(device)
        bind["device_id"] = device
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), store=store, **bind)


def shutdown(clean: bool = True) -> None:
    """Tear down the default group. After a clean run all ranks meet first: a rank that destroys its
    group while a peer still talks to it can make gloo abort the peer."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
