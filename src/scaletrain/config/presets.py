"""Model presets: the shapes of well-known language models as values of the `model.*` keys, each with its source.

`model.preset=NAME` fills the model keys from the preset NAME, under the ones the YAML file or `--set` give
(`apply_preset`, called by `config/load.py`); the planner's catalog (`plan/catalog.py`) builds its models from the
same table, so `scaletrain plan --model NAME` and `scaletrain train --set model.preset=NAME` describe one model.
Torch-free and at the bottom of the house, like the rest of config/.

Sources:
- GPT-2: Radford et al. 2019 (sizes as released: 124M, 355M, 774M, 1.5B; the tanh GELU and the 0.1 dropouts of the
  released checkpoints).
- GPT-3: Brown et al., arXiv 2005.14165, Table 2.1 (vocab 50257, context 2048). Two rows of that table are
  internally inconsistent (1.3B: 24 heads of 128 for d_model 2048; 13B: d_model 5140); we use 16 heads and d_model
  5120 so that heads divide d_model.
- Megatron-LM scaling series: Narayanan et al., arXiv 2104.04473, Table 1 (vocab 51200, seq 2048).
- Korthikanti et al., arXiv 2205.05198, Table 3 (22B).
- Llama 2: Touvron et al., arXiv 2307.09288; Llama 3: Grattafiori et al., arXiv 2407.21783, Table 3 (RoPE base
  500000, pre-training context 8192 without RoPE scaling).
- Mixtral 8x7B: Jiang et al., arXiv 2401.04088, Table 1 (RoPE base 1e6; top-2 of 8 experts, dropless: capacity
  factor 1, which with 2 choices of 8 experts and 64-token groups gives exactly 2 slots per token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from scaletrain.config.schema import ModelConfig
from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    values: dict[str, Any]
    """model.* values (dotted below `model`, e.g. `moe.experts`); every other model key keeps its default."""
    source: str


def _gpt2(layers: int, d: int, heads: int) -> Preset:
    return Preset(dict(n_layers=layers, d_model=d, n_heads=heads, vocab_size=50257, seq_len=1024,
                       activation="gelu_tanh", dropout=0.1), "Radford et al. 2019")


def _gpt3(layers: int, d: int, heads: int) -> Preset:
    return Preset(dict(n_layers=layers, d_model=d, n_heads=heads, vocab_size=50257, seq_len=2048, dropout=0.1),
                  "Brown et al., arXiv 2005.14165, Table 2.1")


def _megatron(heads: int, d: int, layers: int, source: str = "Narayanan et al., arXiv 2104.04473, Table 1") -> Preset:
    return Preset(dict(n_layers=layers, d_model=d, n_heads=heads, vocab_size=51200, seq_len=2048, dropout=0.1),
                  source)


_LLAMA = dict(mlp="swiglu", position="rope", norm="rmsnorm", tie_embeddings=False, bias=False)


def _llama(layers: int, d: int, heads: int, vocab: int, seq: int, ff: int, source: str, kv: int = 0,
           theta: float = 10000.0, **more: Any) -> Preset:
    return Preset(dict(n_layers=layers, d_model=d, n_heads=heads, n_kv_heads=kv, vocab_size=vocab, seq_len=seq,
                       d_ff=ff, rope_theta=theta, **_LLAMA, **more), source)


PRESETS: dict[str, Preset] = {
    "gpt2": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
    "megatron-1.7b": _megatron(24, 2304, 24),
    "megatron-3.6b": _megatron(32, 3072, 30),
    "megatron-7.5b": _megatron(32, 4096, 36),
    "megatron-18b": _megatron(48, 6144, 40),
    "megatron-39b": _megatron(64, 8192, 48),
    "megatron-76b": _megatron(80, 10240, 60),
    "megatron-146b": _megatron(96, 12288, 80),
    "megatron-310b": _megatron(128, 16384, 96),
    "megatron-530b": _megatron(128, 20480, 105),
    "megatron-1t": _megatron(160, 25600, 128),
    "megatron-22b": _megatron(64, 6144, 48, "Korthikanti et al., arXiv 2205.05198, Table 3"),
    "llama2-7b": _llama(32, 4096, 32, 32000, 4096, 11008, "arXiv 2307.09288"),
    "llama2-13b": _llama(40, 5120, 40, 32000, 4096, 13824, "arXiv 2307.09288"),
    "llama2-70b": _llama(80, 8192, 64, 32000, 4096, 28672, "arXiv 2307.09288", kv=8),
    "llama3-8b": _llama(32, 4096, 32, 128256, 8192, 14336, "arXiv 2407.21783, Table 3", kv=8, theta=500000.0),
    "llama3-70b": _llama(80, 8192, 64, 128256, 8192, 28672, "arXiv 2407.21783, Table 3", kv=8, theta=500000.0),
    "llama3-405b": _llama(126, 16384, 128, 128256, 8192, 53248, "arXiv 2407.21783, Table 3", kv=8, theta=500000.0),
    "mixtral-8x7b": _llama(32, 4096, 32, 32000, 4096, 14336, "Jiang et al., arXiv 2401.04088, Table 1", kv=8,
                           theta=1e6, **{"moe.experts": 8, "moe.top_k": 2, "moe.router": "topk",
                                         "moe.capacity_factor": 1.0}),
}
ALIASES = {"gpt2-small": "gpt2", "gpt3": "gpt3-175b", "mt-nlg-530b": "megatron-530b"}


def preset_name(name: str) -> str:
    """The catalog name of a preset (aliases and case resolved); ConfigError listing the known ones otherwise."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ConfigError(f"model.preset: unknown model {name!r} (known: {', '.join(PRESETS)})")
    return key


def _set(model: ModelConfig, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    node = model
    for part in path:
        node = getattr(node, part)
    setattr(node, last, value)


def apply_preset(model: ModelConfig, explicit: set[str]) -> None:
    """Fill `model` from the preset it names (model.preset), except the keys in `explicit` (dotted, `model.d_ff`):
    every model key the preset does not list goes back to its default unless it is explicit."""
    if not model.preset:
        return
    defaults = preset_model(model.preset)
    model.preset = defaults.preset  # the catalog's name (aliases resolved)
    for f in dataclasses.fields(ModelConfig):
        if f.name == "preset":
            continue
        if dataclasses.is_dataclass(getattr(defaults, f.name)):
            for sub in dataclasses.fields(getattr(defaults, f.name)):
                key = f"{f.name}.{sub.name}"
                if f"model.{key}" not in explicit:
                    _set(model, key, getattr(getattr(defaults, f.name), sub.name))
        elif f"model.{f.name}" not in explicit:
            setattr(model, f.name, getattr(defaults, f.name))


def preset_model(name: str) -> ModelConfig:
    """The ModelConfig of preset `name` alone (every other key at its default)."""
    key = preset_name(name)
    model = ModelConfig(preset=key)
    for dotted, value in PRESETS[key].values.items():
        _set(model, dotted, value)
    return model
