"""The run configuration's schema: a tree of typed dataclasses, one docstring (the string literal) under each field.

Imports nothing of the engine, so every layer can read it; `scaletrain config show --doc` prints the docstrings.
Loading (YAML, `--set`) is `config/load.py`; the checks are `config/validate.py` and the features' rules
(`config/rules.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import yaml

# The closed sets of values, each defined once: the field that takes one is annotated with its Literal, and every
# module that lists, checks or branches on the values reads them here (`get_args` gives the tuple for messages).
Dtype = Literal["fp32", "fp64", "bf16", "fp16"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "2bw", "pipedream", "zb-v", "dualpipev"]
TpMode = Literal["1d", "2d", "2.5d", "3d"]
CpMode = Literal["ring", "ulysses"]
SyncMode = Literal["bsp", "ps", "hogwild", "local"]
OuterMode = Literal["avg", "diloco"]
Router = Literal["topk", "switch", "expert_choice"]
AuxLoss = Literal["switch", "importance"]
OptimizerName = Literal["adamw", "adafactor", "sm3", "sgd"]
ZeroStage = Literal[0, 1, 2, 3]
Offload = Literal["none", "optimizer", "params", "nvme"]
Precision = Literal["dtype", "autocast-bf16", "fp8"]
Fp8Recipe = Literal["tensorwise", "rowwise"]
"""How train.precision=fp8 scales tensors to float8 before each GEMM (memory/fp8.py)."""
Fp8Gemm = Literal["auto", "emulate", "hardware"]
"""Where train.precision=fp8's scaled GEMMs run: FP8 tensor cores, or emulated in fp32 (memory/fp8.py)."""
Mlp = Literal["gelu", "swiglu"]
Position = Literal["learned", "rope"]
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "gelu_tanh"]
RopeScalingType = Literal["none", "llama3"]
DropoutImpl = Literal["global", "torch"]
LrSchedule = Literal["cosine", "constant"]
Device = Literal["auto", "cpu", "cuda"]
OnNan = Literal["stop", "skip"]
MissingRows = Literal["skip", "reassign"]
"""parallel.missing_rows: what a step of fault-tolerant replica groups does with a missing group's rows."""
RecomputeKind = Literal["none", "full", "every", "nth", "ops", "attn-core"]
"""The checkpointing policies of memory.recompute (docs/memory.md): `every` is written every:k, `nth` nth:k and `ops`
ops:<op kinds joined by +>; config/parse.py reads the string (`RECOMPUTE_ALIASES` gives the old names)."""
RecomputeOp = Literal["matmul", "attention"]
"""The op kinds whose outputs memory.recompute=ops:... keeps: `matmul` (aten mm / addmm / bmm / baddbmm: every linear
layer, the experts' batched matmuls), `attention` (the fused scaled-dot-product-attention kernels: output and
log-sum-exp)."""
RECOMPUTE_ALIASES: dict[str, str] = {"selective": "attn-core"}
"""Old names of memory.recompute policies, still accepted: `selective` is Korthikanti's attention-core policy."""
CompressMode = Literal["none", "relu-mask", "bf16", "int8"]
"""The modes of memory.compress, which takes one or a comma list; config/parse.py reads the string."""
PartitionKind = Literal["uniform", "params", "time", "ends"]
"""The named ways of parallel.partition, which also takes block counts such as 2,3,3."""

DTYPES: tuple[str, ...] = get_args(Dtype)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
TP_MODES: tuple[str, ...] = get_args(TpMode)
CP_MODES: tuple[str, ...] = get_args(CpMode)
CP_UNSUPPORTED_RECOMPUTE = ("nth", "ops")  # memory.recompute policies refused with parallel.cp > 1
SYNC_MODES: tuple[str, ...] = get_args(SyncMode)
ROUTERS: tuple[str, ...] = get_args(Router)
AUX_LOSSES: tuple[str, ...] = get_args(AuxLoss)
OPTIMIZER_NAMES: tuple[str, ...] = get_args(OptimizerName)
OFFLOADS: tuple[str, ...] = get_args(Offload)
PRECISIONS: tuple[str, ...] = get_args(Precision)
FP8_RECIPES: tuple[str, ...] = get_args(Fp8Recipe)
FP8_GEMMS: tuple[str, ...] = get_args(Fp8Gemm)
MLPS: tuple[str, ...] = get_args(Mlp)
POSITIONS: tuple[str, ...] = get_args(Position)
NORMS: tuple[str, ...] = get_args(Norm)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
ROPE_SCALING_TYPES: tuple[str, ...] = get_args(RopeScalingType)
RECOMPUTE_KINDS: tuple[str, ...] = get_args(RecomputeKind)
RECOMPUTE_OPS: tuple[str, ...] = get_args(RecomputeOp)
COMPRESS_MODES: tuple[str, ...] = get_args(CompressMode)
PARTITION_KINDS: tuple[str, ...] = get_args(PartitionKind)
DROPOUT_IMPLS: tuple[str, ...] = get_args(DropoutImpl)
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)
DEVICES: tuple[str, ...] = get_args(Device)
ON_NAN: tuple[str, ...] = get_args(OnNan)
MISSING_ROWS: tuple[str, ...] = get_args(MissingRows)
OUTER_MODES: tuple[str, ...] = get_args(OuterMode)
ZERO_STAGES: tuple[int, ...] = get_args(ZeroStage)


def or_list(values: tuple[Any, ...]) -> str:
    """A closed set as validate()'s messages spell it: `a, b or c`."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass
class MoEConfig:
    experts: int = 0
    """Experts per mixture-of-experts layer; 0 means a dense model."""
    every: int = 1
    """Replace every k-th MLP by an MoE layer (blocks k-1, 2k-1, ...; GShard uses 2, arXiv 2006.16668)."""
    top_k: int = 2
    """Experts per token (`topk` router); the expected experts per token c of `expert_choice`."""
    router: Router = "topk"
    """`topk` (Shazeer et al., arXiv 1701.06538), `switch` (top-1, arXiv 2101.03961) or `expert_choice`
    (Zhou et al., arXiv 2202.09368)."""
    capacity_factor: float = 1.25
    """Expert capacity = ceil(capacity_factor x top_k x group_tokens / experts) slots per dispatch group."""
    group_tokens: int = 64
    """Tokens per dispatch group (GShard local groups): capacity is enforced per group of consecutive tokens."""
    aux_loss: AuxLoss = "switch"
    """The load-balancing loss: `switch` (n * sum_i f_i * P_i, weighted by aux_loss_weight; Fedus et al., arXiv
    2101.03961) or `importance` (the noisy top-k gate's importance and load losses, each with its weight; Shazeer
    et al., arXiv 1701.06538, Sec. 4 and appendix A), both per dispatch group."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss n * sum_i f_i * p_i (Switch, arXiv 2101.03961); aux_loss=switch only."""
    importance_loss_weight: float = 0.1
    """aux_loss=importance: w_importance of w * CV(sum_x G(x))^2 over a dispatch group (Shazeer: 0.1)."""
    load_loss_weight: float = 0.1
    """aux_loss=importance: w_load of w * CV(sum_x P(x, i))^2, P the probability that the noisy top-k gate selects
    expert i (needs router_noise > 0; Shazeer: 0.1)."""
    groups: int = 1
    """Two-level hierarchical MoE (Shazeer et al., arXiv 1701.06538, appendix B) when > 1: a primary noisy top-k gate
    chooses top_k of `groups` groups of experts/groups experts, a secondary gate in each chosen group chooses
    top_k of its experts (top_k^2 experts per token). Router topk only; 1 is the flat MoE."""
    z_loss_weight: float = 0.001
    """Weight of the router z-loss mean (logsumexp of router logits)^2 (ST-MoE, arXiv 2202.08906)."""
    router_noise: float = 0.0
    """Router noise in training: topk adds N(0,1) x softplus(x W_noise) x this (Shazeer); switch multiplies
    its input by U(1 - eps, 1 + eps) with eps this value (Switch jitter); 0 disables."""
    random_routing: bool = False
    """GShard: dispatch a token to its second expert only with probability 2 x (its normalised gate)."""
    switch_init_scale: float = 0.0
    """> 0: router and expert weights ~ truncated normal with std sqrt(s / fan_in) (Switch uses s = 0.1);
    0 keeps the GPT initialisation."""
    expert_dropout: float = 0.0
    """Dropout on the experts' hidden activations (Switch's expert dropout), separate from model.dropout."""


@dataclass
class RopeScalingConfig:
    type: RopeScalingType = "none"
    """`none`, or `llama3`: Llama 3.1's frequency-dependent RoPE scaling (Hugging Face `rope_type: llama3`; Grattafiori
    et al., arXiv 2407.21783): wavelengths longer than original_max_position_embeddings / low_freq_factor are
    stretched by `factor`, those shorter than original_max_position_embeddings / high_freq_factor are kept, and the
    band between is interpolated smoothly. Needs model.position=rope."""
    factor: float = 8.0
    """llama3: how much the low frequencies are slowed down (Llama 3.1: 8)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / this are scaled fully (Llama 3.1: 1)."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / this are not scaled (Llama 3.1: 4)."""
    original_max_position_embeddings: int = 8192
    """llama3: the context length the model was pre-trained with before the scaling (Llama 3.1: 8192)."""


@dataclass
class ModelConfig:
    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 128
    """Hidden size (the paper's h)."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_kv_heads: int = 0
    """Key/value heads: fewer than n_heads is grouped-query attention (Ainslie et al., arXiv 2305.13245), each
    shared by n_heads / n_kv_heads query heads; 1 is multi-query attention (Shazeer, arXiv 1911.02150); 0 means
    n_heads (multi-head attention). Must divide n_heads."""
    seq_len: int = 128
    """Context length in tokens (the paper's s)."""
    vocab_size: int = 256
    """Vocabulary size; when not set, data.tokenizer's size (256 for the byte tokenizer)."""
    d_ff: int = 0
    """MLP hidden size; 0 means 4 * d_model (GELU) or the 8/3 * d_model rounding of LLaMA (SwiGLU)."""
    mlp: Mlp = "gelu"
    """MLP kind: `gelu` (GPT-2) or `swiglu` (Shazeer, arXiv 2002.05202)."""
    activation: Activation = "gelu"
    """The GELU MLP's activation (Hendrycks & Gimpel, arXiv 1606.08415): `gelu` (exact, with erf) or `gelu_tanh`
    (its tanh approximation, used by GPT-2 checkpoints: Hugging Face `gelu_new` / `gelu_pytorch_tanh`)."""
    position: Position = "learned"
    """Position encoding: `learned` (GPT-2) or `rope` (RoFormer, arXiv 2104.09864)."""
    rope_theta: float = 10000.0
    """RoPE base: pair i of a head rotates by position x theta^(-2i/head_size) (RoFormer: 10000; Llama 3: 500000)."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE frequency scaling (`model.rope_scaling.type`: none or llama3)."""
    tie_embeddings: bool = True
    """Share the token embedding and the output projection (Press & Wolf, arXiv 1608.05859)."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches."""
    dropout_impl: DropoutImpl = "global"
    """`global`: every mask is a hash of (seed, step, site, global element index), so every layout drops what one
    process drops (model/dropout.py; attention then runs unfused when dropout > 0 in training); `torch`:
    torch's dropout and SDPA's fused attention dropout (faster, but masks depend on the layout)."""
    bias: bool = True
    """Biases in linear layers and layer norms."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2, arXiv 2407.10671), for a model.bias=false model."""
    norm_eps: float = 1e-5
    """Layer-norm epsilon."""
    norm: Norm = "layernorm"
    """Normalisation layers: `layernorm` (GPT-2) or `rmsnorm` (LLaMA, arXiv 1910.07467; with model.bias a bias
    is added after the gain)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts (model.moe.experts > 0)."""
    reversible: bool = False
    """Reversible blocks (RevNet arXiv 1707.04585, Reformer arXiv 2001.04451): the residual stream is split into two
    halves of d_model/2, y1 = x1 + attn(ln1(x2)), y2 = x2 + mlp(ln2(y1)), with attention and MLP of width d_model/2;
    backward rebuilds each block's input from its output, so saved activations do not grow with depth. A different
    architecture, not a free saving (docs/memory.md)."""
    share_blocks: bool = False
    """Every block uses block 0's attention and MLP (or mixture-of-experts) weights and keeps its own two norms
    (ALBERT arXiv 1909.11942; with model.moe.experts > 0 and every = 1 this is WideNet, arXiv 2107.11817): a
    shared weight is one parameter, its gradient the sum over the layers. Single process and plain dp only."""
    preset: str = ""
    """The shape of a model of the planner's catalog (`gpt2`, `llama3-8b`, `mixtral-8x7b`, ...; config/presets.py):
    its values of the model.* keys, under those set explicitly (YAML or --set), so `plan --model NAME` and
    `train --set model.preset=NAME` describe the same model; empty: none."""


@dataclass
class ParallelConfig:
    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-LM, arXiv 1909.08053)."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    zero: ZeroStage = 0
    """ZeRO stage over the data-parallel group: 0 (plain DP), 1, 2 or 3 (arXiv 1910.02054)."""
    offload: Offload = "none"
    """ZeRO-Offload: `none`, `optimizer` (optimizer states and step on the CPU), `params` (ZeRO-3 only) or `nvme`
    (ZeRO-Infinity, arXiv 2104.07857, ZeRO-3 only: parameter, master, AdamW and gradient shards in files under
    parallel.offload_dir, streamed back just in time; docs/memory.md)."""
    offload_dir: str = ""
    """offload=nvme: the folder for each rank's shard files (scratch, deleted at the end of the run); it must
    exist and be writable; empty = `OUT/offload` under --out (a temporary folder without --out)."""
    nvme_prefetch: int = 2
    """offload=nvme: units whose parameter shards are read ahead (and optimizer chunks read ahead / written
    behind); the staging pools hold this many + 1 buffers and use this many I/O worker threads + 1."""
    nvme_grads: bool = True
    """offload=nvme: gradient shards in files too (written behind each reduce-scatter); false keeps them in
    memory (fewer disk bytes per step, 4/dp bytes per parameter resident)."""
    bucket_mb: float = 25.0
    """Size of the gradient buckets reduced together, in MiB."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the tp group (arXiv 2205.05198)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, 2bw, pipedream (asynchronous 1F1B with weight stashing,
    arXiv 1806.03377; one minibatch per optimizer step), zb-v (zero bubble V: parallel.virtual_stages=2), dualpipev
    (DeepSeek-V3's DualPipe in its V form, arXiv 2412.19437: parallel.virtual_stages=2, microbatches >= 2 x pp)."""
    vertical_sync: bool = False
    """PipeDream's vertical sync (schedule=pipedream): every stage uses the weight version stage 0 used for the
    minibatch, sent along with the activations; without it each stage uses its newest version (weight stashing)."""
    microbatches: int = 0
    """Pipeline microbatches per step; 0 means global_batch / (micro_batch * dp)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    partition: str = "uniform"
    """How blocks are split into pipeline stages: `uniform`, `params` (balance parameter counts), `time`
    (balance per-block times from a short profile; PipeDream's DP split, arXiv 1806.03377), `ends` (the embedding
    and the head count as one block each, so the first and last stages get one block fewer; Megatron-core's
    account_for_embedding/loss_in_pipeline_split) or block counts such as `2,3,3`."""
    ep: int = 1
    """Expert-parallel degree: experts split over groups of ep consecutive data-parallel ranks."""
    timeout_s: float = 300.0
    """Timeout of every process group, in seconds: a stuck collective fails instead of hanging."""
    heartbeat_s: float = 5.0
    """Launched runs: a rank that stops (killed, SIGSTOP, dead machine) is noticed within this many seconds and
    every rank stops naming it (heartbeat through the job's TCP store, docs/multinode.md); 0 disables it."""
    flight_recorder: int = 256
    """Launched runs: each rank records its last N collectives and point-to-point messages; when one times out
    the ranks' records are matched into a report naming the operation and step (docs/multinode.md); 0: off."""
    sync: SyncMode = "bsp"
    """Data-parallel synchronisation (docs/async.md): `bsp` (all-reduce every step), `ps` (parameter servers, Li et
    al. OSDI 2014), `hogwild` (shared memory, no lock; Niu et al. arXiv 1106.5730) or `local` (local SGD, Lin et al.
    arXiv 1808.07217; DiLoCo with parallel.outer=diloco, arXiv 2311.08105)."""
    servers: int = 1
    """ps: server processes holding the parameters and optimizer state, tensors spread over them; the job has
    parallel.dp workers plus these (--nproc = dp + servers; servers are ranks 0..servers-1, on the CPU)."""
    staleness: int = 0
    """ps: most server versions a gradient may be behind the parameters it is applied to (SSP, Ho et al. NIPS 2013);
    0 is BSP exactly, -1 unbounded (ASP)."""
    hogwild_lock: bool = False
    """hogwild: take a lock around each read and update of the shared parameters (then it is ASP with one
    gradient per update); false is the paper's lock-free Hogwild."""
    local_steps: int = 8
    """local: optimizer steps each worker takes alone between two synchronisations (the paper's H)."""
    outer: OuterMode = "avg"
    """local: `avg` sets the parameters to the workers' average; `diloco` applies the average change with an outer
    Nesterov optimizer (outer_lr, outer_momentum)."""
    outer_lr: float = 0.7
    """local with outer=diloco: outer learning rate (DiLoCo uses 0.7)."""
    outer_momentum: float = 0.9
    """local with outer=diloco: outer Nesterov momentum (DiLoCo uses 0.9; 0 is plain SGD on the average change)."""
    replicas: int = 1
    """Fault-tolerant replica groups (docs/fault_tolerance.md): the data-parallel dimension split into this many
    groups that train on through the death of a group (a per-step quorum, torchft-style; a restarted group heals from
    a live one). 1 = off. A group is one process (dp = replicas) or two data-parallel ranks (dp = 2 x replicas,
    any parallel.zero); no tp/pp/ep/cp inside a group."""
    missing_rows: MissingRows = "skip"
    """parallel.replicas > 1: a step computed by Q < R groups `skip`s the missing groups' rows (the mean over the Q
    groups' rows, at the step's usual lr: a smaller batch) or `reassign`s them to the live groups, round-robin (every
    step uses the whole global batch, the mean over all R groups' rows; the lr is unchanged; the live groups compute
    more). docs/fault_tolerance.md, "The missing group's share of the batch"."""
    heal_attempts: int = 3
    """parallel.replicas > 1: the lighthouse excludes a replica group from the run after this many consecutive failed
    heals (each a round where the group was behind and its heal from a live group failed: a chunk corrupt on every
    resend, a state it cannot load), so a heal that fails the same way every round cannot stall the live groups; the
    excluded group's process stops with a one-line error and its agent is not restarted (docs/fault_tolerance.md)."""
    slow_ranks: str = ""
    """Straggler injection for experiments: `1:0.5` makes data-parallel rank (worker) 1 sleep 0.5 x its measured
    forward+backward time after each of its steps, i.e. 50% slower; a comma list for several."""
    ps_tolerate_loss: bool = False
    """ps with staleness=-1: when a worker dies, continue with the others (its data is given to them) instead of
    stopping the job; needs scaletrain's own launcher (`train --nproc`), which does not stop the job on a death."""
    tp_mode: TpMode = "1d"
    """How the parallel.tp ranks split the model: `1d` (Megatron-LM), `2d` (Optimus, SUMMA on a q x q grid, arXiv
    2104.05343), `2.5d` (Tesseract, parallel.tp_depth x q x q, arXiv 2105.14500) or `3d` (q x q x q, arXiv
    2105.14450); 2d/2.5d/3d also split every activation (docs/tensor_parallel.md)."""
    tp_depth: int = 1
    """The depth d of tp_mode=2.5d (parallel.tp = d x q x q); 1 for the other modes."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over cp ranks, attention included (docs/context_parallel.md);
    they take part in gradient reduction and ZeRO sharding with dp (the job has dp x cp x tp x pp processes)."""
    cp_mode: CpMode = "ring"
    """parallel.cp > 1: `ring` (ring attention, Liu et al. arXiv 2310.01889: key/value chunks passed around the cp
    ranks, partial softmax results combined exactly; each rank holds two of 2 x cp sequence chunks from opposite
    ends, so causal work is balanced) or `ulysses` (DeepSpeed-Ulysses, Jacobs et al. arXiv 2309.14509: all-to-all
    from sequence- to head-sharded around attention; heads divisible by cp)."""
    reshard_after_forward: bool | None = None
    """ZeRO-3 (FSDP's option of that name): `true` releases a unit's gathered parameters after its forward and gathers
    them again for its backward (the least memory; 1.5x data parallelism's traffic); `false` keeps them gathered from
    its forward to the end of its backward (one all-gather per unit and micro-batch instead of two; all units
    gathered at once at the end of the forward). Unset: true, except with parallel.pp > 1, where each stage keeps
    its parameters gathered for the whole step (false is the only value there). Needs parallel.zero=3
    (docs/data_parallel.md)."""

    @property
    def reshards_after_forward(self) -> bool:
        """parallel.reshard_after_forward resolved: the value given, else true without and false with pp > 1."""
        return self.reshard_after_forward if self.reshard_after_forward is not None else self.pp == 1


ASYNC_KEYS = {"servers": "ps", "staleness": "ps", "ps_tolerate_loss": "ps", "hogwild_lock": "hogwild",
              "local_steps": "local", "outer": "local", "outer_lr": "local", "outer_momentum": "local"}
"""The `parallel.*` keys of the asynchronous modes, each with the `parallel.sync` it belongs to (docs/async.md):
validate() refuses one set off its default under another mode, `plan --config` resets them to time a BSP step,
and the runners' checkpoints record those that shape the saved state."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch: int = 8
    """Sequences per forward/backward on one data-parallel rank; the rest is gradient accumulation."""
    seed: int = 1234
    """Seed of initial weights, data order and dropout; results do not depend on the layout."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    lr_schedule: LrSchedule = "cosine"
    """`cosine` (warm-up then cosine decay to min_lr) or `constant` (warm-up then constant)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    dtype: Dtype = "fp32"
    """Parameter and compute dtype: fp32, fp64 (tight equivalence tests), bf16, fp16."""
    precision: Precision = "dtype"
    """`dtype`: parameters, activations and matmuls in train.dtype (bf16/fp16 keep fp32 masters, docs/precision.md);
    `autocast-bf16`: fp32 parameters, gradients and optimizer state, matmuls and attention in bf16 under
    torch.autocast (needs train.dtype=fp32; the fast setting on GPUs, docs/gpu.md); `fp8`: the transformer blocks'
    linear layers compute their three GEMMs in float8 with dynamic scaling (torchao; train.fp8_recipe), the rest
    as autocast-bf16 does (train.dtype=fp32) or in bf16 (train.dtype=bf16) (docs/precision.md)."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """train.precision=fp8: how a tensor is scaled to float8 before a GEMM, from its current absolute maximum:
    `tensorwise` (one scale per tensor; e4m3 for inputs and weights, e5m2 for output gradients; Micikevicius et al.,
    arXiv 2209.05433) or `rowwise` (one scale per row along the GEMM's reduction dimension, rounded down to a power
    of 2; e4m3 throughout)."""
    fp8_layers: str = "blocks.*"
    """train.precision=fp8: which linear layers of the transformer blocks run in FP8, as a comma list of name patterns
    (`*` matches anything) over the plain model's names such as `blocks.3.mlp.fc`; `!pattern` excludes (e.g.
    `blocks.*,!blocks.0.*`). The embedding, output layer, norms and attention stay bf16/fp32 (docs/precision.md)."""
    fp8_gemm: Fp8Gemm = "auto"
    """train.precision=fp8: `hardware` runs the scaled GEMMs on FP8 tensor cores (CUDA compute capability 8.9+:
    Ada, Hopper, Blackwell), `emulate` dequantizes and multiplies in fp32 (same numerics, slower; every CPU, older
    GPUs), `auto` is hardware on a GPU with FP8 and emulate on the CPU (a GPU without FP8 is refused at start)."""
    fp8_all_gather: bool = False
    """train.precision=fp8 with parallel.zero=3 and the tensorwise recipe: ZeRO-3 all-gathers the FP8 layers'
    weights as float8 bytes, cast with the whole weight's scale (torchtitan's enable_fsdp_float8_all_gather;
    parallel/zero_fp8.py): about half the all-gather bytes of bf16 weights."""
    compile: bool = False
    """torch.compile each transformer block (after the tensor-parallel and recomputation passes, before data
    parallelism / ZeRO, as torchtitan orders them); docs/gpu.md lists what it combines with."""
    eval_every: int = 50
    """Validation loss every N steps (and at the end); 0 disables it."""
    eval_batches: int = 4
    """Global batches in one validation pass."""
    log_every: int = 1
    """Write a metrics.jsonl line every N steps."""
    checkpoint_every: int = 100
    """Save a checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_checkpoints: int = 2
    """Complete checkpoints to keep; older ones are deleted after a newer one is complete."""
    checkpoint_async: bool = False
    """Write checkpoints in the background from a host copy of the state while training goes on; the next save
    waits for the previous one (docs/checkpoints.md)."""
    device: Device = "auto"
    """`auto` (cuda when present, else cpu), `cpu` or `cuda`."""
    on_nan: OnNan = "stop"
    """A NaN/inf loss (fp32, fp64, bf16): `stop` the run naming step and rank, or `skip` the step."""
    loss_scale: float = 65536.0
    """fp16: initial dynamic loss scale (Micikevicius et al., arXiv 1710.03740)."""
    loss_scale_window: int = 1000
    """fp16: overflow-free steps before the scale grows by 2x."""
    loss_scale_backoff: float = 0.5
    """fp16: factor applied to the scale after an overflow (once hysteresis is used up)."""
    loss_scale_hysteresis: int = 2
    """fp16: overflows tolerated before the scale backs off."""
    loss_scale_min: float = 1.0
    """fp16: the scale never goes below this."""
    log_noise_scale: bool = False
    """Log the gradient noise scale B_simple = tr(Sigma)/|G|^2 (McCandlish et al., arXiv 1812.06162) from the
    micro-batch and global-batch gradient norms: `noise_scale` etc. in metrics.jsonl (docs/scaling.md)."""
    report: bool = True
    """Write the HTML run report OUT/report.html at each checkpoint and at the end (docs/report.md)."""
    tensorboard: bool = False
    """Also write every metrics.jsonl scalar as TensorBoard events to OUT/tb/ (needs `pip install scaletrain[tb]`)."""
    profile_steps: str = ""
    """`a:b`: record torch.profiler traces of steps a..b on every rank into OUT/profile/ (Chrome/Perfetto JSON,
    linked from the report); empty = no profiling."""


@dataclass
class OptimConfig:
    name: OptimizerName = "adamw"
    """Optimizer: `adamw`, `adafactor` (arXiv 1804.04235), `sm3` (arXiv 1901.11150) or `sgd` (torch's, with
    optim.momentum; L2 weight decay in the gradient; the inner optimizer of local SGD, arXiv 1808.07217)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW, arXiv 1711.05101) on matrices; not on biases, norms."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    relative_step: bool = False
    """Adafactor: relative step size min(train.lr, 1/sqrt(t)) x RMS(param) (the paper's schedule, with parameter
    scaling) instead of train.lr itself. Off by default: RMS(param) ~ 0.02 makes the relative step ~50x smaller
    than AdamW's at the same train.lr, and it needs 1e4+ steps to pay off (docs/memory.md)."""
    decay_rate: float = 0.8
    """Adafactor: second-moment decay 1 - t^(-decay_rate)."""
    clip_threshold: float = 1.0
    """Adafactor: update clipping threshold d."""
    lr_scale: float = 0.0
    """Multiplier of the schedule's learning rate for this optimizer; 0 = its default: 1 for adamw and adafactor,
    5 for sm3 (AdaGrad-style accumulators shrink its step as 1/sqrt(t); 5x train.lr trains the demo like AdamW),
    100 for sgd (no per-coordinate normalisation)."""
    momentum: float = 0.0
    """SM3 and SGD momentum (0 disables the extra full-size buffer); Adafactor uses beta1 only if use_beta1."""
    use_beta1: bool = False
    """Adafactor: keep a first moment with optim.beta1 (adds a full-size buffer)."""


@dataclass
class MemoryConfig:
    recompute: str = "none"
    """Activation checkpointing policy (docs/memory.md): `none`; `full` (each block a checkpoint that keeps its input,
    Chen et al. arXiv 1604.06174); `every:k` (segments of k blocks, one input kept per segment: Chen's sqrt(n)
    trade-off); `nth:k` (blocks 0, k, 2k, ... by global index are full checkpoints, the others keep everything:
    torchtitan's selective layer); `ops:matmul`, `ops:attention`, `ops:matmul+attention` (each block a checkpoint that
    also keeps the outputs of the listed op kinds and recomputes only the rest: torchtitan's selective op, through
    torch's selective activation checkpointing); `attn-core` (only the attention core softmax(QK^T/sqrt(d))V is
    recomputed: Korthikanti et al. arXiv 2205.05198; `selective` is its old name, still accepted)."""
    partition_checkpoints: bool = False
    """With tp > 1 keep each saved block input sharded across tp ranks (ZeRO-R, arXiv 1910.02054)."""
    offload_activations: bool = False
    """Move saved block checkpoints to host memory between forward and backward."""
    compress: str = "none"
    """Saved-activation compression (Gist): none, relu-mask, bf16, int8, or a comma list."""
    contiguous: bool = False
    """ZeRO-R memory defragmentation (arXiv 1910.02054 Sec. 6.3): activation checkpoints (under recompute or
    activation offload) and ZeRO-2/3's per-micro-batch gradient buffers live in arenas allocated once per run and
    reused every step. Bit-identical to false (memory/contiguous.py)."""
    count_allocations: bool = False
    """Log `mem_alloc_count` and `mem_alloc_bytes`: allocator calls of one steady-state training step's forward and
    backward (step 2; CPU: the profiler's memory events, CUDA: torch.cuda.memory_stats, which also gives
    `mem_cuda_allocated_peak` and `mem_cuda_reserved_peak`). Costs one profiled step on CPU."""
    budget_gb: float = 0.0
    """Memory budget per process in GiB (0 = none): refused before launch when the planner's resident bytes
    exceed it, and the run stops at the first step whose measured resident bytes do (CPU: peak RSS growth of
    the step over the process at trainer start; CUDA: max_memory_allocated of the step; docs/memory.md)."""


@dataclass
class MixSource:
    source: str = ""
    """A corpus, as data.source takes it."""
    weight: float = 1.0
    """Its share of the sequences (weights are normalised over the mixture; positive)."""
    text_field: str = ""
    """The text column of this source's JSONL / Parquet / datasets rows; empty means data.text_field."""


@dataclass
class DataConfig:
    source: str = "builtin"
    """`builtin` (the Python standard library sources of this interpreter), a text file or folder, `.jsonl` /
    `.jsonl.gz` files or folders, `.parquet` files or folders, a `datasets.Dataset.save_to_disk` folder, or a `.bin`
    token file (uint16 as nanoGPT writes it; uint32 with a `.bin.json` sidecar, docs/data.md)."""
    tokenizer: str = "byte"
    """`byte` (token = UTF-8 byte, vocabulary 256) or a Hugging Face `tokenizer.json`, or a folder holding one
    (a model folder, or what `scaletrain data tokenizer` writes); documents end with its end-of-text token."""
    text_field: str = "text"
    """The text column of JSONL / Parquet / datasets rows."""
    eot_token: str = ""
    """The token that ends each document; empty means the folder's tokenizer_config.json `eos_token`, else the first
    of <|endoftext|>, <|end_of_text|>, </s>, <eos> the tokenizer has (NUL for `byte`)."""
    mix: list[MixSource] = field(default_factory=list)
    """Several sources with weights, e.g. [{source: a.jsonl, weight: 0.7}, {source: b/, weight: 0.3,
    text_field: body}]: each sequence of a batch comes from source i with probability weight_i / sum (instead of
    data.source)."""
    val_fraction: float = 0.05
    """Fraction of each token stream, at its end, held out for validation."""
    cache_dir: str = ""
    """Where tokenized corpora are cached; empty means $SCALETRAIN_CACHE or ~/.cache/scaletrain."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)

    # ---- derived quantities (never stored) ----
    @property
    def world_size(self) -> int:
        servers = self.parallel.servers if self.parallel.sync == "ps" else 0  # ps: server ranks besides the workers
        return self.parallel.dp * self.parallel.tp * self.parallel.pp * self.parallel.cp + servers

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on one data-parallel rank."""
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.model.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
