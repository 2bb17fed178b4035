"""Activation compression for the backward pass (Gist: Jain et al., ISCA 2018, "Gist: Efficient Data
Encoding for Deep Neural Network Training").

Forward uses every activation at full precision; only the copy autograd *keeps for backward* is
encoded, and it is decoded when backward needs it. Two Gist encodings:

- `relu-mask` (Gist's lossless "binarize"): the backward of ReLU, LeakyReLU, ReLU6 and Hardtanh
  needs only which entries passed, one bit per entry. The modules are swapped for `MaskedActivation`,
  a custom autograd Function that keeps a packed bit mask (numel/8 bytes) instead of a float tensor.
  Detection is by module type, not by guessing inside a global hook: a tensor's producer says
  nothing about what its *consumers* need. Functional calls (`F.relu`) are not seen; use the modules.
- `bf16` / `int8` (Gist's "delayed precision reduction"): every other float tensor autograd saves is
  stored in bfloat16, or in int8 with absmax scales (q = round(x·127/max|x|)): one per tensor, or, with
  `block=b`, one per block of b consecutive entries along the last dimension (block-wise quantization,
  Dettmers et al., arXiv 2110.02861), and restored to its original dtype for backward. Installed with
  `torch.autograd.graph.saved_tensors_hooks`.

Skipped by the hooks (kept as they are): parameters and views of them (held anyway), leaf tensors (inputs,
constant tables; with `leaves=True` only those that do not require grad, and the attached model's buffers),
non-float tensors, tensors whose last dimension is 1 (per-row statistics such as a norm's mean and 1/std),
tensors of one dimension (one number per row: the per-group losses of an MoE router), tensors with fewer than
`min_numel` entries, and tensors already no wider than the target format. A tensor
saved by several ops (or through several views of one base) is encoded once.

Layout independence (the engine pass, `apply_compress_pass`): what is encoded, and how, must not depend on
how the run is split, or a parallel layout would round other values than one process does. So the engine
encodes every float activation whatever its size (`min_numel=0`: a tensor split over tp ranks has fewer
entries than the whole), also a pipeline stage's input (`leaves=True`: a leaf that requires grad, where one
process has the previous block's output), and int8 takes one scale per block of `int8_block(model)` entries
along the last dimension, a size that divides every width tensor parallelism splits (the head size,
d_model/tp, d_ff/tp): a block never straddles two tp ranks, and rows are tokens, whichever rank, micro-batch
or expert holds them. A tensor of one dimension has no rows: its entries are one per row of something (the
balancing losses of each MoE dispatch group, `model/moe_gating.py`), so a block along it would hold the groups of
a sequence shard under context or sequence parallelism and those of the whole sequence in one process, and its
scale (the absmax of the other entries) would change with the layout. Such tensors are kept as they are (a few
numbers per micro-batch).

The compression ratio is measured as the ops run (`CompressionStats`): `bytes_before` is the bytes
of distinct storages autograd would have kept (parameters excluded, as in `device.accounting`),
`bytes_after` what is kept instead; per encoding, `by_kind` compares each encoded slot with the
tensor it replaces. ReLU note: in plain PyTorch a ReLU's saved output usually shares its storage
with the next layer's saved input, so `relu-mask` alone adds numel/8 bytes there; it saves memory
when combined with `bf16`/`int8` (which would otherwise corrupt the sign pattern: small positives
round to 0) or when the consumer keeps nothing (pooling, elementwise ops that save no input).

Nesting: `saved_tensors_hooks` contexts nest and the innermost wins, so inside a non-reentrant
activation-checkpoint region the checkpoint's hooks apply, not these. Where those hooks move what they keep
(partitioned over tp, offloaded to host memory, held in a contiguous arena: `recompute.CheckpointHooks`) they
encode it first with this compressor (`encode`) and move the encoding, so a tensor is encoded the same way
whichever hooks keep it. Double backward
(`create_graph=True`) through decoded tensors is not supported.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.config.parse import parse_modes
from scaletrain.config.sizes import ffn_size
from scaletrain.device.accounting import add_memory_report, count_kept, count_saved
from scaletrain.errors import ConfigError

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- bit packing

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, eight entries per byte (ceil(numel / 8) bytes), little-endian bits."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = _SHIFTS.to(mask.device)
    return (flat.view(-1, 8).to(torch.uint8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of `pack_bits`: the bool tensor of `shape`."""
    shifts = _SHIFTS.to(packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    numel = 1
    for s in shape:
        numel *= s
    return bits.reshape(-1)[:numel].bool().view(shape)


# ----------------------------------------------------------------------------- statistics


@dataclass
class KindStats:
    """Saved-tensor slots handled by one encoding: bytes of the tensors replaced and of what is kept."""

    tensors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else float("nan")


@dataclass
class CompressionStats:
    """What was saved for backward since the last `reset()`, before and after encoding."""

    bytes_before: int = 0
    bytes_after: int = 0
    by_kind: dict[str, KindStats] = field(default_factory=dict)
    # Storages already counted in bytes_before: id(base tensor) -> weak reference (see _count_before).
    _counted: dict[int, weakref.ref] = field(default_factory=dict, repr=False)

    @property
    def ratio(self) -> float:
        """bytes_before / bytes_after over everything saved (kept tensors included)."""
        return self.bytes_before / self.bytes_after if self.bytes_after else float("nan")

    def reset(self) -> None:
        self.bytes_before = self.bytes_after = 0
        self.by_kind.clear()
        self._counted.clear()

    def record(self, kind: str, bytes_in: int, bytes_out: int) -> None:
        k = self.by_kind.setdefault(kind, KindStats())
        k.tensors += 1
        k.bytes_in += bytes_in
        k.bytes_out += bytes_out
        self.bytes_after += bytes_out

    def _count_before(self, base: torch.Tensor) -> None:
        """Add base's storage to bytes_before once while base is alive (ids are reused after death)."""
        ref = self._counted.get(id(base))
        if ref is not None and ref() is base:
            return
        key = id(base)
        self._counted[key] = weakref.ref(base, lambda _r, k=key, d=self._counted: d.pop(k, None))
        self.bytes_before += base.untyped_storage().nbytes()


# ----------------------------------------------------------------------------- 1-bit masks


class _MaskedActivationFn(torch.autograd.Function):
    """y = clamp(x, lo, hi) with slope `neg` below 0 (ReLU, LeakyReLU, Hardtanh/ReLU6); keeps 1 bit/entry."""

    @staticmethod
    def forward(ctx, x, kind, neg, lo, hi, stats):
        if kind == "relu":
            y = F.relu(x)
            keep = ~(y <= 0)  # ReLU backward: 0 where result <= 0 (a NaN result passes, as in torch)
        elif kind == "leaky":
            y = F.leaky_relu(x, neg)
            keep = x > 0
        else:
            y = F.hardtanh(x, lo, hi)
            keep = ~((x <= lo) | (x >= hi))
        # An intermediate, not an input or output: stored on ctx, so saved-tensor hooks never see it.
        ctx.packed = pack_bits(keep)
        count_kept(("gist", id(ctx.packed)), ctx.packed.numel())  # to the activation counter around us
        ctx.shape, ctx.kind, ctx.neg = x.shape, kind, neg
        if stats is not None:
            saved = y if kind == "relu" else x  # what torch's own backward would keep
            stats._count_before(saved._base if saved._base is not None else saved)
            stats.record("relu-mask", y.numel() * y.element_size(), ctx.packed.numel())
        return y

    @staticmethod
    def backward(ctx, grad):
        keep = unpack_bits(ctx.packed, ctx.shape)
        if ctx.kind == "leaky":
            grad_in = torch.where(keep, grad, grad * ctx.neg)
        else:
            grad_in = torch.where(keep, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
        return grad_in, None, None, None, None, None


class MaskedActivation(nn.Module):
    """Drop-in for ReLU / LeakyReLU / ReLU6 / Hardtanh that saves a packed 1-bit mask for backward."""

    def __init__(self, kind: str = "relu", negative_slope: float = 0.0, min_val: float = -1.0,
                 max_val: float = 1.0, stats: CompressionStats | None = None) -> None:
        super().__init__()
        if kind not in ("relu", "leaky", "hardtanh"):
            raise ValueError(f"MaskedActivation kind {kind!r} is not relu, leaky or hardtanh")
        self.kind, self.negative_slope, self.min_val, self.max_val = kind, negative_slope, min_val, max_val
        self.stats = stats

    @classmethod
    def replacing(cls, module: nn.Module, stats: CompressionStats | None = None) -> MaskedActivation | None:
        """The masked equivalent of `module`, or None if it is not a ReLU-family module."""
        if isinstance(module, nn.ReLU):
            return cls("relu", stats=stats)
        if isinstance(module, nn.LeakyReLU):
            return cls("leaky", negative_slope=module.negative_slope, stats=stats)
        if isinstance(module, nn.Hardtanh):  # includes ReLU6
            return cls("hardtanh", min_val=module.min_val, max_val=module.max_val, stats=stats)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            if self.kind == "relu":
                return F.relu(x)
            if self.kind == "leaky":
                return F.leaky_relu(x, self.negative_slope)
            return F.hardtanh(x, self.min_val, self.max_val)
        return _MaskedActivationFn.apply(
            x, self.kind, self.negative_slope, self.min_val, self.max_val, self.stats
        )

    def extra_repr(self) -> str:
        return f"kind={self.kind}, 1-bit saved mask"


# ----------------------------------------------------------------------------- reduced precision


@dataclass
class _Encoded:
    """One base tensor as stored for backward."""

    data: torch.Tensor  # bf16 or int8 values, laid out like the base
    scale: torch.Tensor | None  # int8: max|x| / 127 in the original dtype, 0-d or one per block (rows, blocks, 1)
    dtype: torch.dtype
    version: int

    @property
    def nbytes(self) -> int:
        extra = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.data.numel() * self.data.element_size() + extra

    def decode(self) -> torch.Tensor:
        x = self.data.to(self.dtype)
        if self.scale is None:
            return x
        if self.scale.dim() == 0:
            return x.mul_(self.scale)
        blocks, _ = _blocks(x, self.scale.shape[-2])
        # contiguous: views of the base are rebuilt from it with the base's strides (_Saved.unpack)
        return blocks.mul_(self.scale).flatten(-2)[..., : x.shape[-1]].contiguous().view(x.shape)


def _blocks(x: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, int]:
    """x as (rows, n_blocks, block): rows are all but the last dimension, the last one zero-padded to
    n_blocks x block entries (zeros change no block's absmax)."""
    last = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, last)
    block = -(-last // n_blocks)
    pad = n_blocks * block - last
    if pad:
        rows = F.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], n_blocks, block), pad


def _encode(x: torch.Tensor, fmt: str, block: int = 0) -> _Encoded:
    if fmt == "bf16":
        return _Encoded(x.to(torch.bfloat16), None, x.dtype, x._version)
    x = x.detach()
    if block:  # one scale per block of `block` entries along the last dimension (the last block may be short)
        last = x.shape[-1] if x.dim() else 1
        values, _ = _blocks(x, -(-last // block))
    else:
        values = x
    absmax = values.abs().amax(dim=-1, keepdim=True) if block else values.abs().amax()
    # An all-zero block gets scale 1; non-finite values give a non-finite scale and NaN on decode.
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(values / scale).clamp_(-127, 127).to(torch.int8)
    if block:
        q = q.flatten(-2)[..., : (x.shape[-1] if x.dim() else 1)].contiguous().view(x.shape)
    return _Encoded(q, scale, x.dtype, x._version)


@dataclass
class _Saved:
    """What the pack hook returns: the tensor itself, or an encoded base plus this view's geometry."""

    tensor: torch.Tensor | None = None
    encoded: _Encoded | None = None
    view: tuple | None = None  # (size, stride, offset relative to the base) or None for the base shape

    def unpack(self) -> torch.Tensor:
        if self.encoded is None:
            return self.tensor
        x = self.encoded.decode()
        if self.view is None:
            return x
        size, stride, offset = self.view
        return x.as_strided(size, stride, x.storage_offset() + offset)


class ActivationCompressor:
    """Encodes saved activations (see the module docstring). Use as a context around the forward:

        comp = ActivationCompressor("relu-mask,int8")
        comp.swap_activations(model)        # relu-mask: ReLU-family modules -> MaskedActivation
        with comp:                          # bf16 / int8: saved-tensor hooks
            loss = model(x)
        loss.backward()
        comp.stats.ratio

    or `comp.attach(model)`, which does both: the hooks are active during every `model(...)` call.
    """

    def __init__(self, modes: str | Sequence[str] | None = "none", *, min_numel: int = 1024, block: int = 0,
                 leaves: bool = False) -> None:
        self.modes = parse_modes(modes)
        if min_numel < 0 or block < 0:
            raise ConfigError(f"min_numel ({min_numel}) and block ({block}) must be >= 0")
        self.min_numel, self.block = min_numel, block
        self.leaves = leaves  # also encode leaf tensors that require grad (a pipeline stage's input)
        self.fmt = "int8" if "int8" in self.modes else "bf16" if "bf16" in self.modes else None
        self.stats = CompressionStats()
        # id(base) -> (weak ref to base, encoding); an entry dies with its base (see _pack).
        self._cache: dict[int, tuple[weakref.ref, _Encoded]] = {}
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._held: set[int] = set()  # ids of the attached model's buffers (kept like parameters' views)

    # -- wiring

    def hold(self, model: nn.Module) -> None:
        """Never encode `model`'s buffers (e.g. a pipeline stage's copy of a tied weight, a buffer that
        requires grad): the model holds them anyway. Called at every forward by `attach` and the engine pass."""
        self._held = {id(b) for b in model.buffers()}

    def swap_activations(self, model: nn.Module) -> int:
        """With `relu-mask`, replace ReLU-family submodules of `model` in place; returns how many."""
        if "relu-mask" not in self.modes:
            return 0
        swaps = []
        for name, module in model.named_modules():
            for child_name, child in module.named_children():
                new = MaskedActivation.replacing(child, self.stats)
                if new is not None:
                    swaps.append((module, child_name, new, name))
        for parent, child_name, new, _ in swaps:
            setattr(parent, child_name, new)
        return len(swaps)

    def attach(self, model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Swap activations and run every forward of `model` under the hooks; returns removable handles."""
        self.swap_activations(model)
        if not self.modes:
            return []
        def enter(_module, _args) -> None:  # must return None: a value would replace the inputs
            self.hold(model)
            self.__enter__()

        def leave(_module, _args, _output) -> None:
            self.__exit__(None, None, None)

        pre = model.register_forward_pre_hook(enter)
        post = model.register_forward_hook(leave, always_call=True)
        return [pre, post]

    def __enter__(self) -> ActivationCompressor:
        # Installed even without bf16 / int8, so that the stats count every saved tensor.
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Saved.unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks:
            self._hooks.pop().__exit__(*exc)

    # -- hooks

    def _pack(self, t: torch.Tensor) -> _Saved:
        return self.encode(t, count=True)

    def encode(self, t: torch.Tensor, count: bool = False) -> _Saved:
        """What the hook keeps for `t` (the tensor, or its encoding), with the compression statistics. With
        `count=False` the kept bytes are not reported to the activation counter: an inner hook that moves the
        encoding (`recompute.CheckpointHooks`: to tp shards, host memory or an arena) reports where it went."""
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter):
            return _Saved(tensor=t)  # a parameter or a view of one: held by the model, not counted
        self.stats._count_before(base)
        if not self._compressible(t, base):
            if count:
                count_saved(t)
            ref = self._cache.get(id(base))
            if ref is None or ref[0]() is not base:  # count each kept storage once, like bytes_before
                self._cache[id(base)] = (weakref.ref(base, self._forget(id(base))), None)
                nbytes = base.untyped_storage().nbytes()
                self.stats.record("kept", nbytes, nbytes)
            return _Saved(tensor=t)
        if not base.is_contiguous():  # unusual layout: encode this view on its own
            enc = _encode(t.contiguous(), self.fmt, self.block)
            self.stats.record(self.fmt, t.numel() * t.element_size(), enc.nbytes)
            if count:
                count_kept(("gist", id(enc)), enc.nbytes)
            return _Saved(encoded=enc)
        hit = self._cache.get(id(base))
        if hit is not None and hit[0]() is base and hit[1] is not None and hit[1].version == base._version:
            enc = hit[1]
        else:
            enc = _encode(base, self.fmt, self.block)
            self._cache[id(base)] = (weakref.ref(base, self._forget(id(base))), enc)
            self.stats.record(self.fmt, base.untyped_storage().nbytes(), enc.nbytes)
        if count:
            count_kept(("gist", id(enc)), enc.nbytes)
        if t is base:
            return _Saved(encoded=enc)
        return _Saved(encoded=enc, view=(t.size(), t.stride(), t.storage_offset() - base.storage_offset()))

    def _compressible(self, t: torch.Tensor, base: torch.Tensor) -> bool:
        if self.fmt is None or base.dtype not in _FLOATS or t.dtype != base.dtype:
            return False  # ints / bools, dtype-reinterpreting views
        if not (t.requires_grad or base.requires_grad):
            return False  # inputs and constants (a custom Function's output: its base has no grad_fn, the view has)
        if base.grad_fn is None and base.requires_grad and (not self.leaves or id(base) in self._held):
            return False  # leaves that require grad, held by the caller anyway (with `leaves`: not the model's buffers)
        if base.numel() < self.min_numel or base.dim() <= 1 or base.shape[-1] == 1 or base.device.type == "meta":
            return False  # small tensors, one number per row (per-group losses; norm mean and rstd): see above
        return base.element_size() > (1 if self.fmt == "int8" else 2)

    def _forget(self, key: int):
        cache = self._cache
        return lambda _ref: cache.pop(key, None)

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. per step); forgets which live tensors were already encoded."""
        self.stats.reset()
        self._cache.clear()


def apply_compress(
    model: nn.Module, modes: str | Sequence[str] | None, *, min_numel: int = 1024, block: int = 0
) -> ActivationCompressor:
    """Pass for the parallelize pipeline: a compressor for `modes`, attached to `model` (see `attach`)."""
    comp = ActivationCompressor(modes, min_numel=min_numel, block=block)
    comp.attach(model)
    return comp


def int8_block(model_cfg: Any, cap: int = 64) -> int:
    """The int8 block of a GPT (`ModelConfig`): the largest divisor, up to `cap`, of g = gcd(head size,
    d_ff / gcd(n_heads, d_ff)). Every legal tp divides n_heads and d_ff, so g divides every width tp splits —
    the head size (q, k and v of one head stay on one rank), d_model/tp (whole heads) and d_ff/tp."""
    ff = ffn_size(model_cfg)
    g = math.gcd(model_cfg.d_model // model_cfg.n_heads, ff // math.gcd(model_cfg.n_heads, ff))
    return max(b for b in range(1, min(g, cap) + 1) if g % b == 0)


def apply_compress_pass(engine: Any, compress: str, model_cfg: Any) -> ActivationCompressor:
    """The `build_engine` pass for `memory.compress` (the modes `compress`, of the model `model_cfg`): compress what
    `engine.module` saves for backward.

    The hooks are active during the module's forward, or, for a pipeline stage (whose executor calls
    `forward_chunk`), during each chunk's forward. Statistics restart at every forward with gradients;
    those of the first one are reported to the trainer (`compress_bytes_before`, `compress_bytes_after`,
    `compress_ratio` and one `compress_ratio_<mode>` per configured mode, 1.0 where that mode found
    nothing to encode, so that every rank reports the same fields). What the hooks keep also reaches the
    activation counter, so `mem_activations` is the compressed size.
    """
    module = engine.module
    # min_numel 0 and per-block int8 scales: what is encoded does not depend on the layout (module docstring)
    comp = ActivationCompressor(compress, min_numel=0, block=int8_block(model_cfg), leaves=True)
    comp.swap_activations(module)
    hooks = getattr(engine, "checkpoint_hooks", None)  # the recomputation pass's, innermost: they encode with ours
    if hooks is not None and comp.fmt is not None:
        hooks.encoder = comp
    first: dict[str, float] = {}

    def enter() -> None:
        comp.hold(module)
        if torch.is_grad_enabled():
            comp.reset_stats()
        comp.__enter__()

    def leave() -> None:
        comp.__exit__(None, None, None)
        if torch.is_grad_enabled() and not first:
            first.update(_fixed_metrics(comp.stats, comp.modes))

    chunk = getattr(module, "forward_chunk", None)
    if callable(chunk):  # a pipeline stage
        def forward_chunk(*args: Any, **kwargs: Any) -> Any:
            enter()
            try:
                return chunk(*args, **kwargs)
            finally:
                leave()

        module.forward_chunk = forward_chunk
    else:
        module.register_forward_pre_hook(lambda _m, _a: enter())
        module.register_forward_hook(lambda _m, _a, _o: leave(), always_call=True)
    add_memory_report(engine, lambda: dict(first))
    return comp


def _fixed_metrics(stats: CompressionStats, modes: frozenset[str]) -> dict[str, float]:
    out: dict[str, float] = {
        "compress_bytes_before": stats.bytes_before,
        "compress_bytes_after": stats.bytes_after,
        "compress_ratio": stats.ratio if stats.bytes_after else 1.0,
    }
    for mode in sorted(modes):
        k = stats.by_kind.get(mode)
        out[f"compress_ratio_{mode.replace('-', '_')}"] = k.ratio if k is not None and k.bytes_out else 1.0
    return out
