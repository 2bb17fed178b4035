"""Batches that depend only on (seed, step), never on the layout.

The global batch of step k is `global_batch` windows of `seq_len + 1` tokens at offsets drawn from a
generator seeded with (seed, k) (nanoGPT's random windows, made stateless). A data-parallel rank takes
its contiguous slice of the global batch and splits it into micro-batches, so every layout sees the same
sequences in the same step. Because a batch is a pure function of the step, the loader's position in a
checkpoint is just the step. Validation windows come from the held-out tail with their own stream.

Under context parallelism (parallel/context/) a rank holds only some positions of every sequence: `positions`
(their global indices, in the rank's order) selects those columns of its inputs and targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from scaletrain.device.kernels import pinned
from scaletrain.errors import DataError

_TRAIN, _VAL = 0, 1


@dataclass
class Split:
    tokens: np.ndarray  # uint16 view of the token stream
    stream: int  # which random stream: train or val


class BatchLoader:
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 val_fraction: float = 0.05, vocab_size: int | None = None, positions: torch.Tensor | None = None):
        n = len(tokens)
        n_val = max(int(n * val_fraction), seq_len + 2)
        if n - n_val < seq_len + 2:
            raise DataError(
                f"the data has {n} tokens, too few for model.seq_len ({seq_len}) with a validation split"
            )
        self.train = Split(tokens[: n - n_val], _TRAIN)
        self.val = Split(tokens[n - n_val:], _VAL)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.positions = positions  # context parallelism: this rank's positions of each sequence (None: all)
        if vocab_size is not None:
            top = int(np.max(tokens)) if n <= 50_000_000 else None
            if top is not None and top >= vocab_size:
                raise DataError(f"the data has token id {top} but model.vocab_size is {vocab_size}")

    def offsets(self, split: Split, index: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, split.stream, index]))
        return rng.integers(0, len(split.tokens) - self.seq_len - 1, size=self.global_batch)

    def global_batch_at(self, index: int, split: Split | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (global_batch, seq_len) int64, for step `index`."""
        split = split or self.train
        T = self.seq_len
        rows = np.stack([np.asarray(split.tokens[o: o + T + 1], dtype=np.int64) for o in self.offsets(split, index)])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def micro_batches(self, index: int, dp_rank: int, dp: int, micro_batch: int, split: Split | None = None,
                      device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's slice of the global batch of step `index` (its `positions` of each sequence), split into
        micro-batches."""
        x, y = self.global_batch_at(index, split)
        per_rank = self.global_batch // dp
        x, y = x[dp_rank * per_rank: (dp_rank + 1) * per_rank], y[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        if self.positions is not None:
            x, y = x[:, self.positions], y[:, self.positions]
        x, y = staged(x, y, torch.device(device))
        return [(xm.to(device, non_blocking=True), ym.to(device, non_blocking=True))
                for xm, ym in zip(x.split(micro_batch), y.split(micro_batch))]


def staged(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's inputs and targets in one page-locked host buffer when they go to a CUDA device, so that the
    `non_blocking=True` copies of its micro-batches are asynchronous; unchanged for any other device."""
    if device.type != "cuda":
        return x, y
    both = pinned(torch.stack([x, y]), device)
    return both[0], both[1]
