"""Dropout whose mask does not depend on the layout: every element's keep/drop is a pure function of
(seed, step, site, global element index), computed by a counter-based hash instead of a random stream.

Dropout (Srivastava et al., JMLR 2014) draws a Bernoulli mask per element. With a stateful generator the mask
depends on how many numbers were drawn before and on which rank draws them, so data, tensor, sequence, pipeline
and expert parallelism, gradient accumulation and recomputation each draw different masks than one process
does. Counter-based generation (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011 — the
idea behind Philox) removes the state: the random number of element i is hash(key, i). Here the key is derived
from (seed, step, site) — the site is the dropout module's name in the plain model, e.g.
`blocks.3.attn.attn_dropout` — and i is the element's index in the *global* tensor of the step: the global
sample index of its row (the micro-batch's first row of the global batch, from `DropoutContext`), and for every
other dim its global coordinate (a tensor-parallel rank's heads start at its head offset, a sequence-parallel
rank's tokens at its shard's offset; the parallel passes set these offsets, `GlobalDropout.offsets`). Every
layout therefore drops exactly the elements one process drops.

The hash is Wellons' `lowbias32` integer finaliser applied twice (low and high 32 bits of the index, each mixed
with 32 bits of the key), in int64 tensor arithmetic with exact 32-bit wrap-around; an element is kept when its
32-bit value is >= p * 2^32. Backward multiplies by the same mask, saved as bool (1 byte per element, like
torch's dropout). No distributed code here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from scaletrain.model.init import name_seed

_M32 = 0xFFFFFFFF


@dataclass
class DropoutContext:
    """Where the model is in training, shared by every `GlobalDropout` of one model: the run's seed, the
    optimizer step, and the global batch row of the current micro-batch's first sample. The engine (or the
    pipeline executor) sets `step` and `row` before each micro-batch's forward; recomputation restores the
    values the forward had."""

    seed: int = 0
    step: int = 0
    row: int = 0
    base_row: int = 0  # this data-parallel rank's first row of the step; micro-batch i starts at base + i x rows

    def at_micro(self, index: int, rows: int, step: int | None = None) -> None:
        """Micro-batch `index` (of `rows` rows) of this rank's slice of step `step` (default: the current)."""
        if step is not None:
            self.step = step
        self.row = self.base_row + index * rows

    def state(self) -> tuple[int, int]:
        return self.step, self.row

    def restore(self, state: tuple[int, int]) -> None:
        self.step, self.row = state


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """In place: (x * c) mod 2^32 for x in [0, 2^32), without int64 overflow: a multiplier >= 2^31 is replaced by
    c - 2^32 (the same residue mod 2^32, |c - 2^32| < 2^31), and the two's-complement low 32 bits are kept."""
    return x.mul_(c - 2**32 if c >= 2**31 else c).bitwise_and_(_M32)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place: Wellons' lowbias32 finaliser, a bijection of [0, 2^32) with good avalanche."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def hash32(index: torch.Tensor, key: int) -> torch.Tensor:
    """32-bit hash values (int64 in [0, 2^32)) of non-negative int64 indices under a 64-bit key."""
    k1, k2 = key & _M32, (key >> 32) & _M32
    h = _mix32_((index & _M32).bitwise_xor_(k1))
    return _mix32_(h.bitwise_xor_((index >> 32).bitwise_xor_(k2)))


def keep_mask(index: torch.Tensor, key: int, p: float) -> torch.Tensor:
    """Bool mask: True where the element with this global index is kept by dropout of probability p."""
    return hash32(index, key) >= int(p * 2**32)


class _ApplyMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


class GlobalDropout(nn.Module):
    """Inverted dropout with a layout-independent mask (module docstring).

    `x` is (rows, d1, d2, ...): dim 0 are samples (global row = context row + local row, + `offsets[0][0]` when the
    rank holds a block of the micro-batch's samples); `offsets[d] = (start, total)` places the local coordinates of
    dim d in the global tensor (default: start 0, total = local size); `start` may instead be a tensor of the
    global coordinates themselves (context parallelism holds two separate chunks of the sequence).
    `roles` names the non-batch dims (`seq`, `head`, `feature`, ...) so a parallel pass knows which one it
    splits. `forward(x, index=...)` takes explicit global indices instead (broadcastable to x), for tensors
    whose elements are not a box of a global tensor (MoE expert slots)."""

    def __init__(self, p: float, context: DropoutContext, roles: tuple[str, ...] = ()):
        super().__init__()
        self.p, self.context, self.roles = float(p), context, tuple(roles)
        self.site = ""  # the module's name in the plain model, set by the model after construction
        self.offsets: dict[int, tuple[int, int]] = {}

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site!r}"

    def key(self) -> int:
        c = self.context
        return name_seed(c.seed, f"dropout/{c.step}/{self.site}")

    def global_index(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        # offsets[0] = (first row, _): a rank holding a block of the micro-batch's samples (2d / 2.5d / 3d tp)
        index = torch.arange(shape[0], device=device, dtype=torch.int64) + self.context.row + \
            self.offsets.get(0, (0, 0))[0]
        for d in range(1, len(shape)):
            start, total = self.offsets.get(d, (0, shape[d]))
            coord = start.to(device) if isinstance(start, torch.Tensor) else \
                torch.arange(start, start + shape[d], device=device, dtype=torch.int64)
            index = index.unsqueeze(-1) * total + coord
        return index

    def forward(self, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if index is None:
            index = self.global_index(x.shape, x.device)
        mask = keep_mask(index, self.key(), self.p).expand(x.shape)
        return _ApplyMask.apply(x, mask, 1.0 / (1.0 - self.p))


def begin_step(module: nn.Module, seed: int, step: int, base_row: int) -> None:
    """Key the module's dropout masks by the run's seed and this step; `base_row` is this rank's first row."""
    ctx = dropout_context(module)
    if ctx is not None:
        ctx.seed, ctx.step, ctx.base_row, ctx.row = seed, step, base_row, base_row


def dropout_context(module: nn.Module) -> DropoutContext | None:
    """The context the module's `GlobalDropout`s share (None without any)."""
    for m in module.modules():
        if isinstance(m, GlobalDropout):
            return m.context
    return None


def name_sites(model: nn.Module) -> None:
    """Give every `GlobalDropout` of the plain model its name as its site (call once, before any pass)."""
    for name, m in model.named_modules():
        if isinstance(m, GlobalDropout):
            m.site = name
