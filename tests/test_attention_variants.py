"""The model's attention and MLP variants against independent references, their refusals, and the presets.

- Grouped-query attention (arXiv 2305.13245): our block's attention equals softmax(q kᵀ/√hs + mask) v written here
  with each key/value head repeated for its query heads (fp64, 1e-12; measured ~1e-16), through the flash kernel
  (enable_gqa) and through the explicit attention of layout-independent dropout (p = 0 in eval, so the same
  function); multi-query (1 head) too.
- Llama 3.1's RoPE scaling: our frequencies equal transformers' own `rope_type: llama3` initialisation (float32
  there, 1e-6 relative) for a config in which every band (kept, interpolated, scaled) occurs, and differ from the
  unscaled ones.
- GPT-2's tanh GELU equals transformers' `gelu_new` (1e-6 in fp32).
- Refusals: one line, exit 2, naming the values: n_kv_heads not dividing n_heads, tp against n_kv_heads, 2D tensor
  parallelism with GQA, an unknown RoPE scaling type, RoPE settings with learned positions, the tanh GELU with SwiGLU,
  qkv_bias with bias, an unknown preset.
- Presets: `--set model.preset=NAME` gives the model `plan --model NAME` plans (parameter count of the built model
  equals the catalog's, for every preset), explicit keys win over the preset, `config show` prints the result.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from scaletrain.cli import main
from scaletrain.config import ModelConfig, load_config, validate
from scaletrain.config.presets import PRESETS, preset_model


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention with key/value head g serving query heads [g·r, (g+1)·r), from the definition."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("kv", [2, 1])
@pytest.mark.parametrize("dropout", [0.0, 0.1])  # 0.1: the explicit (layout-independent dropout) path, in eval
def test_grouped_query_attention_equals_the_definition(kv, dropout):
    from scaletrain.model.block import CausalSelfAttention

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, n_kv_heads=kv, dropout=dropout, bias=False, qkv_bias=True)
    attn = CausalSelfAttention(cfg).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    assert attn.kv.weight.shape == (2 * kv * 8, 32) and attn.q.weight.shape == (32, 32)
    q = (x @ attn.q.weight.T + attn.q.bias).view(2, 16, 4, 8).transpose(1, 2)
    k, v = (x @ attn.kv.weight.T + attn.kv.bias).view(2, 16, 2, kv, 8).permute(2, 0, 3, 1, 4)
    want = _reference_attention(q, k, v).transpose(1, 2).reshape(2, 16, 32) @ attn.proj.weight.T
    attn.eval()
    torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)
    if dropout:  # the explicit path runs in training; with p > 0 it must still use every key/value head right
        attn.train()
        attn.attn_dropout.p = attn.resid_dropout.p = 0.0
        torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)


def test_llama3_rope_frequencies_equal_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from scaletrain.config.schema import RopeScalingConfig
    from scaletrain.model.rope import inv_frequencies

    scaling = RopeScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64)
    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=256,
                                  rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                     "original_max_position_embeddings": 64})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    ours = inv_frequencies(64, 500000.0, scaling)
    plain = inv_frequencies(64, 500000.0)
    wavelength = 2 * math.pi / plain
    assert (wavelength < 16).any() and (wavelength > 64).any() and ((wavelength > 16) & (wavelength < 64)).any()
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, plain)


def test_tanh_gelu_equals_gpt2_gelu_new():
    from transformers.activations import ACT2FN

    from scaletrain.model.block import MLP

    mlp = MLP(ModelConfig(d_model=16, activation="gelu_tanh"))
    x = torch.linspace(-6, 6, 1024).view(-1, 16)
    h = mlp.fc(x)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), mlp.proj(ACT2FN["gelu_new"](h)), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(mlp(x), mlp.proj(F.gelu(h)), rtol=1e-7, atol=1e-7)  # not the exact GELU


@pytest.mark.parametrize("sets, fragment", [
    (["model.n_kv_heads=3"], "model.n_heads (4) is not divisible by model.n_kv_heads (3)"),
    (["model.n_kv_heads=8"], "model.n_kv_heads must be between 0 (= model.n_heads) and model.n_heads (4), got 8"),
    (["model.n_heads=8", "model.n_kv_heads=4", "parallel.tp=8", "model.d_model=64", "model.n_kv_heads=4",
      "parallel.tp=8"], None),  # accepted: tp 8 > 4 key/value heads, each copied twice
    (["model.n_heads=12", "model.d_model=96", "model.n_kv_heads=4", "parallel.tp=3"],
     "model.n_kv_heads (4) and parallel.tp (3): one must divide the other"),
    (["model.n_kv_heads=2", "parallel.tp=4", "parallel.tp_mode=2d"],
     "model.n_kv_heads (2) with parallel.tp_mode=2d"),
    (["model.position=rope", "model.rope_scaling.type=yarn"], "model.rope_scaling.type must be none or llama3, got "
                                                              "'yarn'"),
    (["model.rope_theta=500000"], "model.rope_theta (500000.0) / model.rope_scaling.type (none) set with "
                                  "model.position=learned"),
    (["model.position=rope", "model.rope_scaling.factor=4"], "model.rope_scaling.factor (4.0) set with "
                                                             "model.rope_scaling.type=none"),
    (["model.position=rope", "model.rope_scaling.type=llama3", "model.rope_scaling.high_freq_factor=0.5"],
     "model.rope_scaling (llama3) needs"),
    (["model.mlp=swiglu", "model.activation=gelu_tanh"], "model.activation=gelu_tanh with model.mlp=swiglu"),
    (["model.qkv_bias=true"], "model.qkv_bias=true with model.bias=true"),
    (["model.preset=gpt5"], "model.preset: unknown model 'gpt5'"),
])
def test_bad_attention_settings_are_one_line_and_exit_2(sets, fragment, capsys):
    argv = ["config", "show"] + [x for s in sets for x in ("--set", s)]
    code = main(argv)
    captured = capsys.readouterr()
    if fragment is None:
        assert code == 0, captured.err
        return
    assert code == 2 and len(captured.err.strip().splitlines()) == 1 and fragment in captured.err, captured.err


def test_every_preset_is_the_model_the_planner_plans():
    """`train --set model.preset=NAME` gives the ModelSpec `plan --model NAME` plans, for every catalog model (the
    catalog is made from the same table); for one model of each family the model built from it (on the meta device)
    has exactly the parameters the catalog counts."""
    from scaletrain.model.gpt import GPT
    from scaletrain.plan.analytic.params import total_params
    from scaletrain.plan.catalog import MODELS, from_model_config

    assert set(MODELS) == set(PRESETS)
    for name in PRESETS:
        cfg = validate(load_config(None, [f"model.preset={name}"]))
        assert cfg.model == preset_model(name)
        assert total_params(from_model_config(cfg.model)) == total_params(MODELS[name]), name
    for name in ("gpt2", "gpt3-125m", "megatron-1.7b", "llama2-70b", "llama3-8b", "mixtral-8x7b"):
        with torch.device("meta"):
            model = GPT(preset_model(name))
        assert sum(p.numel() for p in model.parameters()) == total_params(MODELS[name]), name


def test_explicit_keys_win_over_the_preset_and_config_show_prints_the_result(capsys, tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model:\n  preset: llama3-8b\n  n_layers: 2\n")
    assert main(["config", "show", "--config", str(yaml_file), "--set", "model.seq_len=256"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(yaml_file, ["model.seq_len=256"])
    m = cfg.model
    assert (m.n_layers, m.seq_len, m.d_model, m.n_kv_heads, m.rope_theta, m.mlp) == (2, 256, 4096, 8, 500000.0,
                                                                                       "swiglu")
    for line in ("n_layers: 2", "seq_len: 256", "d_model: 4096", "n_kv_heads: 8", "rope_theta: 500000.0",
                 "preset: llama3-8b"):
        assert f"  {line}\n" in out, line
    gpt2 = load_config(None, ["model.preset=GPT2-small", "model.dropout=0.0"]).model  # an alias, case-insensitive
    assert (gpt2.preset, gpt2.activation, gpt2.dropout, gpt2.vocab_size) == ("gpt2", "gelu_tanh", 0.0, 50257)
