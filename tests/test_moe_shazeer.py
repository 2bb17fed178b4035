"""The sparsely-gated MoE's importance and load losses and its two-level hierarchical MoE (Shazeer et al., arXiv
1701.06538, Sec. 4, appendices A and B): the losses against references written here from the paper's formulas
with Python loops and math.erf (rtol 1e-10), the hierarchical layer against a direct per-token sum, validate()'s
refusals, the planner's parameter count, and dp2 x ep2 and tp2 against the single-process run in fp64 (losses per
step and every final parameter, rtol 1e-9 as tests/test_moe.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from harness import TINY, make_config, run_ranks
from test_moe import _check, _rank_runs, _run

from scaletrain.config import MoEConfig, load_config, validate
from scaletrain.errors import ConfigError
from scaletrain.model.moe import MoE, route_hierarchical, route_topk


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# --------------------------------------------------------------------------- the paper's formulas, with loops


def phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def cv2(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values) / (mean * mean + 1e-10)


def top_gates(h: list[float], k: int) -> dict[int, float]:
    """Softmax(KeepTopK(h, k)) as {index: gate} of the kept entries."""
    order = sorted(range(len(h)), key=lambda i: -h[i])[:k]
    z = sum(math.exp(h[i]) for i in order)
    return {i: math.exp(h[i]) / z for i in order}


def p_selected(clean: list[float], noisy: list[float], std: list[float], k: int) -> list[float]:
    """P(x, i) = Φ((clean_i − kth_excluding(noisy, k, i)) / std_i) (appendix A, eq. 9)."""
    out = []
    for i in range(len(clean)):
        others = sorted((noisy[j] for j in range(len(noisy)) if j != i), reverse=True)
        out.append(phi((clean[i] - others[k - 1]) / std[i]))
    return out


def flat_losses(clean, noise, std, k: int, wi: float, wl: float) -> float:
    """Σ over dispatch groups of S (w_i CV(Importance)² + w_l CV(Load)²); tensors (G, S, E)."""
    G, S, E = clean.shape
    total = 0.0
    for g in range(G):
        importance, load = [0.0] * E, [0.0] * E
        for s in range(S):
            c, n, d = clean[g, s].tolist(), (clean[g, s] + noise[g, s]).tolist(), std[g, s].tolist()
            for i, w in top_gates(n, k).items():
                importance[i] += w
            for i, p in enumerate(p_selected(c, n, d, k)):
                load[i] += p
        total += S * (wi * cv2(importance) + wl * cv2(load))
    return total


def hierarchical_losses(cp, np_, sp, cs, ns, ss, k: int, wi: float, wl: float) -> float:
    """Appendix B: Importance_H(X)_ij = Σ_x G_p(x)_i G_i(x)_j, Load_H(X)_ij = Load_p(X)_i Load_i(X^(i))_j / |X^(i)|."""
    G, S, a = cp.shape
    b = cs.shape[-1]
    total = 0.0
    for g in range(G):
        imp = [[0.0] * b for _ in range(a)]
        load_p, load_s, count = [0.0] * a, [[0.0] * b for _ in range(a)], [0] * a
        for s in range(S):
            hp = (cp[g, s] + np_[g, s]).tolist()
            gp = top_gates(hp, k)
            for i, p in enumerate(p_selected(cp[g, s].tolist(), hp, sp[g, s].tolist(), k)):
                load_p[i] += p
            for i, wp in gp.items():
                hs = (cs[g, s, i] + ns[g, s, i]).tolist()
                for j, ws in top_gates(hs, k).items():
                    imp[i][j] += wp * ws
                count[i] += 1
                for j, p in enumerate(p_selected(cs[g, s, i].tolist(), hs, ss[g, s, i].tolist(), k)):
                    load_s[i][j] += p
        load = [load_p[i] * load_s[i][j] / max(count[i], 1) for i in range(a) for j in range(b)]
        total += S * (wi * cv2([v for row in imp for v in row]) + wl * cv2(load))
    return total


def test_importance_and_load_losses_match_the_papers_formulas():
    torch.manual_seed(0)
    G, S, E, k = 3, 8, 6, 2
    clean, eps = torch.randn(G, S, E), torch.randn(G, S, E)
    std = F.softplus(torch.randn(G, S, E)) * 0.7
    r = route_topk(clean, k, S, eps * std, None, std, (0.3, 0.2))
    want = flat_losses(clean, eps * std, std, k, 0.3, 0.2)
    assert abs(float(r.aux) - want) <= 1e-10 * abs(want)
    assert want > 0.1  # the random gates are far from balanced: the comparison is not of two zeros


def test_hierarchical_losses_match_appendix_b():
    torch.manual_seed(1)
    G, S, a, b, k = 2, 8, 3, 4, 2
    cp, cs = torch.randn(G, S, a), torch.randn(G, S, a, b)
    sp, ss = F.softplus(torch.randn(G, S, a)) * 0.5, F.softplus(torch.randn(G, S, a, b)) * 0.5
    np_, ns = torch.randn(G, S, a) * sp, torch.randn(G, S, a, b) * ss
    r = route_hierarchical(cp, cs, k, S, (np_, ns), (sp, ss), (0.3, 0.2))
    want = hierarchical_losses(cp, np_, sp, cs, ns, ss, k, 0.3, 0.2)
    assert abs(float(r.aux) - want) <= 1e-10 * abs(want)


def make_layer(**kw) -> MoE:
    cfg = MoEConfig(**{"experts": 8, "groups": 2, "top_k": 2, "router": "topk", "group_tokens": 8,
                       "capacity_factor": 4.0, **kw})
    torch.manual_seed(3)
    m = MoE(16, 32, "gelu", cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def test_hierarchical_layer_is_the_two_level_gate_weighted_sum_of_experts():
    """No drops (capacity = all tokens): y(x) = Σ_i Σ_j G_p(x)_i G_i(x)_j E_ij(x) over the chosen pairs."""
    m = make_layer().eval()
    x = torch.randn(2, 8, 16)
    y = m(x).reshape(-1, 16)
    w1, w2, wp, ws = m.experts.fc_weight, m.experts.proj_weight, m.router.weight, m.expert_router.weight
    for t, xt in enumerate(x.view(-1, 16)):
        want = torch.zeros(16)
        for i, gp in top_gates((wp @ xt).tolist(), 2).items():
            for j, gs in top_gates((ws[i * 4:(i + 1) * 4] @ xt).tolist(), 2).items():
                e = i * 4 + j
                want += gp * gs * (F.gelu(xt @ w1[e]) @ w2[e])
        torch.testing.assert_close(y[t], want, rtol=1e-12, atol=1e-12)


def test_importance_loss_reaches_router_and_noise_weights():
    m = make_layer(aux_loss="importance", router_noise=0.5, groups=1, experts=4).train()
    m.grad_scale = 1.0
    m(torch.randn(2, 8, 16)).sum().mul(0.0).backward()  # only the attached losses give gradients
    assert m.router.weight.grad.abs().sum() > 0 and m.noise.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------- validate() and the planner


@pytest.mark.parametrize("sets, message", [
    (["model.moe.aux_loss=shazeer"], "model.moe.aux_loss must be switch or importance, got 'shazeer'"),
    (["model.moe.experts=6", "model.moe.groups=4"], "model.moe.groups (4) must divide model.moe.experts (6)"),
    (["model.moe.experts=8", "model.moe.groups=2", "model.moe.router=switch"], "needs model.moe.router=topk"),
    (["model.moe.experts=8", "model.moe.aux_loss=importance", "model.moe.router=expert_choice"],
     "aux_loss=importance is built on the noisy top-k gate"),
    (["model.moe.experts=8", "model.moe.aux_loss=importance"], "needs model.moe.router_noise > 0"),
    (["model.moe.experts=8", "model.moe.groups=4", "model.moe.top_k=3"], "top_k must be <= both"),
    (["model.moe.experts=4", "model.moe.groups=2", "model.moe.top_k=2", "model.moe.aux_loss=importance",
      "model.moe.router_noise=1"], "each gate needs more than top_k (2) choices, got 2 and 2"),
    (["model.moe.experts=8", "model.moe.groups=2", "model.moe.random_routing=true"], "random_routing with"),
    (["model.moe.groups=2"], "groups=2 set in a dense model: they need model.moe.experts > 0"),
])
def test_validate_names_the_shazeer_values(sets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(load_config(None, sets))


def test_planner_counts_the_hierarchical_routers_and_k_squared_experts():
    from scaletrain.model import build_gpt
    from scaletrain.plan.analytic.params import total_params
    from scaletrain.plan.catalog import from_model_config

    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.moe.experts=8", "model.moe.groups=2"])
    model = build_gpt(cfg.model, 1, "meta", torch.float64)
    spec = from_model_config(cfg.model)
    assert total_params(spec) == sum(p.numel() for p in model.parameters())
    assert spec.top_k == 4 and model.blocks[0].mlp.capacity() == math.ceil(1.25 * 4 * 64 / 8)
    from scaletrain.plan.exact.run_memory import predicts_activations

    assert not predicts_activations(cfg)  # the two-level gate's saved tensors are not modelled: no wrong number


def test_logged_loss_adds_the_weighted_importance_losses_once():
    """loss = cross-entropy + loss_aux (importance's weights already inside) + z_loss_weight x loss_z."""
    from scaletrain.train.trainer import Trainer

    cfg = make_config({**TINY, **MOE, "model.moe.aux_loss": "importance", "model.moe.importance_loss_weight": 0.5})
    row = Trainer(cfg, None, None).train_step(1)
    assert row["loss_aux"] > 0
    want = row["loss_ce"] + row["loss_aux"] + 0.01 * row["loss_z"]
    assert abs(row["loss"] - want) <= 1e-12 * want


# --------------------------------------------------------------------------- against one process


MOE = {"model.moe.experts": 8, "model.moe.group_tokens": 16, "model.moe.capacity_factor": 1.0,
       "model.moe.router_noise": 0.5, "model.moe.z_loss_weight": 0.01, "train.steps": 3}
CASES = {
    "importance dp2 ep2": {**MOE, "model.moe.aux_loss": "importance", "parallel.dp": 2, "parallel.ep": 2},
    # 3 groups of 4 experts over 2 ep ranks: group 1 is split between the ranks
    "hierarchical+importance dp2 ep2": {**MOE, "model.moe.groups": 3, "model.moe.aux_loss": "importance",
                                        "model.moe.experts": 12, "model.moe.top_k": 2,
                                        "parallel.dp": 2, "parallel.ep": 2},
    "importance tp2": {**MOE, "model.moe.aux_loss": "importance", "parallel.tp": 2},
    "hierarchical+switch tp2 sp": {**MOE, "model.moe.groups": 4, "model.moe.top_k": 1, "parallel.tp": 2,
                                   "parallel.sequence_parallel": True},
}


def test_importance_and_hierarchical_moe_under_dp_ep_and_tp_match_single_process():
    outs = run_ranks(_rank_runs, 2, list(CASES.values()), timeout=300)[0]
    for (name, o), (par_rows, par_state) in zip(CASES.items(), outs):
        ref_rows, ref_state = _run({**o, "parallel.dp": 1, "parallel.tp": 1, "parallel.ep": 1,
                                    "parallel.sequence_parallel": False})
        assert all(r[1] > 0 for r in ref_rows), f"{name}: the balancing loss should be on"
        _check((ref_rows, ref_state), (par_rows, par_state), name)
