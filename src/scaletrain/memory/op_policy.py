"""The op-level checkpointing policy `memory.recompute=ops:<kinds>`: each block is a checkpoint that keeps the outputs
of the listed op kinds and recomputes only the rest in backward (torchtitan's "selective op" activation
checkpointing; the trade-off of Korthikanti et al., arXiv 2205.05198 Sec. 5, made per op instead of per layer part).

It is torch's selective activation checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts` with a
`CheckpointPolicy` function): in the forward a dispatch mode asks `OpPolicy` about every op run inside the checkpoint
and caches the outputs it says to save; the recomputation in backward takes those from the cache instead of running
the op again. Kinds (schema.RecomputeOp):

- `matmul`: aten mm / addmm / bmm / baddbmm, i.e. every linear layer (tensor-parallel ones included) and the
  experts' batched matmuls; the attention's own matmuls when it runs unfused (dropout with layout-independent masks);
- `attention`: the fused scaled-dot-product-attention kernels (flash for CPU, flash / memory-efficient / cuDNN on
  CUDA): their output and log-sum-exp.

One rule keeps the recomputation exact: an op that writes into a tensor the cache holds (the tensor-parallel
all-reduce of a row-parallel matmul's output runs in place on it) is saved too, so the cached, already written
value is not written twice; collectives that write a fresh buffer (sequence parallelism's reduce-scatter and
all-gather) run again in backward, as under `full`.

What the cache keeps is reported to the activation counter (`device.accounting.count_saved`), once per storage, so
`mem_activations` is the block inputs plus the kept outputs; `plan/exact/run_memory.py` predicts the same sum.
The cache is held by torch, outside saved-tensor hooks, so activation offload, partitioned checkpoints,
compression and contiguous arenas do not apply to it (memory/rules.py refuses them with ops:...).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from scaletrain.device.accounting import count_saved

_aten = torch.ops.aten


def _ops(names: Iterable[str]) -> frozenset:
    """The default overloads of the aten ops of these names that this torch build has."""
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


OP_KINDS: dict[str, frozenset] = {
    "matmul": _ops(("mm", "addmm", "bmm", "baddbmm")),
    "attention": _ops(("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                       "_scaled_dot_product_fused_attention_overrideable")),
}
"""schema.RecomputeOp -> the aten ops whose outputs that kind keeps."""


def _storages(tree: Any) -> list[int]:
    return [t.untyped_storage()._cdata for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments `func` writes into: the alias-annotated ones of an aten op; the first (the destination) of a
    c10d collective, whose schemas carry no annotation."""
    if func.namespace == "c10d":
        return list(args[:1])
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(a.name))
    return out


class OpPolicy:
    """The `CheckpointPolicy` of one checkpointed call: MUST_SAVE for the ops of `ops` (schema.RecomputeOp kinds) and
    for ops writing into what was saved, PREFER_RECOMPUTE for everything else. Counts the kept outputs' bytes."""

    def __init__(self, ops: Iterable[str]):
        self.save = frozenset().union(*(OP_KINDS[k] for k in ops))
        self.kept: set[int] = set()  # storages in the cache
        self.cached_mode: Any = None  # the recomputation's dispatch mode (to allow the writes this policy saved)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in self.save:
            return self._keep(ctx.op_output)
        if func._schema.is_mutable or func.namespace == "c10d":
            written = _storages(_written(func, args, kwargs))
            if any(s in self.kept for s in written):
                if self.cached_mode is not None:  # the written value is what the cache returns; the write is not
                    self.cached_mode.allow_cache_entry_mutation = True  # run again
                return self._keep(ctx.op_output)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _keep(self, output: Any) -> CheckpointPolicy:
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in self.kept:
                    self.kept.add(key)
                    count_saved(t)
        return CheckpointPolicy.MUST_SAVE


def op_contexts(ops: Iterable[str]) -> tuple[Any, Any]:
    """(forward, recomputation) contexts of torch's selective checkpointing with a fresh `OpPolicy` for `ops`."""
    policy = OpPolicy(ops)
    caching, cached = create_selective_checkpoint_contexts(policy)
    policy.cached_mode = cached
    return caching, cached
