"""ZeRO-3 all-gathering the FP8 layers' weights in float8 (`train.fp8_all_gather=true`; torchtitan's
`enable_fsdp_float8_all_gather`, torchao float8 with FSDP2).

Under `train.precision=fp8` with the tensorwise recipe, a layer's forward and input-gradient GEMMs use its weight cast
to e4m3 with one scale from the whole weight's amax (memory/fp8.py). ZeRO-3 (arXiv 1910.02054) all-gathers each
unit's parameters before its forward and backward; this module makes the all-gather carry those float8 bytes instead
of the high-precision weights, as torchtitan does:

1. each rank takes the amax of its pieces of each FP8 weight in the unit; one MAX all-reduce over dp (a vector, one
   value per weight: `zero.fp8_amax` in the comm stats) gives every rank the whole weight's amax, hence the scale
   s = 448 / amax the layer itself computes (torchao's `amax_to_scale`);
2. each rank casts its FP8 pieces to e4m3 with that scale (torchao's `to_fp8_saturated`, the layer's own cast) and
   packs them (1 byte an element) after the rest of its shard (norms, biases, non-FP8 layers: their own dtype) into
   one byte buffer of the same size on every rank; one all-gather of those bytes (`all_gather` in the comm stats);
3. each rank unpacks every rank's chunk into the unit's flat buffer: the high-precision elements as they are, the
   float8 elements divided by the scale. The layer then casts that weight again: its amax is 448 / s (the largest
   element is cast to exactly 448), so it gets the same scale up to one fp32 rounding and every element back
   exactly, the float8 values of one process; the run differs from one process by that rounding of the scale.

The gathered buffer keeps the parameter dtype (the bytes on the wire are float8; memory is that of ZeRO-3 without
it, unlike torchtitan, whose gathered weight stays a float8 tensor). Checkpoints (`gather_params`) gather the exact
high-precision values. Rowwise scaling is refused (its GEMMs cast the weight along different dimensions, as torchao
refuses it too), and so are layouts this is not proven with (config: memory/rules.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.distributed.comm import all_gather_single
from scaletrain.memory.fp8 import torchao_float8
from scaletrain.parallel.zero import preserve_version

E4M3 = torch.float8_e4m3fn


@dataclass
class _Layout:
    """One rank's shard of a unit's flat buffer: its high-precision and float8 segments, in flat coordinates
    (float8 segments also name their weight: an index into the unit's FP8 weights)."""

    high: list[tuple[int, int]]
    low: list[tuple[int, int, int]]

    @property
    def n_high(self) -> int:
        return sum(b - a for a, b in self.high)

    @property
    def n_low(self) -> int:
        return sum(b - a for _, a, b in self.low)


@dataclass
class _Unit:
    weights: list[int]  # FlatGroup.params indices of the FP8 weights
    layouts: list[_Layout]  # per dp rank
    chunk: int  # bytes per rank in the all-gather
    high_bytes: int  # bytes of the high-precision part (the chunk's start)


def _layout(g, weights: list[int], r: int) -> _Layout:
    lo, hi = r * g.shard, (r + 1) * g.shard
    low = []
    for k, i in enumerate(weights):
        a, b = max(g.offsets[i], lo), min(g.offsets[i] + g.params[i].numel(), hi)
        if a < b:
            low.append((k, a, b))
    high, at = [], lo
    for _, a, b in sorted(low, key=lambda s: s[1]):
        if a > at:
            high.append((at, a))
        at = b
    if at < hi:
        high.append((at, hi))
    return _Layout(high, low)


class Fp8AllGather:
    """The float8 all-gather of a ZeroOptimizer's units (`opt.fp8_gather`); `weights` are the FP8 layers' weights."""

    def __init__(self, opt, weights: list[nn.Parameter]) -> None:
        f8 = torchao_float8()
        self.opt = opt
        self._scale, self._saturate = f8.float8_utils.amax_to_scale, f8.float8_utils.to_fp8_saturated
        ids = {id(w) for w in weights}
        self.units: dict[int, _Unit] = {}
        for g in opt.groups:
            mine = [i for i, p in enumerate(g.params) if id(p) in ids]
            if not mine or opt.n == 1:
                continue
            layouts = [_layout(g, mine, r) for r in range(opt.n)]
            esize = g.full.element_size()
            high = max(lay.n_high for lay in layouts) * esize
            chunk = high + max(lay.n_low for lay in layouts)
            chunk += -chunk % esize  # every rank's chunk starts aligned for its high-precision view
            self.units[id(g)] = _Unit(mine, layouts, chunk, high)

    def handles(self, g) -> bool:
        return id(g) in self.units

    def start(self, g, src: torch.Tensor, async_op: bool) -> tuple:
        """Begin gathering unit `g` from this rank's shard `src`; returns (work or None, finish), `finish()` unpacks
        into `g.full` once the all-gather is done."""
        u, opt = self.units[id(g)], self.opt
        me = u.layouts[opt.rank]
        amax = torch.zeros(len(u.weights), dtype=torch.float32, device=src.device)
        base = opt.rank * g.shard
        for k, a, b in me.low:
            amax[k] = torch.maximum(amax[k], src[a - base: b - base].detach().abs().max().float())
        opt.comm.add("zero.fp8_amax", 2 * (opt.n - 1) / opt.n * amax.numel() * amax.element_size())
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=opt.group)
        scale = self._scale(amax, E4M3)
        send = torch.zeros(u.chunk, dtype=torch.uint8, device=src.device)
        hv = send[: u.high_bytes].view(src.dtype)
        at = 0
        for a, b in me.high:
            hv[at: at + b - a] = src[a - base: b - base]
            at += b - a
        at = u.high_bytes
        for k, a, b in me.low:
            bits = self._saturate(src[a - base: b - base].float() * scale[k], E4M3)
            send[at: at + b - a] = bits.view(torch.uint8)
            at += b - a
        recv = torch.empty(u.chunk * opt.n, dtype=torch.uint8, device=src.device)
        opt.comm.add("all_gather", (opt.n - 1) / opt.n * recv.numel())
        work = all_gather_single(recv, send, group=opt.group, async_op=async_op)
        return work, self._finish(g, u, recv, scale)

    def _finish(self, g, u: _Unit, recv: torch.Tensor, scale: torch.Tensor) -> Callable[[], None]:
        def unpack() -> None:
            full = g.full
            with torch.no_grad(), preserve_version(full):
                for r, lay in enumerate(u.layouts):
                    chunk = recv[r * u.chunk: (r + 1) * u.chunk]
                    hv = chunk[: u.high_bytes].view(full.dtype)
                    at = 0
                    for a, b in lay.high:
                        full[a:b] = hv[at: at + b - a]
                        at += b - a
                    at = u.high_bytes
                    for k, a, b in lay.low:
                        full[a:b] = (chunk[at: at + b - a].view(E4M3).float() / scale[k]).to(full.dtype)
                        at += b - a
        return unpack


def gather_fp8(opt, module: nn.Module) -> Fp8AllGather:
    """Make ZeRO-3 optimizer `opt` all-gather the FP8 layers' weights of `module` in float8 (`opt.fp8_gather`)."""
    weights = [m.weight for m in module.modules() if getattr(m, "fp8", None) is not None]
    opt.fp8_gather = Fp8AllGather(opt, weights)
    return opt.fp8_gather
