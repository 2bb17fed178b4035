"""DeepSpeed-Ulysses (Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models", arXiv 2309.14509).

Around the attention core, an all-to-all turns q, k and v from sequence-sharded (every head, T/n tokens) into
head-sharded (h/n heads, all T tokens); the unchanged core attends over the whole sequence for its heads, and a
second all-to-all turns the output back. Per layer and pass each rank sends (n-1)/n of q, k, v and the output:
4 all-to-alls in forward, their 4 transposes in backward (one message carries q, k and v when they have the same
head count). Rank r holds the contiguous r-th chunk of the sequence (`layout.py`), so the gathered sequence is in
global order and the core's causal mask and dropout (global head offsets, model/dropout.py) apply unchanged.
Needs heads (and key/value heads) divisible by n; under tensor parallelism, the heads of a tp rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scaletrain.distributed.comm import CommStats
from scaletrain.parallel.context.comm import HeadsToSeq, SeqToHeads


class UlyssesCore:
    """Replaces an attention module's `attn_core(q, k, v)`: all-to-all in, the module's own core, all-to-all out."""

    def __init__(self, inner: Callable, group, stats: CommStats | None):
        self.inner, self.group, self.stats = inner, group, stats

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B = q.shape[0]
        if k.shape[1] == q.shape[1]:  # one all-to-all for q, k and v
            q, k, v = SeqToHeads.apply(torch.cat([q, k, v]), self.group, self.stats).split(B)
        else:  # grouped-query attention: fewer key/value heads, a message of their own
            q = SeqToHeads.apply(q, self.group, self.stats)
            k, v = SeqToHeads.apply(torch.cat([k, v]), self.group, self.stats).split(B)
        y = self.inner(q, k, v)  # (B, h/n, T, d): the plain core over the whole sequence
        return HeadsToSeq.apply(y, self.group, self.stats)
