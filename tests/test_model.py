"""The plain GPT: layout-independent init, causality, parameter count, variants."""

import torch

from scaletrain.config import ModelConfig
from scaletrain.config.sizes import ffn_size
from scaletrain.model import build_gpt, count_params
from scaletrain.model.gpt import model_flops_per_token
from scaletrain.model.init import gpt_rules, init_value


def test_init_depends_only_on_seed_and_name():
    a = build_gpt(ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16), seed=7)
    b = build_gpt(ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16), seed=7)
    c = build_gpt(ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16), seed=8)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n
    # The same name gives the same value whatever else is in the model, so a slice held by a parallel
    # rank equals the slice of the full tensor.
    deep = build_gpt(ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16), seed=7)
    assert torch.equal(deep.blocks[1].attn.qkv.weight, a.blocks[1].attn.qkv.weight)
    full = init_value("blocks.1.mlp.fc.weight", (128, 32), 7, gpt_rules(2))
    assert torch.equal(full.float(), a.blocks[1].mlp.fc.weight)


def test_fp64_init_is_the_same_draw():
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8)
    a = build_gpt(cfg, 3, dtype=torch.float64)
    b = build_gpt(cfg, 3, dtype=torch.float32)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.float(), q)


def test_causal():
    m = build_gpt(ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, position="rope"), 1,
                  dtype=torch.float64)
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    assert torch.equal(m(x)[:, :10], m(y)[:, :10])
    assert not torch.allclose(m(x)[:, 10:], m(y)[:, 10:])


def test_param_count_formula():
    for mlp in ("gelu", "swiglu"):
        for tie in (True, False):
            cfg = ModelConfig(n_layers=3, d_model=48, n_heads=4, seq_len=20, mlp=mlp, tie_embeddings=tie)
            C, V, T, L, F = 48, 256, 20, 3, ffn_size(cfg)
            mlp_params = (2 * C * F + F + C) if mlp == "gelu" else (3 * C * F + 2 * F + C)
            block = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + mlp_params
            expect = V * C + T * C + L * block + 2 * C + (0 if tie else V * C)
            assert count_params(build_gpt(cfg, 0)) == expect


def test_tied_weights_are_one_parameter():
    m = build_gpt(ModelConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8), 0)
    assert m.lm_head.weight is m.wte.weight


def test_flops_per_token_is_about_6n():
    cfg = ModelConfig(n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab_size=50257)
    # Kaplan et al. 2020, table 1: 2N + 2 n_layer n_ctx d per forward token, N = non-embedding weights
    # plus the output projection, times 3 for forward + backward.
    n = 12 * 12 * 768**2 + 768 * 50257
    assert model_flops_per_token(cfg) == 6 * n + 6 * 12 * 1024 * 768
