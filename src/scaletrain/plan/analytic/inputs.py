"""The inputs of one estimate of the analytic cost model: the layout (how the model is split: dp, tp, pp, ep,
ZeRO stage, micro-batch, recomputation, schedule, offload), the training settings (batch, dtype, attention
kernel, optimizer) and the time model's assumptions, with the enumerations they take their values from.

Bytes per element follow mixed-precision training (Micikevicius et al., arXiv 1710.03740) with the ZeRO
paper's K = 12 optimizer bytes per parameter for Adam (Rajbhandari et al., arXiv 1910.02054 Sec. 3.1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from scaletrain.config.parse import RecomputeMode, parse_recompute
from scaletrain.config.schema import OFFLOADS
from scaletrain.config.schema import SCHEDULES as _SCHEDULES
from scaletrain.errors import ConfigError, UserError
from scaletrain.optim.registry import OPTIMIZERS as OPTIMIZER_SPECS

Recompute = RecomputeMode
"""An activation-checkpointing policy, with the engine's names (memory.recompute, docs/memory.md; config/parse.py
reads it for the engine and the planner alike): none, full, every:k (Chen's segments, arXiv 1604.06174), nth:k
(torchtitan's selective layer), ops:<kinds> (torchtitan's selective op) and attn-core (Korthikanti et al., arXiv
2205.05198; with flash attention it saves nothing)."""


@functools.lru_cache(maxsize=128)
def recompute_policy(spec: str) -> Recompute:
    """A layout's `recompute` -> Recompute; UserError naming the value otherwise. `every:1` and `nth:1` are `full`."""
    try:
        return parse_recompute(spec)
    except ConfigError as e:  # the planner's layouts name the field `recompute`
        raise UserError(str(e).replace("memory.recompute", "recompute", 1)) from None


SCHEDULES = ("1f1b", *(s for s in _SCHEDULES if s != "1f1b"))  # the config's, 1F1B (the default) listed first
OFFLOAD = OFFLOADS
KERNELS = ("fused", "eager")
"""How the element-wise work of a block runs (`Training.kernels`): `fused` kernels (Megatron-LM's fused bias-GeLU,
softmax and layer norm, TransformerEngine, torch.compile) or PyTorch `eager`, one kernel per operation."""
OPTIMIZERS = tuple(name for name, spec in OPTIMIZER_SPECS.items() if spec.sharded)  # the ones layouts can shard
# bytes per element of parameters / gradients / activations, and K (optimizer bytes per parameter)
DTYPES = {
    "bf16": (2, 2, 2, 12),  # mixed precision Adam: fp32 master + m + v = 12 (ZeRO paper, K = 12)
    "fp16": (2, 2, 2, 12),
    "fp32": (4, 4, 4, 8),  # plain Adam in fp32: m + v
    "fp64": (8, 8, 8, 16),
    "fp8": (2, 2, 2, 12),  # FP8 GEMMs in the blocks' linear layers, the rest as bf16 mixed precision (step_time.py)
}


@dataclass(frozen=True)
class Training:
    global_batch: int
    dtype: str = "bf16"
    attention: str = "flash"
    """`flash` (no s x s scores stored, fused kernel) or `standard` (scores, softmax, dropout stored)."""
    dp_overlap: bool = True
    """Gradient reduction overlapped with the backward pass (PyTorch DDP buckets); Megatron-LM 2021 and
    Korthikanti 2022 did not overlap."""
    optimizer_k: float | None = None
    """Optimizer bytes per parameter, sharded by ZeRO; None = what `optimizer` keeps in this dtype."""
    optimizer: str = "adamw"
    """adamw (two moments), adafactor (factored second moment, Shazeer & Stern arXiv 1804.04235) or sm3
    (one accumulator per row and per column, Anil et al. arXiv 1901.11150); see `optimizer_bytes`."""
    first_moment: bool = False
    """Adafactor with beta1 / SM3 with momentum: one more element-wise state per parameter."""
    grad_bytes: int | None = None
    """Bytes per gradient element; None = the dtype's (2 in bf16/fp16; our engine keeps fp32 buffers: 4)."""
    param_bytes: int | None = None
    """Bytes per parameter element; None = the dtype's (autocast keeps fp32 parameters, 4, with bf16 compute)."""
    kernels: str = "fused"
    """`fused` (Megatron-LM's and TransformerEngine's fused element-wise kernels, torch.compile: `Assumptions.
    mem_traffic`) or `eager` (PyTorch eager, every element-wise operation its own kernel reading and writing HBM:
    `Assumptions.eager_mem_traffic`); `scaletrain plan --kernels`, and for `plan --config` the run's train.compile."""
    fp8_gather: float = 0.0
    """Fraction of the blocks' parameter elements ZeRO-3 all-gathers as float8, one byte each (`train.fp8_all_gather`:
    the FP8 layers' weights, parallel/zero_fp8.py); the rest in `param_bytes`."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    offload: str = "none"
    tp_mode: str = "1d"
    """`1d` (Megatron), `2d`, `2.5d`, `3d` (plan/analytic/tp_nd.py)."""
    vertical_sync: bool = False
    """PipeDream's vertical sync (schedule=pipedream): every stage keeps p weight versions instead of p - r."""
    tp_depth: int = 1
    """The depth d of tp_mode=2.5d."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (plan/analytic/context.py)."""
    cp_mode: str = "ring"
    """`ring` (ring attention, arXiv 2310.01889) or `ulysses` (all-to-all, arXiv 2309.14509)."""
    partition: str = "uniform"
    """How the blocks split into pp x virtual_stages stages: uniform, params, time, ends or block counts "7,8,8,7"
    (plan/analytic/stages.py; the engine's `parallel.partition`)."""
    reshard_after_forward: bool | None = None
    """ZeRO-3 (FSDP's option, the engine's parallel.reshard_after_forward): true releases a unit's gathered
    parameters after its forward and gathers them again for its backward; false keeps them from its forward to the
    end of its backward (one all-gather per unit and microbatch, all units gathered at the end of the forward).
    Unset: true, except with pp > 1, where a stage stays gathered for the whole step (false)."""

    @property
    def reshards(self) -> bool:
        """reshard_after_forward resolved: the value given, else true without and false with pp > 1."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else self.pp == 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("dp", "tp", "pp", "ep", "zero", "micro_batch", "recompute",
                                               "schedule", "virtual_stages", "sequence_parallel", "offload",
                                               "tp_mode", "tp_depth", "cp", "cp_mode", "partition",
                                               "reshard_after_forward")}

    def short(self) -> str:
        mode = "" if self.tp_mode == "1d" else f"({self.tp_mode}" + (f" d{self.tp_depth})" if self.tp_depth > 1
                                                                      else ")")
        s = f"dp{self.dp} tp{self.tp}{mode} pp{self.pp}"
        if self.cp > 1:
            s += f" cp{self.cp}" + ("(ulysses)" if self.cp_mode == "ulysses" else "")
        if self.ep > 1:
            s += f" ep{self.ep}"
        s += f" z{self.zero}" + ("-keep" if self.zero == 3 and self.pp == 1 and not self.reshards else "")
        s += f" mb{self.micro_batch} {self.recompute}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
            if self.partition != "uniform":
                s += f" {self.partition}"
        if self.sequence_parallel:
            s += " sp"
        if self.offload != "none":
            s += f" off:{self.offload}"
        return s


@dataclass(frozen=True)
class Assumptions:
    """The constants of the time model. Each is a stated assumption, not a measurement."""

    link_efficiency: float = 0.8
    """Fraction of the link bandwidth a large NCCL collective reaches (bus bandwidth / link)."""
    gemm_half_dim: float = 64.0
    """GEMM efficiency falls as d/(d + d0) with the sharded hidden size d = h/t (small GEMMs are slower)."""
    attn_efficiency: float = 0.5
    """Unfused attention batched matmuls (QK^T, AV) run at this fraction of the GEMM efficiency."""
    mem_traffic: float = 2.0
    """HBM bytes moved by the element-wise work of a forward pass per byte of activations it stores
    (each stored tensor written once and read once); backward moves twice that."""
    eager_mem_traffic: float = 3.5
    """The same with PyTorch eager kernels (`Training.kernels="eager"`): each element-wise operation of a block (norms,
    casts, activations, residual adds, head transposes) is its own kernel that reads its inputs from HBM and writes
    its output back, where fused kernels make one pass. Fitted on two measured eager / compiled pairs, the same model
    and GPU with only the kernels changed (tests/test_plan_h100.py): our GPT-3 125M on one H100 (benchmarks/RESULTS.md
    "GPU fast path": 0.0611 s eager, 0.0528 s compiled) gives 3.30, torchtitan's Llama 3.1 8B on 8 H100 (pytorch/
    torchtitan docs/performance.md Table 1: 5,762 and 6,667 tokens/s per GPU) 3.76; their mean, 3.5. On H100 (3.2x
    A100's FLOP/s, 1.6x its bandwidth) this memory-bound work weighs about twice as much as on A100."""
    hbm_efficiency: float = 0.8
    tp_comm_overlap: bool = False
    """Tensor-parallel communication overlapped with its GEMMs (`--tp-overlap`; Megatron's tp-comm-overlap, PyTorch's
    async TP): with sequence parallelism each all-gather / reduce-scatter is decomposed into tp chunks exchanged
    while the GEMM that consumes or produces it runs on the others (Wang et al., ASPLOS 2023, "Overlap
    communication with dependent computation via decomposition"; Flux, arXiv 2406.06858), so one chunk's transfer
    stays exposed and the rest only where the collective outlasts its GEMM (`step_time.tp_exposed`). Off: every tp
    collective exposed. The all-reduces of tp without sequence parallelism are exposed either way."""
    fragmentation: float = 0.05
    """Allocator fragmentation allowance, a fraction of everything else (ZeRO-R's M_D)."""
    reserved_bytes: float = 1.0 * (1 << 30)
    """CUDA context, NCCL and cuBLAS workspaces per GPU."""
    bucket_bytes: float = 25 * (1 << 20)
    """DP gradient bucket (PyTorch DDP default 25 MiB), two in flight."""
    cpu_adam_params_per_s: float = 1.0e9
    """CPU Adam throughput per GPU's share of host cores (ZeRO-Offload, arXiv 2101.06840)."""
    nvme_read_bw: float = 1.6e9
    """offload=nvme: NVMe read bytes/s per GPU's share of the node's drives (a DGX-2 of ZeRO-Infinity,
    arXiv 2104.07857 Sec. 8: ~25 GB/s over 16 GPUs). `scaletrain plan --config --calibrate` measures our own."""
    nvme_write_bw: float = 1.0e9
    """offload=nvme: NVMe write bytes/s per GPU's share."""
    zero3_style: str = "prefetch"
    """How the ZeRO-3 implementation moves parameters (`zero3_exposed_time`). `prefetch`: one all-gather
    per layer, issued one layer ahead, gradients reduce-scattered while the backward goes on (our engine,
    PyTorch FSDP arXiv 2304.11277, DeepSpeed since its coalesced collectives of late 2021). `per-tensor`:
    DeepSpeed ZeRO-3 up to v0.4 (the runs of arXiv 2104.04473 Table 2): one all-gather per weight behind a
    device synchronise, so only the next weight's gather hides behind the current compute; weights are
    gathered again for the recomputed forward, and each gradient reduce-scatter is waited for."""
    gpu_speed_spread: float = 0.05
    """Spread (fastest to slowest) of the sustained speed of the GPUs of one 8-GPU node: "5% and higher differences
    on an 8-gpu node" (silicon lottery, cooling; S. Bekman, ml-engineering, compute/accelerator/README.md). A
    synchronous step waits for the slowest of its N GPUs: its compute takes sigma x E[max of N standard normals]
    longer, with sigma = spread / E[range of 8] (`step_time.straggler_factor`). 0 turns it off."""
    zero3_link_bw: float | None = None
    """Per-GPU bandwidth (bytes/s) ZeRO-3's collectives reach over a dp group that spans nodes; None = a
    ring over all the node's NICs (`group_link`). Set it from a measurement of your implementation."""


DEFAULT_ASSUMPTIONS = Assumptions()
