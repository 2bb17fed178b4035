"""Batches that depend only on (seed, step), never on the layout.

The global batch of step k is `global_batch` windows of `seq_len + 1` tokens at offsets drawn from a
generator seeded with (seed, k) (nanoGPT's random windows, made stateless). With a mixture (`data.mix`) the same
generator first draws, for each window, its source i with probability weight_i, then its offset in that source,
so the realised proportions converge to the weights and the batch is still a function of (seed, k) alone. A
data-parallel rank takes its contiguous slice of the global batch and splits it into micro-batches, so every layout
sees the same sequences in the same step. Because a batch is a pure function of the step, the loader's position in
a checkpoint is just the step. Validation windows come from each source's held-out tail with their own stream.

Under context parallelism (parallel/context/) a rank holds only some positions of every sequence: `positions`
(their global indices, in the rank's order) selects those columns of its inputs and targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from scaletrain.data.corpus import Corpus
from scaletrain.data.stream import TokenStream
from scaletrain.device.kernels import pinned
from scaletrain.errors import DataError

_TRAIN, _VAL = 0, 1


@dataclass
class Split:
    parts: list[np.ndarray]  # per source: its train part or its held-out tail (views of the token streams)
    stream: int  # which random stream: train or val

    @property
    def tokens(self) -> np.ndarray:
        """The only part of a single-source split."""
        return self.parts[0]


class BatchLoader:
    def __init__(self, tokens: np.ndarray | Corpus, seq_len: int, global_batch: int, seed: int,
                 val_fraction: float = 0.05, vocab_size: int | None = None, positions: torch.Tensor | None = None):
        corpus = tokens if isinstance(tokens, Corpus) else Corpus.of_array(tokens)
        self.corpus, self.weights = corpus, np.asarray(corpus.weights, dtype=np.float64)
        train, val = [], []
        for s in corpus.streams:
            n = len(s)
            n_val = max(int(n * val_fraction), seq_len + 2)
            if n - n_val < seq_len + 2:
                raise DataError(f"{s.name} has {n} tokens, too few for model.seq_len ({seq_len}) with a validation "
                                "split")
            train.append(s.tokens[: n - n_val])
            val.append(s.tokens[n - n_val:])
        self.train, self.val = Split(train, _TRAIN), Split(val, _VAL)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.positions = positions  # context parallelism: this rank's positions of each sequence (None: all)
        if vocab_size is not None:
            for s in corpus.streams:
                if s.max_id >= vocab_size:
                    raise DataError(f"the data has token id {s.max_id} ({s.name}) but model.vocab_size is "
                                    f"{vocab_size}")

    @property
    def streams(self) -> list[TokenStream]:
        return self.corpus.streams

    def windows(self, split: Split, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, offset) of each window of step `index`'s global batch."""
        rng = np.random.Generator(np.random.PCG64([self.seed, split.stream, index]))
        highs = np.array([len(p) - self.seq_len - 1 for p in split.parts], dtype=np.int64)
        if len(highs) == 1:  # one source: the offsets alone (the draws of a single corpus stay as they were)
            return np.zeros(self.global_batch, dtype=np.int64), rng.integers(0, highs[0], size=self.global_batch)
        source = rng.choice(len(highs), size=self.global_batch, p=self.weights)
        return source, rng.integers(0, highs[source])

    def offsets(self, split: Split, index: int) -> np.ndarray:
        return self.windows(split, index)[1]

    def global_batch_at(self, index: int, split: Split | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (global_batch, seq_len) int64, for step `index`."""
        split = split or self.train
        T = self.seq_len
        rows = np.stack([np.asarray(split.parts[s][o: o + T + 1], dtype=np.int64)
                         for s, o in zip(*self.windows(split, index))])
        for stream in self.corpus.streams:
            stream.release()  # a large stream's pages leave this process's memory map (data/stream.py)
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

    def describe(self, tokens_per_step: int, steps: int) -> str:
        """One line: the corpus's tokens, how they are split, and how much of it `steps` steps read."""
        c = self.corpus
        tok = "ids given" if c.tokenizer is None else f"tokenizer {c.tokenizer.name} ({c.tokenizer.vocab_size:,} ids)"
        dtypes = "/".join(sorted({s.dtype.name for s in c.streams}))
        if len(c.streams) == 1:
            what = f"{c.n_tokens:,} tokens in {c.streams[0].name}"
        else:
            parts = ", ".join(f"{s.name} {len(s):,} (weight {w:.2g})" for s, w in zip(c.streams, c.weights))
            what = f"{c.n_tokens:,} tokens in a mix of {len(c.streams)} sources: {parts}"
        train = sum(len(p) for p in self.train.parts)
        reads = tokens_per_step * steps
        return (f"data: {what} ({tok}, {dtypes}); {train:,} for training, {c.n_tokens - train:,} held "
                f"out; {steps:,} steps read {reads:,} tokens ({reads / max(train, 1):.3g} epochs)")


def staged(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's inputs and targets in one page-locked host buffer when they go to a CUDA device, so that the
    `non_blocking=True` copies of its micro-batches are asynchronous; unchanged for any other device."""
    if device.type != "cuda":
        return x, y
    both = pinned(torch.stack([x, y]), device)
    return both[0], both[1]
