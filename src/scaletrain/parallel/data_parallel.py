"""Data parallelism: gradients summed over the data-parallel group in flat buckets, overlapped with backward.

Each parameter's `.grad` is a view into the flat gradient buffer of its bucket (PyTorch DDP's
`gradient_as_bucket_view`, Li et al., arXiv 2006.15704). Buckets follow the reverse order of parameter
registration, the approximate order in which backward produces gradients. A post-accumulate-grad hook
counts the parameters of a bucket that are ready; when the last one is, the bucket's all-reduce is
launched asynchronously, so communication overlaps the rest of backward. During gradient accumulation
only the last micro-batch communicates.

Loss normalisation is global (each micro-batch loss is divided by the token count of the whole global
batch), so the exact gradient of the single-process run is the *sum* of the ranks' gradients: the
buckets are all-reduced with SUM, not averaged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scaletrain.distributed.comm import CommStats, all_reduce, group_size


def bucket_params(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters grouped into buckets of at most `bucket_bytes` (a larger one stands alone)."""
    out: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [b for b in out if b]


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    grad: torch.Tensor  # flat buffer; each param's .grad is a view into it
    ready: int = 0
    work: object = None
    offsets: list[int] = field(default_factory=list)


class BucketedAllReduce:
    """Owns the gradients of `params` and sums them over `group` as buckets fill during backward."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, bucket_mb: float,
                 stats: CommStats | None = None, grad_dtype: torch.dtype | None = None):
        self.group, self.stats = group, stats
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        # Mixed precision: gradients accumulate and are reduced in `grad_dtype` (fp32) "main gradient"
        # buffers, each micro-batch's low-precision .grad being added in by the hook and then dropped.
        self.main_grads = grad_dtype is not None and grad_dtype != self.params[0].dtype
        self.views: dict[int, torch.Tensor] = {}  # param id -> its slice of the bucket buffer
        for plist in bucket_params(list(reversed(self.params)), int(bucket_mb * 2**20)):
            numel = sum(p.numel() for p in plist)
            flat = torch.zeros(numel, dtype=grad_dtype or plist[0].dtype, device=plist[0].device)
            bucket = Bucket(plist, flat)
            offset = 0
            for p in plist:
                bucket.offsets.append(offset)
                self.views[id(p)] = flat[offset: offset + p.numel()].view(p.shape)
                if not self.main_grads:
                    p.grad = self.views[id(p)]
                offset += p.numel()
                self._bucket_of[id(p)] = bucket
            self.buckets.append(bucket)
        self.sync = True
        self.exposed_s = 0.0  # time spent waiting for communication after backward (not hidden)
        # With several ranks, zero_grad drops .grad instead of zeroing the buckets: the first backward of a
        # step then writes a fresh gradient that the hook copies into the bucket (one pass over the memory
        # instead of a zeroing pass plus an accumulation), later micro-batches accumulate in place.
        self.copy_in = not self.main_grads and group_size(group) > 1
        if group_size(group) > 1 or self.main_grads:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def begin_micro(self, index: int, count: int) -> None:
        """Called before each micro-batch's backward: communicate only after the last one."""
        self.sync = index == count - 1
        if self.sync:
            for b in self.buckets:
                b.ready, b.work = 0, None

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.main_grads:
            self.views[id(p)].add_(p.grad)
            p.grad = None
        elif self.copy_in and p.grad.data_ptr() != self.views[id(p)].data_ptr():
            self.views[id(p)].copy_(p.grad)
            p.grad = self.views[id(p)]
        if not self.sync or group_size(self.group) == 1:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = all_reduce(bucket.grad, self.group, stats=self.stats, async_op=True)

    def finish(self) -> None:
        """After the last backward: launch buckets whose parameters got no gradient, wait for all."""
        if group_size(self.group) == 1:
            return
        t0 = time.perf_counter()
        for b in self.buckets:
            if b.work is None:
                if self.copy_in:  # parameters that got no gradient this step contribute zeros
                    for q in b.params:
                        if q.grad is None:
                            self.views[id(q)].zero_()
                            q.grad = self.views[id(q)]
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
        self.exposed_s += time.perf_counter() - t0

    def zero_grad(self) -> None:
        if self.copy_in:
            for p in self.params:
                p.grad = None
            return
        for b in self.buckets:
            b.grad.zero_()

    def grad_tensors(self) -> list[torch.Tensor]:
        return [b.grad for b in self.buckets]

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The (reduced) gradient of `p`: its slice of the bucket buffer."""
        return self.views[id(p)]
