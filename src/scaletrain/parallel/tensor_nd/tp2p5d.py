"""2.5D tensor parallelism: Tesseract (Wang, Xu, Li & You, "Tesseract: Parallelize the Tensor Parallelism
Efficiently", arXiv 2105.14500), d x q x q ranks.

The micro-batch's sequences are split into d x q blocks and the hidden dimension into q: rank (k, i, j) holds
sequences block k q + i and hidden block j of every activation (the paper's input split into d q rows and q
columns, each of the d "layers" a q x q SUMMA grid). The weights are split q x q exactly as in 2D (tp2d.py) and
replicated over the d depth layers; each depth layer runs Optimus' SUMMA products on its own sequences with its
own row and column groups, so the per-layer activation memory is 1/(d q^2) and the SUMMA messages carry 1/d of
2D's activation blocks at the same weight blocks.

The d copies of a weight see different sequences, so their gradients are summed over the depth (the paper's
all-reduce along the depth dimension). We fold that sum into data parallelism: the ranks holding the same weight
blocks are every (dp, depth) pair (`mesh.group("dp_dep")`), and the engine's optimizer reduces gradients over
that group (`parallelize._grad_dim`) once per optimizer step (bucketed, overlapped with the backward; ZeRO-1
shards the optimizer over it), instead of once per layer and micro-batch. Volume per step: 2(g-1)/g of the
rank's parameter bytes for the group size g = dp x d, the same all-reduce the paper counts for dp = 1 and one
micro-batch. So 2.5D with depth d moves the bytes and holds the memory of 2D with d times the data parallelism,
each replica taking 1/d of the micro-batch (`plan.analytic.tp_nd.as_2d`): what differs is who shares a micro-batch.

Deviations: as in tp2d.py; and the depth reduction's placement (per step with the data-parallel gradients, not
per layer).
"""

from __future__ import annotations

import torch.nn as nn

from scaletrain.parallel.tensor_nd.tp2d import Embedding2D, Plan2D


class Plan2p5D(Plan2D):
    """Plan2D on depth layer k: sequences block k q + i, the depth layer's ids looked up by its embedding, the loss
    summed over the column and the depth."""

    def embedding(self, emb: nn.Embedding) -> nn.Module:
        return Embedding2D(emb, self.grid, rows=(self.grid.k * self.layer_rows, self.layer_rows))

    def loss_value_groups(self) -> list:
        return [self.grid.col, self.grid.dep]
