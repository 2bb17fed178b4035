"""Tensor-parallel plans: a table saying how each module of a model is split, the pass applying it, and the
engine's pass for our GPT (`apply_tp`, with `gpt_plan`).

A plan maps module names to a style; `*` stands for one path component (`blocks.*.attn.qkv`):

    Column(parts)     nn.Linear split by output features (Megatron-LM arXiv 1909.08053, Sec. 3: the first
                      linear of the MLP, the fused q/k/v projection with parts=3); Column(parts, shards) cuts
                      it into at most `shards` pieces, each copied on tp / shards ranks when tp is larger
                      (grouped-query attention's key/value heads, arXiv 2305.13245: gradients summed over
                      the copies)
    Row()             nn.Linear split by input features, after a Column (the MLP's and attention's output)
    VocabEmbedding()  nn.Embedding split over the vocabulary
    VocabHead()       the output nn.Linear split over the vocabulary; the logits stay split (use its loss_fn)
    Replicated(...)   a module on the replicated activations (norms, position embeddings, dropout between
                      sub-layers); its own parameters are replicated; with sequence parallelism (Korthikanti
                      et al., arXiv 2205.05198) it runs on sequence shards
    Split(enter)      a module computing on tp-split activations (attention, split by heads): its dropout
                      draws from the per-rank stream; with enter=True its input enters the tp region at
                      the module's entry (f, or the sequence all-gather), once for all the column-parallel
                      layers inside (SwiGLU's gate and up), or because the module needs the whole sequence
                      (our attention reads T from its input)

`apply_tp_plan(model, plan, group, ...)` swaps the matched layers for those of `tensor_parallel`, slicing the
full, already initialised weights (so every shard holds exactly its part of the single-device values),
marks the replicated parameters, attaches the dropout regions and returns a `TPModel`, whose
`gather_state` rebuilds the full state dict under the plain model's names. It works on any model built
from nn.Linear / nn.Embedding, e.g.

    plan = {"ff.up": Column(), "ff.down": Row(), "norm": Replicated()}
    tp = apply_tp_plan(model, plan, mesh.group("tp"))
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import ModelConfig
from scaletrain.config.sizes import is_gqa, kv_heads, moe_layers
from scaletrain.distributed.comm import CommStats, group_size
from scaletrain.errors import UserError
from scaletrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    copy_layout,
    enter_hook,
    group_rank,
    mark_replicated,
    seq_shard,
)


@dataclass(frozen=True)
class Column:
    parts: int = 1  # fused projections stacked along the output (q, k, v: 3), each split over tp
    shards: int = 0  # at most this many pieces (0: tp); with tp > shards each piece sits on tp / shards ranks


@dataclass(frozen=True)
class Row:
    pass


@dataclass(frozen=True)
class VocabEmbedding:
    pass


@dataclass(frozen=True)
class VocabHead:
    pass


@dataclass(frozen=True)
class Replicated:
    seq_dim: int | None = None  # with sequence parallelism keep this rank's shard of the output along it


@dataclass(frozen=True)
class Split:
    enter: bool = False  # apply f (f_sp) to the first input at the module's entry, for the layers inside


Style = Column | Row | VocabEmbedding | VocabHead | Replicated | Split


def gpt_plan(cfg: ModelConfig) -> dict[str, Style]:
    """The plan of `scaletrain.model.gpt.GPT`: attention split by heads, the MLP column-then-row, the
    embedding and (tied or not) head over the vocabulary, the residual stream replicated."""
    plan: dict[str, Style] = {"wte": VocabEmbedding()}
    if cfg.position == "learned":
        plan["wpe"] = Replicated(seq_dim=0)  # wpe(arange(T)) is (T, C)
    plan |= {
        "drop": Replicated(),
        "blocks.*.ln1": Replicated(),
        # heads are split (attention-probability dropout per rank); it reads T from its input, so under
        # sequence parallelism the input is gathered at its entry (qkv still saves only the shard)
        "blocks.*.attn": Split(enter=True),
        **attention_plan(cfg),
        "blocks.*.attn.proj": Row(),
        "blocks.*.attn.resid_dropout": Replicated(),
        "blocks.*.ln2": Replicated(),
    }
    moe = set(moe_layers(cfg))
    # dense MLPs: one wildcard entry set for all blocks, or one per dense block when MoE blocks sit between them
    for block in ["*"] if not moe else [str(i) for i in range(cfg.n_layers) if i not in moe]:
        mlp = f"blocks.{block}.mlp"
        if cfg.mlp == "swiglu":  # gate and up read the same input: one f (one all-gather with sp) for both
            plan |= {mlp: Split(enter=True), f"{mlp}.gate": Column(), f"{mlp}.up": Column()}
        else:
            plan[f"{mlp}.fc"] = Column()
        plan |= {f"{mlp}.proj": Row(), f"{mlp}.dropout": Replicated()}
    if cfg.share_blocks and moe:  # every block calls block 0's MoE layer: listed (and planned) once
        moe = {min(moe)}
    for i in sorted(moe):  # MoE blocks: router and experts replicated over tp; under sequence parallelism each
        mlp = f"blocks.{i}.mlp"  # rank routes the tokens of its sequence shard (their gradients summed over tp)
        plan |= {f"{mlp}.router": Replicated(), f"{mlp}.experts": Replicated(), f"{mlp}.dropout": Replicated()}
        if cfg.moe.router == "topk" and cfg.moe.router_noise > 0:
            plan[f"{mlp}.noise"] = Replicated()
        if cfg.moe.groups > 1:  # the secondary gates of the hierarchical MoE (and their noise)
            plan[f"{mlp}.expert_router"] = Replicated()
            if cfg.moe.router_noise > 0:
                plan[f"{mlp}.expert_noise"] = Replicated()
    plan |= {"ln_f": Replicated(), "lm_head": VocabHead()}
    return plan


def attention_plan(cfg: ModelConfig) -> dict[str, Style]:
    """The attention's projections: the fused qkv split by heads (q, k, v each), or with grouped-query attention q
    split by query heads and kv (k, v each) by key/value heads, each head copied on tp / n_kv_heads ranks when tp
    exceeds n_kv_heads (rank r's query heads all use key/value head r // (tp / n_kv_heads))."""
    if not is_gqa(cfg):
        return {"blocks.*.attn.qkv": Column(parts=3)}
    return {"blocks.*.attn.q": Column(), "blocks.*.attn.kv": Column(parts=2, shards=kv_heads(cfg))}


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split: along `dim`, each of `parts` stacked blocks separately, the first `full`
    entries real (the rest padding). `copies` > 1: the tensor is cut into tp / copies pieces, each held by
    `copies` consecutive tp ranks (a parameter's mark `_st_tp_shard` then names its piece and the piece count)."""

    dim: int
    parts: int = 1
    full: int | None = None
    copies: int = 1

    def global_shape(self, local_shape: tuple[int, ...], n: int) -> tuple[int, ...]:
        """The plain model's shape of a parameter whose shard on one of `n` ranks has `local_shape`."""
        shape = list(local_shape)
        shape[self.dim] = self.full if self.full is not None else local_shape[self.dim] * n
        return tuple(shape)

    def global_index(self, local_shape: tuple[int, ...], rank: int, n: int) -> torch.Tensor:
        """For each element of rank `rank`'s shard (row-major), its flat index in the plain model's tensor, or -1
        for a padding element (vocabulary rows beyond the true size)."""
        k = local_shape[self.dim] // self.parts  # rows of one part on one rank
        i = torch.arange(local_shape[self.dim])
        along = (i // k) * (k * n) + rank * k + i % k  # part j of rank r sits at j * (k n) + r k in the full tensor
        full = self.global_shape(local_shape, n)
        grids = torch.meshgrid(*[along if d == self.dim else torch.arange(s) for d, s in enumerate(local_shape)],
                               indexing="ij")
        flat = torch.zeros(local_shape, dtype=torch.long)
        for d, g in enumerate(grids):
            flat = flat * full[d] + g
        if self.full is not None:
            flat = torch.where(grids[self.dim] < self.full, flat, torch.full_like(flat, -1))
        return flat.reshape(-1)

    def gather(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        pieces = pieces[:: self.copies]  # one of each piece's copies
        if self.parts == 1:
            out = torch.cat(pieces, self.dim)
        else:
            blocks = [p.chunk(self.parts, self.dim) for p in pieces]
            out = torch.cat([torch.cat([b[j] for b in blocks], self.dim) for j in range(self.parts)], self.dim)
        return out if self.full is None else out.narrow(self.dim, 0, self.full)


@dataclass
class TPModel:
    """The result of `apply_tp_plan`: the (sharded in place) module and how its parameters are split."""

    module: nn.Module
    group: Any
    specs: dict[str, ShardSpec] = field(default_factory=dict)  # state-dict name -> split (absent: replicated)

    def gather_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full state dict (plain model's names and shapes) from this rank's; collective over tp."""
        n = group_size(self.group)
        out: dict[str, torch.Tensor] = {}
        done: dict[tuple, torch.Tensor] = {}  # a tied weight is gathered once
        for name, t in local.items():
            spec = self.specs.get(name)
            if spec is None or n == 1:
                out[name] = t
                continue
            key = (t.data_ptr(), tuple(t.shape), spec)
            if key not in done:
                t = t.contiguous()
                pieces = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(pieces, t, group=self.group)
                done[key] = spec.gather(pieces)
            out[name] = done[key]
        return out


def _pattern(entry: str) -> re.Pattern:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in entry.split(".")) + "$")


def resolve_plan(model: nn.Module, plan: dict[str, Style]) -> list[tuple[str, Style]]:
    """(module name, style) for every module a plan entry matches, in module order (first entry wins)."""
    compiled = [(entry, _pattern(entry), style) for entry, style in plan.items()]
    used: set[str] = set()
    out: list[tuple[str, Style]] = []
    for name, _ in model.named_modules():
        for entry, pat, style in compiled:
            if pat.match(name):
                out.append((name, style))
                used.add(entry)
                break
    missing = [e for e in plan if e not in used]
    if missing:
        raise UserError(f"tp plan entries {missing} match no module of {type(model).__name__}")
    return out


def _check(name: str, module: nn.Module, style: Style, n: int) -> None:
    want = nn.Embedding if isinstance(style, VocabEmbedding) else nn.Linear
    if not isinstance(module, want):
        raise UserError(f"tp plan: {name} is {type(module).__name__}, {type(style).__name__} needs {want.__name__}")
    if isinstance(style, Column):
        pieces, _ = copy_layout(n, style.shards)
        if module.out_features % (style.parts * pieces):
            raise UserError(f"tp plan: {name} has {module.out_features} output features, not divisible by "
                            f"parts ({style.parts}) x {pieces} pieces (tp {n})")
    if isinstance(style, Row) and module.in_features % n:
        raise UserError(f"tp plan: {name} has {module.in_features} input features, not divisible by tp ({n})")


def _parallel_layer(module: nn.Module, style: Style, group, kw: dict, tied: nn.Parameter | None):
    """The parallel layer for a dense one, and the split of its parameters by attribute name."""
    if isinstance(style, Column):
        new = ColumnParallelLinear.from_dense(module, group, parts=style.parts, shards=style.shards, **kw)
        spec = ShardSpec(0, style.parts, copies=new.copies)
        return new, {"weight": spec, "bias": spec}
    if isinstance(style, Row):
        return RowParallelLinear.from_dense(module, group, **kw), {"weight": ShardSpec(1)}
    if isinstance(style, VocabEmbedding):
        new = VocabParallelEmbedding.from_dense(module, group, **kw)
        spec = ShardSpec(0, full=module.num_embeddings)
    else:
        new = VocabParallelHead.from_dense(module, group, weight=tied, **kw)
        spec = ShardSpec(0, full=module.out_features)
    if tied is not None:
        new.weight = tied
    return new, {"weight": spec}


def apply_tp_plan(model: nn.Module, plan: dict[str, Style], group, *, sequence_parallel: bool = False,
                  stats: CommStats | None = None, rng: RNGTracker | None = None) -> TPModel:
    """Shard `model` in place over `group` by `plan`; returns how to gather its full state.

    Parameters not covered by a sharding entry are replicated: their gradient norm counts on tp rank 0
    only. Under sequence parallelism each must belong to a module marked Replicated (their gradients are
    then summed over tp); a parameter the plan does not cover is an error there, since silently it would
    drift apart on the tp ranks. `rng` (None: leave dropout alone) attaches the dropout regions.
    """
    n = group_size(group)
    sequence_parallel = sequence_parallel and n > 1  # nothing to split over one rank
    kw = {"sequence_parallel": sequence_parallel, "stats": stats}
    result = TPModel(model, group)
    converted: dict[int, tuple[nn.Parameter, ShardSpec]] = {}  # id(dense param) -> its shard (ties stay tied)
    covered: set[int] = set()
    for name, style in resolve_plan(model, plan):
        module = model.get_submodule(name)
        if isinstance(style, (Column, Row, VocabEmbedding, VocabHead)):
            _check(name, module, style, n)
            prior = converted.get(id(module.weight))
            new, specs = _parallel_layer(module, style, group, kw, prior[0] if prior else None)
            if prior is not None and prior[1] != specs["weight"]:
                raise UserError(f"tp plan: {name}.weight is tied to a parameter split differently")
            for attr, spec in specs.items():
                old, p = getattr(module, attr, None), getattr(new, attr, None)
                if p is None:
                    continue
                # where the shard sits in the plain tensor: piece rank // copies of n / copies
                p._st_tp_shard = (spec, group_rank(group) // spec.copies, n // spec.copies)
                converted[id(old)] = (p, spec)
                result.specs[f"{name}.{attr}"] = spec
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            covered.update(id(p) for p in new.parameters())
        elif isinstance(style, Replicated):
            for p in module.parameters(recurse=False):  # its own; children have entries of their own
                mark_replicated(p, group, sequence_parallel, stats)
                covered.add(id(p))
            if sequence_parallel and style.seq_dim is not None:
                module.register_forward_hook(lambda m, a, out, d=style.seq_dim: seq_shard(out, group, d))
        elif isinstance(style, Split) and style.enter:
            module.register_forward_pre_hook(enter_hook(group, sequence_parallel, stats))
        dropout = isinstance(style, Split) or any(isinstance(m, nn.Dropout) for m in module.modules())
        if rng is not None and isinstance(style, (Split, Replicated)) and dropout:
            rng.attach(module, "split" if isinstance(style, Split) or sequence_parallel else "shared")
    for pname, p in model.named_parameters():
        if id(p) in covered:
            continue
        if sequence_parallel:
            raise UserError(f"tp plan: parameter {pname} is not covered; under sequence parallelism mark its "
                            "module Replicated() (or split it)")
        mark_replicated(p, group, sequence_parallel, stats)
    return result


# --------------------------------------------------------------------------- the engine pass


def apply_tp(engine, model_cfg: ModelConfig, sequence_parallel: bool, mesh, comm: CommStats) -> None:
    """Shard the engine's GPT over mesh's tp group by `gpt_plan`; set the vocab-parallel loss and the gather of the
    full state. Called by `build_engine` when parallel.tp > 1 (tp_mode 1d)."""
    device = next(engine.module.parameters()).device
    # torch's dropout draws from per-rank streams (RNGTracker); the global implementation needs only offsets
    torch_dropout = model_cfg.dropout > 0 and model_cfg.dropout_impl == "torch"
    rng = RNGTracker(mesh.local_rank("tp"), device) if torch_dropout else None
    tp = apply_tp_plan(engine.module, gpt_plan(model_cfg), mesh.group("tp"), sequence_parallel=sequence_parallel,
                       stats=comm, rng=rng)
    engine.loss_fn = engine.module.lm_head.loss_fn()
    engine.gather_state = tp.gather_state
    if sequence_parallel:  # MoE layers route the tokens of this rank's sequence shard
        from scaletrain.model.moe import moe_modules

        for m in moe_modules(engine.module):
            m.seq_shard = (mesh.local_rank("tp"), mesh.size("tp"))
    place_dropout(engine.module, model_cfg, sequence_parallel, mesh.local_rank("tp"), mesh.size("tp"))


def place_dropout(module: nn.Module, model_cfg: ModelConfig, sequence_parallel: bool, rank: int, n: int) -> None:
    """Where each layout-independent dropout's local tensor sits in the global one under tensor parallelism:
    attention probabilities hold this rank's heads; with sequence parallelism the residual-stream dropouts
    (roles `seq`, `feature`) hold this rank's sequence shard. Other dims are whole on every rank."""
    from scaletrain.model.dropout import GlobalDropout

    for m in module.modules():
        if not isinstance(m, GlobalDropout):
            continue
        if "head" in m.roles:
            local = model_cfg.n_heads // n
            m.offsets[1 + m.roles.index("head")] = (rank * local, model_cfg.n_heads)
        elif sequence_parallel and m.roles == ("seq", "feature"):
            local = model_cfg.seq_len // n
            m.offsets[1] = (rank * local, model_cfg.seq_len)
