"""Model catalog: the dimensions of well-known transformer language models, each with its source.

`ModelSpec` is the planner's description of a decoder-only transformer: enough to count parameters
exactly, FLOPs and activation bytes. It covers our own GPT (`scaletrain.model.gpt`), GPT-2/3,
Megatron-LM's scaling series, Llama 2/3 (RMSNorm, SwiGLU, grouped-query attention, untied head) and a
mixture-of-experts example.

The models and their sources are the presets of `config/presets.py` (the table `model.preset=NAME` reads, so
`plan --model NAME` plans the model `train --set model.preset=NAME` trains), turned into specs by
`from_model_config`; mixture-of-experts presets are planned dropless (capacity factor x k slots per token).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.config.presets import ALIASES, PRESETS, preset_model
from scaletrain.config.schema import MLPS, or_list
from scaletrain.config.sizes import experts_per_token
from scaletrain.errors import UserError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    d_ff: int = 0
    """MLP hidden size; 0 = 4*d_model (gelu) or LLaMA's 8/3*d_model rounded up to 64 (swiglu)."""
    mlp: str = "gelu"
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 = n_heads."""
    position: str = "learned"
    """`learned` (a seq_len x d_model table) or `rope` (no parameters)."""
    tie_embeddings: bool = True
    bias: bool = True
    """Biases in linear layers and norms (LayerNorm weight+bias; without bias one weight vector)."""
    qkv_bias: bool = False
    """Biases on the query/key/value projections only (Qwen2) in a bias-free model."""
    n_experts: int = 0
    """Mixture-of-experts: experts per MoE layer (0 = dense). Expert MLPs are bias-free (ours, Switch,
    Mixtral) and stacked per layer; the router is Linear(d_model, n_experts) without bias."""
    top_k: int = 1
    """Experts per token (1 for Switch; the expected experts per token c of expert choice; top_k² of the
    hierarchical MoE)."""
    expert_groups: int = 1
    """Two-level hierarchical MoE (arXiv 1701.06538 appendix B; our `model.moe.groups`) when > 1: the routers are
    a primary Linear(d_model, groups) and the groups' secondary gates, Linear(d_model, n_experts) stacked."""
    moe_every: int = 1
    """Every `moe_every`-th block is an MoE block (blocks every-1, 2 every-1, ...; GShard: 2)."""
    capacity_factor: float = 1.0
    """Expert capacity slots per routed token-choice: the experts compute capacity_factor x top_k slots
    per token, full or empty (1.0: no padding, as a dropless implementation)."""
    group_tokens: int = 0
    """Tokens per dispatch group (our `model.moe.group_tokens`): the capacity is then rounded up per group
    exactly as the engine does; 0 uses capacity_factor x top_k unrounded."""
    dropout: bool = False
    """Dropout masks are stored for backward (Korthikanti's 34 sbh counts them)."""
    reversible: bool = False
    """Reversible blocks (RevNet arXiv 1707.04585, Reformer arXiv 2001.04451; our `model.reversible`): attention
    and MLP of width d_model / 2 on the two halves of the stream, nothing stored per layer, each layer's forward
    run again in backward."""
    share_blocks: bool = False
    """Every block uses block 0's attention and MLP weights, each keeps its norms (WideNet arXiv 2107.11817; our
    `model.share_blocks`): total_params counts the shared weights once; compute is per layer as without."""
    source: str = ""

    def __hash__(self) -> int:  # the cost model caches per model: hash the fields once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def width(self) -> int:
        """Width of the blocks' attention and MLP: d_model, or d_model / 2 with reversible blocks."""
        return self.d_model // 2 if self.reversible else self.d_model

    @property
    def ffn(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            return 64 * math.ceil(8 * self.width / 3 / 64)
        return 4 * self.width

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.width // self.n_heads

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every if self.n_experts else 0

    @property
    def expert_slots_per_token(self) -> float:
        """Expert MLP rows computed per token of an MoE layer: E x K / S with K = ceil(factor x k x S / E)
        slots per expert and group of S tokens (empty slots are computed too), or factor x k."""
        if not self.n_experts:
            return 1.0
        if self.group_tokens:
            from scaletrain.config.sizes import capacity

            S = self.group_tokens
            return self.n_experts * capacity(S, self.n_experts, self.top_k, self.capacity_factor) / S
        return self.capacity_factor * self.top_k

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["d_ff"] = self.ffn
        return d


def check_model(m: ModelSpec) -> ModelSpec:
    """Raise UserError naming the bad value."""
    for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len"):
        if getattr(m, name) <= 0:
            raise UserError(f"model {name} must be positive, got {getattr(m, name)}")
    if m.reversible and m.d_model % 2:
        raise UserError(f"reversible blocks split the hidden size ({m.d_model}) in two halves: it must be even")
    if m.width % m.n_heads:
        raise UserError(f"hidden size ({m.width}) is not divisible by heads ({m.n_heads})")
    if m.n_heads % m.kv_heads:
        raise UserError(f"heads ({m.n_heads}) is not divisible by kv heads ({m.kv_heads})")
    if m.mlp not in MLPS:
        raise UserError(f"mlp must be {or_list(MLPS)}, got {m.mlp!r}")
    if m.n_experts < 0 or (m.n_experts and not 1 <= m.top_k <= m.n_experts):
        raise UserError(f"top-k ({m.top_k}) must be in 1..experts ({m.n_experts})")
    if m.n_experts and not (m.capacity_factor > 0 and 1 <= m.moe_every <= m.n_layers):
        raise UserError(f"capacity factor ({m.capacity_factor}) must be > 0 and moe every ({m.moe_every}) in"
                        f" 1..layers ({m.n_layers})")
    return m


def _catalog() -> dict[str, ModelSpec]:
    """The catalog: one ModelSpec per preset of config/presets.py (the same table `model.preset` reads)."""
    out = {}
    for name, preset in PRESETS.items():
        spec = from_model_config(preset_model(name), name)
        if spec.n_experts:  # planned dropless (capacity factor x k slots per token, unrounded)
            spec = dataclasses.replace(spec, group_tokens=0)
        out[name] = dataclasses.replace(spec, source=preset.source)
    return out


def get_model(name: str) -> ModelSpec:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise UserError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[key]


def with_seq_len(m: ModelSpec, seq_len: int | None) -> ModelSpec:
    """The same model trained at another context length (learned position tables resize with it)."""
    if seq_len is None or seq_len == m.seq_len:
        return m
    if seq_len <= 0:
        raise UserError(f"--seq-len must be positive, got {seq_len}")
    return dataclasses.replace(m, seq_len=seq_len)


def from_model_config(mc, name: str = "config") -> ModelSpec:
    """The ModelSpec of a scaletrain `ModelConfig` (scaletrain.model.gpt builds exactly this)."""
    return check_model(ModelSpec(
        name=name, n_layers=mc.n_layers, d_model=mc.d_model, n_heads=mc.n_heads, vocab_size=mc.vocab_size,
        seq_len=mc.seq_len, d_ff=mc.d_ff, mlp=mc.mlp, position=mc.position, tie_embeddings=mc.tie_embeddings,
        bias=mc.bias, dropout=mc.dropout > 0, n_experts=mc.moe.experts,
        top_k=experts_per_token(mc.moe) if mc.moe.experts else 1,
        expert_groups=getattr(mc.moe, "groups", 1) if mc.moe.experts else 1,
        # a dense model carries the spec's neutral MoE values (the config's unused model.moe.* defaults plan nothing)
        **(dict(moe_every=mc.moe.every, capacity_factor=mc.moe.capacity_factor, group_tokens=mc.moe.group_tokens)
           if mc.moe.experts else {}),
        reversible=getattr(mc, "reversible", False), n_kv_heads=getattr(mc, "n_kv_heads", 0),
        qkv_bias=getattr(mc, "qkv_bias", False), share_blocks=getattr(mc, "share_blocks", False),
    ))


MODELS: dict[str, ModelSpec] = _catalog()
