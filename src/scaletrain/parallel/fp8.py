"""The FP8 pass (`train.precision=fp8`): the blocks' linear layers of this rank — plain, column- or row-parallel —
compute their three GEMMs in float8 (memory/fp8.py; Micikevicius et al., arXiv 2209.05433; torchao's float8 training).

Which layers: `memory/fp8_layers.fp8_layer_names` (the blocks' linear layers, filtered by `train.fp8_layers`); the
pass converts exactly those of this rank's blocks and fails loudly if the model disagrees. A layer keeps its
parameters, so names, initialisation, ZeRO's flat buffers and checkpoints are those of the bf16 run: a checkpoint
moves between FP8 and other precisions and between layouts as any other.

Under 1D tensor parallelism (Megatron-LM, arXiv 1909.08053) each layer scales its shard as the whole tensor is scaled
in one process: an amax taken along a dimension the layer splits is MAX-all-reduced over the tp group (`Fp8Gemm.split`)
— tensorwise: the weight and output gradient of a column-parallel layer and the input and weight of a row-parallel
one; rowwise: only the per-row amaxes whose row runs along the split dimension. With sequence parallelism (arXiv
2205.05198) the column-parallel layer all-gathers its input in high precision, casts the whole sequence, and saves only
its shard for backward (`_Fp8SeqParallelLinear`, the FP8 twin of tensor_parallel.f_sp_linear).

Order in build_engine: after tp, ep and pp (it converts the layers this rank holds, tensor-parallel ones included),
before recomputation, autocast and compile (their wrappers then see the FP8 layers: torchtitan converts before
activation checkpointing and torch.compile too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from scaletrain.config import ModelConfig, TrainConfig
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh
from scaletrain.errors import UserError
from scaletrain.memory.autocast import forward_compute_dtype
from scaletrain.memory.fp8 import (
    Fp8Gemm,
    autocast_off,
    compute_input,
    convert_linear,
    emulated,
    fp8_linear,
    recipe_config,
)
from scaletrain.memory.fp8_layers import describe, fp8_layer_names
from scaletrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_reduce_,
    f,
    g,
    g_sp,
    group_rank,
    start_gather_seq,
    start_reduce_scatter_seq,
)


class _Fp8SeqParallelLinear(torch.autograd.Function):
    """Sequence parallelism's column-parallel linear in float8: y = gather(x_shard) Wᵀ + b, saving only this rank's
    sequence shard of x; backward all-gathers it again for dW (overlapped with dx) and reduce-scatters dx when the
    forward gathered (x_full None), as `f_sp_linear` does in high precision. x is cast to the GEMM's dtype after the
    gather, so every rank quantizes the whole sequence."""

    @staticmethod
    def forward(ctx, x_full, x_shard, weight, bias, gemm, group, stats):
        ctx.gemm, ctx.group, ctx.stats, ctx.gathers = gemm, group, stats, x_full is None
        ctx.has_bias, ctx.compute = bias is not None, forward_compute_dtype(x_shard) or x_shard.dtype
        ctx.save_for_backward(x_shard, weight)
        x = start_gather_seq(x_shard, group, stats).wait() if x_full is None else x_full
        x = x.to(ctx.compute)
        with autocast_off(x):
            y = gemm.output(x.reshape(-1, x.shape[-1]), weight)  # (B T, O): the caller views it as (B, T, O)
            return y if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        gemm = ctx.gemm
        need_w = ctx.needs_input_grad[2]
        gathering = start_gather_seq(x_shard, ctx.group, ctx.stats, async_op=True) if need_w else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        B = x_shard.shape[0]
        dx = gemm.grad_input(dy2, weight).view(B, -1, weight.shape[1]).to(x_shard.dtype)  # summed in x's dtype
        if ctx.gathers:
            dx = start_reduce_scatter_seq(dx, ctx.group, ctx.stats, async_op=True)
        dw = db = None
        if need_w:
            x = gathering.wait().to(ctx.compute)
            dw = gemm.grad_weight(dy2, x.reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy2.sum(0).to(weight.dtype)
        if ctx.gathers:
            return None, dx.wait(), dw, db, None, None, None
        return dx, None, dw, db, None, None, None


class _SumCopiesGrad(torch.autograd.Function):
    """Identity forward; backward sums the output gradient over the tp ranks holding copies of the same piece of a
    column-parallel layer (grouped-query attention with tp > n_kv_heads: each rank back-propagates only its own query
    heads' part of the key/value gradient) and keeps it on the piece's first copy only, zero on the others.

    Float8 casting is not linear: one process casts the whole output gradient (the sum of the copies' parts) with the
    amax of that sum, so the copies' parts must be summed in high precision before the layer's FP8 GEMMs, not their
    float8 products after them (which, with each part cast by the MAX of the parts' amaxes, is what differed by
    7.9e-2 in loss). The first copy then computes dW and dx from the whole gradient, as one process does; the others
    contribute zeros to `sum_copies_hook` (dW, db) and to the input's all-reduce (dx), so nothing is counted twice."""

    @staticmethod
    def forward(ctx, y, group, piece, pieces, first, stats):
        ctx.group, ctx.piece, ctx.pieces, ctx.first, ctx.stats = group, piece, pieces, first, stats
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        buf = dy.new_zeros((ctx.pieces, *dy.shape))
        buf[ctx.piece] = dy
        whole = all_reduce_(buf, ctx.group, ctx.stats)[ctx.piece]
        return (whole if ctx.first else torch.zeros_like(dy)), None, None, None, None, None


def sum_copies(layer: ColumnParallelLinear, y: torch.Tensor) -> torch.Tensor:
    """`y` of a column-parallel FP8 layer whose pieces are copied over tp ranks, with `_SumCopiesGrad` between it and
    the GEMMs (the identity when each rank holds its own piece)."""
    if layer.copies == 1 or not torch.is_grad_enabled():
        return y
    first = group_rank(layer.group) % layer.copies == 0
    return _SumCopiesGrad.apply(y, layer.group, layer.piece, layer.pieces, first, layer.stats)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: Fp8Gemm) -> torch.Tensor:
    x = compute_input(x)
    with autocast_off(x):
        y = fp8_linear(x, weight, gemm)
        return y if bias is None else y + bias.to(y.dtype)


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear layer (output features split) in float8; its weight's and output gradient's
    amaxes are reduced over tp (`Fp8Gemm(split="out")`); a piece copied over several ranks (tp > n_kv_heads) gets
    its whole output gradient before the float8 casts (`sum_copies`)."""

    fp8: Fp8Gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entered = getattr(x, "_st_tp_entered", False)  # f / f_sp already applied at a module's entry (enter_hook)
        if self.sequence_parallel:
            shard = x._st_seq_shard if entered else x
            y = _Fp8SeqParallelLinear.apply(x if entered else None, shard, self.weight, self.bias, self.fp8,
                                            self.group, self.stats)
            return sum_copies(self, y.view(shard.shape[0], -1, y.shape[-1]))  # (B, T, out / tp)
        x = x if entered else f.apply(x, self.group, self.stats)
        return sum_copies(self, _linear(x, self.weight, self.bias, self.fp8))


class Fp8RowParallelLinear(RowParallelLinear):
    """A row-parallel linear layer (input features split) in float8; its input's and weight's amaxes are reduced
    over tp (`Fp8Gemm(split="in")`); the partial outputs are summed in the GEMM's output dtype."""

    fp8: Fp8Gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(x, self.weight, None, self.fp8)
        y = (g_sp if self.sequence_parallel else g).apply(y, self.group, self.stats)
        return y if self.bias is None else y + self.bias.to(y.dtype)


@dataclass
class Fp8Run:
    """What the FP8 pass did on this rank: the recipe, whether its GEMMs are emulated, the layers it converted
    (plain-model names, checked against the rule) and how many the whole model has (metrics: `fp8_layers`)."""

    recipe: str
    emulated: bool
    layers: list[str]
    model_layers: int  # FP8 layers of the whole model (all pipeline stages)

    def step_fields(self) -> dict[str, int]:
        """The metrics row's `fp8_layers`: linear layers of the whole model that compute in FP8."""
        return {"fp8_layers": self.model_layers}

    def info(self) -> dict:
        """For run_info.json: what ran in FP8 on this rank."""
        return {"recipe": self.recipe, "gemm": "emulated" if self.emulated else "FP8 tensor cores",
                "layers": self.layers}


def apply_fp8(engine, model_cfg: ModelConfig, train: TrainConfig, mesh: Mesh, comm: CommStats,
              device: torch.device) -> Fp8Run:
    """Convert this rank's FP8 layers (memory/fp8_layers.py) in place; sets and returns `engine.fp8`. A device
    without FP8 tensor cores where they are required is refused in one line (memory/fp8.emulated)."""
    emulate = emulated(train.fp8_gemm, device)
    config = recipe_config(train.fp8_recipe, emulate)
    wanted = fp8_layer_names(model_cfg, train)
    local = [name for name, _ in engine.module.named_modules() if name in set(wanted)]
    run = Fp8Run(train.fp8_recipe, emulate, local, len(wanted))
    group = mesh.group("tp")
    for name in local:
        m = engine.module.get_submodule(name)
        if type(m) is nn.Linear:
            gemm = Fp8Gemm(config)
            convert_linear(m, gemm)
        elif type(m) in (ColumnParallelLinear, RowParallelLinear):
            column = type(m) is ColumnParallelLinear
            gemm = Fp8Gemm(config, "out" if column else "in", group, comm)
            m.__class__ = Fp8ColumnParallelLinear if column else Fp8RowParallelLinear
            m.fp8 = gemm
        else:
            raise UserError(f"train.precision=fp8: {name} is a {type(m).__name__}, not a linear layer FP8 converts "
                            f"({describe(wanted, model_cfg)})")
        if not emulate:
            _check_shape(name, m, train.micro_batch * model_cfg.seq_len)
    blocks = {n.split(".")[1] for n, _ in engine.module.named_modules() if n.count(".") == 1 and n[:7] == "blocks."}
    expected = [n for n in wanted if n.split(".")[1] in blocks]
    if sorted(expected) != sorted(local):
        raise RuntimeError(f"FP8 pass: this rank's blocks hold {sorted(local)}, the rule expects {sorted(expected)}")
    engine.fp8 = run
    return run


def _check_shape(name: str, m: nn.Module, tokens: int) -> None:
    """FP8 tensor cores (torch._scaled_mm) need every GEMM dimension but the first operand's rows divisible by 16:
    both of a weight's, and the tokens of a micro-batch (the reduction dimension of dW)."""
    out, inp = m.weight.shape
    if out % 16 or inp % 16 or tokens % 16:
        raise UserError(f"train.precision=fp8: {name}'s weight is {out} x {inp} on this rank and a micro-batch has "
                        f"{tokens} tokens; FP8 tensor cores need all three divisible by 16: exclude the layer with "
                        "train.fp8_layers, change the sizes, or use train.fp8_gemm=emulate")
