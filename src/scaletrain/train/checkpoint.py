"""Layout-independent checkpoints: atomic, verified, written synchronously or in the background.

On disk, `OUT/checkpoints/step_00000100/` holds
- `__<rank>_0.distcp`: the tensors (torch.distributed.checkpoint's file format, one file per writing rank);
- `index.json`: every tensor by name (`train/state.py`) with its global shape, dtype and chunks (offsets, sizes,
  file, byte range, SHA-256);
- `meta.json`: format, step, the writing run's layout and world size, its resolved config, and the trainer's
  scalars (loss scaler, skipped steps, noise-scale averages);
- `COMPLETE`: written last, with the SHA-256 of `index.json` and `meta.json`.

A save writes everything into `step_00000100.tmp/` (files fsynced), waits for all ranks, and rank 0 writes
`COMPLETE` and renames the directory into place; only then are checkpoints beyond `train.keep_checkpoints`
pruned. A kill at any moment leaves either the new complete checkpoint or only the previous ones; unfinished
`.tmp` directories are never read. `Saver(async_=True)` copies this rank's blocks to host memory (the staged
copy) and does the write and the publish in a background thread on a process group of its own, so training
goes on; the next save (and the end of the run) first waits for the previous one.

Loading reads only `index.json`/`meta.json` (JSON) and the chunks it needs, each checked against its SHA-256
and read with `torch.load(weights_only=True)`; anything corrupted, truncated or mismatched raises
`CheckpointError` (exit 2) and nothing is deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.distributed.launch import hold_if_orphaned
from scaletrain.errors import CheckpointError, DiskFull, UserError, disk_full
from scaletrain.train import checkpoint_dirs, ckpt_index
from scaletrain.train.checkpoint_dirs import (
    COMPLETE,
    DCP_FORMAT,
    RANK_FORMAT,
    format_of,
    fsync_dir,
    latest,
    prune,
    step_dir,
)
from scaletrain.train.shards import Block
from scaletrain.train.state import Entry

FORMAT = DCP_FORMAT
META = "meta.json"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- random states


def rng_state(device: torch.device) -> dict[str, Any]:
    """Python, NumPy and torch RNG states (the trainer swaps them in while it computes). Checkpoints keep the
    torch (and CUDA) states: training draws from nothing else."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# --------------------------------------------------------------------------- reading


def read_meta(directory: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint, after checking COMPLETE's checksums of meta.json and index.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    if any(directory.glob("rank*.pt")) and not (directory / ckpt_index.INDEX).exists():
        if format_of(directory) == RANK_FORMAT:
            raise CheckpointError(f"{directory} is a per-rank checkpoint of an asynchronous run ({RANK_FORMAT}, "
                                  "parallel.sync=ps/hogwild/local): resume it with that run's parallel.sync, which "
                                  "cannot change, and without --reshard")
        raise CheckpointError(f"{directory} is a checkpoint in the old per-rank format (rankNNNNN.pt), which this "
                              "version does not read; train into a new --out")
    if not (directory / COMPLETE).is_file():
        raise CheckpointError(f"{directory} is not a complete scaletrain checkpoint (no {COMPLETE} marker)")
    try:
        marker = json.loads((directory / COMPLETE).read_text())
        want = {name: str(marker["sha256"][name]) for name in (META, ckpt_index.INDEX)}
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {directory} has an unreadable {COMPLETE} marker") from None
    for name, digest in want.items():
        try:
            got = _sha256_file(directory / name)
        except OSError:
            raise CheckpointError(f"checkpoint {directory} is missing {name}") from None
        if got != digest:
            raise CheckpointError(f"checkpoint {directory}: {name} fails its SHA-256 check (corrupted)")
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory} has an unreadable {META} ({e.__class__.__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else "?"
        raise CheckpointError(f"checkpoint {directory} has format {found}, this version reads {FORMAT}")
    for key in ("step", "config", "layout", "world_size"):
        if key not in meta:
            raise CheckpointError(f"checkpoint {directory}: {META} has no {key}")
    return meta


def read_tensors(directory: Path, prefix: str = "model/", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors whose names start with `prefix`, by name without it (no process group needed)."""
    index = ckpt_index.read_index(directory)
    out: dict[str, torch.Tensor] = {}
    entries: dict[str, Entry] = {}
    for key, t in index["tensors"].items():
        if key.startswith(prefix):
            shape = tuple(t["shape"])
            buf = torch.empty(shape, dtype=ckpt_index.DTYPES_BY_NAME[t["dtype"]])
            entries[key] = Entry(shape, buf.dtype, [Block((0,) * len(shape), shape, [buf])])
            out[key[len(prefix):]] = buf
    from scaletrain.train import dcp_io  # torch.distributed.checkpoint: imported when a checkpoint is read

    dcp_io.load_entries(directory, entries, index)
    return {k: v.to(dtype) for k, v in out.items()} if dtype is not None else out


@dataclass
class VerifyReport:
    tensors: int
    chunks: int
    bytes: int
    bad: list[str]


def verify(directory: Path, index: dict | None = None) -> VerifyReport:
    """Read every chunk of the checkpoint and check its SHA-256 (what `checkpoint inspect` reports)."""
    index = index if index is not None else ckpt_index.read_index(directory)
    bad: list[str] = []
    chunks = nbytes = 0
    for name, t in index["tensors"].items():
        for c in t["chunks"]:
            chunks += 1
            nbytes += int(c["length"])
            path = Path(directory) / c["file"]
            try:
                with open(path, "rb") as f:
                    stored = ckpt_index.Stored(c["file"], int(c["offset"]), int(c["length"]), c["sha256"])
                    ckpt_index.read_chunk(f, path, name, stored)
            except (CheckpointError, OSError) as e:
                bad.append(str(e))
    return VerifyReport(len(index["tensors"]), chunks, nbytes, bad)


# --------------------------------------------------------------------------- writing


def stage(entries: dict[str, Entry]) -> dict[str, Entry]:
    """A host copy of this rank's blocks (what an asynchronous save writes while training goes on)."""
    out: dict[str, Entry] = {}
    for key, e in entries.items():
        blocks = [Block(b.offsets, b.sizes, [b.views[0].detach().to("cpu", e.dtype, copy=True).contiguous()])
                  for b in e.blocks]
        out[key] = Entry(e.shape, e.dtype, blocks)
    return out


def staged_bytes(entries: dict[str, Entry]) -> int:
    return sum(b.views[0].numel() * b.views[0].element_size() for e in entries.values() for b in e.blocks)


class Saver:
    """Collective checkpoint writer of one run (every rank makes one, with the same arguments).

    `save(step, entries, meta)` writes `entries` (this rank's blocks) and rank 0's `meta` as the checkpoint of
    `step` under `root`. Synchronous by default, over the default process group; with `async_` the blocks are
    staged to host memory and written by a background thread over a gloo group of its own (created here,
    collectively), so its collectives never interleave with training's; `wait()` (called by the next save and at
    the end of a run) finishes it."""

    def __init__(self, root: Path, rank: int, keep: int, async_: bool = False, timeout_s: float = 300.0):
        self.root, self.rank, self.keep, self.async_ = Path(root), rank, keep, async_
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group = None  # the default group
        if async_ and self.distributed:
            from datetime import timedelta

            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stall_s = 0.0  # how long the last save held the training loop
        self.last_staged_bytes = 0

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def save(self, step: int, entries: dict[str, Entry], meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.wait()
        if not self.async_:
            self._write(step, entries, meta)
            self.last_stall_s = time.perf_counter() - t0
            return
        staged = stage(entries)
        self.last_staged_bytes = staged_bytes(staged)
        self._error = None
        self._thread = threading.Thread(target=self._background, args=(step, staged, meta), daemon=True,
                                        name=f"scaletrain-checkpoint-{step}")
        self._thread.start()
        self.last_stall_s = time.perf_counter() - t0

    def _background(self, step: int, entries: dict[str, Entry], meta: dict[str, Any]) -> None:
        try:
            self._write(step, entries, meta)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    def wait(self) -> None:
        """Finish the save in flight (if any); re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def _write(self, step: int, entries: dict[str, Entry], meta: dict[str, Any]) -> Path:
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # leftover of a save that was killed; never a complete checkpoint
            tmp.mkdir(parents=True)
        self._barrier()
        from scaletrain.train import dcp_io  # torch.distributed.checkpoint: imported when a checkpoint is written

        try:
            dcp_io.save_entries(tmp, entries, self.group)  # collective; rank 0 writes index.json before it returns
            if self.rank == 0:
                publish(tmp, final, {**meta, "format": FORMAT, "step": step})
        except (OSError, RuntimeError) as e:
            if not disk_full(e):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # the partial save: give the space back
            before = latest(self.root)
            kept = f"; the earlier checkpoint {before} is intact" if before is not None else ""
            raise DiskFull(f"cannot write checkpoint step {step} into {self.root}: the disk is full "
                           f"({shutil.disk_usage(self.root).free / 2**20:,.1f} MiB free){kept}") from None
        if self.rank == 0:
            prune(self.root, self.keep)
        self._barrier()
        return final


def publish(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Write meta.json and COMPLETE into `tmp` and rename it to `final` (replacing an older one of that step)."""
    hold_if_orphaned()
    ckpt_index.write_json(tmp / META, meta)
    digests = {name: _sha256_file(tmp / name) for name in (META, ckpt_index.INDEX)}
    ckpt_index.write_json(tmp / COMPLETE, {"sha256": digests})
    fsync_dir(tmp)
    if final.exists():  # the same step saved again (a rerun): replace it only now that the new one is complete
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def usable_latest(root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint (its markers checked) and a note for each newer incomplete one passed over
    (checkpoint_dirs.usable_latest). A CheckpointError when only incomplete ones exist, when the newest complete one
    fails its checks, or when `root` is not a folder: the run stops rather than start again from step 0."""
    found, notes = checkpoint_dirs.usable_latest(root)
    if found is not None:
        read_meta(found)  # a complete checkpoint that fails its checks (tampered, truncated) stops the run: exit 2
    return found, notes


def find_checkpoint(path: str | Path, note: bool = True) -> Path:
    """The checkpoint `path` names: itself, a run's newest, or the newest of a folder of runs (said on stderr)."""
    from scaletrain.guards import check_path

    p = check_path(path, "the run")  # long parts, link loops, dangling links: one line
    if not p.is_dir():
        raise UserError(f"{p} is not a scaletrain run, a checkpoint or a folder of runs (not a directory)")
    if (p / COMPLETE).exists() or (p / META).exists() or any(p.glob("rank*.pt")):
        return p
    found = latest(p / "checkpoints")
    if found is not None:
        return found
    if (p / "config.yaml").exists() or (p / "checkpoints").is_dir():
        raise CheckpointError(f"no complete checkpoint in {p / 'checkpoints'}")
    runs = []
    for sub in sorted(p.iterdir()):
        newest = latest(sub / "checkpoints") if sub.is_dir() else None
        if newest is not None:
            runs.append(((newest / COMPLETE).stat().st_mtime, sub, newest))
    if not runs:
        raise UserError(f"{p} is not a scaletrain run (no checkpoints/, no config.yaml) and holds no runs")
    _, run, newest = max(runs, key=lambda r: (r[0], r[1].name))
    if note:
        sys.stderr.write(f"scaletrain: using {run}, the run with the newest checkpoint in {p}\n")
    return newest
