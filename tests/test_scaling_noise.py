"""The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al., arXiv 1812.06162, App. A.1).

The estimator is checked on synthetic per-example gradients drawn from N(G, Σ) with known G and Σ, the
probe against per-micro-batch gradients from autograd, the trainer's logged norms against autograd on the
same batch, and the logged noise scale across layouts (one process, dp 2 with ZeRO 0, 1 and 3, tp 2)
with the same global batch: the same micro-batches enter every layout, so the values agree to rounding.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from scaletrain.config import load_config, validate
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.errors import ConfigError
from scaletrain.model import loss_sum
from scaletrain.model.moe import begin_step as begin_moe_step
from scaletrain.parallel.parallelize import build_engine
from scaletrain.train.noise_scale import GradSqProbe, NoiseScaleEMA, unbiased_estimates
from scaletrain.train.trainer import Trainer
from tests.harness import TINY, make_config, run_ranks

NOISE = {**TINY, "train.log_noise_scale": "true", "train.steps": 3}


def test_unbiased_estimates_invert_the_expected_norms():
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B at two batch sizes gives back |G|^2 and tr(Sigma) exactly
    g2, trace = 0.37, 12.5
    for b_small, b_big in ((1, 2), (8, 64), (3, 1000)):
        got = unbiased_estimates(g2 + trace / b_small, b_small, g2 + trace / b_big, b_big)
        assert got == pytest.approx((g2, trace), rel=1e-12)
    with pytest.raises(ValueError):
        unbiased_estimates(1.0, 8, 1.0, 8)


def _synthetic_steps(seed: int, steps: int = 2000, d: int = 64, big: int = 64, small: int = 8):
    """Per-step (|G_small|^2 averaged over the micro-batches, |G_big|^2) of gradients ~ N(G, Sigma)."""
    rng = np.random.default_rng(seed)
    G = rng.normal(size=d)
    G /= np.linalg.norm(G)  # |G|^2 = 1
    A = rng.normal(size=(d, d))
    sigma = A @ A.T
    sigma *= 50.0 / np.trace(sigma)  # tr(Sigma) = 50, so B_simple = 50
    g = G + rng.normal(size=(steps, big, d)) @ np.linalg.cholesky(sigma).T  # per-example gradients
    micro = g.reshape(steps, big // small, small, d).mean(axis=2)
    sq_small = (micro**2).sum(axis=2).mean(axis=1)  # as the trainer: mean over the step's micro-batches
    sq_big = (g.mean(axis=1) ** 2).sum(axis=1)
    return sq_small, sq_big, small, big


@pytest.mark.parametrize("seed", [0, 1])
def test_noise_scale_of_synthetic_gradients_converges_to_trace_over_g2(seed):
    sq_small, sq_big, b, B = _synthetic_steps(seed)
    ema = NoiseScaleEMA(decay=0.999)  # a ~1000-step window: the scatter over seeds is about 1 %
    for s, S in zip(sq_small, sq_big):
        row = ema.update(float(s), b, float(S), B)
    assert row["noise_scale"] == pytest.approx(50.0, rel=0.05)
    # each step's estimates are unbiased: their means over 2000 steps are within 4 standard errors
    # (0.65 % for |G|^2, 0.22 % for tr(Sigma))
    est = np.array([unbiased_estimates(float(s), b, float(S), B) for s, S in zip(sq_small, sq_big)])
    assert est[:, 0].mean() == pytest.approx(1.0, rel=0.03)
    assert est[:, 1].mean() == pytest.approx(50.0, rel=0.01)


def test_ema_is_bias_corrected_and_state_round_trips():
    ema = NoiseScaleEMA(decay=0.9)
    row = ema.update(3.0, 1, 2.0, 2)  # |G|^2 = 1, tr = 2 from a single step
    assert (row["noise_grad_sq"], row["noise_trace"], row["noise_scale"]) == pytest.approx((1.0, 2.0, 2.0))
    other = NoiseScaleEMA()
    other.load_state_dict(ema.state_dict())
    assert other.value == ema.value and other.steps == 1


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_probe_sums_the_squared_norm_of_each_micro_batch_gradient(recompute):
    """Tied embeddings count once per backward; activation recomputation does not call hooks twice."""
    cfg = make_config({**TINY, "memory.recompute": recompute})
    engine = build_engine(cfg, Mesh.build(ParallelDims()), torch.device("cpu"), torch.float64, CommStats())
    model, params = engine.module, list(engine.module.parameters())
    x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    probe = GradSqProbe(params)
    expected = 0.0
    for i in (0, 2):
        grads = torch.autograd.grad(loss_sum(model(x[i:i + 2]), y[i:i + 2]), params)
        expected += sum(float(g.double().square().sum()) for g in grads)
    probe.reset()
    for i in (0, 2):
        loss_sum(model(x[i:i + 2]), y[i:i + 2]).backward()
    assert probe.calls == 2 * len(params)
    assert probe.take() == pytest.approx(expected, rel=1e-10)
    probe.remove()


def test_logged_norms_are_the_micro_batch_and_global_batch_gradient_norms():
    """Step 1 of a real run: grad_sq_small = mean over micro-batches of |mean-loss gradient|^2 and
    grad_sq_big = |mean-loss gradient of the global batch|^2, computed here with autograd."""
    t = Trainer(make_config(NOISE))
    params = [p for p in t.model.parameters()]
    micro = t.loader.micro_batches(1, 0, 1, 2)

    def sq_grad(batches):
        tokens = sum(y.numel() for _, y in batches)
        loss = sum(loss_sum(t.model(x), y) for x, y in batches) / tokens
        return sum(float(g.square().sum()) for g in torch.autograd.grad(loss, params))

    small = float(np.mean([sq_grad([mb]) for mb in micro]))
    big = sq_grad(micro)
    row = t.train_step(1)
    assert row["grad_sq_small"] == pytest.approx(small, rel=1e-9)
    assert row["grad_sq_big"] == pytest.approx(big, rel=1e-9)
    assert row["grad_sq_big"] == pytest.approx(row["grad_norm"] ** 2, rel=1e-12)
    g2, trace = unbiased_estimates(small, 2, big, 8)
    assert row["noise_scale"] == pytest.approx(trace / g2, rel=1e-9)  # one step: the EMA is the estimate
    assert row["noise_scale_tokens"] == pytest.approx(32 * trace / g2, rel=1e-9)


def _layout_runs(rank, world, layouts, out):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    values = []
    for i, overrides in enumerate(layouts):  # the first writes metrics.jsonl, the others return their rows
        t = Trainer(make_config({**NOISE, **overrides}), f"{out}/{i}" if i == 0 else None,
                    DistEnv(rank, world, 0, "test"))
        values.append(t.run() and None if i == 0 else [t.train_step(s) for s in (1, 2, 3)])
    return values


def test_noise_scale_is_logged_finite_positive_and_equal_across_layouts(tmp_path):
    Trainer(make_config(NOISE), tmp_path / "single").run()
    single = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    layouts = [{"parallel.dp": 2}] + [{"parallel.dp": 2, "parallel.zero": z} for z in (1, 2, 3)] + \
        [{"parallel.tp": 2}]
    runs = run_ranks(_layout_runs, 2, layouts, str(tmp_path / "par"), timeout=150)[0]
    dp2 = [json.loads(line) for line in (tmp_path / "par" / "0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in single] == [1, 2, 3]
    for row in single:
        assert math.isfinite(row["noise_scale"]) and row["noise_scale"] > 0
        assert row["grad_sq_small"] > row["grad_sq_big"] > 0  # a micro-batch's gradient is the noisier one
    # fp64 runs on the same micro-batches: agreement to 1e-9 relative (observed ~1e-15)
    for rows, name in [(dp2, "dp2 (metrics.jsonl)")] + [(r, str(lay)) for r, lay in zip(runs[1:], layouts[1:])]:
        for ref, row in zip(single, rows):
            for key in ("noise_scale", "grad_sq_small", "grad_sq_big"):
                assert row[key] == pytest.approx(ref[key], rel=1e-9), f"{name} step {ref['step']} {key}"


def test_noise_scale_averages_are_checkpointed_and_resumed(tmp_path):
    over = {**NOISE, "train.steps": 4, "train.checkpoint_every": 2}
    first = Trainer(make_config(over), tmp_path)
    first.run(stop_after=2)
    resumed = Trainer(make_config(over), tmp_path)
    assert resumed.step == 2 and resumed.noise.steps == 2
    assert resumed.noise.state_dict() == first.noise.state_dict()


@pytest.mark.parametrize("overrides, words", [
    ({"train.micro_batch": 8}, "train.micro_batch (8) < train.global_batch (8)"),
    ({"parallel.pp": 2}, "parallel.pp (2) > 1 needs model.tie_embeddings=false"),
    ({"parallel.ep": 2, "parallel.dp": 2, "model.moe.experts": 2, "train.micro_batch": 4},
     "train.micro_batch (4) x ep < train.global_batch (8)"),
])
def test_validate_rejects_noise_scale_where_a_micro_batch_gradient_is_not_on_one_rank(overrides, words):
    cfg = load_config(None, [f"{k}={v}" for k, v in {**NOISE, **overrides}.items()])
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg)


def test_no_hooks_when_noise_logging_is_off():
    t = Trainer(make_config(TINY))
    assert t.noise_probe is None
    assert not any(p._backward_hooks for p in t.model.parameters())  # nothing added to the backward pass
    row = t.train_step(1)
    assert "noise_scale" not in row


def _pipeline_runs(rank, world, layouts):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for overrides in layouts:
        t = Trainer(make_config({**NOISE, **overrides}), None, DistEnv(rank, world, 0, "test"))
        out.append([t.train_step(s) for s in (1, 2, 3)])
    return out


def test_noise_scale_under_pipeline_schedules_equals_the_single_process_value():
    """Each stage's hooks see its part of every micro-batch's gradient (F/B, or B and W for zero-bubble), and the
    parts add up over stages (untied embeddings: a tied weight's gradient would be split between two stages).
    PipeDream-2BW is logged the same way but trains with stale weights, so it has no single-process value."""
    untied = {"model.tie_embeddings": False}
    layouts = [{**untied, "parallel.pp": 2, "parallel.schedule": s} for s in ("1f1b", "zb-h1")]
    layouts.append({**untied, "parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
                    "model.n_layers": 4})
    runs = run_ranks(_pipeline_runs, 2, layouts, timeout=150)[0]
    refs = {n: Trainer(make_config({**NOISE, **untied, "model.n_layers": n})) for n in (2, 4)}
    expected = {n: [t.train_step(s) for s in (1, 2, 3)] for n, t in refs.items()}
    for layout, rows in zip(layouts, runs):
        for ref, row in zip(expected[layout.get("model.n_layers", 2)], rows):
            for key in ("noise_scale", "grad_sq_small", "grad_sq_big"):
                assert row[key] == pytest.approx(ref[key], rel=1e-9), (layout, ref["step"], key)


def _ep_first_step(rank, world, overrides):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    return Trainer(make_config({**NOISE, **overrides}), None, DistEnv(rank, world, 0, "test")).train_step(1)


def test_noise_scale_under_expert_parallelism_adds_the_expert_part_at_its_own_small_batch():
    """dp 2 x ep 2: an expert's gradient in one backward holds micro-batch i of both ranks (4 sequences). The
    logged |G|² and tr(Σ) of step 1 equal an independent computation on one process: per-micro-batch gradients
    of the dense parameters (2 sequences) and pairwise sums of the expert parameters' (4 sequences), each part
    through McCandlish's unbiased estimates, added."""
    moe = {"model.moe.experts": 2, "model.moe.aux_loss_weight": 0.0, "model.moe.z_loss_weight": 0.0,
           "model.moe.group_tokens": 32}
    row = run_ranks(_ep_first_step, 2, {**moe, "parallel.dp": 2, "parallel.ep": 2}, timeout=120)[0]

    t = Trainer(make_config({**NOISE, **moe}))
    names = [n for n, _ in t.model.named_parameters()]
    tokens, G, b = t.cfg.tokens_per_step, t.cfg.train.global_batch, t.cfg.train.micro_batch
    grads = {}
    for r in range(2):  # the micro-batches of dp rank r in the dp 2 run, on one process
        for i, (x, y) in enumerate(t.loader.micro_batches(1, r, 2, b)):
            t.model.zero_grad()
            begin_moe_step(t.model, t.cfg.train.seed, 1, r * (G // 2) + i * b)
            (loss_sum(t.model(x), y) / tokens).backward()
            grads[r, i] = {n: p.grad.clone() for n, p in zip(names, t.model.parameters())}
    expert = [n for n in names if ".experts." in n]
    dense = [n for n in names if n not in expert]

    def sq(parts: list[dict], keys: list[str]) -> float:
        return sum(float(sum(g[k] for g in parts).square().sum()) for k in keys)

    big = list(grads.values())
    dense_small = sum(sq([g], dense) for g in big) / len(big) * (G / b) ** 2
    pairs = [[grads[0, i], grads[1, i]] for i in range(G // (2 * b))]
    expert_small = sum(sq(p, expert) for p in pairs) / len(pairs) * (G / (2 * b)) ** 2
    g2_d, tr_d = unbiased_estimates(dense_small, b, sq(big, dense), G)
    g2_e, tr_e = unbiased_estimates(expert_small, 2 * b, sq(big, expert), G)
    assert row["noise_grad_sq"] == pytest.approx(g2_d + g2_e, rel=1e-9)
    assert row["noise_trace"] == pytest.approx(tr_d + tr_e, rel=1e-9)
    assert row["noise_scale"] == pytest.approx((tr_d + tr_e) / (g2_d + g2_e), rel=1e-9)
