"""The entry of the analytic cost model: `estimate` gives the memory per category, step time, MFU, pipeline
bubble and communication of one layout of a model on a GPU, after `check_layout` has refused impossible ones.

Every number the planner prints comes from one formula, each in the module of its term, with its paper:
`params` (parameter counts), `flops`, `memory` (bytes per category), `comm` (links and collective times),
`zero3` (ZeRO-3's exposed communication), `pipeline` (schedules in closed form: bubble, in-flight chunks),
`step_time` (step time, MFU, bytes per dimension), `tp_nd` (2D / 2.5D / 3D tensor parallelism). Our own runs
are predicted exactly by `plan.exact` (memory through `predict_run`, step time after `--calibrate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scaletrain.errors import UserError
from scaletrain.plan.analytic import context, tp_nd
from scaletrain.plan.analytic.inputs import (
    DEFAULT_ASSUMPTIONS,
    OFFLOAD,
    SCHEDULES,
    Assumptions,
    Layout,
    Training,
    recompute_policy,
)
from scaletrain.plan.analytic.memory import optimizer_bytes, rank_activation_bytes, rank_memory
from scaletrain.plan.analytic.stages import Stages, check_partition, rank_params, run_length, split, stages_of
from scaletrain.plan.analytic.step_time import block_time_costs, step_cost
from scaletrain.plan.catalog import ModelSpec
from scaletrain.plan.hardware import CATALOG, GPU


@dataclass
class Estimate:
    layout: Layout
    microbatches: int
    memory: dict[str, float]
    capacity: float
    step_time_s: float = math.inf
    tokens_per_s: float = 0.0
    model_tflops_per_gpu: float = 0.0
    hardware_tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    bubble_fraction: float = 0.0
    comm_bytes: dict[str, float] = field(default_factory=dict)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    stage_blocks: tuple[int, ...] = ()
    """Blocks per pipeline stage, in model order (pp x virtual_stages of them)."""
    notes: tuple[str, ...] = ()
    """What the prediction assumed that a user should know (printed under the table, `notes` in --json)."""

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.capacity

    def label(self) -> str:
        """The layout in short, with the blocks per stage when they differ (`dp64 tp8 pp16 ... ends [7,8x14,7]`)."""
        text = self.layout.short()
        return text + f" [{run_length(self.stage_blocks)}]" if len(set(self.stage_blocks)) > 1 else text

    @property
    def over_by(self) -> float:
        return self.memory["total"] - self.capacity

    @property
    def dominant(self) -> str:
        if not self.time_breakdown:
            return "-"
        return max(self.time_breakdown, key=self.time_breakdown.get)

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "fits": self.fits,
            "memory_bytes": {k: int(round(v)) for k, v in self.memory.items()},
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "comm_bytes_per_step": {k: int(round(v)) for k, v in self.comm_bytes.items()},
            "time_breakdown_s": self.time_breakdown,
            "microbatches": self.microbatches,
            "dominant_cost": self.dominant,
            "blocks_per_stage": list(self.stage_blocks),
            "notes": list(self.notes),
        }


def check_layout(m: ModelSpec, train: Training, lay: Layout, n_gpus: int | None = None) -> int:
    """Raise UserError for an impossible layout; return the number of microbatches per dp rank."""
    for name in ("dp", "tp", "pp", "ep", "micro_batch", "virtual_stages", "cp"):
        if getattr(lay, name) < 1:
            raise UserError(f"layout {name} must be >= 1, got {getattr(lay, name)}")
    if n_gpus is not None and lay.world != n_gpus:
        cp = f" x cp ({lay.cp})" if lay.cp > 1 else ""
        raise UserError(f"layout dp ({lay.dp}) x tp ({lay.tp}) x pp ({lay.pp}){cp} = {lay.world}"
                        f" does not match --gpus ({n_gpus})")
    context.check_cp(m.seq_len, m.n_heads, m.kv_heads, lay.tp, lay.cp, lay.cp_mode)
    if lay.cp > 1 and lay.tp_mode != "1d":
        raise UserError(f"cp ({lay.cp}) > 1 needs tp_mode=1d, got {lay.tp_mode}")
    if lay.tp_mode != "1d" or lay.tp_depth != 1:  # 2d / 2.5d / 3d: the grid's own constraints
        tp_nd.check_layout(m, lay)
    elif m.n_heads % lay.tp:
        raise UserError(f"heads ({m.n_heads}) is not divisible by tp ({lay.tp})")
    elif m.kv_heads % lay.tp and lay.tp % m.kv_heads:
        raise UserError(f"kv heads ({m.kv_heads}) and tp ({lay.tp}) do not divide each other")
    chunks = lay.pp * lay.virtual_stages
    if lay.partition != "uniform" and lay.tp_mode != "1d":
        raise UserError(f"partition={lay.partition} with tp_mode={lay.tp_mode}: the grid modes split the layers"
                        " uniformly")
    if lay.partition == "uniform" and m.n_layers % chunks:
        raise UserError(f"layers ({m.n_layers}) is not divisible by pp ({lay.pp}) x virtual_stages"
                        f" ({lay.virtual_stages}) = {chunks} (partition=ends, params, time or block counts split"
                        " them unevenly)")
    check_partition(lay.partition, m.n_layers, chunks)
    if lay.zero not in (0, 1, 2, 3):
        raise UserError(f"zero must be 0, 1, 2 or 3, got {lay.zero}")
    recompute_policy(lay.recompute)
    if lay.schedule not in SCHEDULES:
        raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {lay.schedule!r}")
    if lay.offload not in OFFLOAD:
        raise UserError(f"offload must be one of {', '.join(OFFLOAD)}, got {lay.offload!r}")
    if lay.offload in ("params", "nvme") and lay.zero != 3:
        raise UserError(f"offload={lay.offload} needs zero=3 (the optimizer states alone: offload=optimizer, any zero)")
    if lay.reshard_after_forward is not None:
        value = str(lay.reshard_after_forward).lower()
        if lay.zero != 3:
            raise UserError(f"reshard_after_forward={value} needs zero=3, got zero={lay.zero}")
        if lay.reshard_after_forward and lay.pp > 1:
            raise UserError(f"reshard_after_forward=true with pp ({lay.pp}) > 1: a pipeline stage keeps its ZeRO-3"
                            " parameters gathered for the whole step")
        if not lay.reshard_after_forward and lay.offload == "nvme":
            raise UserError("reshard_after_forward=false with offload=nvme: ZeRO-Infinity streams each unit's"
                            " parameters from files just in time")
    if lay.virtual_stages > 1 and lay.schedule not in ("interleaved", "zb-v", "dualpipev"):
        raise UserError(f"virtual_stages ({lay.virtual_stages}) > 1 needs schedule=interleaved, zb-v or dualpipev")
    if lay.ep > 1 and (not m.n_experts or m.n_experts % lay.ep or lay.dp % lay.ep):
        raise UserError(f"ep ({lay.ep}) must divide experts ({m.n_experts}) and dp ({lay.dp})")
    if lay.sequence_parallel and lay.tp == 1:
        raise UserError("sequence_parallel needs tp > 1")
    split = lay.micro_batch * lay.dp
    if train.global_batch % split:
        raise UserError(f"global batch ({train.global_batch}) is not divisible by micro_batch"
                        f" ({lay.micro_batch}) x dp ({lay.dp}) = {split}")
    mbs = train.global_batch // split
    if lay.schedule == "pipedream" and lay.pp > 1 and mbs != 1:
        raise UserError(f"schedule=pipedream runs one minibatch per step: microbatches ({mbs}) must be 1"
                        " (global batch = micro_batch x dp)")
    if lay.schedule == "interleaved" and lay.pp > 1 and mbs % lay.pp:
        raise UserError(f"interleaved schedule needs microbatches ({mbs}) divisible by pp ({lay.pp})")
    if lay.schedule in ("zb-v", "dualpipev") and lay.pp > 1:
        from scaletrain.parallel.pipeline.schedules import schedule_constraints  # torch-free

        errors = schedule_constraints(lay.schedule, lay.pp, mbs, lay.virtual_stages)
        if errors:
            raise UserError(errors[0].replace("parallel.", ""))
    return mbs


def estimate(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions = DEFAULT_ASSUMPTIONS,
             n_gpus: int | None = None, memory_only: bool = False) -> Estimate:
    """Memory, time and communication of one layout. Raises UserError for impossible layouts."""
    mbs = check_layout(m, train, lay, n_gpus)
    if train.dtype == "fp8" and not gpu.fp8_flops:
        raise UserError(f"--dtype fp8 needs FP8 tensor cores: {gpu.name} has none ({', '.join(FP8_GPUS)} have)")
    if lay.tp_mode == "2.5d":  # the same bytes and times as 2d with d times the dp (tp_nd.as_2d)
        return replace(estimate(m, gpu, train, tp_nd.as_2d(lay), a, n_gpus, memory_only), layout=lay)
    st = pipeline_stages(m, gpu, train, lay, a)
    if lay.tp_mode != "1d":  # 2d / 3d (tp_nd.py): their parameters per rank (middle ranks counted as the first)
        first, last = tp_nd.stage_params(m, lay)
        ranks = [first] * (lay.pp - 1) + [last]
    else:
        ranks = rank_params(m, lay, st)
    memory = rank_memory(m, train, lay, a, ranks, rank_activation_bytes(m, train, lay, mbs, st), mbs,
                         [g.rank for g in st.groups] if lay.tp_mode == "1d" else None)
    notes = layout_notes(train, lay, gpu)
    if min(st.blocks) == 0:
        notes += ("the first and the last pipeline chunk hold only the embedding and only the head (Llama 3's split);"
                  " scaletrain's engine (parallel.partition=ends) needs a block on every stage",)
    est = Estimate(lay, mbs, memory, gpu.memory_bytes, stage_blocks=st.blocks, notes=notes)
    if memory_only:
        return est
    k, _ = optimizer_bytes(m, train)
    cost = step_cost(m, gpu, train, lay, a, ranks, st, mbs, k)
    return replace(est, **{**vars(cost), "notes": est.notes + cost.notes})


FP8_GPUS = tuple(name for name, g in CATALOG.items() if g.fp8_flops)


def layout_notes(train: Training, lay: Layout, gpu: GPU | None = None) -> tuple[str, ...]:
    """Sentences on what a layout's setting does under these training settings, where it may surprise."""
    notes = []
    if train.dtype == "fp8" and gpu is not None:
        notes.append(f"FP8: the blocks' linear layers run their three GEMMs at {gpu.fp8_flops / 1e12:,.0f} TFLOP/s"
                     f" FP8 peak x {gpu.fp8_gemm_efficiency:.2f}, with dynamic tensorwise scaling (casts, tp scale"
                     " all-reduces, FP8 ZeRO-3 gathers); attention, embeddings, head and experts in bf16; MFU is"
                     " against the bf16 peak")
    if recompute_policy(lay.recompute).kind == "attn-core" and train.attention == "flash":
        notes.append("recompute=attn-core with flash attention saves no memory (the kernel keeps only its output and"
                     " log-sum-exp) and runs the attention forward again: it only costs time")
    return tuple(notes)


def pipeline_stages(m: ModelSpec, gpu: GPU, train: Training, lay: Layout, a: Assumptions) -> Stages:
    """The blocks of every stage under the layout's partition (`stages.split`); `time` balances this model's per-block,
    embedding and head times on this GPU."""
    n = lay.pp * lay.virtual_stages
    costs = block_time_costs(m, gpu, train, lay, a) if lay.partition == "time" and n > 1 else None
    return stages_of(m, split(m, lay.partition if n > 1 else "uniform", n, costs), lay.pp, lay.virtual_stages,
                     lay.pp > 1 and lay.schedule in ("zb-v", "dualpipev"))
