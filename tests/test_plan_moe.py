"""The planner on mixture-of-experts runs (issue 8): `predict_run` against the trainer's measurement, and
the cost model's expert terms (total vs active parameters, FLOPs with the capacity padding, expert-parallel
sharding of model states, all-to-all volume and time) against counts made independently here.

Tolerances: memory of our own runs is compared to the byte (`==`; both are counts of the same tensors);
the cost model's parameter counts to the parameter, its bytes and FLOPs to 1e-9 relative (float sums).
"""

from __future__ import annotations

import math

import pytest

from scaletrain.plan import catalog, hardware
from scaletrain.plan.analytic.comm import group_link
from scaletrain.plan.analytic.estimate import estimate
from scaletrain.plan.analytic.flops import forward_flops_per_token, step_flops
from scaletrain.plan.analytic.inputs import DEFAULT_ASSUMPTIONS, Layout, Training
from scaletrain.plan.analytic.params import active_params, expert_params, param_counts, total_params
from scaletrain.plan.exact.run_memory import predict_run

SMALL = {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": 32, "model.vocab_size": 257,
         "train.steps": 1, "train.global_batch": 8, "train.micro_batch": 2, "train.eval_every": 0,
         "model.moe.experts": 4, "model.moe.group_tokens": 16}

ONE_RANK = [
    {},  # topk, k = 2, fp32
    {"model.moe.router": "switch"},
    {"model.moe.router": "expert_choice", "train.dtype": "bf16"},
    {"model.moe.every": 2, "model.mlp": "swiglu", "train.dtype": "fp64", "model.moe.capacity_factor": 0.5},
    {"train.dtype": "bf16", "memory.recompute": "selective"},
    {"memory.recompute": "full"},
]


@pytest.mark.parametrize("overrides", ONE_RANK, ids=lambda o: ",".join(f"{k.split('.')[-1]}={v}" for k, v in o.items())
                         or "topk")
def test_moe_predict_run_equals_trainer_measurement_one_process(overrides):
    from harness import make_config, measured_and_planned

    from scaletrain.train.trainer import Trainer

    trainer = Trainer(make_config({**SMALL, **overrides}))
    trainer.run()
    for key, (measured, planned) in measured_and_planned(trainer).items():
        assert planned == measured, (key, planned, measured)


TWO_RANKS = [
    {"parallel.dp": 2, "parallel.ep": 2},
    {"parallel.dp": 2, "parallel.ep": 2, "model.moe.router": "switch", "train.dtype": "bf16"},
    {"parallel.tp": 2, "model.moe.every": 2},
    {"parallel.pp": 2, "model.moe.every": 2, "model.n_layers": 4},
    {"parallel.tp": 2, "model.moe.every": 1},  # no dense block
    {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.dtype": "bf16", "model.moe.router": "expert_choice"},
    {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1, "train.dtype": "bf16"},  # experts sharded over edp
    {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3, "optim.name": "adafactor"},
]


def test_moe_predict_run_equals_trainer_measurement_two_processes():
    """ep 2 (the all-to-all version of the experts), tp 2 (experts replicated; with sequence parallelism each rank
    routes its shard), pp 2 (MoE blocks on both stages), ep 2 with ZeRO (dense parameters sharded over dp, experts
    over edp): every category to the byte, as the trainer reports it (max over ranks)."""
    from harness import measure_layouts

    results = measure_layouts(SMALL, TWO_RANKS)
    wrong = [(layout, key, planned, measured) for layout, got in zip(TWO_RANKS, results)
             for key, (measured, planned) in got.items() if planned != measured]
    assert not wrong, wrong


def test_moe_activations_not_guessed_with_router_noise():
    from harness import make_config

    cfg = make_config({**SMALL, "model.moe.router_noise": 1.0})
    assert "plan_mem_activations" not in predict_run(cfg)


# --------------------------------------------------------------------------- the cost model's expert terms

MOE_MODELS = [
    {"model.moe.experts": 4, "model.moe.every": 2, "model.moe.router": "switch", "model.moe.group_tokens": 16},
    {"model.moe.experts": 8, "model.moe.top_k": 2, "model.mlp": "swiglu", "model.bias": False,
     "model.moe.capacity_factor": 1.3, "model.moe.group_tokens": 16},
]
BASE = {"model.n_layers": 4, "model.d_model": 64, "model.n_heads": 4, "model.seq_len": 32}


@pytest.mark.parametrize("overrides", MOE_MODELS, ids=("switch-every2", "top2-swiglu"))
def test_total_and_active_params_equal_our_model(overrides):
    """Total = the model's parameters; active = total minus (E - k) experts per MoE layer, counted here from
    the model's own expert tensors; the tensor count (AdamW's step scalars) too."""
    from harness import make_config

    from scaletrain.model import build_gpt

    cfg = make_config({**BASE, **overrides})
    spec = catalog.from_model_config(cfg.model)
    model = build_gpt(cfg.model, 0, "meta")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    E, k = cfg.model.moe.experts, spec.top_k
    assert total_params(spec) == total
    assert active_params(spec) == total - experts + experts * k // E
    assert param_counts(spec).tensors == len(list(model.parameters()))


@pytest.mark.parametrize("overrides", MOE_MODELS, ids=("switch-every2", "top2-swiglu"))
def test_forward_flops_count_the_empty_capacity_slots(overrides):
    """FlopCounterMode on a real forward (it counts the matmuls, the experts' bmm over all E x G x K
    slots, the router and the logits; not the CPU flash-attention kernel) equals the planner's padded
    matmul + logits FLOPs exactly; model FLOPs (k rows per token) are smaller by (slots - k) expert MLPs."""
    import torch
    from harness import make_config
    from torch.utils.flop_counter import FlopCounterMode

    from scaletrain.model import build_gpt

    cfg = make_config({**BASE, **overrides})
    spec = catalog.from_model_config(cfg.model)
    model = build_gpt(cfg.model, 0, "cpu").train()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as fc:
        model(idx)
    mats, _attn, logits = forward_flops_per_token(spec)
    assert fc.get_total_flops() == pytest.approx((mats + logits) * 64, rel=1e-12)
    unpadded = forward_flops_per_token(spec, padded=False)[0]
    slots = spec.expert_slots_per_token - spec.top_k
    assert mats - unpadded == pytest.approx(2 * spec.n_moe_layers * slots * expert_params(spec), rel=1e-12)
    model_f, hw_f = step_flops(spec, 1000, "none")
    assert hw_f - model_f == pytest.approx(3 * 1000 * (mats - unpadded), rel=1e-12)


MIXTRAL = catalog.get_model("mixtral-8x7b")
TRAIN = Training(global_batch=256, dtype="bf16")


def test_expert_states_shard_over_ep():
    """ep 2 holds half of every expert weight, gradient and optimizer state (ZeRO 0): the difference to
    ep 1 is half the expert parameters x (2 + 2 + 12) bytes."""
    gpu = hardware.get_gpu("h100-80gb")
    one = estimate(MIXTRAL, gpu, TRAIN, Layout(dp=8, tp=1, pp=8, ep=1), memory_only=True)
    two = estimate(MIXTRAL, gpu, TRAIN, Layout(dp=8, tp=1, pp=8, ep=2), memory_only=True)
    experts_per_rank = MIXTRAL.n_layers / 8 * MIXTRAL.n_experts * expert_params(MIXTRAL)
    for key, bytes_per in (("params", 2), ("grads", 2), ("optimizer", 12)):
        assert one.memory[key] - two.memory[key] == pytest.approx(experts_per_rank / 2 * bytes_per, rel=1e-9)


def test_all_to_all_volume_is_four_per_moe_layer_and_microbatch():
    """comm_bytes['ep'] = microbatches x MoE layers of the stage x 4 x (ep-1)/ep x capacity_factor x k x
    tokens x d_model x bytes."""
    spec = catalog.ModelSpec("moe", 8, 1024, 16, 32000, 2048, n_experts=8, top_k=2, capacity_factor=1.25,
                             moe_every=2)
    lay = Layout(dp=8, tp=2, pp=2, ep=4, micro_batch=1)
    est = estimate(spec, hardware.get_gpu("a100-80gb"), Training(64, "bf16"), lay)
    mbs = 64 // 8
    expected = mbs * (4 / 2) * 4 * 3 / 4 * 1.25 * 2 * 2048 * 1024 * 2
    assert est.comm_bytes["ep"] == pytest.approx(expected, rel=1e-12)
    assert est.time_breakdown["ep_comm"] > 0


def test_all_to_all_across_nodes_is_slower_than_inside_one():
    """Rank order tp - ep - dp: with tp 8 on 8-GPU nodes the ep group spans nodes (InfiniBand), with tp 1
    it stays on NVLink; the same bytes take longer across nodes."""
    gpu = hardware.get_gpu("a100-80gb")
    inside = group_link(gpu, 4, 1, DEFAULT_ASSUMPTIONS)
    across = group_link(gpu, 4, 8, DEFAULT_ASSUMPTIONS)
    assert across[0] < inside[0]
    spec = catalog.ModelSpec("moe", 8, 1024, 16, 32000, 2048, n_experts=8, top_k=2)
    t = {}
    for tp in (1, 8):
        lay = Layout(dp=4, tp=tp, pp=1, ep=4)
        est = estimate(spec, gpu, Training(64, "bf16"), lay)
        t[tp] = est.time_breakdown["ep_comm"]
    assert t[8] > t[1]


def test_plan_cli_moe_catalog_and_custom_dims_json(capsys):
    import json

    from scaletrain.cli import main

    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--global-batch", "256", "--json",
                 "--layout", "ep=8,tp=1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["params"] == total_params(MIXTRAL)
    assert doc["model"]["active_params"] == active_params(MIXTRAL)
    best = doc["candidates"][0]
    assert best["layout"]["ep"] == 8 and best["comm_bytes_per_step"]["ep"] > 0
    assert main(["plan", "--layers", "8", "--hidden", "1024", "--heads", "16", "--vocab", "32000", "--seq-len",
                 "2048", "--experts", "8", "--top-k", "2", "--capacity-factor", "1.25", "--moe-every", "2",
                 "--gpus", "16", "--global-batch", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    spec = catalog.ModelSpec("custom", 8, 1024, 16, 32000, 2048, n_experts=8, top_k=2, capacity_factor=1.25,
                             moe_every=2)
    assert doc["model"]["active_params"] == active_params(spec)
    assert doc["model"]["capacity_factor"] == 1.25 and doc["model"]["moe_every"] == 2
    assert all("ep" in c["layout"] for c in doc["candidates"])


def test_active_params_formula_by_hand():
    """Mixtral 8x7B: 46.7B total, about 12.9B active (Jiang et al. report 47B / 13B)."""
    assert total_params(MIXTRAL) == 46_702_792_704
    per_expert = 3 * 4096 * 14336
    assert active_params(MIXTRAL) == 46_702_792_704 - 32 * 6 * per_expert
    assert math.isclose(active_params(MIXTRAL) / 1e9, 12.9, abs_tol=0.05)
