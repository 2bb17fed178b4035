"""Reversible transformer blocks: backward rebuilds each block's input from its output instead of storing it.

RevNet (Gomez et al., "The Reversible Residual Network", arXiv 1707.04585) splits a residual stream into two
halves and updates them in turn; the reversible Transformer of Reformer (Kitaev et al., arXiv 2001.04451,
Sec. 3) takes F = attention and G = feed-forward:

    y1 = x1 + F(x2),   F(.) = attn(ln1(.))
    y2 = x2 + G(y1),   G(.) = mlp(ln2(.))

and the inverse needs no stored activation: x2 = y2 - G(y1), x1 = y1 - F(x2). Here the stream of width
C = d_model is cut into halves of C/2 (x1 = the first C/2 features), and F and G are the plain model's attention
and MLP built at width C/2 (`n_heads` heads of C/(2 n_heads), MLP hidden 4·C/2 or `d_ff`): a different
architecture from the standard block of width C, with about a quarter of its block parameters.

Backward (`_ReversibleFn`, RevNet's Algorithm 1): from the block output y and its gradient (dy1, dy2),
recompute G(y1) with autograd, backpropagate dy2 through it (weight gradients of G, and dy1 += dG/dy1ᵀ dy2),
rebuild x2 = y2 - G(y1); recompute F(x2), backpropagate the new dy1 (weight gradients of F, dx2 = dy2 + dF/dx2ᵀ
dy1), rebuild x1 = y1 - F(x2). Weight gradients are accumulated by a nested `torch.autograd.backward` (as the
reentrant activation checkpoint does), so data parallelism, ZeRO and tensor parallelism see them through their
usual gradient hooks. Each sub-layer's forward runs twice (once in the forward, once in backward), like full
recomputation.

The chain: block i's forward keeps a reference to its output y_i (a `Link`); when block i+1 takes y_i as its
input it drops that reference, and its backward hands the rebuilt input back through the link, just before block
i's backward needs it. So a run of reversible blocks keeps one stream tensor (the last output) however deep it is
- what autograd would otherwise store for every block. Nothing is freed that somebody else holds: a link only
drops its own reference.

State a block's forward read and its recomputation must read again is recorded at the forward and restored
around the recomputation: the layout-independent dropout's (step, micro-batch row) context (`model/dropout.py`,
so the same masks are drawn), the MoE layers' keyed random streams and statistics (counted once), and with
torch's own dropout the RNG state (CPU and CUDA). Rebuilt inputs equal the forward's up to the rounding of
(x + F) - F: exact to ~1e-16 relative in fp64, ~1e-7 in fp32, ~1e-2 in bf16 (docs/memory.md). No distributed
code here.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn as nn

from scaletrain.config import ModelConfig
from scaletrain.config.sizes import half_config
from scaletrain.device.accounting import count_kept, uncount_kept
from scaletrain.model.block import Block
from scaletrain.model.dropout import DropoutContext, GlobalDropout
from scaletrain.model.moe import MoE


class Link:
    """A block's reference to its own output, dropped when the next reversible block takes the output as input;
    that block's backward puts the rebuilt tensor back here before this block's backward reads it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor | None):
        self.tensor = tensor


@dataclasses.dataclass
class _Recorded:
    """What the forward read that is not in its tensors: replayed around the recomputation."""

    dropout: tuple[int, int] | None
    moe_keys: list[tuple[int, int, int]]
    rng: tuple[torch.Tensor, torch.Tensor | None] | None


class ReversibleBlock(Block):
    """A pre-norm block of width d_model/2 acting on the two halves of a d_model-wide stream (module docstring).

    Parameter names are those of `Block` (`ln1`, `attn`, `ln2`, `mlp`), so initialisation by name, the
    tensor-parallel plan, ZeRO units, pipeline stages and dropout sites apply unchanged. `custom_backward=False`
    makes autograd store the activations of the same forward (for the gradient check)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, context: DropoutContext | None = None):
        context = context or DropoutContext()
        super().__init__(half_config(cfg), layer, context)
        self.context = context
        self.custom_backward = True
        self._moes: list[MoE] | None = None
        self._torch_dropout: bool | None = None

    def f(self, x2: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """F = attention of the second half: (B, T, C/2) -> (B, T, C/2)."""
        return self.attn(self.ln1(x2), rope)

    def g(self, y1: torch.Tensor) -> torch.Tensor:
        """G = MLP (or MoE) of the updated first half."""
        return self.mlp(self.ln2(y1))

    def couple(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The block's function, (B, T, C) -> (B, T, C), as plain autograd ops."""
        x1, x2 = x.chunk(2, dim=-1)
        y1 = x1 + self.f(x2, rope)
        y2 = x2 + self.g(y1)
        return torch.cat([y1, y2], dim=-1)

    @torch.no_grad()
    def inverse(self, y: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The block input rebuilt from its output: x2 = y2 - G(y1), x1 = y1 - F(x2) (in evaluation mode, or with
        the dropout state the forward had)."""
        y1, y2 = y.chunk(2, dim=-1)
        x2 = y2 - self.g(y1)
        return torch.cat([y1 - self.f(x2, rope), x2], dim=-1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if not (self.custom_backward and torch.is_grad_enabled() and x.requires_grad):
            # evaluation, the gradient check's reference, or an input without a gradient path (never inside our
            # models, whose stream starts at a trained embedding): autograd through the same ops
            return self.couple(x, rope)
        link = Link(None)
        out = _ReversibleFn.apply(x, self, rope, link)
        out._st_rev_link = link  # the next reversible block finds its input's link here
        return out

    # ---- what the recomputation must see as the forward saw it
    def moes(self) -> list[MoE]:
        if self._moes is None:
            self._moes = [m for m in self.modules() if isinstance(m, MoE)]
        return self._moes

    def uses_torch_dropout(self) -> bool:
        """Whether the forward draws from the global RNG (torch's dropout, or SDPA's fused dropout)."""
        if self._torch_dropout is None:
            drops = [m for m in self.modules() if isinstance(m, nn.Dropout) and m.p > 0]
            fused = self.attn.dropout > 0 and not isinstance(getattr(self.attn, "attn_dropout", None), GlobalDropout)
            self._torch_dropout = bool(drops) or fused
        return self._torch_dropout

    def record(self, device: torch.device) -> _Recorded:
        rng = None
        if self.training and self.uses_torch_dropout():
            rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        return _Recorded(self.context.state(), [m.key for m in self.moes()], rng)

    @contextmanager
    def replay(self, rec: _Recorded, device: torch.device):
        """Run with the recorded state, then put the current one back (MoE statistics are not counted twice)."""
        now_dropout = self.context.state()
        now_moe = [(m.key, m.stats) for m in self.moes()]
        now_rng = None
        if rec.rng is not None:
            now_rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        self.context.restore(rec.dropout)
        for m, key in zip(self.moes(), rec.moe_keys):
            m.key, m.stats = key, dataclasses.replace(m.stats)
        try:
            yield
        finally:
            self.context.restore(now_dropout)
            for m, (key, stats) in zip(self.moes(), now_moe):
                m.key, m.stats = key, stats
            if now_rng is not None:
                torch.set_rng_state(now_rng[0])
                if now_rng[1] is not None:
                    torch.cuda.set_rng_state(now_rng[1], device)

    def _set_rng(self, rng: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> None:
        if rng is not None:
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _ReversibleFn(torch.autograd.Function):
    """One reversible block: the forward keeps no activation of its own; backward rebuilds and differentiates."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, block: ReversibleBlock, rope, link: Link) -> torch.Tensor:
        ctx.block, ctx.rope, ctx.link = block, rope, link
        rec = block.record(x.device)
        # sub-layer RNG states: G runs after F, so with torch's dropout its state is taken between the two
        x1, x2 = x.chunk(2, dim=-1)
        y1 = x1 + block.f(x2, rope)
        rng_g = None
        if rec.rng is not None:
            rng_g = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None)
        y2 = x2 + block.g(y1)
        y = torch.cat([y1, y2], dim=-1)
        ctx.recorded, ctx.rng_g = rec, rng_g
        link.tensor = y.detach()
        count_kept(_storage_key(y), y.untyped_storage().nbytes())
        before = getattr(x, "_st_rev_link", None)
        ctx.input_link = None
        if before is not None and before.tensor is not None:  # the previous block's output: it may drop it now
            ctx.input_link = before
            uncount_kept(_storage_key(before.tensor))
            before.tensor = None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        block, rope, rec = ctx.block, ctx.rope, ctx.recorded
        y = ctx.link.tensor
        if y is None:
            raise RuntimeError("reversible block: its output was not handed back (backward twice through one forward "
                               "is not supported)")
        ctx.link.tensor = None
        device = y.device
        y1, y2 = y.chunk(2, dim=-1)
        dy1, dy2 = dy.chunk(2, dim=-1)
        with block.replay(rec, device):
            # G: y2 = x2 + G(y1)
            block._set_rng(ctx.rng_g, device)
            with torch.enable_grad():
                y1_ = y1.detach().requires_grad_()
                g_out = block.g(y1_)
            torch.autograd.backward(g_out, dy2)
            with torch.no_grad():
                x2 = y2 - g_out
                dy1 = dy1 + y1_.grad
            del g_out, y1_
            # F: y1 = x1 + F(x2)
            block._set_rng(rec.rng, device)
            with torch.enable_grad():
                x2_ = x2.requires_grad_()
                f_out = block.f(x2_, rope)
            torch.autograd.backward(f_out, dy1)
            with torch.no_grad():
                x1 = y1 - f_out
                dx = torch.cat([dy1, dy2 + x2_.grad], dim=-1)
                x = torch.cat([x1, x2.detach()], dim=-1)
        if ctx.input_link is not None:
            ctx.input_link.tensor = x  # the previous block's output, rebuilt
        return dx, None, None, None


def reversible_blocks(module: nn.Module) -> list[ReversibleBlock]:
    return [m for m in module.modules() if isinstance(m, ReversibleBlock)]
