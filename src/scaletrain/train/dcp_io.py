"""torch.distributed.checkpoint (DCP) underneath our checkpoints: planners over named global tensors, and a
file storage with per-chunk SHA-256 checksums and a JSON index in place of DCP's pickled metadata.

What DCP does here: `dcp.save` gathers every rank's plan (one write item per rectangular block of each named
tensor, `state.Entry`), removes duplicates of replicated blocks so each is written once (by the least loaded
rank), checks that the chunks tile every tensor, and each rank writes its items into its own file
`__<rank>_0.distcp` (each item a `torch.save` blob). `dcp.load` asks its resharding planner
(`create_read_items_for_chunk_list`) which stored chunks overlap each block the loading rank needs, and the
reader reads exactly those chunks' byte ranges.

What we add:
- `EntrySavePlanner` / `EntryLoadPlanner`: the state is a dict name -> `Entry` (blocks of live tensors), not a
  state dict of DTensors; a load may write one block into several tensors (a parameter and its copies).
- `ChecksummedWriter`: after writing, each item's byte range is read back and hashed; `finish` writes
  `index.json` (every tensor's shape, dtype and chunks: file, offset, length, SHA-256) instead of DCP's pickled
  `.metadata`, so nothing of a checkpoint is ever unpickled outside `torch.load(weights_only=True)`.
- `ChecksummedReader`: builds DCP's metadata from `index.json`, verifies each chunk's SHA-256 before
  `torch.load(weights_only=True)`, and reports a short read (a truncated file) or a mismatch as
  `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from scaletrain.errors import CheckpointError
from scaletrain.train.ckpt_index import DTYPE_NAMES, DTYPES_BY_NAME, INDEX, Stored, read_chunk, read_index, write_json
from scaletrain.train.state import Entry


def _key(fqn: str, offsets) -> tuple[str, tuple[int, ...]]:
    return fqn, tuple(int(o) for o in offsets)


# --------------------------------------------------------------------------- save


class EntrySavePlanner(DefaultSavePlanner):
    """One write item per block of each entry; DCP's global step deduplicates replicated blocks and validates
    that the chunks of every tensor tile it exactly."""

    def __init__(self, entries: dict[str, Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries
        self.by_index = {_key(k, b.offsets): (e, b) for k, e in entries.items() for b in e.blocks}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, e in self.entries.items():
            for b in e.blocks:
                whole = tuple(b.sizes) == tuple(e.shape)
                items.append(WriteItem(
                    index=MetadataIndex(key, torch.Size(b.offsets)),
                    type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                        properties=TensorProperties(dtype=e.dtype), size=torch.Size(e.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        e, b = self.by_index[_key(write_item.index.fqn, write_item.index.offset)]
        t = b.views[0].detach()
        if t.device.type != "cpu" or t.dtype != e.dtype:
            t = t.to("cpu", e.dtype)
        # torch.save writes a view's whole storage: hand it a compact tensor
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.contiguous().clone()
        return t


class ChecksummedWriter(dcp.FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced), with a SHA-256 per item and a JSON index."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)

    def write_data(self, plan: SavePlan, planner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        out, by_file = [], {}
        for r in results:
            by_file.setdefault(r.storage_data.relative_path, []).append(r)
        for rel, rs in by_file.items():
            with open(Path(self.path) / rel, "rb") as f:
                for r in sorted(rs, key=lambda r: r.storage_data.offset):
                    info = r.storage_data
                    f.seek(info.offset)
                    digest = hashlib.sha256(f.read(info.length)).hexdigest()
                    out.append(dataclasses.replace(r, storage_data={
                        "file": rel, "offset": info.offset, "length": info.length, "sha256": digest}))
        fut: Future = Future()
        fut.set_result(out)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        stored = {_key(r.index.fqn, r.index.offset): r.storage_data for rs in results for r in rs}
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{fqn}: only tensors are checkpointed")
            chunks = []
            for c in md.chunks:
                s = stored[_key(fqn, c.offsets)]
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), **s})
            tensors[fqn] = {"shape": list(md.size), "dtype": DTYPE_NAMES[md.properties.dtype], "chunks": chunks}
        write_json(Path(self.path) / INDEX, {"format": "dcp-torch-save", "tensors": tensors})


def _original(e: CheckpointException) -> BaseException:
    """The first rank's own exception inside DCP's wrapper."""
    failures = e.failures
    return failures[min(failures)][0] if failures else e


def save_entries(directory: Path, entries: dict[str, Entry], group=None) -> None:
    """Collective over `group` (all ranks; none for a single process): write `entries` into `directory`."""
    dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "... assuming the intent is to save in a single process": intended
        try:
            dcp.save(entries, storage_writer=ChecksummedWriter(directory), planner=EntrySavePlanner(entries),
                     process_group=group, no_dist=not dist_on)
        except CheckpointException as e:
            raise _original(e) from None


# --------------------------------------------------------------------------- load


def index_metadata(index: dict[str, Any]) -> Metadata:
    """DCP's Metadata for a checkpoint, from index.json."""
    sd_md, storage = {}, {}
    for fqn, t in index["tensors"].items():
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                  for c in t["chunks"]]
        sd_md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=DTYPES_BY_NAME[t["dtype"]]),
                                           size=torch.Size(t["shape"]), chunks=chunks)
        for c in t["chunks"]:
            storage[MetadataIndex(fqn, torch.Size(c["offsets"]))] = Stored(c["file"], int(c["offset"]),
                                                                            int(c["length"]), c["sha256"])
    return Metadata(state_dict_metadata=sd_md, storage_data=storage)


class EntryLoadPlanner(DefaultLoadPlanner):
    """Read items for every block of each entry (DCP's resharding planner finds the stored chunks overlapping
    it); each block's data is copied into all of its views."""

    def __init__(self, entries: dict[str, Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, e in self.entries.items():
            md = self.metadata.state_dict_metadata[key]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in e.blocks]
            items += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        b = self.entries[read_item.dest_index.fqn].blocks[read_item.dest_index.index]
        view = b.views[0]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(d, o, n)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        b = self.entries[read_item.dest_index.fqn].blocks[read_item.dest_index.index]
        for other in b.views[1:]:
            for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                other = other.narrow(d, o, n)
            other.copy_(tensor)


class ChecksummedReader(dcp.FileSystemReader):
    """Reads the stored chunks a plan needs, each verified against its SHA-256, with torch.load(weights_only)."""

    def __init__(self, directory: Path, index: dict[str, Any]):
        super().__init__(directory)
        self.directory, self.index = Path(directory), index
        self.names = {(fqn, tuple(c["offsets"])): fqn for fqn, t in index["tensors"].items() for c in t["chunks"]}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return index_metadata(self.index)

    def read_data(self, plan: LoadPlan, planner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            path = self.directory / rel
            cache: dict[tuple, torch.Tensor] = {}
            try:
                f = open(path, "rb")
            except OSError:
                raise CheckpointError(f"checkpoint file {path} is missing or unreadable") from None
            with f:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    k = _key(item.storage_index.fqn, item.storage_index.offset)
                    if k not in cache:
                        cache.clear()  # items of one stored chunk are consecutive (sorted by offset)
                        cache[k] = read_chunk(f, path, item.storage_index.fqn, info)
                    src = cache[k]
                    for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                        src = src.narrow(d, o, n)
                    dst = planner.resolve_tensor(item).detach()
                    if dst.shape != src.shape:
                        raise CheckpointError(f"checkpoint file {path}: {item.storage_index.fqn} chunk has shape "
                                              f"{tuple(src.shape)}, expected {tuple(dst.shape)}")
                    dst.copy_(src)
                    planner.commit_tensor(item, dst)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def load_entries(directory: Path, entries: dict[str, Entry], index: dict[str, Any] | None = None) -> None:
    """Fill this rank's `entries` from the checkpoint in `directory` (no collectives: each rank reads what it
    needs). Shapes and dtypes are checked first; a missing tensor or mismatch raises CheckpointError."""
    index = index if index is not None else read_index(directory)
    tensors = index["tensors"]
    for key, e in entries.items():
        t = tensors.get(key)
        if t is None:
            raise CheckpointError(f"checkpoint {directory} has no tensor {key}")
        if tuple(t["shape"]) != tuple(e.shape) or DTYPES_BY_NAME[t["dtype"]] != e.dtype:
            raise CheckpointError(f"checkpoint {directory}: {key} is {tuple(t['shape'])} {t['dtype']} there, "
                                  f"{tuple(e.shape)} {DTYPE_NAMES.get(e.dtype, e.dtype)} in this run")
    reader = ChecksummedReader(directory, index)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended here
        try:
            dcp.load(entries, storage_reader=reader, planner=EntryLoadPlanner(entries), no_dist=True)
        except CheckpointException as e:
            err = _original(e)
            if isinstance(err, CheckpointError):
                raise err from None
            raise CheckpointError(f"checkpoint {directory} cannot be read: {str(err).splitlines()[0][:200]}") \
                from None
    for e in entries.values():
        if e.after_load is not None:
            e.after_load()
