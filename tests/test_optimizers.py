"""Adafactor (arXiv 1804.04235) and SM3-II (arXiv 1901.11150) against direct implementations of the
papers' algorithm boxes, against torch.optim.Adafactor, and for their O(sum of dims) state.

References below are written independently of the library: Adafactor with the paper's *sums* and an
explicit outer product V̂ = R Cᵀ / (1ᵀR) (the library keeps means and never builds V̂); SM3 with a
literal loop over entries and cover sets in Python floats. All comparisons in float64.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn

from scaletrain.errors import ConfigError
from scaletrain.optim import SM3, Adafactor, build_optimizer, state_bytes

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


TOL = dict(rtol=1e-11, atol=1e-13)  # float64 rounding over a few steps; a wrong formula is off by >1e-3


def _grads(shape, steps, seed=0, zero_row_at_first=False):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(shape, generator=gen, dtype=F64) * (0.1 + t) for t in range(steps)]
    if zero_row_at_first and len(shape) >= 1:
        out[0][0] = 0.0  # exercises 0/0 = 0 in SM3 and ε1 in Adafactor
    return out


def _run(opt_cls, x0, grads, **kw):
    p = nn.Parameter(x0.clone())
    opt = opt_cls([p], **kw)
    traj = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        traj.append(p.detach().clone())
    return traj, opt, p


# ------------------------------------------------------------------------------------------ Adafactor


def adafactor_paper(x0, grads, lr=1e-2, decay=0.8, d=1.0, eps1=1e-30, eps2=1e-3, beta1=None, wd=0.0,
                    relative=True, scale=True):
    """Algorithms 4 (matrices; applied to each trailing n×m slice) and 5 (vectors) of the paper."""
    X = x0.clone()
    R = C = V = M = None
    traj = []
    for t, G in enumerate(grads, start=1):
        beta2 = 1.0 - t ** (-decay)
        rho = min(lr, 1.0 / math.sqrt(t)) if relative else lr
        rms_x = math.sqrt((X * X).sum().item() / X.numel())
        alpha = max(eps2, rms_x) * rho if scale else rho
        G2 = G * G + eps1
        if X.dim() >= 2:
            n, m = X.shape[-2:]
            slices = G2.reshape(-1, n, m)
            row = torch.stack([s @ torch.ones(m, dtype=F64) for s in slices])  # (G² + ε1) 1_m
            col = torch.stack([torch.ones(n, dtype=F64) @ s for s in slices])  # 1_nᵀ (G² + ε1)
            R = row if R is None else beta2 * R + (1 - beta2) * row
            C = col if C is None else beta2 * C + (1 - beta2) * col
            V = torch.stack([torch.outer(r, c) / (torch.ones(n, dtype=F64) @ r) for r, c in zip(R, C)])
            V = V.reshape(X.shape)
        else:
            V = G2 if V is None else beta2 * V + (1 - beta2) * G2
        U = G / torch.sqrt(V)
        rms_u = math.sqrt((U * U).sum().item() / U.numel())
        step = alpha * U / max(1.0, rms_u / d)
        if beta1 is not None:
            M = (1 - beta1) * step if M is None else beta1 * M + (1 - beta1) * step
            step = M
        X = X * (1 - lr * wd) - step
        traj.append(X.clone())
    return traj, R, C


SHAPES = [(6, 5), (7,), (2, 3, 4), ()]
SETTINGS = {
    "paper": {},
    "first_moment": dict(beta1=0.9),
    "weight_decay_and_clip": dict(weight_decay=0.1, clip_threshold=1.5),
    "absolute_step": dict(lr=3e-3, relative_step=False, scale_parameter=False, decay_rate=0.5),
}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_adafactor_matches_paper_algorithm_fp64(shape, setting):
    kw = SETTINGS[setting]
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = _grads(shape, 6, zero_row_at_first=True)
    traj, opt, p = _run(Adafactor, x0, grads, **kw)
    ref, R, C = adafactor_paper(
        x0, grads, lr=kw.get("lr", 1e-2), decay=kw.get("decay_rate", 0.8), d=kw.get("clip_threshold", 1.0),
        beta1=kw.get("beta1"), wd=kw.get("weight_decay", 0.0), relative=kw.get("relative_step", True),
        scale=kw.get("scale_parameter", True),
    )
    for ours, theirs in zip(traj, ref):
        torch.testing.assert_close(ours, theirs, **TOL)
    if len(shape) >= 2:  # the state is the paper's R and C, kept as means (÷ m and ÷ n)
        n, m = shape[-2:]
        torch.testing.assert_close(opt.state[p]["row"].reshape(-1, n) * m, R, **TOL)
        torch.testing.assert_close(opt.state[p]["col"].reshape(-1, m) * n, C, **TOL)


@pytest.mark.parametrize("shape", [(6, 5), (7,), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("torch_eps1", [1e-30, None])
def test_adafactor_matches_torch_adafactor(shape, weight_decay, torch_eps1):
    """Same definitions: torch's lr is our lr (the cap of ρ_t, and the weight-decay factor), its
    beta2_decay is −decay_rate, d = clip_threshold, eps[1] = ε2. torch applies ε1 as a floor
    (max(V̂, ε1²), max(mean R, ε1)) where the paper and we add ε1 to G²; the two agree unless G² is
    of order ε1 (1e-30, or float64 machine epsilon for torch's default eps1=None)."""
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    grads = _grads(shape, 6, seed=3)
    ours, _, _ = _run(Adafactor, x0, grads, lr=1e-2, weight_decay=weight_decay, clip_threshold=1.0)
    theirs, _, _ = _run(
        torch.optim.Adafactor, x0, grads, lr=1e-2, beta2_decay=-0.8, eps=(torch_eps1, 1e-3), d=1.0,
        weight_decay=weight_decay,
    )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL)


# ------------------------------------------------------------------------------------------ SM3


def sm3_paper(w0, grads, lr, momentum=0.0, wd=0.0):
    """SM3-II, entry by entry: ν(j) = min over covering sets of μ'(r) + g(j)²; μ'(r) = max over the set."""
    shape = tuple(w0.shape)
    entries = list(itertools.product(*[range(s) for s in shape]))
    if shape:
        sets = [(d, i) for d in range(len(shape)) for i in range(shape[d])]
        covers = {(d, i): {e for e in entries if e[d] == i} for d, i in sets}
    else:
        covers = {(0, 0): {()}}
    w = {e: w0[e].item() for e in entries}
    mom = dict.fromkeys(entries, 0.0)
    mu = dict.fromkeys(covers, 0.0)
    traj = []
    for G in grads:
        g = {e: G[e].item() for e in entries}
        new_mu = dict.fromkeys(covers, 0.0)
        nu = {}
        for j in entries:
            sets = [r for r, s in covers.items() if j in s]
            nu[j] = min(mu[r] for r in sets) + g[j] ** 2
            for r in sets:
                new_mu[r] = max(new_mu[r], nu[j])
        mu = new_mu
        for j in entries:
            u = g[j] / math.sqrt(nu[j]) if nu[j] > 0 else 0.0
            mom[j] = momentum * mom[j] + (1 - momentum) * u
            w[j] = w[j] * (1 - lr * wd) - lr * mom[j]
        out = torch.empty(shape, dtype=F64)
        for e in entries:
            out[e] = w[e]
        traj.append(out)
    return traj


@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 4), (6,), ()], ids=str)
@pytest.mark.parametrize(
    "kw", [dict(lr=0.1), dict(lr=0.05, momentum=0.9, weight_decay=0.1)], ids=["plain", "momentum_wd"]
)
def test_sm3_matches_paper_algorithm_fp64(shape, kw):
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    grads = _grads(shape, 5, seed=5, zero_row_at_first=True)
    ours, _, _ = _run(SM3, w0, grads, **kw)
    ref = sm3_paper(w0, grads, kw["lr"], kw.get("momentum", 0.0), kw.get("weight_decay", 0.0))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **TOL)


def test_sm3_on_a_vector_is_diagonal_adagrad():
    w0 = torch.randn(9, dtype=F64)
    grads = _grads((9,), 4, seed=6)
    ours, _, _ = _run(SM3, w0, grads, lr=0.1)
    theirs, _, _ = _run(torch.optim.Adagrad, w0, grads, lr=0.1, eps=0.0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL)


# ------------------------------------------------------------------------------------------ state size


@pytest.mark.parametrize("n,m", [(8, 16), (64, 32), (256, 512)])
def test_state_bytes_is_n_plus_m_for_a_matrix(n, m):
    def state_of(cls, shape, **kw):
        p = nn.Parameter(torch.zeros(shape))
        opt = cls([p], **kw)
        p.grad = torch.ones(shape)
        opt.step()
        return state_bytes(opt)

    assert state_of(Adafactor, (n, m)) == 4 * (n + m)
    assert state_of(SM3, (n, m)) == 4 * (n + m)
    assert state_of(Adafactor, (3, n, m)) == 4 * 3 * (n + m)  # factored per leading index
    assert state_of(SM3, (3, n, m)) == 4 * (3 + n + m)
    assert state_of(Adafactor, (n,)) == 4 * n and state_of(SM3, (n,)) == 4 * n
    # The optional first moments are full-size: what the default (off) saves.
    assert state_of(Adafactor, (n, m), beta1=0.9) == 4 * (n + m + n * m)
    assert state_of(SM3, (n, m), momentum=0.9) == 4 * (n + m + n * m)
    adam = state_of(torch.optim.AdamW, (n, m))
    assert adam >= 4 * 2 * n * m


@pytest.mark.parametrize("name,kw", [("adafactor", {}), ("sm3", dict(lr=0.1))])
def test_small_model_trains(name, kw):
    """Paper defaults (Adafactor's relative step needs no lr); 100 full-batch steps of a tiny MLP."""
    torch.manual_seed(0)
    x = torch.randn(128, 16)
    y = torch.sin(x @ torch.randn(16, 1))
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = build_optimizer(name, model.parameters(), **kw)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])


def test_bf16_parameters_keep_fp32_state():
    p = nn.Parameter(torch.randn(8, 4).bfloat16())
    for cls in (Adafactor, SM3):
        opt = cls([p])
        p.grad = torch.randn(8, 4).bfloat16()
        opt.step()
        assert all(v.dtype == torch.float32 for v in opt.state[p].values() if isinstance(v, torch.Tensor))
        assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()


# ------------------------------------------------------------------------------------------ build


def test_build_optimizer_names_and_errors():
    p = [nn.Parameter(torch.zeros(3, 3))]
    assert isinstance(build_optimizer("adamw", p, lr=1e-3, betas=(0.9, 0.95)), torch.optim.AdamW)
    assert isinstance(build_optimizer("Adafactor", p, beta1=None), Adafactor)
    assert isinstance(build_optimizer("sm3", p, momentum=0.9), SM3)
    with pytest.raises(ConfigError, match="'lion'"):
        build_optimizer("lion", p)
    with pytest.raises(ConfigError, match="betas"):
        build_optimizer("sm3", p, betas=(0.9, 0.99))
    with pytest.raises(ConfigError, match="decay_rate"):
        build_optimizer("adafactor", p, decay_rate=1.5)



def test_every_registered_optimizer_builds_from_its_config_keywords():
    """Each registry entry's constructor keywords (`config_hyper`) are accepted by its class, at lr x its scale; the
    registry describes exactly the names the config accepts."""
    from scaletrain.config import OptimConfig
    from scaletrain.config.schema import OPTIMIZER_NAMES
    from scaletrain.optim import OPTIMIZERS, config_hyper, decay_groups, optimizer_class

    assert set(OPTIMIZERS) == set(OPTIMIZER_NAMES)
    p = [nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))]
    for name, spec in OPTIMIZERS.items():
        opt = build_optimizer(name, decay_groups(p, 0.1), **config_hyper(OptimConfig(name=name), 1e-3))
        assert type(opt) is optimizer_class(name), name
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * spec.lr_scale), name
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0], name


def test_a_new_plain_optimizer_is_one_registry_entry_and_zero_shards_it(monkeypatch):
    """A plain (element-wise) optimizer added to the registry runs under ZeRO on flat shard pieces exactly as on whole
    tensors, and ZeRO's byte prediction counts its state; no call site compares names (this used to be a KeyError:
    every name other than adamw was taken for a factored optimizer)."""
    import dataclasses

    from scaletrain.optim import OPTIMIZERS, decay_groups
    from scaletrain.parallel.zero import ZeroOptimizer, predict_bytes

    rms = dataclasses.replace(OPTIMIZERS["sgd"], name="rmsprop", cls="torch.optim:RMSprop", sharded=True,
                              lr_scale=1.0, moments=1, momentum_buffer=False, hyper=lambda o, lr: {"lr": lr})
    monkeypatch.setitem(OPTIMIZERS, "rmsprop", rms)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).double()

    x, y = torch.randn(4, 5, dtype=F64), torch.randn(4, 3, dtype=F64)
    ref = model()
    ref_opt = torch.optim.RMSprop(decay_groups(list(ref.parameters()), 0.1), lr=1e-2)
    sharded = model()
    opt = ZeroOptimizer(sharded, 1, None, optimizer="rmsprop", hyper={"lr": 1e-2}, weight_decay=0.1, bucket_mb=1e-4)
    assert isinstance(opt.opt, torch.optim.RMSprop)
    for _ in range(3):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.begin_micro(0, 1)
        torch.nn.functional.mse_loss(sharded(x), y).backward()
        opt.finish_backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), sharded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)  # element-wise: the same arithmetic
    numel = sum(q.numel() for q in sharded.parameters())
    assert predict_bytes(sharded, 1, 1, bucket_mb=1e-4, optimizer="rmsprop")["optim"] == numel * 8  # one square_avg

# ------------------------------------------------------------------------------------------ ZeRO plan


def _flat_slices(numel, world):
    cuts = [0, 3, 17, numel] if world == 3 else [round(numel * r / world) for r in range(world + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def test_adafactor_shard_layout_reproduces_unsharded_steps():
    """Simulate 3 ranks with uneven flat slices of a 5×7 matrix following `Adafactor.shard_layout`:
    local R rows + replicated C, one SUM all-reduce of partial row/column means of G², two scalar sums."""
    n, m = 5, 7
    x0 = torch.randn(n, m, dtype=F64)
    grads = _grads((n, m), 4, seed=7)
    ref, _, _ = _run(Adafactor, x0, grads)
    slices = _flat_slices(n * m, 3)
    plans = [Adafactor.shard_layout((n, m), s, e) for s, e in slices]
    # flat [0,3) [3,17) [17,35) of rows of 7: rows {0}, {0,1,2}, {2,3,4}; C whole on every rank
    assert [p[0].local for p in plans] == [(slice(0, 1),), (slice(0, 3),), (slice(2, 5),)]
    assert all(p[1].reduce == "sum" and p[1].local_numel == m for p in plans)
    R = [torch.zeros(n, dtype=F64)[plan[0].local] for plan in plans]
    C = [torch.zeros(m, dtype=F64) for _ in plans]
    x = x0.reshape(-1).clone()
    for t, G in enumerate(grads, start=1):
        g = G.reshape(-1)
        rows, cols = torch.arange(n * m) // m, torch.arange(n * m) % m
        partial = []
        for s, e in slices:  # each rank: row and column means of G² over its own entries only
            buf = torch.zeros(n + m, dtype=F64)
            buf.index_add_(0, rows[s:e], g[s:e] ** 2 / m)
            buf.index_add_(0, n + cols[s:e], g[s:e] ** 2 / n)
            partial.append(buf)
        total = torch.stack(partial).sum(0)  # the all-reduce (SUM)
        beta = 1 - t ** -0.8
        u_parts, x_sq = [], sum((x[s:e] ** 2).sum() for s, e in slices)  # scalar all-reduce of Σ X²
        for k, ((s, e), plan) in enumerate(zip(slices, plans)):
            r0 = plan[0].local[0].start
            R[k] = beta * R[k] + (1 - beta) * total[:n][plan[0].local]
            C[k] = beta * C[k] + (1 - beta) * total[n:]
            denom = (R[k][rows[s:e] - r0] * C[k][cols[s:e]] / C[k].mean()).sqrt()
            u_parts.append(g[s:e] / denom)
        u_sq = sum((u ** 2).sum() for u in u_parts)  # scalar all-reduce of Σ U²
        alpha = max(1e-3, math.sqrt(x_sq / (n * m))) * min(1e-2, 1 / math.sqrt(t))
        clip = max(1.0, math.sqrt(u_sq / (n * m)))
        for (s, e), u in zip(slices, u_parts):
            x[s:e] -= alpha * u / clip
        torch.testing.assert_close(x.reshape(n, m), ref[t - 1], **TOL)
    persistent = sum(len(range(*p[0].local[0].indices(n))) + m for p in plans)
    assert persistent <= n + 2 + 3 * m  # rows split at a boundary are held twice; C replicated


def test_sm3_shard_layout_reproduces_unsharded_steps():
    """3 ranks, uneven flat slices of a 5×7 matrix: local acc0 rows, replicated acc1, MAX all-reduce."""
    n, m = 5, 7
    w0 = torch.randn(n, m, dtype=F64)
    grads = _grads((n, m), 4, seed=8, zero_row_at_first=True)
    ref, _, _ = _run(SM3, w0, grads, lr=0.1)
    slices = _flat_slices(n * m, 3)
    plans = [SM3.shard_layout((n, m), s, e) for s, e in slices]
    assert all(p[0].reduce == "max" and p[1].local == (slice(0, m),) for p in plans)
    acc0 = [torch.zeros(n, dtype=F64)[p[0].local] for p in plans]
    acc1 = [torch.zeros(m, dtype=F64) for _ in plans]
    rows, cols = torch.arange(n * m) // m, torch.arange(n * m) % m
    w = w0.reshape(-1).clone()
    for t, G in enumerate(grads, start=1):
        g = G.reshape(-1)
        nus, partial = [], []
        for k, ((s, e), plan) in enumerate(zip(slices, plans)):
            r0 = plan[0].local[0].start
            nu = torch.minimum(acc0[k][rows[s:e] - r0], acc1[k][cols[s:e]]) + g[s:e] ** 2
            buf = torch.zeros(n + m, dtype=F64)
            buf.scatter_reduce_(0, rows[s:e], nu, "amax")
            buf.scatter_reduce_(0, n + cols[s:e], nu, "amax")
            nus.append(nu)
            partial.append(buf)
        total = torch.stack(partial).amax(0)  # the all-reduce (MAX)
        for k, ((s, e), plan, nu) in enumerate(zip(slices, plans, nus)):
            acc0[k] = total[:n][plan[0].local]
            acc1[k] = total[n:].clone()
            u = torch.where(nu > 0, g[s:e] / nu.sqrt(), torch.zeros((), dtype=F64))
            w[s:e] -= 0.1 * u
        torch.testing.assert_close(w.reshape(n, m), ref[t - 1], **TOL)
