"""`train.precision=fp8`: linear layers whose three GEMMs run in float8 with dynamic scaling (torchao float8).

Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433: two 8-bit formats, e4m3 (largest finite
448, more precision) and e5m2 (57344, more range). Before a GEMM each operand is multiplied by a scale
s = fp8_max / amax, amax being its current absolute maximum (dynamic scaling, as torchao and torchtitan do: no
history), and cast to float8 with saturation; the GEMM multiplies the float8 values and divides its fp32
accumulation by both scales. A linear layer y = x Wᵀ has three GEMMs:

    output       y  = x  · Wᵀ     x and W in e4m3
    grad_input   dx = dy · W      dy in e5m2 (tensorwise) or e4m3 (rowwise)
    grad_weight  dW = dyᵀ · x

`train.fp8_recipe` (torchao's recipes): `tensorwise` — one scale per tensor; `rowwise` — one scale per row along
each GEMM's reduction dimension (x per token for the output, per feature for dW; W per output feature for the
output, per input feature for dx), rounded down to a power of 2 so scaling itself never rounds, e4m3 throughout.

The casts, scales and GEMMs are torchao's (`torchao.float8`: the recipes' `Float8LinearConfig`, `tensor_to_amax`,
`amax_to_scale`, `hp_tensor_and_scale_to_float8` and `Float8TrainingTensor`, whose matmul is `torch._scaled_mm` on FP8
tensor cores or, emulated, a dequantize-and-multiply in fp32 with the same rounding of the inputs). `Fp8Gemm` adds
what a sharded layer needs: the amax of an operand whose reduced dimension is split over tensor-parallel ranks (the
weight and output gradient of a column-parallel layer, the input and weight of a row-parallel one; which ones depends
on the recipe) is MAX-all-reduced over their group, so each shard is scaled exactly as the whole tensor is in one
process. `fp8_linear` is the autograd function over the three GEMMs; `Fp8Linear` the plain layer (torchao's
`Float8Linear`, with autocast on any device: the input is cast to the autocast dtype as autocast's own linear would,
and the output keeps that dtype). Which layers convert: memory/fp8_layers.py; the pass: parallel/fp8.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.distributed.comm import CommStats, group_size
from scaletrain.errors import UserError
from scaletrain.memory.autocast import forward_compute_dtype

OUTPUT, GRAD_INPUT, GRAD_WEIGHT = "output", "grad_input", "grad_weight"
INPUT, WEIGHT, GRAD_OUTPUT = "input", "weight", "grad_output"
# (operand, GEMM) -> (torchao config field, the 2-D operand's dimension a rowwise amax is taken along)
# operands as torchao passes them: x (N, K), Wᵀ (K, O), dy (N, O)
CASTS = {
    (INPUT, OUTPUT): ("cast_config_input", -1),
    (WEIGHT, OUTPUT): ("cast_config_weight", 0),
    (GRAD_OUTPUT, GRAD_INPUT): ("cast_config_grad_output", -1),
    (WEIGHT, GRAD_INPUT): ("cast_config_weight_for_grad_input", -1),
    (GRAD_OUTPUT, GRAD_WEIGHT): ("cast_config_grad_output_for_grad_weight", 0),
    (INPUT, GRAD_WEIGHT): ("cast_config_input_for_grad_weight", 0),
}
# which dimension of each 2-D operand is split over tp: `in` = row-parallel (K split), `out` = column-parallel (O)
SPLIT_DIM = {("in", INPUT): 1, ("in", WEIGHT): 0, ("out", WEIGHT): 1, ("out", GRAD_OUTPUT): 1}
FP8_CAPABILITY = (8, 9)  # CUDA compute capability of FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell


@functools.cache
def torchao_float8() -> Any:
    """`torchao.float8`, imported quietly: torchao's package root logs a warning for each of its CUDA kernel
    libraries a CPU build of torch cannot load, and a pytree deprecation; neither concerns float8 training."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as f8
        import torchao.float8.float8_training_tensor  # noqa: F401
        import torchao.float8.float8_utils  # noqa: F401
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return f8


def recipe_config(recipe: str, emulate: bool) -> Any:
    """torchao's `Float8LinearConfig` of `train.fp8_recipe`, emulated or on FP8 tensor cores."""
    f8 = torchao_float8()
    return dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def emulated(setting: str, device: torch.device) -> bool:
    """Whether `train.fp8_gemm` (auto / emulate / hardware) emulates the GEMMs on `device`; a device without FP8
    tensor cores when the hardware is required (`hardware`, or `auto` on a GPU) is refused in one line."""
    if setting == "emulate":
        return True
    if device.type == "cpu":
        if setting == "auto":
            return True
        raise UserError("train.fp8_gemm=hardware needs a GPU with FP8 tensor cores (CUDA compute capability 8.9+); "
                        "this run is on the CPU: use train.fp8_gemm=auto or emulate")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) >= FP8_CAPABILITY:
        return False
    name = torch.cuda.get_device_name(device)
    raise UserError(f"train.precision=fp8: {name} (compute capability {cap[0]}.{cap[1]}) has no FP8 tensor cores "
                    "(8.9+: Ada, Hopper, Blackwell); set train.fp8_gemm=emulate to run FP8 emulated (slower than "
                    "bf16, for testing) or use train.precision=autocast-bf16")


def check_fp8_device(cfg: Any) -> None:
    """Before a run starts (the launcher, nothing written yet): the device rank 0 will use refuses
    `train.precision=fp8` in one line when it has no FP8 tensor cores and emulation was not asked for."""
    if cfg.train.precision != "fp8":
        return
    from scaletrain.distributed.process_group import pick_device

    emulated(cfg.train.fp8_gemm, pick_device(cfg.train.device, 0))


@dataclass
class Fp8Gemm:
    """The three GEMMs of one linear layer in float8 under torchao's `config` (a Float8LinearConfig).

    `split` says which of the layer's dimensions is split over the tensor-parallel `group`: None (a whole layer),
    `out` (column-parallel: output features) or `in` (row-parallel: input features); an operand's amax taken along
    a split dimension is then MAX-all-reduced over `group` (bytes counted in `stats` as `tp.fp8_amax`). It holds no
    state that changes during training (no amax history, no counters), so a torch.compile'd block traces it once."""

    config: Any
    split: str | None = None
    group: dist.ProcessGroup | None = None
    stats: CommStats | None = None
    mm_config: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # torchao's pieces resolved once, here: torch.compile then traces `cast` without the import machinery
        f8 = torchao_float8()
        tt, c = f8.float8_training_tensor, self.config
        self.mm_config = tt.LinearMMConfig(*(tt.ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
                                             for g in (c.gemm_config_output, c.gemm_config_grad_input,
                                                       c.gemm_config_grad_weight)))
        roles = {INPUT: tt.GemmInputRole.INPUT, WEIGHT: tt.GemmInputRole.WEIGHT,
                 GRAD_OUTPUT: tt.GemmInputRole.GRAD_OUTPUT}
        self._amax, self._scale = f8.float8_utils.tensor_to_amax, f8.float8_utils.amax_to_scale
        self._to_float8 = tt.hp_tensor_and_scale_to_float8
        self._casts = {}  # (operand, gemm) -> None (high precision) or (granularity, axis, float8 dtype, role)
        for (operand, gemm), (name, along) in CASTS.items():
            cc = getattr(c, name)
            axiswise = cc.scaling_granularity is f8.ScalingGranularity.AXISWISE
            self._casts[(operand, gemm)] = None if cc.scaling_type is f8.ScalingType.DISABLED else (
                cc.scaling_granularity, along if axiswise else None, cc.target_dtype, roles[operand])

    def reduces(self, operand: str, axis: int | None) -> bool:
        """Whether the amax of `operand` (along `axis`; None: the whole tensor) spans a dimension split over tp."""
        dim = SPLIT_DIM.get((self.split, operand)) if group_size(self.group) > 1 else None
        return dim is not None and (axis is None or axis % 2 == dim)

    def cast(self, t: torch.Tensor, operand: str, gemm: str) -> torch.Tensor:
        """`t` (2-D) scaled and cast to float8 as `gemm` wants its `operand` (unchanged when the recipe keeps it in
        high precision)."""
        how = self._casts[(operand, gemm)]
        if how is None:
            return t
        granularity, axis, dtype, role = how
        amax = self._amax(t, False, None, granularity, axis)
        if self.reduces(operand, axis):
            amax = amax.float()
            n = group_size(self.group)
            if self.stats is not None:
                self.stats.add("tp.fp8_amax", 2 * (n - 1) / n * amax.numel() * amax.element_size())
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        scale = self._scale(amax, dtype, self.config.round_scales_to_power_of_2)
        return self._to_float8(t, scale, dtype, self.mm_config, role, axis)

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y = x Wᵀ for x (N, K), W (O, K), in x's dtype."""
        return torch.mm(self.cast(x, INPUT, OUTPUT), self.cast(weight.t(), WEIGHT, OUTPUT))

    def grad_input(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """dx = dy W for dy (N, O), in dy's dtype."""
        return torch.mm(self.cast(dy, GRAD_OUTPUT, GRAD_INPUT), self.cast(weight.t(), WEIGHT, GRAD_INPUT).t())

    def grad_weight(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dW = dyᵀ x (O, K), in dy's dtype."""
        return torch.mm(self.cast(dy, GRAD_OUTPUT, GRAD_WEIGHT).t(), self.cast(x, INPUT, GRAD_WEIGHT))


class _Fp8Linear(torch.autograd.Function):
    """y = x Wᵀ with the three GEMMs of `gemm`; saves x and W in high precision (torchao's float8 training does
    the same: the backward casts them again along the dimensions its GEMMs reduce)."""

    @staticmethod
    def forward(ctx, x, weight, gemm):  # x (N, K), weight (O, K) -> (N, O)
        ctx.gemm = gemm
        ctx.save_for_backward(x, weight)
        return gemm.output(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        gemm = ctx.gemm
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = gemm.grad_input(dy, weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = gemm.grad_weight(dy, x).to(weight.dtype)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, gemm: Fp8Gemm) -> torch.Tensor:
    """x (..., K) times Wᵀ (O, K) in float8; the output has x's dtype. Under autocast call it from `compute_input`'s
    result inside `autocast_off` (the subclass tensors must not meet autocast's casts). The token dimensions are
    flattened outside the autograd function, so the output is an ordinary view that later ops may write into (the
    row-parallel all-reduce does)."""
    y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, gemm)
    return y.view(*x.shape[:-1], y.shape[-1])


def compute_input(x: torch.Tensor) -> torch.Tensor:
    """The high-precision input of an FP8 GEMM: x in the autocast dtype inside an autocast region (what autocast's
    linear would multiply), else x itself."""
    dtype = forward_compute_dtype(x)
    return x if dtype is None else x.to(dtype)


def autocast_off(x: torch.Tensor) -> torch.autocast:
    return torch.autocast(x.device.type, enabled=False)


class Fp8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in float8 (`self.fp8`, an `Fp8Gemm`); made by `convert_linear` from a plain
    nn.Linear, keeping its parameters (and so its name, initialisation and checkpoint keys)."""

    fp8: Fp8Gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = compute_input(x)
        with autocast_off(x):
            y = fp8_linear(x, self.weight, self.fp8)
            return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8.config.cast_config_input.scaling_granularity.value}"


def convert_linear(linear: nn.Linear, gemm: Fp8Gemm) -> Fp8Linear:
    """Turn `linear` (a plain nn.Linear) into an `Fp8Linear` in place."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"convert_linear takes a plain nn.Linear, got {type(linear).__name__}")
    linear.__class__ = Fp8Linear
    linear.fp8 = gemm
    return linear
