"""Hugging Face Transformers directories <-> scaletrain's GPT: the weights of the GPT-2, Llama / Mistral and Qwen2
families, by name, with shapes checked (the config.json side is interop/hf_config.py).

A scaletrain GPT with learned positions, GELU (exact or tanh), LayerNorm and biases is a GPT-2 (Radford et al. 2019);
one with RoPE (arXiv 2104.09864, any base, Llama 3 scaling), SwiGLU (arXiv 2002.05202), RMSNorm (arXiv 1910.07467), no
biases and any number of key/value heads (grouped-query attention, arXiv 2305.13245) is a Llama (Touvron et al.,
arXiv 2302.13971; a Mistral without sliding window reads the same), and with biases on q, k and v a Qwen2 (arXiv
2407.10671). `export_hf` writes `config.json` and `model.safetensors` (fp32) that `transformers` loads as
`GPT2LMHeadModel` / `LlamaForCausalLM` / `Qwen2ForCausalLM`, plus the files the run's data pipeline hands it (its
tokenizer); `read_hf_weights` maps such a directory back to our parameter names after checking that its config
describes the run's model (one-line `UserError` naming the values otherwise). The mapping (docs/checkpoints.md has the
table):

- GPT-2's `Conv1D` layers store weights as (in, out): transposed against our `nn.Linear` (out, in);
  `c_attn` is our fused `qkv` (q, k, v stacked in that order, heads contiguous, as ours).
- Llama stores q, k, v separately (`q_proj` ...); ours are one fused `qkv` (multi-head attention) or `q` and a fused
  `kv` (k then v, grouped-query attention). Llama rotates the halves (i, i + hs/2) of each head where our RoPE rotates
  neighbours (2i, 2i + 1) with the same frequency; the rows of q and k (weights and Qwen2's biases) are permuted
  within each head on the way out (and back on the way in), which leaves every attention score unchanged.
- Tied embeddings are written once (HF's convention) and `lm_head.weight` is read from the embedding.

Only safetensors files are read (a `pytorch_model.bin` would need unpickling); a sharded checkpoint
(`model.safetensors.index.json`) is read shard by shard.
"""

from __future__ import annotations

import json
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

import torch

from scaletrain.config import ModelConfig
from scaletrain.config.sizes import is_gqa, kv_heads
from scaletrain.errors import UserError
from scaletrain.interop.hf_config import check_hf_config, hf_config, hf_family, read_hf_config

LLAMA_MLP = (("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.proj", "mlp.down_proj"))
GPT2_LINEAR = (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
               ("mlp.proj", "mlp.c_proj"))


def _require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise UserError("Hugging Face import/export needs the safetensors package: pip install 'scaletrain[hf]'") \
            from None
    return st


def _rope_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k (a weight, or a bias): ours rotate (2i, 2i+1) within a head, HF's (i, i + hs/2)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rope_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _split_attention(m: ModelConfig, state: dict[str, torch.Tensor], p: str, kind: str) -> list[torch.Tensor]:
    """q, k, v of block prefix `p` (weights, or biases with kind="bias"), from `qkv` or from `q` and `kv`."""
    kv = kv_heads(m) * (m.d_model // m.n_heads)
    if not is_gqa(m):
        return list(state[f"{p}attn.qkv.{kind}"].split(m.d_model, 0))
    return [state[f"{p}attn.q.{kind}"], *state[f"{p}attn.kv.{kind}"].split(kv, 0)]


def _join_attention(m: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: str,
                    kind: str) -> dict[str, torch.Tensor]:
    if not is_gqa(m):
        return {f"{p}attn.qkv.{kind}": _cat([q, k, v], p, kind)}
    return {f"{p}attn.q.{kind}": q, f"{p}attn.kv.{kind}": _cat([k, v], p, kind)}


def _cat(parts: list[torch.Tensor], p: str, kind: str) -> torch.Tensor:
    """q, k, v (or k, v) stacked along the rows, after checking that their other dimensions agree."""
    if len({tuple(t.shape[1:]) for t in parts}) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in parts)
        raise UserError(f"the Hugging Face q/k/v projections of {p.rstrip('.')} ({kind}) have shapes {shapes}, which "
                        "do not stack")
    return torch.cat(parts, 0)


def to_hf(m: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters by name (plain model names) -> the HF architecture's state dict."""
    family, out = hf_family(m), {}
    if family == "gpt2":
        out["transformer.wte.weight"] = state["wte.weight"]
        out["transformer.wpe.weight"] = state["wpe.weight"]
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[f"{q}{theirs}.weight"] = state[f"{p}{ours}.weight"]
                out[f"{q}{theirs}.bias"] = state[f"{p}{ours}.bias"]
            for ours, theirs in GPT2_LINEAR:
                out[f"{q}{theirs}.weight"] = state[f"{p}{ours}.weight"].t()  # Conv1D: (in, out)
                out[f"{q}{theirs}.bias"] = state[f"{p}{ours}.bias"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["ln_f.weight"], state["ln_f.bias"]
    else:
        heads = (m.n_heads, kv_heads(m), None)  # q and k are permuted per head, v is not rotated
        out["model.embed_tokens.weight"] = state["wte.weight"]
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"model.layers.{i}."
            for kind in ("weight", "bias") if m.qkv_bias else ("weight",):
                for name, w, h in zip(("q_proj", "k_proj", "v_proj"), _split_attention(m, state, p, kind), heads):
                    out[f"{q}self_attn.{name}.{kind}"] = w if h is None else _rope_to_hf(w, h)
            out[f"{q}self_attn.o_proj.weight"] = state[f"{p}attn.proj.weight"]
            for ours, theirs in LLAMA_MLP:
                out[f"{q}{theirs}.weight"] = state[f"{p}{ours}.weight"]
            out[f"{q}input_layernorm.weight"] = state[f"{p}ln1.weight"]
            out[f"{q}post_attention_layernorm.weight"] = state[f"{p}ln2.weight"]
        out["model.norm.weight"] = state["ln_f.weight"]
    if not m.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def from_hf(m: ModelConfig, hf: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The HF architecture's state dict -> our parameters by plain name (shapes checked by the caller)."""
    out: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise UserError(f"the Hugging Face weights have no {name}")
        return hf[name]

    if family == "gpt2":
        out["wte.weight"] = get("transformer.wte.weight")
        out["wpe.weight"] = get("transformer.wpe.weight")[: m.seq_len]
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[f"{p}{ours}.weight"] = get(f"{q}{theirs}.weight")
                out[f"{p}{ours}.bias"] = get(f"{q}{theirs}.bias")
            for ours, theirs in GPT2_LINEAR:
                out[f"{p}{ours}.weight"] = _transposed(get(f"{q}{theirs}.weight"), f"{q}{theirs}.weight")
                out[f"{p}{ours}.bias"] = get(f"{q}{theirs}.bias")
        out["ln_f.weight"], out["ln_f.bias"] = get("transformer.ln_f.weight"), get("transformer.ln_f.bias")
    else:
        out["wte.weight"] = get("model.embed_tokens.weight")
        heads = (m.n_heads, kv_heads(m), None)
        for i in range(m.n_layers):
            p, q = f"blocks.{i}.", f"model.layers.{i}."
            for kind in ("weight", "bias") if m.qkv_bias else ("weight",):
                parts = []
                for name, h in zip(("q_proj", "k_proj", "v_proj"), heads):
                    w = get(f"{q}self_attn.{name}.{kind}")
                    parts.append(w if h is None else _rope_from_hf(_rows(w, h, f"{q}self_attn.{name}.{kind}"), h))
                out.update(_join_attention(m, *parts, p, kind))
            out[f"{p}attn.proj.weight"] = get(f"{q}self_attn.o_proj.weight")
            for ours, theirs in LLAMA_MLP:
                out[f"{p}{ours}.weight"] = get(f"{q}{theirs}.weight")
            out[f"{p}ln1.weight"] = get(f"{q}input_layernorm.weight")
            out[f"{p}ln2.weight"] = get(f"{q}post_attention_layernorm.weight")
        out["ln_f.weight"] = get("model.norm.weight")
    if not m.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


def _transposed(w: torch.Tensor, name: str) -> torch.Tensor:
    if w.ndim != 2:
        raise UserError(f"the Hugging Face weight {name} has shape {tuple(w.shape)}, not a matrix")
    return w.t()


def _rows(w: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """A q or k tensor whose rows split into `heads` heads of an even size (else its shape is named)."""
    if w.ndim == 0 or w.shape[0] % (2 * heads):
        raise UserError(f"the Hugging Face weight {name} has shape {tuple(w.shape)}: its rows do not split into "
                        f"{heads} heads of an even size")
    return w


# --------------------------------------------------------------------------- files


def export_hf(m: ModelConfig, state: dict[str, torch.Tensor], out: Path, extra_files: Iterable[Path] = ()) -> str:
    """Write `out/config.json` and `out/model.safetensors` (fp32), and copy `extra_files` beside them (the run's
    tokenizer files, handed over by whoever knows the run's data); returns the architecture name."""
    st = _require_safetensors()
    cfg = hf_config(m)
    tensors = to_hf(m, state)
    st.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    # safetensors writes its file 0600; give the weights the mode the umask gives every other file of the export
    (out / "model.safetensors").chmod(stat.S_IMODE((out / "config.json").stat().st_mode))
    for f in extra_files:
        shutil.copyfile(f, out / Path(f).name)
    return cfg["architectures"][0]


def _weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
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


def _hf_tensors(directory: Path, shapes_only: bool) -> dict[str, torch.Tensor]:
    """The directory's tensors by HF name; with `shapes_only` as meta tensors of their shapes (the files' headers
    only are read)."""
    st = _require_safetensors()
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        try:
            if shapes_only:
                from safetensors import safe_open

                with safe_open(str(path), "pt") as f:
                    for name in f.keys():
                        out[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
            else:
                out.update(st.load_file(str(path)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
            raise UserError(f"{path} cannot be read as safetensors: {str(e).splitlines()[0][:160]}") from None
    return out


def _mapped(directory: Path, m: ModelConfig, shapes_only: bool) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    family = check_hf_config(read_hf_config(directory), m, directory)
    ours = from_hf(m, _hf_tensors(directory, shapes_only), family)
    expect = {n: tuple(p.shape) for n, p in _meta_gpt(m).named_parameters()}
    for name, shape in expect.items():
        got = ours.get(name)
        if got is None:
            raise UserError(f"{directory}: no weight maps to {name}")
        if tuple(got.shape) != shape:
            raise UserError(f"{directory}: {name} has shape {tuple(got.shape)}, but config.json's model needs {shape}")
    return {n: ours[n] for n in expect}


def check_hf_weights(directory: Path, m: ModelConfig) -> None:
    """Before launch: the directory's config describes `m` and every weight has the shape `m` needs (the
    safetensors headers only are read); UserError naming the first tensor that does not."""
    _mapped(directory, m, shapes_only=True)


def read_hf_weights(directory: Path, m: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters by plain name from a HF GPT-2 / Llama / Mistral / Qwen2 directory, after checking its config
    against `m` and every tensor's shape against the model's."""
    return _mapped(directory, m, shapes_only=False)  # in their dtype: each rank copies (and converts) its own shards


def _meta_gpt(m: ModelConfig):
    from scaletrain.model.gpt import gpt_on_meta

    return gpt_on_meta(m)
