"""Hugging Face `config.json` <-> the `model.*` keys: which families we read and write, field by field. Torch-free.

Families (docs/checkpoints.md has the table):

- `gpt2` (Radford et al. 2019): learned positions, LayerNorm, biases everywhere, the GELU MLP (`activation_function`
  `gelu`: exact; `gelu_new` / `gelu_pytorch_tanh` / `gelu_fast`: the tanh approximation, `model.activation=gelu_tanh`).
- `llama` (Touvron et al., arXiv 2302.13971) and `mistral` (Jiang et al., arXiv 2310.06825, without sliding-window
  attention): RoPE with its base and `llama3` scaling, RMSNorm, SwiGLU, no biases, grouped-query attention
  (`num_key_value_heads`, arXiv 2305.13245). A Mistral model is a Llama one computation for computation; it is
  written back as `LlamaForCausalLM`.
- `qwen2` (arXiv 2407.10671): a Llama with biases on the query, key and value projections (`model.qkv_bias`).

`hf_model_values` reads a config.json into model values (one-line `UserError` naming the field for what we cannot
represent: sliding windows, other RoPE types, mixture-of-experts checkpoints, a head_dim that is not
hidden_size / num_attention_heads); `apply_hf_model` puts them into a run's config under `train --init-from DIR`,
refusing an explicit `--set model.X` (or YAML value) that contradicts config.json with both values;
`check_hf_config` checks that a directory describes a run's model; `hf_config` writes the config.json of a model.
`tokenizer_dir` is the one place that says whether DIR carries a tokenizer (its files are the data pipeline's).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from scaletrain.config import Config, ModelConfig
from scaletrain.config.sizes import ffn_size, kv_heads
from scaletrain.errors import UserError

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
_ROPE_DEFAULT = 10000.0
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_hf_config(directory: Path) -> dict[str, Any]:
    """DIR/config.json as a dict, or a one-line UserError (not a folder, no config.json, not JSON)."""
    directory = Path(directory)
    path = directory / "config.json"
    if not directory.is_dir():
        raise UserError(f"--init-from {directory} is not a directory")
    try:
        cfg = json.loads(path.read_text())
    except OSError:
        raise UserError(f"--init-from {directory} has no config.json (not a Hugging Face model directory)") from None
    except ValueError:
        raise UserError(f"{path} is not valid JSON") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} is not a JSON object")
    return cfg


def tokenizer_dir(directory: Path) -> Path | None:
    """DIR when it holds a Hugging Face tokenizer's files (what `--init-from DIR` uses when data.tokenizer is not
    set), else None."""
    directory = Path(directory)
    return directory if any((directory / f).is_file() for f in TOKENIZER_FILES) else None


# --------------------------------------------------------------------------- config.json -> model values


@dataclasses.dataclass(frozen=True)
class HFModel:
    family: str
    values: dict[str, tuple[str, Any]]
    """model key (dotted below `model`) -> (the config.json field it comes from, its value)."""
    positions: int
    """The model's positions (n_positions / max_position_embeddings): model.seq_len must not exceed them."""


def _field(hf: dict[str, Any], name: str, where: Path, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = hf.get(name, default)
    if value is None and default is None:
        raise UserError(f"{where}/config.json has no {name}")
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float, (int, float)))
    if not ok:
        raise UserError(f"{where}/config.json: {name} {value!r} is not a {getattr(kind, '__name__', 'number')}")
    return value


def _refuse_if(cond: bool, where: Path, what: str) -> None:
    if cond:
        raise UserError(f"{where}/config.json: {what}")


def _rope(hf: dict[str, Any], where: Path) -> dict[str, tuple[str, Any]]:
    """RoPE base and scaling from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    _refuse_if(not isinstance(params, dict) or not isinstance(legacy, dict), where,
               f"rope_parameters {hf.get('rope_parameters')!r} / rope_scaling {hf.get('rope_scaling')!r} are not "
               "objects")
    thetas = [(k, v) for k, v in (("rope_theta", hf.get("rope_theta")), ("rope_parameters.rope_theta",
                                                                          params.get("rope_theta"))) if v is not None]
    _refuse_if(len(thetas) == 2 and not _same(thetas[0][1], thetas[1][1]), where,
               f"rope_theta {thetas[0][1]!r} and rope_parameters.rope_theta {thetas[-1][1]!r} disagree")
    name, theta = thetas[0] if thetas else ("rope_theta", _ROPE_DEFAULT)
    _refuse_if(not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0, where,
               f"{name} {theta!r} is not a positive number")
    scaling, where_scaling = (legacy, "rope_scaling") if legacy else (params, "rope_parameters")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, tuple[str, Any]] = {"rope_theta": (name, float(theta))}
    for partial in (hf.get("partial_rotary_factor"), scaling.get("partial_rotary_factor")):
        _refuse_if(partial not in (None, 1, 1.0), where, f"partial_rotary_factor {partial!r} is not supported (RoPE on "
                   "whole heads only)")
    if kind == "default":
        out["rope_scaling.type"] = (f"{where_scaling}.rope_type", "none")
        return out
    _refuse_if(kind != "llama3", where, f"{where_scaling}.rope_type {kind!r} is not supported (default or llama3)")
    out["rope_scaling.type"] = (f"{where_scaling}.rope_type", "llama3")
    for key in _LLAMA3:
        value = scaling.get(key)
        _refuse_if(not isinstance(value, (int, float)) or isinstance(value, bool), where,
                   f"{where_scaling}.{key} {value!r} is missing or not a number (rope_type llama3)")
        out[f"rope_scaling.{key}"] = (f"{where_scaling}.{key}", int(value) if key.startswith("original") else
                                      float(value))
    return out


def _gpt2(hf: dict[str, Any], where: Path) -> HFModel:
    act = hf.get("activation_function", "gelu_new")
    _refuse_if(act not in GELU, where, f"activation_function {act!r} is not supported ({', '.join(GELU)})")
    for flag, bad in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
                      ("add_cross_attention", True)):
        _refuse_if(hf.get(flag, not bad) == bad, where, f"{flag} {bad} is not supported")
    n_embd = _field(hf, "n_embd", where, int)
    inner = hf.get("n_inner")
    values = {
        "vocab_size": ("vocab_size", _field(hf, "vocab_size", where, int)),
        "d_model": ("n_embd", n_embd), "n_layers": ("n_layer", _field(hf, "n_layer", where, int)),
        "n_heads": ("n_head", _field(hf, "n_head", where, int)), "n_kv_heads": ("n_head", 0),
        "d_ff": ("n_inner", 0 if inner is None else _field(hf, "n_inner", where, int)),
        "activation": ("activation_function", GELU[act]),
        "norm_eps": ("layer_norm_epsilon", float(_field(hf, "layer_norm_epsilon", where, (int, float), 1e-5))),
        "tie_embeddings": ("tie_word_embeddings", _field(hf, "tie_word_embeddings", where, bool, True)),
        "position": ("model_type", "learned"), "mlp": ("model_type", "gelu"), "norm": ("model_type", "layernorm"),
        "bias": ("model_type", True), "qkv_bias": ("model_type", False),
        "rope_theta": ("model_type", _ROPE_DEFAULT), "rope_scaling.type": ("model_type", "none"),
    }
    return HFModel("gpt2", values, _field(hf, "n_positions", where, int, 1024))


def _llama_like(hf: dict[str, Any], where: Path, family: str) -> HFModel:
    act = hf.get("hidden_act", "silu")
    _refuse_if(act != "silu", where, f"hidden_act {act!r} is not supported (SwiGLU with silu)")
    for moe in ("num_local_experts", "num_experts", "n_routed_experts"):
        _refuse_if(bool(hf.get(moe)), where, f"{moe} {hf.get(moe)!r}: mixture-of-experts checkpoints are not supported")
    if family == "mistral":
        _refuse_if(hf.get("sliding_window") is not None, where,
                   f"sliding_window {hf.get('sliding_window')!r}: sliding-window attention is not supported "
                   "(null only)")
    if family == "qwen2":
        _refuse_if(bool(hf.get("use_sliding_window")), where,
                   "use_sliding_window true: sliding-window attention is not supported")
        kinds = set(hf.get("layer_types") or ["full_attention"])
        _refuse_if(kinds != {"full_attention"}, where, f"layer_types {sorted(kinds)}: only full_attention layers")
    for flag in ("attention_bias", "mlp_bias"):
        _refuse_if(family != "qwen2" and bool(hf.get(flag)), where, f"{flag} true is not supported (model.qkv_bias "
                   "puts biases on q, k and v only, as Qwen2)")
    hidden = _field(hf, "hidden_size", where, int)
    heads = _field(hf, "num_attention_heads", where, int)
    kv = _field(hf, "num_key_value_heads", where, int, heads)
    head_dim = hf.get("head_dim") or (hidden // heads if heads else 0)
    _refuse_if(head_dim * heads != hidden, where, f"head_dim {head_dim} x num_attention_heads {heads} != hidden_size "
               f"{hidden} (scaletrain's heads are hidden_size / num_attention_heads wide)")
    values = {
        "vocab_size": ("vocab_size", _field(hf, "vocab_size", where, int)),
        "d_model": ("hidden_size", hidden),
        "n_layers": ("num_hidden_layers", _field(hf, "num_hidden_layers", where, int)),
        "n_heads": ("num_attention_heads", heads), "n_kv_heads": ("num_key_value_heads", 0 if kv == heads else kv),
        "d_ff": ("intermediate_size", _field(hf, "intermediate_size", where, int)),
        "norm_eps": ("rms_norm_eps", float(_field(hf, "rms_norm_eps", where, (int, float), 1e-6))),
        "tie_embeddings": ("tie_word_embeddings", _field(hf, "tie_word_embeddings", where, bool, False)),
        "position": ("model_type", "rope"), "mlp": ("model_type", "swiglu"), "norm": ("model_type", "rmsnorm"),
        "bias": ("model_type", False), "qkv_bias": ("model_type", family == "qwen2"),
        "activation": ("model_type", "gelu"), **_rope(hf, where),
    }
    return HFModel(family, values, _field(hf, "max_position_embeddings", where, int, 2048))


def hf_model_values(hf: dict[str, Any], where: Path) -> HFModel:
    """The model values a config.json says, with the field each comes from; UserError naming what we cannot
    represent."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"{where}: model_type {family!r} (architectures {hf.get('architectures')}) is not supported; "
                        f"scaletrain imports {', '.join(FAMILIES)}")
    return _gpt2(hf, where) if family == "gpt2" else _llama_like(hf, where, family)


# --------------------------------------------------------------------------- into a run's config


def _get(m: ModelConfig, key: str) -> Any:
    node: Any = m
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _put(m: ModelConfig, key: str, value: Any) -> None:
    *path, last = key.split(".")
    node: Any = m
    for part in path:
        node = getattr(node, part)
    setattr(node, last, value)


def _effective(m: ModelConfig, key: str) -> Any:
    """A key's meaning rather than its spelling: d_ff 0 is the MLP's default width, n_kv_heads 0 is n_heads."""
    if key == "d_ff":
        return ffn_size(m)
    if key == "n_kv_heads":
        return kv_heads(m)
    return _get(m, key)


def apply_hf_model(cfg: Config, explicit: set[str], directory: Path) -> None:
    """`train --init-from DIR`: the model values of DIR/config.json into `cfg.model`. A key in `explicit` (set by
    the YAML file or --set) must agree with config.json (UserError naming both values); model.seq_len stays a
    training choice, at most the model's positions (by default the smaller of the two)."""
    directory = Path(directory)
    if "model.preset" in explicit and cfg.model.preset:
        raise UserError(f"model.preset={cfg.model.preset} with --init-from {directory}: the model is the one "
                        f"{directory}/config.json describes")
    hf = hf_model_values(read_hf_config(directory), directory)
    wanted = dataclasses.replace(cfg.model, rope_scaling=dataclasses.replace(cfg.model.rope_scaling))
    for key, (_, value) in hf.values.items():
        _put(wanted, key, value)
    clash = [f"{name} {value!r} but model.{key}={_get(cfg.model, key)} is set"
             for key, (name, value) in hf.values.items()
             if f"model.{key}" in explicit and not _same(_effective(cfg.model, key), _effective(wanted, key))]
    if clash:
        raise UserError(f"--init-from {directory}: config.json has {'; '.join(clash)} (leave the model keys out to "
                        "take config.json's)")
    if "model.seq_len" in explicit and cfg.model.seq_len > hf.positions:
        raise UserError(f"model.seq_len ({cfg.model.seq_len}) is above the {hf.positions} positions of "
                        f"{directory}/config.json")
    for key, (_, value) in hf.values.items():
        _put(cfg.model, key, value)
    if "model.seq_len" not in explicit:
        cfg.model.seq_len = min(cfg.model.seq_len, hf.positions)


def check_hf_config(hf: dict[str, Any], m: ModelConfig, where: Path) -> str:
    """The family if the config.json describes the run's model (`m`); else UserError naming the first differing
    values (config.json's field and value against the run's key and value)."""
    parsed = hf_model_values(hf, where)
    bad = [f"{name} {value!r} vs model.{key} {_get(m, key)!r}" for key, (name, value) in parsed.values.items()
           if not _same(_effective(_with(m, key, value), key), _effective(m, key))]
    if bad:
        raise UserError(f"{where} does not match this run's model: {'; '.join(bad)}")
    if parsed.positions < m.seq_len:
        raise UserError(f"{where}: its {parsed.positions} positions are fewer than model.seq_len ({m.seq_len})")
    if getattr(m, "reversible", False) or m.moe.experts:
        hf_family(m)  # raises with the reason
    return parsed.family


def _with(m: ModelConfig, key: str, value: Any) -> ModelConfig:
    out = dataclasses.replace(m, rope_scaling=dataclasses.replace(m.rope_scaling))
    _put(out, key, value)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return a == b


# --------------------------------------------------------------------------- model -> config.json


def hf_family(m: ModelConfig) -> str:
    """`gpt2`, `llama` or `qwen2`: the Hugging Face architecture that computes what this model computes; UserError
    naming the values otherwise."""
    if getattr(m, "share_blocks", False):
        raise UserError("model.share_blocks=true: GPT-2, Llama and Qwen2 have one set of weights per layer, none "
                        "shares a block's attention and MLP across layers (a copy per layer is a different model)")
    if m.moe.experts:
        raise UserError(f"model.moe.experts ({m.moe.experts}) > 0: mixture-of-experts models have no GPT-2, Llama or "
                        "Qwen2 equivalent to export to")
    if getattr(m, "reversible", False):
        raise UserError("model.reversible=true: reversible blocks (two half-width streams) have no GPT-2, Llama or "
                        "Qwen2 equivalent")
    have = (m.position, m.mlp, m.norm, m.bias)
    if have == ("learned", "gelu", "layernorm", True):
        if kv_heads(m) != m.n_heads:
            raise UserError(f"model.n_kv_heads ({m.n_kv_heads}) with a GPT-2-shaped model: GPT-2 has no grouped-query "
                            "attention")
        return "gpt2"
    if have == ("rope", "swiglu", "rmsnorm", False) and m.activation == "gelu":
        return "qwen2" if m.qkv_bias else "llama"
    raise UserError(f"model.position={m.position}, model.mlp={m.mlp}, model.norm={m.norm}, model.bias={m.bias} is "
                    "neither a GPT-2 (learned, gelu, layernorm, bias true) nor a Llama / Qwen2 (rope, swiglu, rmsnorm, "
                    "bias false)")


def _rope_fields(m: ModelConfig) -> dict[str, Any]:
    """RoPE as transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`) read it, both written."""
    r = m.rope_scaling
    scaling = None if r.type == "none" else {"rope_type": "llama3", **{k: getattr(r, k) for k in _LLAMA3}}
    params = {"rope_type": "default" if scaling is None else "llama3", "rope_theta": m.rope_theta, **(scaling or {})}
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def hf_config(m: ModelConfig) -> dict[str, Any]:
    """config.json for the model (transformers >= 4.46 reads it)."""
    family = hf_family(m)
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
                "n_positions": m.seq_len, "n_embd": m.d_model, "n_layer": m.n_layers, "n_head": m.n_heads,
                "n_inner": ffn_size(m), "activation_function": "gelu_new" if m.activation == "gelu_tanh" else "gelu",
                "layer_norm_epsilon": m.norm_eps, "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
                "attn_pdrop": m.dropout, "scale_attn_weights": True, "tie_word_embeddings": m.tie_embeddings,
                "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    positions = m.seq_len
    if m.rope_scaling.type == "llama3":  # transformers wants the scaled model's positions above the original ones
        positions = max(positions, m.rope_scaling.original_max_position_embeddings + 1)
    out = {"architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"], "model_type": family,
           "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": ffn_size(m),
           "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": kv_heads(m),
           "head_dim": m.d_model // m.n_heads, "hidden_act": "silu", "max_position_embeddings": positions,
           "rms_norm_eps": m.norm_eps, **_rope_fields(m), "attention_dropout": m.dropout,
           "tie_word_embeddings": m.tie_embeddings, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
           "torch_dtype": "float32"}
    if family == "llama":
        out |= {"attention_bias": False, "mlp_bias": False}
    else:
        out |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layers,
                "layer_types": ["full_attention"] * m.n_layers}
    return out
