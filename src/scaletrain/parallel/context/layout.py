"""Which positions of every sequence a context-parallel rank holds.

`ring` (load-balanced, as Megatron-core and torchtitan lay out causal ring attention): the sequence is cut into
2 x cp chunks of T / (2 cp) tokens and rank r holds chunks r and 2cp - 1 - r, one from each end. Under a causal
mask the queries of chunk j attend j + 1 chunks of keys, so rank r's two chunks attend (r + 1) + (2cp - r) = 2cp + 1
chunk pairs whatever r: every rank does the same attention work in every ring step (Brandon et al., "Striped
Attention", arXiv 2311.09431, discuss the imbalance of contiguous chunks). `ulysses`: rank r holds the contiguous
r-th of cp chunks, so its all-to-all gathers the sequence in global order.

The functions returning plain ranges are torch-free (the planner and the rules use them); `local_positions`
returns the int64 tensor the loader, the model's positions, dropout and MoE are given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def chunks_of(seq_len: int, cp: int, rank: int, mode: str) -> list[tuple[int, int]]:
    """The [start, end) ranges of global positions rank `rank` of `cp` holds, in its local order."""
    if cp == 1:
        return [(0, seq_len)]
    if mode == "ring":
        c = seq_len // (2 * cp)
        return [(rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    c = seq_len // cp
    return [(rank * c, (rank + 1) * c)]


def chunk_tokens(seq_len: int, cp: int, mode: str) -> int:
    """Tokens of one contiguous chunk a rank holds: T / (2 cp) (ring), T / cp (ulysses), T (cp = 1)."""
    if cp == 1:
        return seq_len
    return seq_len // (2 * cp) if mode == "ring" else seq_len // cp


def local_positions(seq_len: int, cp: int, rank: int, mode: str) -> torch.Tensor:
    """Global positions of rank `rank`'s tokens (int64, in its local order)."""
    import torch

    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in chunks_of(seq_len, cp, rank, mode)])
