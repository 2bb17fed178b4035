"""Mixture of experts: routers against direct implementations of their papers' equations, the losses,
the layer, layout-independent random streams, validate() messages, and expert parallelism against the
single-process run (fp64: losses per step and final gathered parameters, rtol 1e-9; dropped-token counts
equal)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from harness import TINY, make_config, run_ranks

from scaletrain.config import MoEConfig, load_config, validate
from scaletrain.errors import ConfigError
from scaletrain.model.moe import (
    MoE,
    balance_loss_sum,
    begin_step,
    capacity,
    route_expert_choice,
    route_switch,
    route_topk,
    set_grad_scale,
    z_loss_sum,
)


@pytest.fixture(autouse=True)
def _float64():
    """Unit tests in float64 (tolerances 1e-12); restored afterwards for the other test files."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)

# --------------------------------------------------------------------------- direct implementations


def direct_token_choice(choices, E: int, K: int):
    """GShard dispatch by hand. choices[g][s] = list of (expert, gate, kept_by_random_routing), best first.
    Returns {(g, e): [(token, gate), ...]} in slot order and the dropped count."""
    slots, dropped = {}, 0
    for g, group in enumerate(choices):
        k = len(group[0])
        for j in range(k):  # all first choices before any second choice
            for s, ch in enumerate(group):
                e, gate, keep = ch[j]
                if not keep:
                    continue
                buf = slots.setdefault((g, e), [])
                if len(buf) < K:
                    buf.append((s, gate))
                else:
                    dropped += 1
    return slots, dropped


def slots_of(r, G: int, E: int, S: int):
    out = {}
    for g in range(G):
        for e in range(E):
            lst = [(int(t), float(w)) for t, w in zip(r.slot_token[g, e], r.slot_weight[g, e]) if int(t) < S]
            if lst:
                out[(g, e)] = lst
    return out


def assert_slots_equal(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert [t for t, _ in got[key]] == [t for t, _ in want[key]], key
        for (_, a), (_, b) in zip(got[key], want[key]):
            assert abs(a - b) < 1e-12


def shazeer_topk(h_row: list[float], k: int):
    """Noisy top-k gating, Shazeer eq. 3-5: KeepTopK then softmax (exp over the kept values only)."""
    order = sorted(range(len(h_row)), key=lambda i: -h_row[i])[:k]
    z = sum(math.exp(h_row[i]) for i in order)
    return [(i, math.exp(h_row[i]) / z) for i in order]


# --------------------------------------------------------------------------- routers


@pytest.mark.parametrize("random_routing", [False, True])
def test_topk_router_matches_shazeer_gating_with_gshard_capacity(random_routing):
    torch.manual_seed(0)
    G, S, E, k = 3, 12, 4, 2
    K = capacity(S, E, k, 1.0)  # 6 slots: some experts overflow
    logits, noise = torch.randn(G, S, E), 0.3 * torch.randn(G, S, E)
    u = torch.rand(G, S) if random_routing else None
    r = route_topk(logits, k, K, noise, u)
    h = (logits + noise).tolist()
    choices = []
    for g in range(G):
        group = []
        for s in range(S):
            top = shazeer_topk(h[g][s], k)
            keep2 = u is None or float(u[g, s]) < 2 * top[1][1]  # GShard: second expert w.p. 2·g2
            group.append([(top[0][0], top[0][1], True), (top[1][0], top[1][1], keep2)])
        choices.append(group)
    want, dropped = direct_token_choice(choices, E, K)
    assert_slots_equal(slots_of(r, G, E, S), want)
    assert int(r.dropped) == dropped and dropped > 0
    assert int(r.assignments) == sum(c[2] for grp in choices for t in grp for c in t)


def test_switch_router_is_top1_with_unnormalised_gate():
    torch.manual_seed(1)
    G, S, E = 2, 16, 4
    K = capacity(S, E, 1, 1.0)
    logits = torch.randn(G, S, E) * 2
    r = route_switch(logits, K)
    p = logits.softmax(-1).tolist()
    choices = [[[(max(range(E), key=lambda i: p[g][s][i]), max(p[g][s]), True)] for s in range(S)] for g in range(G)]
    want, dropped = direct_token_choice(choices, E, K)
    assert_slots_equal(slots_of(r, G, E, S), want)
    assert int(r.dropped) == dropped


def test_expert_choice_router_takes_each_experts_top_tokens():
    torch.manual_seed(2)
    G, S, E = 2, 16, 4
    K = capacity(S, E, 2, 1.0)  # k = n·c/e with c = 2
    logits = torch.randn(G, S, E)
    r = route_expert_choice(logits, K)
    scores = logits.softmax(-1)  # Zhou et al.: S = Softmax(X · W_g) over experts
    taken = set()
    for g in range(G):
        for e in range(E):
            col = scores[g, :, e].tolist()
            best = sorted(range(S), key=lambda s: -col[s])[:K]
            assert sorted(r.slot_token[g, e].tolist()) == sorted(best)
            torch.testing.assert_close(r.slot_weight[g, e].sort().values, torch.tensor(sorted(col[s] for s in best)))
            taken |= {(g, s) for s in best}
    assert int(r.dropped) == G * S - len(taken)


def test_balance_and_z_losses_match_their_formulas():
    torch.manual_seed(3)
    G, S, E = 2, 8, 4
    logits = torch.randn(G, S, E)
    probs = logits.softmax(-1)
    first = probs.argmax(-1)
    want = 0.0
    for g in range(G):  # Switch eq. 4: α · N · Σ_i f_i · P_i, per group, token-weighted by S
        f = [sum(int(first[g, s]) == i for s in range(S)) / S for i in range(E)]
        P = [float(probs[g, :, i].mean()) for i in range(E)]
        want += S * E * sum(fi * pi for fi, pi in zip(f, P))
    assert abs(float(balance_loss_sum(probs, first)) - want) < 1e-12
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for grp in logits.tolist() for row in grp)
    assert abs(float(z_loss_sum(logits)) - z) < 1e-10
    uniform = torch.zeros(1, E, E)  # perfectly balanced: aux = S · E · Σ (1/E)(1/E) = S
    assert abs(float(balance_loss_sum(uniform.softmax(-1), torch.arange(E).view(1, E))) - E) < 1e-12


# --------------------------------------------------------------------------- the layer


def make_moe(router="topk", **kw) -> MoE:
    cfg = MoEConfig(**{"experts": 4, "top_k": 2, "router": router, "group_tokens": 8, "capacity_factor": 1.0, **kw})
    torch.manual_seed(4)
    m = MoE(16, 32, "gelu", cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def test_moe_layer_output_is_gate_weighted_sum_of_expert_mlps_and_zero_for_dropped():
    m = make_moe(capacity_factor=0.5).eval()  # 2 slots per expert and group of 8: 8 of 16 assignments
    x = torch.randn(2, 8, 16)
    y = m(x)
    r = m.route(x.view(-1, 8, 16), 2)
    want = torch.zeros(2, 8, 16).view(-1, 8, 16)
    xg = x.view(-1, 8, 16)
    w1, w2 = m.experts.fc_weight, m.experts.proj_weight
    hit = torch.zeros(xg.shape[:2], dtype=torch.bool)
    for g in range(xg.shape[0]):
        for e in range(4):
            for t, w in zip(r.slot_token[g, e].tolist(), r.slot_weight[g, e]):
                if t < 8:
                    want[g, t] += w * (F.gelu(xg[g, t] @ w1[e]) @ w2[e])
                    hit[g, t] = True
    torch.testing.assert_close(y.view(-1, 8, 16), want)
    assert (~hit).any(), "some token should lose both experts here"
    assert (y.view(-1, 8, 16)[~hit] == 0).all()


def test_aux_and_z_losses_reach_the_gradient_with_the_engine_scale():
    m = make_moe(aux_loss_weight=0.3, z_loss_weight=0.2).train()
    x = torch.randn(2, 8, 16)
    set_grad_scale(m, 0.125)
    m(x).sum().mul(0.125).backward()
    got = m.router.weight.grad.clone()
    m.zero_grad()
    m.grad_scale = 0.0  # auxiliary gradient off; add the losses by hand instead
    y = m(x)
    r = m.route(x.view(-1, 8, 16), 2)
    ((y.sum() + 0.3 * r.aux + 0.2 * r.z) * 0.125).backward()
    torch.testing.assert_close(got, m.router.weight.grad)


@pytest.mark.parametrize("router", ["topk", "switch"])
def test_router_randomness_depends_on_global_rows_not_on_the_split(router):
    kw = {"router_noise": 0.5, "random_routing": router == "topk"}
    m = make_moe(router, **kw).train()
    x = torch.randn(4, 8, 16)
    begin_step(m, seed=7, step=3, first_row=0)
    whole = m(x)
    begin_step(m, seed=7, step=3, first_row=0)
    first = m(x[:1])
    begin_step(m, seed=7, step=3, first_row=1)  # another rank's slice: rows 1..3 of the global batch
    rest = torch.cat([m(x[1:2]), m(x[2:])])  # its micro-batches continue the row count
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-12, atol=1e-12)  # matmul blocking only
    begin_step(m, seed=7, step=4, first_row=0)
    assert not torch.equal(m(x), whole)  # another step draws other noise


def test_router_runs_in_fp32_in_a_bf16_model():
    m = make_moe("switch").to(torch.bfloat16).eval()
    r = m.route(torch.randn(1, 8, 16).to(torch.bfloat16), 1)
    assert r.slot_weight.dtype == torch.float32 and m(torch.randn(1, 8, 16).bfloat16()).dtype == torch.bfloat16


def test_switch_init_scale_gives_truncated_normal_with_std_sqrt_s_over_fan_in():
    from scaletrain.model import build_gpt

    small = ["model.n_layers=1", "model.d_model=64", "model.moe.experts=8"]
    cfg = load_config(None, [*small, "model.moe.switch_init_scale=0.1"])
    model = build_gpt(cfg.model, 1, "cpu", torch.float64)
    w = model.blocks[0].mlp.experts.fc_weight  # (E, C, F): fan-in C = 64
    std = math.sqrt(0.1 / 64)
    assert w.abs().max() <= 2 * std + 1e-12
    assert abs(float(w.detach().std()) - 0.8796 * std) < 0.02 * std  # std of a normal truncated at ±2σ: 0.8796σ
    default = build_gpt(load_config(None, small).model, 1, "cpu", torch.float64)
    assert abs(float(default.blocks[0].mlp.router.weight.detach().std()) - 0.02) < 0.003  # GPT's N(0, 0.02)


# --------------------------------------------------------------------------- validate()


@pytest.mark.parametrize("sets, message", [
    (["model.moe.experts=6", "parallel.dp=4", "parallel.ep=4"],
     "model.moe.experts (6) is not divisible by parallel.ep (4)"),
    (["model.moe.experts=4", "parallel.dp=2", "parallel.ep=4"], "parallel.ep (4) must divide parallel.dp (2)"),
    (["model.moe.experts=4", "model.moe.top_k=5"], "model.moe.top_k (5) must be between 1 and model.moe.experts (4)"),
    (["model.moe.experts=4", "model.moe.capacity_factor=0"], "model.moe.capacity_factor must be > 0, got 0.0"),
    (["model.moe.experts=4", "model.moe.group_tokens=48"], "model.moe.group_tokens (48) must divide"),
    (["parallel.dp=2", "parallel.ep=2"], "parallel.ep (2) > 1 needs model.moe.experts > 0"),
    (["model.moe.experts=4", "model.moe.router=hash"], "model.moe.router must be one of"),
    (["model.moe.experts=4", "model.moe.random_routing=true", "model.moe.top_k=1"], "needs router topk with top_k 2"),
    (["model.moe.experts=4", "parallel.tp=2", "parallel.sequence_parallel=true", "model.moe.group_tokens=128"],
     "model.moe.group_tokens (128) to divide the tokens of a sequence shard, model.seq_len (128) / parallel.tp (2)"),
])
def test_validate_names_the_moe_values(sets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(load_config(None, sets))


# --------------------------------------------------------------------------- expert parallelism


MOE = {"model.moe.experts": 4, "model.moe.group_tokens": 16, "model.moe.capacity_factor": 1.0,
       "model.moe.aux_loss_weight": 0.05, "model.moe.z_loss_weight": 0.01, "train.steps": 3}


def _run(overrides: dict, rank: int = 0, world: int = 1):
    """Per-step (loss, loss_aux, loss_z, dropped) and the full final state (on every rank)."""
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    cfg = make_config({**TINY, **overrides})
    t = Trainer(cfg, None, DistEnv(rank, world, 0, "test") if world > 1 else None)
    rows = [t.train_step(s) for s in range(1, cfg.train.steps + 1)]
    return [(r["loss"], r["loss_aux"], r["loss_z"], r["moe_dropped"]) for r in rows], t.full_state()


def _rank_runs(rank, world, configs):
    out = []
    for o in configs:
        rows, state = _run(o, rank, world)
        out.append((rows, state if rank == 0 else None))
    return out


def _reference(o: dict):
    return _run({**o, "parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1, "parallel.ep": 1})


def _check(ref, par, what: str):
    (ref_rows, ref_state), (par_rows, par_state) = ref, par
    for step, (a, b) in enumerate(zip(ref_rows, par_rows), 1):
        for i, name in enumerate(("loss", "loss_aux", "loss_z")):
            assert abs(a[i] - b[i]) <= 1e-9 * abs(a[i]) + 1e-12, f"{what} step {step} {name}: {b[i]} vs {a[i]}"
        assert a[3] == b[3], f"{what} step {step}: dropped {b[3]} vs single-process {a[3]}"
    assert ref_state.keys() == par_state.keys()
    for name in ref_state:
        torch.testing.assert_close(par_state[name], ref_state[name], rtol=1e-9, atol=1e-11,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


WORLD2 = {
    "topk+noise+random-routing": {**MOE, "model.moe.router_noise": 0.5, "model.moe.random_routing": True},
    "switch+jitter+small-init": {**MOE, "model.moe.router": "switch", "model.moe.router_noise": 0.1,
                                 "model.moe.switch_init_scale": 0.1},
    # expert choice has no balance loss: validate() refuses an aux_loss_weight it would ignore
    "expert-choice": {**{k: v for k, v in MOE.items() if k != "model.moe.aux_loss_weight"},
                      "model.moe.router": "expert_choice", "model.moe.capacity_factor": 0.75},
}
WORLD4 = {
    "ep4": {**MOE, "parallel.dp": 4, "parallel.ep": 4},
    "ep2-in-dp4": {**MOE, "model.mlp": "swiglu", "parallel.dp": 4, "parallel.ep": 2},
    "ep2-dp2-tp2": {**MOE, "model.moe.every": 2, "parallel.dp": 2, "parallel.tp": 2, "parallel.ep": 2},
    "ep2-dp2-pp2": {**MOE, "model.moe.every": 2, "parallel.dp": 2, "parallel.pp": 2, "parallel.ep": 2},
}


def test_each_router_with_ep2_matches_single_process_including_dropped_counts():
    configs = [{**o, "parallel.dp": 2, "parallel.ep": 2} for o in WORLD2.values()]
    outs = run_ranks(_rank_runs, 2, configs, timeout=240)[0]
    for (name, o), par in zip(WORLD2.items(), outs):
        ref = _reference(o)
        assert sum(r[3] for r in ref[0]) > 0, f"{name}: the capacity factor should drop tokens"
        _check(ref, par, name)


def test_ep4_ep_inside_dp_with_tp_and_with_pp_match_single_process():
    outs = run_ranks(_rank_runs, 4, list(WORLD4.values()), timeout=300)[0]
    for (name, o), par in zip(WORLD4.items(), outs):
        _check(_reference(o), par, name)
