"""File I/O of the ZeRO-Infinity store: one rank's shard files, read ahead and written behind by worker threads.

Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning",
arXiv 2104.07857, Sec. 6 (the overlap-centric design: NVMe reads of the next parameters and writes of the last
gradients run while the device computes).

`ShardFiles` keeps one file per category (`params`, `masters`, `exp_avg`, `exp_avg_sq`, `grads`) in a folder of
its own; unit k's shard sits at a fixed byte offset in each. Reads and writes go straight between the file and a
tensor's memory with `os.preadv` / `os.pwritev` (no intermediate copy; the GIL is released during the system
call, so a few threads keep several requests in flight). Space is reserved up front with `posix_fallocate`, so a
full disk fails when the run starts, not in the middle of it. Every byte moved is counted (`read_bytes`,
`write_bytes`), which is what a run reports per step.

We use plain threads rather than an asynchronous-I/O library: the standard library's positioned vector I/O
already releases the GIL and reads into the tensor's own memory, and `benchmarks/bench_offload.py` measures
the resulting bandwidth against the disk's.

`ReadAhead` is the pool of staging buffers for parameter shards: `want(k)` starts reading unit k into a free
buffer (never evicting), `take(k)` returns unit k's shard (waiting for its read, or reading it now, evicting the
oldest unused read-ahead when the pool is exhausted), `give(buf)` returns a buffer to the pool.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from scaletrain.errors import UserError


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a writable byte view (no copy; works for bf16 too)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def pread_into(fd: int, t: torch.Tensor, offset: int) -> int:
    view, done = _bytes_view(t), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read at byte {offset + done} of an offload file")
        done += got
    return done


def pwrite_from(fd: int, t: torch.Tensor, offset: int) -> int:
    view, done = _bytes_view(t), 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
    return done


class ShardFiles:
    """One rank's shard files. `layout[category] = (dtype, [elements of unit 0, unit 1, ...])`."""

    def __init__(self, directory: Path, layout: dict[str, tuple[torch.dtype, list[int]]], threads: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=False)
        self.dtype = {c: d for c, (d, _) in layout.items()}
        self.offsets: dict[str, list[int]] = {}
        self.fds: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.read_bytes = self.write_bytes = 0
        self._lock = threading.Lock()
        for cat, (dtype, counts) in layout.items():
            esz = torch.empty((), dtype=dtype).element_size()
            offs, total = [], 0
            for c in counts:
                offs.append(total)
                total += c * esz
            self.offsets[cat], self.sizes[cat] = offs, total
        try:
            for cat, total in self.sizes.items():
                fd = os.open(self.dir / f"{cat}.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self.fds[cat] = fd
                if total:
                    os.posix_fallocate(fd, 0, total)  # reserved now; unwritten ranges read as zeros
        except OSError as e:
            self.close()
            raise UserError(f"parallel.offload_dir: cannot create {self.total_bytes / 2**30:.2f} GiB of offload files "
                            f"in {self.dir}: {e.strerror or e}") from None
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvme")

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def _offset(self, cat: str, unit: int, start: int) -> int:
        return self.offsets[cat][unit] + start * self.dtype[cat].itemsize

    def read(self, cat: str, unit: int, out: torch.Tensor, start: int = 0) -> None:
        """Read unit `unit`'s elements [start, start + out.numel()) of `cat` into `out` (in this thread)."""
        n = pread_into(self.fds[cat], out, self._offset(cat, unit, start))
        with self._lock:
            self.read_bytes += n

    def write(self, cat: str, unit: int, src: torch.Tensor, start: int = 0) -> None:
        n = pwrite_from(self.fds[cat], src, self._offset(cat, unit, start))
        with self._lock:
            self.write_bytes += n

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        """Stop the workers and delete the files (they are scratch: checkpoints are separate)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
            self.pool = None
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
        shutil.rmtree(self.dir, ignore_errors=True)


class ReadAhead:
    """`count` staging buffers of `elements` each for parameter shards of category `cat`."""

    def __init__(self, files: ShardFiles, cat: str, sizes: list[int], count: int, elements: int, pin: bool):
        self.files, self.cat, self.sizes = files, cat, sizes
        dtype = files.dtype[cat]
        self.buffers = [torch.empty(elements, dtype=dtype, pin_memory=pin) for _ in range(count)]
        self.free = list(self.buffers)
        self.staged: OrderedDict[int, tuple[torch.Tensor, Future]] = OrderedDict()

    def _read(self, k: int, buf: torch.Tensor) -> None:
        self.files.read(self.cat, k, buf[: self.sizes[k]])

    def want(self, k: int) -> None:
        """Start reading unit k if a buffer is free and k is not staged already."""
        if k in self.staged or not self.free:
            return
        buf = self.free.pop()
        self.staged[k] = (buf, self.files.submit(self._read, k, buf))

    def take(self, k: int) -> torch.Tensor:
        """Unit k's shard in a staging buffer (a view of its first S_k elements); `give` it back when done."""
        if k in self.staged:
            buf, fut = self.staged.pop(k)
            fut.result()
            return buf[: self.sizes[k]]
        if not self.free:
            _, (buf, fut) = self.staged.popitem(last=False)  # evict the oldest read-ahead nobody took yet
            fut.result()
            self.free.append(buf)
        buf = self.free.pop()
        self._read(k, buf)
        return buf[: self.sizes[k]]

    def give(self, view: torch.Tensor) -> None:
        for buf in self.buffers:
            if buf.data_ptr() == view.data_ptr():
                self.free.append(buf)
                return
        raise ValueError("not a staging buffer of this pool")

    def drop(self) -> None:
        """Forget every read-ahead (the files are about to change): wait for them and free their buffers."""
        while self.staged:
            _, (buf, fut) = self.staged.popitem(last=False)
            fut.result()
            self.free.append(buf)


def measure_bandwidth(directory: str | os.PathLike, nbytes: int = 256 << 20, block: int = 4 << 20,
                      direct: bool = False) -> tuple[float, float]:
    """(read, write) bytes/s of `nbytes` written then read back in `block`-byte requests in a scratch file
    under `directory`, through the engine's own path (positioned vector I/O into tensor memory). `direct=True`
    opens the file with O_DIRECT and syncs the writes, so the numbers are the device's, not the page cache's."""
    import tempfile
    import time

    flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if direct else 0)
    buf = torch.empty(block + 4096, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 4096  # O_DIRECT needs aligned memory
    t = buf[start: start + block]
    t.random_(0, 255)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        fd = os.open(os.path.join(d, "bench.bin"), flags, 0o600)
        try:
            n = max(1, nbytes // block)
            t0 = time.perf_counter()
            for i in range(n):
                pwrite_from(fd, t, i * block)
            if direct:
                os.fsync(fd)
            t1 = time.perf_counter()
            for i in range(n):
                pread_into(fd, t, i * block)
            t2 = time.perf_counter()
        finally:
            os.close(fd)
    return n * block / (t2 - t1), n * block / (t1 - t0)
