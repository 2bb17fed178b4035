"""Per-rank checkpoints of the asynchronous runners (parallel.sync = ps, hogwild, local; docs/async.md).

The synchronous trainer saves layout-independent checkpoints (`scaletrain.train.checkpoint`, on
torch.distributed.checkpoint). The asynchronous runners (parameter servers, Li et al. OSDI 2014; Hogwild,
arXiv 1106.5730; local SGD / DiLoCo, arXiv 1808.07217 / 2311.08105) keep state that has no meaning under
another layout (a parameter server's shard of the flat buffer and its optimizer moments, each worker's own
replica and RNG, version logs, local SGD's round position), so they keep this small per-rank format instead and
cannot be resharded: `--reshard`, `--init-from` and a change of layout are refused (`common.check_async_run`).

Layout: `OUT/checkpoints/step_00000100/` holding `rank00000.pt` (one file per saving rank: its payload of
tensors and plain values), `rank00000.sha256`, `meta.json` (`format` = FORMAT, step, world size and the run
signature of `common.async_signature`) and `COMPLETE`. A save writes everything into `step_00000100.tmp/` (each
file written to a temporary name, fsynced and renamed), waits for all saving ranks, writes `COMPLETE` last and
renames the directory into place; older checkpoints are pruned only after that. A kill at any moment leaves
either the new complete checkpoint or only the previous ones; `.tmp` directories are never read.

Loading checks each file's SHA-256 and uses `torch.load(weights_only=True)`; a corrupted or mismatched checkpoint
raises `CheckpointError` (exit 2) and nothing is deleted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from scaletrain.errors import CheckpointError
from scaletrain.train.checkpoint_dirs import (
    COMPLETE,
    RANK_FORMAT,
    complete_checkpoints,
    format_of,
    fsync_dir,
    latest,
    prune,
    step_dir,
    usable_latest,
)

FORMAT = RANK_FORMAT

__all__ = ["FORMAT", "complete_checkpoints", "is_async_checkpoint", "latest", "load_rank", "read_meta", "save",
           "usable_latest"]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank:05d}.pt"


def save_rank_file(directory: Path, rank: int, payload: dict[str, Any]) -> Path:
    """This rank's file and its SHA-256 in `directory`, each written atomically and fsynced."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    path = rank_file(directory, rank)
    _write_atomic(path, data)
    _write_atomic(path.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
    return path


def save(root: Path, step: int, rank: int, world_size: int, payload: dict[str, Any], meta: dict[str, Any],
         barrier, keep: int) -> Path:
    """Collective save of this rank's `payload` over the `world_size` saving ranks; rank 0 publishes.
    `barrier()` synchronises the saving ranks."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # leftover of a save that was killed; never a complete checkpoint
        tmp.mkdir(parents=True)
    barrier()
    save_rank_file(tmp, rank, payload)
    barrier()
    if rank == 0:
        _write_atomic(tmp / "meta.json", json.dumps({**meta, "format": FORMAT, "step": step,
                                                     "world_size": world_size}, indent=1).encode())
        _write_atomic(tmp / COMPLETE, b"ok\n")
        fsync_dir(tmp)
        if final.exists():  # same step saved again (a rerun): replaced only now that the new one is complete
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        prune(root, keep)
    barrier()
    return final


def is_async_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint of this format (read from meta.json; False if unreadable)."""
    return format_of(directory) == FORMAT


def read_meta(directory: Path) -> dict[str, Any]:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory} has an unreadable meta.json ({e.__class__.__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else "?"
        raise CheckpointError(f"checkpoint {directory} has format {found}, not the asynchronous runners' {FORMAT}: "
                              "it was written by a parallel.sync=bsp run, resume it with parallel.sync=bsp")
    return meta


def load_rank(directory: Path, rank: int) -> dict[str, Any]:
    """This rank's payload, verified against its SHA-256 and loaded with weights_only=True."""
    path = rank_file(directory, rank)
    try:
        data = path.read_bytes()
        expected = path.with_suffix(".sha256").read_text().strip()
    except OSError:
        raise CheckpointError(f"checkpoint {directory} is missing {path.name} or its checksum") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"checkpoint file {path} is corrupted (SHA-256 mismatch)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise CheckpointError(f"checkpoint file {path} cannot be loaded: {str(e).splitlines()[0][:200]}") from None
