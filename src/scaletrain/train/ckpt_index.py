"""A checkpoint's own index: `index.json` (every tensor by name with its global shape, dtype and stored chunks, each
with its file, offset, length and SHA-256), its dtype names, and reading one stored chunk with its checksum checked.

What needs only the index lives here, without torch.distributed.checkpoint: inspecting, converting and resuming
read it first, and a process that never saves or loads a checkpoint (most test ranks, `verify`) does not pay DCP's
import (about a second per process). The writing and the resharding read through DCP are `train/dcp_io.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from scaletrain.errors import CheckpointError

INDEX = "index.json"
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16", torch.uint8: "uint8", torch.int64: "int64", torch.int32: "int32"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def write_json(path: Path, data: Any) -> None:
    """Write JSON to `path` atomically (temporary name, fsync, rename)."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_index(directory: Path) -> dict[str, Any]:
    """The checkpoint's index.json (tensors, shapes, chunks), checked for structure."""
    try:
        index = json.loads((directory / INDEX).read_text())
        tensors = index["tensors"]
        for name, t in tensors.items():
            if t["dtype"] not in DTYPES_BY_NAME or not isinstance(t["shape"], list):
                raise ValueError(name)
            for c in t["chunks"]:
                _ = (str(c["file"]), int(c["offset"]), int(c["length"]), str(c["sha256"]), list(c["offsets"]),
                     list(c["sizes"]))
                if "/" in c["file"] or c["file"].startswith("."):
                    raise ValueError(c["file"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {directory} has an unreadable {INDEX} ({e.__class__.__name__})") from None
    return index


@dataclasses.dataclass
class Stored:
    """Where one chunk is stored (the fields DCP's reader reads)."""

    relative_path: str
    offset: int
    length: int
    sha256: str
    transform_descriptors: Any = None


def read_chunk(f, path: Path, fqn: str, info) -> torch.Tensor:
    """One stored chunk: its bytes checked against the SHA-256, then torch.load(weights_only=True)."""
    f.seek(info.offset)
    data = f.read(info.length)
    if len(data) != info.length:
        raise CheckpointError(f"checkpoint file {path} is truncated ({fqn} needs bytes {info.offset}.."
                              f"{info.offset + info.length}, the file ends before)")
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise CheckpointError(f"checkpoint file {path} is corrupted: {fqn} fails its SHA-256 check")
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise CheckpointError(f"checkpoint file {path}: {fqn} cannot be loaded: {str(e).splitlines()[0][:160]}") \
            from None
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"checkpoint file {path}: {fqn} is not a tensor")
    return t
