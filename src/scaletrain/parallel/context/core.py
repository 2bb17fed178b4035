"""The ring attention core that replaces an attention module's `attn_core(q, k, v)` (ring.py does the work)."""

from __future__ import annotations

import torch
import torch.nn as nn

from scaletrain.parallel.context.comm import Ring
from scaletrain.parallel.context.kernels import BlockDropout, default_scale
from scaletrain.parallel.context.ring import RingAttention


class RingCore:
    """`attn_core` of one attention module under ring attention: its attention-probability dropout (the module's
    layout-independent `attn_dropout`, with the global head offset tensor parallelism gave it) is applied inside
    the ring's blocks with the mask of global (row, head, query, key) indices."""

    def __init__(self, attn: nn.Module, ring: Ring, positions: list[torch.Tensor], seq_len: int):
        self.attn, self.ring, self.positions, self.seq_len = attn, ring, positions, seq_len
        self._on: dict[torch.device, list[torch.Tensor]] = {}  # the positions on each device they were needed on

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        drop = None
        d = getattr(self.attn, "attn_dropout", None)
        if d is not None and self.attn.training and d.p > 0:
            head0, heads = d.offsets.get(1, (0, q.shape[1]))
            drop = BlockDropout(d.p, d.key(), d.context.row, head0, heads, self.seq_len)
        positions = self._on.setdefault(q.device, [p.to(q.device) for p in self.positions])
        return RingAttention.apply(q, k, v, self.ring, default_scale(q.shape[-1]), drop, positions)
