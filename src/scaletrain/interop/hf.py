"""Hugging Face Transformers directories <-> scaletrain's GPT: GPT-2 and Llama, by name, with shapes checked.

A scaletrain GPT with learned positions, GELU, LayerNorm and biases is a GPT-2 (Radford et al. 2019); one with
RoPE (arXiv 2104.09864), SwiGLU (arXiv 2002.05202), RMSNorm (arXiv 1910.07467) and no biases is a Llama
(Touvron et al., arXiv 2302.13971). `export_hf` writes `config.json` and `model.safetensors` (fp32) that
`transformers` loads as `GPT2LMHeadModel` / `LlamaForCausalLM`; `read_hf_weights` maps such a directory back to
our parameter names after checking that its config describes the run's model (one-line `UserError` naming the
values otherwise). The mapping (docs/checkpoints.md has the table):

- GPT-2's `Conv1D` layers store weights as (in, out): transposed against our `nn.Linear` (out, in);
  `c_attn` is our fused `qkv` (q, k, v stacked in that order, heads contiguous, as ours).
- Llama stores q, k, v separately (`q_proj` ...) and rotates the halves (i, i + hs/2) of each head where our
  RoPE rotates neighbours (2i, 2i + 1) with the same frequency; the rows of q and k are permuted within each
  head on the way out (and back on the way in), which leaves every attention score unchanged.
- Tied embeddings are written once (HF's convention) and `lm_head.weight` is read from the embedding.

Only safetensors files are read (a `pytorch_model.bin` would need unpickling); a sharded checkpoint
(`model.safetensors.index.json`) is read shard by shard.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from scaletrain.config import ModelConfig
from scaletrain.errors import UserError

ROPE_BASE = 10000.0  # model/gpt.py rope_tables
LLAMA_MLP = (("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.proj", "mlp.down_proj"))


def _require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise UserError("Hugging Face import/export needs the safetensors package: pip install 'scaletrain[hf]'") \
            from None
    return st


def hf_kind(m: ModelConfig) -> str:
    """`gpt2` or `llama`: the Hugging Face architecture that computes what this model computes."""
    have = {"position": m.position, "mlp": m.mlp, "norm": m.norm, "bias": m.bias}
    if m.moe.experts:
        raise UserError(f"model.moe.experts ({m.moe.experts}) > 0: mixture-of-experts models have no GPT-2 or "
                        "Llama equivalent to export to")
    if getattr(m, "reversible", False):
        raise UserError("model.reversible=true: reversible blocks (two half-width streams) have no GPT-2 or Llama "
                        "equivalent")
    for kind, want in (("gpt2", {"position": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True}),
                       ("llama", {"position": "rope", "mlp": "swiglu", "norm": "rmsnorm", "bias": False})):
        if have == want:
            return kind
    raise UserError(f"model.position={m.position}, model.mlp={m.mlp}, model.norm={m.norm}, model.bias={m.bias} is "
                    "neither a GPT-2 (learned, gelu, layernorm, bias true) nor a Llama (rope, swiglu, rmsnorm, bias "
                    "false)")


def hf_config(m: ModelConfig) -> dict[str, Any]:
    """config.json for the model (transformers >= 4.46 reads it)."""
    from scaletrain.config.sizes import ffn_size

    kind = hf_kind(m)
    if kind == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
                "n_positions": m.seq_len, "n_embd": m.d_model, "n_layer": m.n_layers, "n_head": m.n_heads,
                "n_inner": ffn_size(m), "activation_function": "gelu", "layer_norm_epsilon": m.norm_eps,
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
                "scale_attn_weights": True, "tie_word_embeddings": m.tie_embeddings, "bos_token_id": None,
                "eos_token_id": None, "torch_dtype": "float32"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.d_model, "intermediate_size": ffn_size(m), "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads, "head_dim": m.d_model // m.n_heads,
            "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
            "rope_theta": ROPE_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": m.dropout,
            "tie_word_embeddings": m.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "torch_dtype": "float32"}


def _rope_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k: ours rotate (2i, 2i+1) within a head, HF's (i, i + hs/2)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(m: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters by name (plain model names) -> the HF architecture's state dict."""
    kind, C, out = hf_kind(m), m.d_model, {}
    if kind == "gpt2":
        out["transformer.wte.weight"] = state["wte.weight"]
        out["transformer.wpe.weight"] = state["wpe.weight"]
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[f"{q}{theirs}.weight"] = state[f"{p}{ours}.weight"]
                out[f"{q}{theirs}.bias"] = state[f"{p}{ours}.bias"]
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                 ("mlp.proj", "mlp.c_proj")):
                out[f"{q}{theirs}.weight"] = state[f"{p}{ours}.weight"].t()  # Conv1D: (in, out)
                out[f"{q}{theirs}.bias"] = state[f"{p}{ours}.bias"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["ln_f.weight"], state["ln_f.bias"]
    else:
        out["model.embed_tokens.weight"] = state["wte.weight"]
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"model.layers.{i}."
            wq, wk, wv = state[f"{p}attn.qkv.weight"].split(C, 0)
            out[f"{q}self_attn.q_proj.weight"] = _rope_to_hf(wq, m.n_heads)
            out[f"{q}self_attn.k_proj.weight"] = _rope_to_hf(wk, m.n_heads)
            out[f"{q}self_attn.v_proj.weight"] = wv
            out[f"{q}self_attn.o_proj.weight"] = state[f"{p}attn.proj.weight"]
            for ours, theirs in LLAMA_MLP:
                out[f"{q}{theirs}.weight"] = state[f"{p}{ours}.weight"]
            out[f"{q}input_layernorm.weight"] = state[f"{p}ln1.weight"]
            out[f"{q}post_attention_layernorm.weight"] = state[f"{p}ln2.weight"]
        out["model.norm.weight"] = state["ln_f.weight"]
    if not m.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def from_hf(m: ModelConfig, hf: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """The HF architecture's state dict -> our parameters by plain name (shapes checked by the caller)."""
    out: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise UserError(f"the Hugging Face weights have no {name}")
        return hf[name]

    if kind == "gpt2":
        out["wte.weight"] = get("transformer.wte.weight")
        out["wpe.weight"] = get("transformer.wpe.weight")[: m.seq_len]
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[f"{p}{ours}.weight"] = get(f"{q}{theirs}.weight")
                out[f"{p}{ours}.bias"] = get(f"{q}{theirs}.bias")
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                 ("mlp.proj", "mlp.c_proj")):
                out[f"{p}{ours}.weight"] = get(f"{q}{theirs}.weight").t()
                out[f"{p}{ours}.bias"] = get(f"{q}{theirs}.bias")
        out["ln_f.weight"], out["ln_f.bias"] = get("transformer.ln_f.weight"), get("transformer.ln_f.bias")
    else:
        out["wte.weight"] = get("model.embed_tokens.weight")
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"model.layers.{i}."
            out[f"{p}attn.qkv.weight"] = torch.cat([_rope_from_hf(get(f"{q}self_attn.q_proj.weight"), m.n_heads),
                                                   _rope_from_hf(get(f"{q}self_attn.k_proj.weight"), m.n_heads),
                                                   get(f"{q}self_attn.v_proj.weight")], 0)
            out[f"{p}attn.proj.weight"] = get(f"{q}self_attn.o_proj.weight")
            for ours, theirs in LLAMA_MLP:
                out[f"{p}{ours}.weight"] = get(f"{q}{theirs}.weight")
            out[f"{p}ln1.weight"] = get(f"{q}input_layernorm.weight")
            out[f"{p}ln2.weight"] = get(f"{q}post_attention_layernorm.weight")
        out["ln_f.weight"] = get("model.norm.weight")
    if not m.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


# --------------------------------------------------------------------------- files


def export_hf(m: ModelConfig, state: dict[str, torch.Tensor], out: Path) -> str:
    """Write `out/config.json` and `out/model.safetensors` (fp32); returns the architecture name."""
    st = _require_safetensors()
    cfg = hf_config(m)
    tensors = to_hf(m, state)
    st.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return cfg["architectures"][0]


def read_hf_config(directory: Path) -> dict[str, Any]:
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


def check_hf_config(hf: dict[str, Any], m: ModelConfig, where: Path) -> str:
    """The architecture (`gpt2` / `llama`) if the HF config describes the run's model; else UserError naming the
    first differing values (HF's value vs this run's config key)."""
    from scaletrain.config.sizes import ffn_size

    kind = hf.get("model_type")
    if kind not in ("gpt2", "llama"):
        archs = hf.get("architectures")
        raise UserError(f"{where}: model_type {kind!r} (architectures {archs}) is not supported; scaletrain imports "
                        "gpt2 and llama")
    ours = hf_kind(m)  # the run's model must be of that family too
    if ours != kind:
        raise UserError(f"{where} is a {kind} model but this run's model is a {ours} (model.position={m.position}, "
                        f"model.mlp={m.mlp}, model.norm={m.norm}, model.bias={m.bias})")
    if kind == "gpt2":
        checks = [("vocab_size", hf.get("vocab_size"), "model.vocab_size", m.vocab_size),
                  ("n_embd", hf.get("n_embd"), "model.d_model", m.d_model),
                  ("n_layer", hf.get("n_layer"), "model.n_layers", m.n_layers),
                  ("n_head", hf.get("n_head"), "model.n_heads", m.n_heads),
                  ("n_inner", hf.get("n_inner") or 4 * hf.get("n_embd", 0), "model.d_ff", ffn_size(m)),
                  ("activation_function", hf.get("activation_function", "gelu_new"), "GELU (exact)", "gelu"),
                  ("layer_norm_epsilon", hf.get("layer_norm_epsilon", 1e-5), "model.norm_eps", m.norm_eps),
                  ("tie_word_embeddings", hf.get("tie_word_embeddings", True), "model.tie_embeddings",
                   m.tie_embeddings)]
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise UserError(f"{where}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        positions = hf.get("n_positions", 0)
        if not isinstance(positions, int) or positions < m.seq_len:
            raise UserError(f"{where}: n_positions ({positions}) is smaller than model.seq_len ({m.seq_len})")
    else:
        rope = hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", ROPE_BASE))
        checks = [("vocab_size", hf.get("vocab_size"), "model.vocab_size", m.vocab_size),
                  ("hidden_size", hf.get("hidden_size"), "model.d_model", m.d_model),
                  ("num_hidden_layers", hf.get("num_hidden_layers"), "model.n_layers", m.n_layers),
                  ("num_attention_heads", hf.get("num_attention_heads"), "model.n_heads", m.n_heads),
                  ("num_key_value_heads", hf.get("num_key_value_heads", hf.get("num_attention_heads")),
                   "model.n_heads (no grouped-query attention)", m.n_heads),
                  ("intermediate_size", hf.get("intermediate_size"), "model.d_ff", ffn_size(m)),
                  ("hidden_act", hf.get("hidden_act", "silu"), "SwiGLU's activation", "silu"),
                  ("rms_norm_eps", hf.get("rms_norm_eps"), "model.norm_eps", m.norm_eps),
                  ("rope_theta", theta, "the RoPE base", ROPE_BASE),
                  ("tie_word_embeddings", hf.get("tie_word_embeddings", False), "model.tie_embeddings",
                   m.tie_embeddings),
                  ("attention_bias", hf.get("attention_bias", False), "model.bias", m.bias),
                  ("mlp_bias", hf.get("mlp_bias", False), "model.bias", m.bias)]
        head_dim = hf.get("head_dim") or m.d_model // m.n_heads
        if head_dim * m.n_heads != m.d_model:
            raise UserError(f"{where}: head_dim ({head_dim}) x heads ({m.n_heads}) != model.d_model ({m.d_model})")
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise UserError(f"{where}: RoPE scaling {rope.get('rope_type') or hf.get('rope_scaling')} is not supported")
        positions = hf.get("max_position_embeddings", 0)
        if not isinstance(positions, int) or positions < m.seq_len:
            raise UserError(f"{where}: max_position_embeddings ({positions}) is smaller than model.seq_len "
                            f"({m.seq_len})")
    bad = [f"{name} {theirs!r} vs {key} {mine!r}" for name, theirs, key, mine in checks
           if not _same(theirs, mine)]
    if bad:
        raise UserError(f"{where} does not match this run's model: {'; '.join(bad)}")
    return kind


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return a == b


def _weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            raise UserError(f"{index} is not a valid safetensors index") from None
        paths = [directory / f for f in files]
        for p in paths:
            if p.parent != directory or not p.is_file():
                raise UserError(f"{index} names {p.name}, which is not a file in {directory}")
        return paths
    if any(directory.glob("*.bin")):
        raise UserError(f"{directory} has only pickled .bin weights; scaletrain reads safetensors (re-save the model "
                        "with safe_serialization=True)")
    raise UserError(f"{directory} has no model.safetensors")


def read_hf_weights(directory: Path, m: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters by plain name from a HF GPT-2 / Llama directory, after checking its config against `m` and
    every tensor's shape against the model's."""
    st = _require_safetensors()
    directory = Path(directory)
    kind = check_hf_config(read_hf_config(directory), m, directory)
    hf: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        try:
            hf.update(st.load_file(str(path)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
            raise UserError(f"{path} cannot be read as safetensors: {str(e).splitlines()[0][:160]}") from None
    ours = from_hf(m, hf, kind)
    expect = {n: tuple(p.shape) for n, p in _meta_gpt(m).named_parameters()}
    for name, shape in expect.items():
        got = ours.get(name)
        if got is None:
            raise UserError(f"{directory}: no weight maps to {name}")
        if tuple(got.shape) != shape:
            raise UserError(f"{directory}: {name} has shape {tuple(got.shape)}, this run's model needs {shape}")
    return {n: ours[n] for n in expect}  # in their dtype: each rank copies (and converts) only its own shards


def _meta_gpt(m: ModelConfig):
    from scaletrain.model.gpt import GPT

    with torch.device("meta"):
        return GPT(m)
