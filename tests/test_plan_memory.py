"""Planner memory formulas: exact counts against our own model, torch and the trainer's measurements of
real runs (one and two processes, every layout the engine runs), and the published formulas (Korthikanti
et al. arXiv 2205.05198 eqs. 1-6; ZeRO arXiv 1910.02054 Sec. 5 and Fig. 1).

Tolerance: model states and saved activations are compared to the byte (`==`); they are counts of the
same tensors the trainer counts, so any difference is a bug in the count, not noise."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import Config, ModelConfig
from scaletrain.model.gpt import GPT, loss_sum
from scaletrain.plan.analytic.memory import layer_activation_bytes, memory_model_states
from scaletrain.plan.analytic.params import param_counts, total_params
from scaletrain.plan.catalog import ModelSpec, from_model_config, get_model
from scaletrain.plan.exact.run_memory import implementation_activation_bytes, predict_run

CONFIGS = [
    dict(),
    dict(bias=False),
    dict(mlp="swiglu"),
    dict(position="rope", tie_embeddings=False),
    dict(n_layers=2, d_model=96, n_heads=6, seq_len=48, vocab_size=300, d_ff=100),
    dict(mlp="swiglu", bias=False, position="rope", tie_embeddings=False),
    dict(n_kv_heads=2, mlp="swiglu", bias=False, qkv_bias=True, position="rope"),  # grouped-query, Qwen2's biases
    dict(n_kv_heads=1),  # multi-query
]


def _mc(**kw) -> ModelConfig:
    base = dict(n_layers=3, d_model=64, n_heads=4, seq_len=32, vocab_size=256)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("kw", CONFIGS)
def test_param_count_equals_real_gpt(kw):
    mc = _mc(**kw)
    model = GPT(mc)
    spec = from_model_config(mc)
    assert total_params(spec) == sum(p.numel() for p in model.parameters())
    assert param_counts(spec).tensors == len(list(model.parameters()))


def test_catalog_param_counts_match_published_values():
    # exact published counts (GPT-2 small, Llama 2 7B, Llama 3 8B, Mixtral 8x7B model cards)
    assert total_params(get_model("gpt2")) == 124_439_808
    assert total_params(get_model("llama2-7b")) == 6_738_415_616
    assert total_params(get_model("llama3-8b")) == 8_030_261_248
    assert total_params(get_model("mixtral-8x7b")) == 46_702_792_704
    # Megatron-LM 2021 Table 1 parameter column (billions, one decimal)
    table1 = {"megatron-1.7b": 1.7, "megatron-3.6b": 3.6, "megatron-7.5b": 7.5, "megatron-18b": 18.4,
              "megatron-39b": 39.1, "megatron-76b": 76.1, "megatron-146b": 145.6, "megatron-310b": 310.1,
              "megatron-530b": 529.6, "megatron-1t": 1008.0}
    for name, billions in table1.items():
        assert total_params(get_model(name)) / 1e9 == pytest.approx(billions, abs=0.051), name


@pytest.mark.parametrize("dtype,torch_dtype", [("fp32", torch.float32), ("fp64", torch.float64)])
@pytest.mark.parametrize("kw", CONFIGS[:4])
def test_predict_run_model_states_exact_to_the_byte(dtype, torch_dtype, kw):
    cfg = Config(model=_mc(**kw))
    cfg.train.dtype = dtype
    cfg.train.global_batch, cfg.train.micro_batch = 4, 2
    model = GPT(cfg.model).to(torch_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    loss_sum(model(idx), idx).backward()
    opt.step()
    measured_params = sum(p.numel() * p.element_size() for p in model.parameters())
    measured_grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    measured_optim = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    pred = predict_run(cfg)
    assert pred["plan_mem_params"] == measured_params
    assert pred["plan_mem_grads"] == measured_grads
    assert pred["plan_mem_optim"] == measured_optim


def _saved_bytes(mc: ModelConfig, batch: int, dtype: torch.dtype) -> int:
    """Distinct non-parameter storages saved for backward (the trainer's saved_tensors_hooks method)."""
    torch.manual_seed(0)
    model = GPT(mc).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept, seen = [], {}

    def pack(t):
        kept.append(t)
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    idx = torch.randint(0, mc.vocab_size, (batch, mc.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum(model(idx), idx)
    return sum(seen.values())


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.float64, 8)])
@pytest.mark.parametrize("kw", CONFIGS)
def test_implementation_activations_exact_for_our_gpt(dtype, elem, kw):
    mc = _mc(**kw)
    assert implementation_activation_bytes(from_model_config(mc), 2, elem) == _saved_bytes(mc, 2, dtype)


@pytest.mark.parametrize("kw", [dict(dropout=0.1), dict(dropout=0.1, position="rope", mlp="swiglu")])
def test_implementation_activations_with_dropout_exact(kw):
    # dropout > 0 switches scaled_dot_product_attention to the math kernel: a different list of tensors
    mc = _mc(**kw)
    assert implementation_activation_bytes(from_model_config(mc), 2, 4) == _saved_bytes(mc, 2, torch.float32)


def test_korthikanti_activation_formulas():
    # GPT-3 175B dims with dropout: eqs. 2 (no parallelism), 3 (tp), 4 (tp + sp), 6 (selective), full.
    m = ModelSpec("x", 96, 12288, 96, 51200, 2048, dropout=True)
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    f = layer_activation_bytes
    assert f(m, s * b, 1, False, "none", "standard", 2) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert f(m, s * b, t, False, "none", "standard", 2) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(m, s * b, t, True, "none", "standard", 2) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    # attn-core (selective) keeps 34 sbh/t plus a 4-byte log-sum-exp per head and token (< 0.1% here)
    assert f(m, s * b, t, True, "attn-core", "standard", 2) == pytest.approx(34 * sbh / t, rel=1e-3)
    assert f(m, s * b, t, True, "full", "standard", 2) == pytest.approx(2 * sbh / t)
    assert f(m, s * b, 1, False, "full", "standard", 2) == pytest.approx(2 * sbh)


# ZeRO paper (arXiv 1910.02054) Table 1: per-device model-state memory in GB (1e9 bytes), K = 12,
# columns baseline DP, Pos, Pos+g, Pos+g+p. The 7.5B / Nd=64 row is also the paper's Figure 1
# (120 GB, 31.4 GB, 16.6 GB, 1.9 GB).
ZERO_TABLE1 = {
    7.5e9: {1: (120, 120, 120, 120), 4: (120, 52.5, 41.3, 30), 16: (120, 35.6, 21.6, 7.5),
            64: (120, 31.4, 16.6, 1.88), 256: (120, 30.4, 15.4, 0.47), 1024: (120, 30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048, 2048), 4: (2048, 896, 704, 512), 16: (2048, 608, 368, 128),
            64: (2048, 536, 284, 32), 256: (2048, 518, 263, 8), 1024: (2048, 513, 257, 2)},
    1e12: {1: (16000, 16000, 16000, 16000), 4: (16000, 7000, 5500, 4000), 16: (16000, 4750, 2875, 1000),
           64: (16000, 4187, 2218, 250), 256: (16000, 4046, 2054, 62.5), 1024: (16000, 4011, 2013, 15.6)},
}


@pytest.mark.parametrize("psi", sorted(ZERO_TABLE1))
def test_zero_paper_table1_reproduced(psi):
    for nd, row in ZERO_TABLE1[psi].items():
        for stage, published in enumerate(row):
            got = sum(memory_model_states(psi, nd, stage, 2, 2, 12)) / 1e9
            # the paper rounds to 3 significant figures (and truncates 2218.75 -> 2218, 4187.5 -> 4187)
            assert got == pytest.approx(published, rel=5e-3, abs=0.01), (psi, nd, stage)


@pytest.mark.parametrize("overrides", [[], ["model.mlp=swiglu", "model.position=rope", "train.dtype=fp64"]])
def test_predict_run_equals_measured_trainer_memory(tmp_path, overrides):
    """`scaletrain train` logs mem_*; the plan must equal them to the byte (activations included)."""
    import json

    from scaletrain.cli import main
    from scaletrain.config import load_config

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text("model: {n_layers: 2, d_model: 64, n_heads: 4, seq_len: 64, vocab_size: 256}\n"
                        "train: {steps: 1, global_batch: 8, micro_batch: 4, eval_every: 0,"
                        " checkpoint_every: 0}\n")
    argv = ["train", "--config", str(cfg_path), "--out", str(tmp_path / "run")]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 0
    measured = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    for key, value in predict_run(load_config(cfg_path, overrides)).items():
        assert value == measured[key.replace("plan_", "")], key


# --------------------------------------------------------------------------- real runs, measured by the trainer

SMALL = {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": 32, "model.vocab_size": 257,
         "train.steps": 1, "train.global_batch": 8, "train.micro_batch": 2, "train.eval_every": 0}

ONE_RANK = [  # the passes that run in one process: precision, recomputation, offload, optimizers, model kinds
    {"train.dtype": "bf16"},
    {"train.dtype": "fp16", "model.mlp": "swiglu", "model.position": "rope", "model.bias": False},
    {"memory.recompute": "full", "model.position": "rope"},
    {"memory.recompute": "selective", "model.position": "rope", "train.dtype": "fp64"},
    {"memory.recompute": "every:2", "model.n_layers": 4, "train.dtype": "bf16"},
    {"model.dropout": 0.1, "train.dtype": "bf16", "model.tie_embeddings": False},
    {"memory.offload_activations": True},
    {"optim.name": "adafactor"},
    {"optim.name": "sm3", "optim.momentum": 0.9, "train.dtype": "bf16"},
    # autocast-bf16: fp32 residual stream, bf16 casts of each linear layer's input and of every weight
    {"train.precision": "autocast-bf16", "model.mlp": "swiglu", "model.position": "rope", "model.bias": False},
    {"train.precision": "autocast-bf16", "memory.recompute": "selective", "model.tie_embeddings": False},
    {"train.precision": "autocast-bf16", "memory.recompute": "every:2", "model.n_layers": 4},
    # grouped-query attention: q and kv outputs, RoPE's rotated q and k, autocast's extra input cast
    {"model.n_kv_heads": 2, "model.position": "rope", "model.rope_scaling.type": "llama3", "train.dtype": "bf16"},
    {"model.n_kv_heads": 1, "train.precision": "autocast-bf16", "model.position": "rope",
     "memory.recompute": "selective"},
]


@pytest.mark.parametrize("overrides", ONE_RANK, ids=lambda o: ",".join(f"{k.split('.')[1]}={v}" for k, v in o.items()))
def test_predict_run_equals_trainer_measurement_one_process(overrides):
    from harness import make_config, measured_and_planned

    from scaletrain.train.trainer import Trainer

    trainer = Trainer(make_config({**SMALL, **overrides}))
    trainer.run()
    for key, (measured, planned) in measured_and_planned(trainer).items():
        assert planned == measured, (key, planned, measured)


TWO_RANKS = [  # every parallel layout on two processes: dp x ZeRO 0-3 (+ offload, padding), tp (+ sp), pp
    {"parallel.dp": 2},
    {"parallel.dp": 2, "parallel.zero": 1, "train.dtype": "bf16"},
    {"parallel.dp": 2, "parallel.zero": 2, "parallel.offload": "optimizer", "parallel.bucket_mb": 0.01},
    {"parallel.dp": 2, "parallel.zero": 3, "model.d_model": 36, "model.n_heads": 3},  # odd sizes: padding
    {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "params", "train.dtype": "bf16"},
    {"parallel.tp": 2, "model.mlp": "swiglu", "memory.recompute": "selective"},  # V = 257: padded vocabulary
    {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.dtype": "bf16", "model.position": "rope"},
    {"parallel.tp": 2, "memory.recompute": "full", "memory.partition_checkpoints": True},
    {"parallel.pp": 2},
    {"parallel.pp": 2, "parallel.schedule": "gpipe", "model.dropout": 0.1},
    {"parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2, "model.n_layers": 4},
    {"parallel.pp": 2, "parallel.schedule": "zb-h1", "train.dtype": "bf16", "model.tie_embeddings": False},
    {"parallel.pp": 2, "parallel.zero": 3, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
     "model.n_layers": 4},
    {"parallel.pp": 2, "train.precision": "autocast-bf16"},  # autocast on each stage: the head's casts on the last
    {"model.moe.experts": 4, "parallel.dp": 2, "parallel.ep": 2},
    # Adafactor / SM3 under ZeRO: replicated factored statistics, sharded element-wise states
    {"parallel.dp": 2, "parallel.zero": 1, "optim.name": "adafactor", "optim.use_beta1": True, "train.dtype": "bf16"},
    {"parallel.dp": 2, "parallel.zero": 2, "optim.name": "adafactor", "parallel.bucket_mb": 0.01,
     "model.d_model": 36, "model.n_heads": 3},
    {"parallel.dp": 2, "parallel.zero": 3, "optim.name": "sm3", "optim.momentum": 0.9},
    {"parallel.dp": 2, "parallel.zero": 3, "optim.name": "sm3", "parallel.offload": "optimizer", "train.dtype": "bf16"},
    # ... and under tensor parallelism: statistics of the whole matrix on each tp rank, element-wise states local
    {"parallel.tp": 2, "optim.name": "adafactor", "optim.use_beta1": True, "train.dtype": "bf16"},
    {"parallel.tp": 2, "optim.name": "sm3", "optim.momentum": 0.9, "parallel.sequence_parallel": True},
    # grouped-query attention: 2 key/value heads split over tp 2; 1 copied on both ranks (with sp, Adafactor)
    {"parallel.tp": 2, "model.n_kv_heads": 2, "model.position": "rope", "memory.recompute": "selective"},
    {"parallel.tp": 2, "model.n_kv_heads": 1, "parallel.sequence_parallel": True, "optim.name": "adafactor",
     "model.bias": False, "model.qkv_bias": True},
]


def test_predict_run_equals_trainer_measurement_two_processes():
    """Real trainings on 2 processes (gloo), 1 step each; the trainer reports each category as the max
    over ranks, next to the plan it logged before measuring."""
    from harness import measure_layouts

    results = measure_layouts(SMALL, TWO_RANKS)
    wrong = [(layout, key, planned, measured) for layout, got in zip(TWO_RANKS, results)
             for key, (measured, planned) in got.items()
             if planned != measured]
    assert not wrong, wrong  # MoE activations too (tests/test_plan_moe.py covers the routers and layouts)


@pytest.mark.parametrize("overrides", [{}, {"model.mlp": "swiglu", "model.position": "rope", "model.bias": False},
                                       {"model.tie_embeddings": False}])
def test_planner_factored_statistics_equal_the_models_rows_and_columns(overrides):
    """Adafactor / SM3 keep rows + columns per matrix: the planner's count from the dims equals the count
    over our GPT's actual parameter shapes (MoE excluded)."""
    import math

    from harness import make_config

    from scaletrain.plan.analytic.params import factored_statistics
    from scaletrain.plan.catalog import from_model_config
    from scaletrain.plan.exact.run_memory import engine_module_on_meta

    cfg = make_config({**SMALL, **overrides})
    shapes = [tuple(p.shape) for p in engine_module_on_meta(cfg).parameters()]
    exact = sum(math.prod(s[:-1]) + s[-1] for s in shapes if len(s) >= 2) / sum(math.prod(s) for s in shapes)
    assert factored_statistics(from_model_config(cfg.model)) == pytest.approx(exact, rel=1e-12)
