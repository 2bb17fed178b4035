"""Model catalog: the dimensions of well-known transformer language models, each with its source.

`ModelSpec` is the planner's description of a decoder-only transformer: enough to count parameters
exactly, FLOPs and activation bytes. It covers our own GPT (`scaletrain.model.gpt`), GPT-2/3,
Megatron-LM's scaling series, Llama 2/3 (RMSNorm, SwiGLU, grouped-query attention, untied head) and a
mixture-of-experts example.

Sources:
- GPT-2: Radford et al. 2019 (sizes as released: 124M, 355M, 774M, 1.5B).
- GPT-3: Brown et al., arXiv 2005.14165, Table 2.1 (vocab 50257, context 2048). Two rows of that table
  are internally inconsistent (1.3B: 24 heads of 128 for d_model 2048; 13B: d_model 5140); we use 16
  heads and d_model 5120 so that heads divide d_model.
- Megatron-LM scaling series: Narayanan et al., arXiv 2104.04473, Table 1 (vocab 51200, seq 2048).
- Korthikanti et al., arXiv 2205.05198, Table 3 (22B).
- Llama 2: Touvron et al., arXiv 2307.09288; Llama 3: Grattafiori et al., arXiv 2407.21783, Table 3.
- Mixtral 8x7B: Jiang et al., arXiv 2401.04088, Table 1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.config.schema import MLPS, or_list
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
    n_experts: int = 0
    """Mixture-of-experts: experts per MoE layer (0 = dense). Expert MLPs are bias-free (ours, Switch,
    Mixtral) and stacked per layer; the router is Linear(d_model, n_experts) without bias."""
    top_k: int = 1
    """Experts per token (1 for Switch; the expected experts per token c of expert choice)."""
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


def _gpt3(name: str, layers: int, d: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers, d, heads, 50257, 2048, dropout=True,
                     source="Brown et al., arXiv 2005.14165, Table 2.1")


def _megatron(name: str, heads: int, d: int, layers: int) -> ModelSpec:
    return ModelSpec(name, layers, d, heads, 51200, 2048, dropout=True,
                     source="Narayanan et al., arXiv 2104.04473, Table 1")


_LLAMA = dict(mlp="swiglu", position="rope", tie_embeddings=False, bias=False)

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("gpt2", 12, 768, 12, 50257, 1024, dropout=True, source="Radford et al. 2019"),
        ModelSpec("gpt2-medium", 24, 1024, 16, 50257, 1024, dropout=True, source="Radford et al. 2019"),
        ModelSpec("gpt2-large", 36, 1280, 20, 50257, 1024, dropout=True, source="Radford et al. 2019"),
        ModelSpec("gpt2-xl", 48, 1600, 25, 50257, 1024, dropout=True, source="Radford et al. 2019"),
        _gpt3("gpt3-125m", 12, 768, 12),
        _gpt3("gpt3-350m", 24, 1024, 16),
        _gpt3("gpt3-760m", 24, 1536, 16),
        _gpt3("gpt3-1.3b", 24, 2048, 16),
        _gpt3("gpt3-2.7b", 32, 2560, 32),
        _gpt3("gpt3-6.7b", 32, 4096, 32),
        _gpt3("gpt3-13b", 40, 5120, 40),
        _gpt3("gpt3-175b", 96, 12288, 96),
        _megatron("megatron-1.7b", 24, 2304, 24),
        _megatron("megatron-3.6b", 32, 3072, 30),
        _megatron("megatron-7.5b", 32, 4096, 36),
        _megatron("megatron-18b", 48, 6144, 40),
        _megatron("megatron-39b", 64, 8192, 48),
        _megatron("megatron-76b", 80, 10240, 60),
        _megatron("megatron-146b", 96, 12288, 80),
        _megatron("megatron-310b", 128, 16384, 96),
        _megatron("megatron-530b", 128, 20480, 105),
        _megatron("megatron-1t", 160, 25600, 128),
        ModelSpec("megatron-22b", 48, 6144, 64, 51200, 2048, dropout=True,
                  source="Korthikanti et al., arXiv 2205.05198, Table 3"),
        ModelSpec("llama2-7b", 32, 4096, 32, 32000, 4096, d_ff=11008, source="arXiv 2307.09288", **_LLAMA),
        ModelSpec("llama2-13b", 40, 5120, 40, 32000, 4096, d_ff=13824, source="arXiv 2307.09288", **_LLAMA),
        ModelSpec("llama2-70b", 80, 8192, 64, 32000, 4096, d_ff=28672, n_kv_heads=8,
                  source="arXiv 2307.09288", **_LLAMA),
        ModelSpec("llama3-8b", 32, 4096, 32, 128256, 8192, d_ff=14336, n_kv_heads=8,
                  source="arXiv 2407.21783, Table 3", **_LLAMA),
        ModelSpec("llama3-70b", 80, 8192, 64, 128256, 8192, d_ff=28672, n_kv_heads=8,
                  source="arXiv 2407.21783, Table 3", **_LLAMA),
        ModelSpec("llama3-405b", 126, 16384, 128, 128256, 8192, d_ff=53248, n_kv_heads=8,
                  source="arXiv 2407.21783, Table 3", **_LLAMA),
        ModelSpec("mixtral-8x7b", 32, 4096, 32, 32000, 4096, d_ff=14336, n_kv_heads=8, n_experts=8,
                  top_k=2, source="Jiang et al., arXiv 2401.04088, Table 1", **_LLAMA),
    )
}
ALIASES = {"gpt2-small": "gpt2", "gpt3": "gpt3-175b", "mt-nlg-530b": "megatron-530b"}


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
        top_k=(1 if mc.moe.router == "switch" else mc.moe.top_k) if mc.moe.experts else 1,
        moe_every=mc.moe.every, capacity_factor=mc.moe.capacity_factor, group_tokens=mc.moe.group_tokens,
        reversible=getattr(mc, "reversible", False),
    ))
