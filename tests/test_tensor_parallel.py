"""Tensor and sequence parallelism (Megatron) equal to the single-process run; comm and activation counts.

Every equivalence test trains the real Trainer in fp64 on the byte data (harness TINY: 2 layers, d_model 32,
seq 32, 4 steps) and compares the loss of every step and the final gathered parameters with the
single-process run. Tolerance rtol 1e-11, atol 1e-12: measured differences are at most 1.8e-15 in the loss
and 3.7e-14 in any parameter (tp=3, d_model 48; 4e-15 to 9e-15 elsewhere), i.e. summation order only.

Spawning processes costs 5-15 s on the shared 2-core machine while a tiny run costs under a second, so
each world size is spawned once (module-scoped fixtures) and runs all its layouts; each test reads its part.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import TINY, make_config, run_ranks, train_reference

from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError, UserError
from scaletrain.parallel.tensor_parallel import RNGTracker, vocab_parallel_cross_entropy
from scaletrain.parallel.tp_plan import Column, Replicated, Row, Split, apply_tp_plan

RTOL, ATOL = 1e-11, 1e-12
HAS_ZERO = importlib.util.find_spec("scaletrain.parallel.zero") is not None

TP2 = {"parallel.tp": 2}
SWIGLU = {"model.mlp": "swiglu", "model.position": "rope", "model.tie_embeddings": False, "model.bias": False,
          "model.vocab_size": 257}
TP3 = {"model.d_model": 48, "model.n_heads": 6, "model.vocab_size": 257}  # 3 divides neither 256 nor 257

RUNS2 = {
    "tp2": TP2,
    "tp2_sp": {**TP2, "parallel.sequence_parallel": True},
    "tp2_vocab257": {**TP2, "model.vocab_size": 257},
    "tp2_sp_vocab257": {**TP2, "parallel.sequence_parallel": True, "model.vocab_size": 257},
    "tp2_sp_swiglu_rope_untied": {**TP2, "parallel.sequence_parallel": True, **SWIGLU},
}
RUNS4 = {
    "tp4": {"parallel.tp": 4},
    "dp2_tp2": {"parallel.dp": 2, "parallel.tp": 2},
    "dp2_tp2_sp": {"parallel.dp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
}
if HAS_ZERO:
    RUNS4["dp2_tp2_zero1"] = {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 1}
RUNS3 = {"tp3": {**TP3, "parallel.tp": 3}}


def _model_part(overrides: dict) -> dict:
    return {k: v for k, v in overrides.items() if not k.startswith("parallel.")}


# ----------------------------------------------------------------------------- rank-side jobs


def _train(rank, world, overrides):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    t = Trainer(make_config({**TINY, **overrides}), None, DistEnv(rank, world, 0, "test"))
    result = t.run()
    return result.losses, t.full_state(), {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def _probe(rank, world, n_layers, sp, mlp="gelu"):
    """CommStats bytes by kind and saved-activation bytes of one forward+backward of one micro-batch."""
    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.parallel.parallelize import build_engine

    cfg = make_config({**TINY, "model.n_layers": n_layers, "parallel.tp": world, "parallel.sequence_parallel": sp,
                       "model.mlp": mlp})
    comm = CommStats()
    engine = build_engine(cfg, Mesh.build(ParallelDims(tp=world), 60), torch.device("cpu"), torch.float64, comm)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (cfg.train.micro_batch, cfg.model.seq_len), generator=g) for _ in range(2))
    engine.forward_backward([(x, y)], 1.0)
    return dict(comm.bytes), engine.activation_bytes


def _session(rank, world, runs, probes, dropout):
    out = {"runs": {}, "probes": {}}
    for name, overrides in runs.items():
        losses, full, local = _train(rank, world, overrides)
        out["runs"][name] = (losses, full if rank == 0 else None)
    for key in probes:
        out["probes"][key] = _probe(rank, world, *key)
    if dropout:  # replicated regions must draw identical masks on the tp ranks, or the copies drift apart
        losses, _, local = _train(rank, world, {**TP2, "model.dropout": 0.1, "train.steps": 3})
        out["dropout"] = (losses, local)
    return out


@pytest.fixture(scope="module")
def world2():
    probes = [(n, sp, mlp) for n in (1, 2) for sp in (False, True) for mlp in ("gelu", "swiglu")]
    return run_ranks(_session, 2, RUNS2, probes, True, timeout=400)


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_session, 4, RUNS4, [], False, timeout=400)


@pytest.fixture(scope="module")
def world3():
    return run_ranks(_session, 3, RUNS3, [], False, timeout=300)


_refs: dict = {}


def _reference(overrides: dict):
    key = json.dumps(_model_part(overrides), sort_keys=True)
    if key not in _refs:
        _refs[key] = train_reference(_model_part(overrides))
    return _refs[key]


def _assert_matches(name: str, runs: dict, overrides: dict) -> None:
    ref_losses, ref_state = _reference(overrides)
    losses, state = runs[name]
    assert losses.keys() == ref_losses.keys()
    for step, ref in ref_losses.items():
        assert abs(losses[step] - ref) <= ATOL + RTOL * abs(ref), f"{name} step {step}: {losses[step]!r} vs {ref!r}"
    assert state.keys() == ref_state.keys()
    for k, ref in ref_state.items():
        assert state[k].shape == ref.shape, f"{name} {k}: {tuple(state[k].shape)} vs {tuple(ref.shape)}"
        torch.testing.assert_close(state[k], ref, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{name} {k}: {m}")
    loss_diff = max(abs(losses[s] - ref_losses[s]) for s in ref_losses)
    param_diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    print(f"{name}: max |loss diff| {loss_diff:.2e}, max |param diff| {param_diff:.2e}")  # shown with -s


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", ["tp2", "tp2_sp"])
def test_tp2_with_and_without_sequence_parallel_matches_single_process(world2, name):
    _assert_matches(name, world2[0]["runs"], RUNS2[name])


@pytest.mark.parametrize("name", ["tp2_vocab257", "tp2_sp_vocab257"])
def test_vocab_not_divisible_by_tp_is_padded_without_changing_the_loss(world2, name):
    _assert_matches(name, world2[0]["runs"], RUNS2[name])


def test_swiglu_rope_untied_biasless_gpt_with_sequence_parallel_matches(world2):
    _assert_matches("tp2_sp_swiglu_rope_untied", world2[0]["runs"], RUNS2["tp2_sp_swiglu_rope_untied"])


@pytest.mark.parametrize("name", list(RUNS4))
def test_tp4_and_dp2_x_tp2_match_single_process(world4, name):
    _assert_matches(name, world4[0]["runs"], RUNS4[name])


def test_tp3_which_divides_neither_256_nor_the_vocab_matches(world3):
    _assert_matches("tp3", world3[0]["runs"], RUNS3["tp3"])


# ----------------------------------------------------------------------------- dropout streams


def test_dropout_keeps_replicated_parameters_identical_on_tp_ranks(world2):
    (l0, s0), (l1, s1) = world2[0]["dropout"], world2[1]["dropout"]
    assert l0 == l1  # the vocab-parallel loss is the full loss on every tp rank
    replicated = [k for k in s0 if s0[k].shape == s1[k].shape and ("ln" in k or "wpe" in k or "proj.bias" in k)]
    assert len(replicated) == 2 * 6 + 3  # per block ln1, ln2 (w, b), two row biases; wpe, ln_f (w, b)
    for k in replicated:
        assert torch.equal(s0[k], s1[k]), k
    # and the run did use dropout: the losses differ from the dropout-free tp2 run
    assert l0[1] != world2[0]["runs"]["tp2"][0][1]


class _Toy(nn.Module):
    """block = up (column) then dropout in the split region; down (row); dropout on the replicated output."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential()
        self.block.up, self.block.inner = nn.Linear(16, 64), nn.Dropout(0.5)
        self.down, self.outer = nn.Linear(64, 16), nn.Dropout(0.5)

    def forward(self, x):
        return self.outer(self.down(self.block(x)))


def _toy_masks(tp_rank: int, sequence_parallel: bool = False):
    """Masks the toy draws as tp rank `tp_rank` would (group None: the layers are whole; only the streams
    are those of that rank), from the same shared generator state; and the shared stream's next draw."""
    model = _Toy()
    plan = {"block": Split(), "block.up": Column(), "down": Row(), "outer": Replicated()}
    apply_tp_plan(model, plan, None, rng=RNGTracker(tp_rank, torch.device("cpu")))
    masks = {}
    model.block.inner.register_forward_hook(lambda m, a, o: masks.__setitem__("inner", o != 0))
    model.outer.register_forward_hook(lambda m, a, o: masks.__setitem__("outer", o != 0))
    torch.manual_seed(123)
    model(torch.ones(4, 16) + torch.rand(4, 16))
    return masks, torch.rand(3)


def test_rng_tracker_split_regions_differ_replicated_regions_agree():
    (m0, next0), (m1, next1) = _toy_masks(0), _toy_masks(1)
    assert not torch.equal(m0["inner"], m1["inner"])  # split region: per-rank streams
    assert torch.equal(m0["outer"], m1["outer"])  # replicated region: the shared stream
    assert torch.equal(next0, next1)  # the shared stream stays in step after the split region
    again, _ = _toy_masks(0)
    assert torch.equal(again["inner"], m0["inner"])  # split stream = f(shared state, rank): resumable


def test_rng_tracker_regions_nest_and_restore():
    tracker = RNGTracker(1, torch.device("cpu"))
    torch.manual_seed(7)
    with tracker.region("split"):
        a = torch.rand(2)
        with tracker.region("shared"):
            shared_inside = torch.rand(2)
        b = torch.rand(2)
    after = torch.rand(2)
    torch.manual_seed(7)
    torch.randint(0, 2**62, (1,))  # each entry into split draws one number from the shared stream
    assert torch.equal(torch.rand(2), shared_inside)
    torch.randint(0, 2**62, (1,))
    assert torch.equal(torch.rand(2), after)
    assert not torch.equal(a, shared_inside) and not torch.equal(a, b)
    assert tracker.mode == "shared"


# ----------------------------------------------------------------------------- vocab-parallel loss


def test_padded_logits_never_change_the_loss_or_get_gradient():
    g = torch.Generator().manual_seed(0)
    V, pad = 257, 3
    logits = torch.randn(6, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (6,), generator=g)
    padded = torch.cat([logits, torch.full((6, pad), 50.0, dtype=torch.float64)], 1).requires_grad_()
    loss = vocab_parallel_cross_entropy(padded, target, None, 0, V)
    ref = F.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(loss, ref, rtol=1e-14, atol=1e-14)
    loss.sum().backward()
    exact = torch.autograd.functional.jacobian(lambda z: F.cross_entropy(z, target, reduction="sum"), logits)
    torch.testing.assert_close(padded.grad[:, :V], exact, rtol=1e-13, atol=1e-14)
    assert torch.count_nonzero(padded.grad[:, V:]) == 0
    # unmasked, the padding (a zero or any logit) would have changed the loss: the silent error guarded against
    assert (F.cross_entropy(padded.detach(), target, reduction="none") - ref).abs().min() > 1.0


# ----------------------------------------------------------------------------- measured counts


def _elements_per_token(h: int, a: int, t: int, sp: bool) -> float:
    """Elements one layer saves per token in our implementation (flash attention, no dropout): replicated
    4h (ln1, ln2 inputs; qkv, fc inputs) + 4 LayerNorm statistics; split 12h (q, k, v; attention output;
    GELU input and output, 4h each) + a log-sum-exp values. With sequence parallelism everything is split."""
    rep, split = 4 * h + 4, 12 * h + a
    return (rep + split) / t if sp else rep + split / t


@pytest.mark.parametrize("sp", [False, True])
def test_activation_bytes_per_layer_match_the_korthikanti_terms(world2, sp):
    b, s, h, a = TINY["train.micro_batch"], TINY["model.seq_len"], TINY["model.d_model"], TINY["model.n_heads"]
    e, t = 8, 2
    one, two = (world2[0]["probes"][(n, sp, "gelu")][1] for n in (1, 2))
    assert two - one == e * b * s * _elements_per_token(h, a, t, sp)
    # the same terms with t = 1 on one process: 16h + 4 + a elements per token
    single = _probe(0, 1, 2, False)[1] - _probe(0, 1, 1, False)[1]
    assert single == e * b * s * (16 * h + 4 + a) == e * b * s * _elements_per_token(h, a, 1, False)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_tp_communication_per_layer_matches_the_analytic_count(world2, sp, mlp):
    b, s, h, e, t = TINY["train.micro_batch"], TINY["model.seq_len"], TINY["model.d_model"], 8, 2
    one, two = (world2[0]["probes"][(n, sp, mlp)][0] for n in (1, 2))
    per_layer = {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two) if two.get(k, 0) != one.get(k, 0)}
    act = b * s * h * e  # one (b, s, h) activation
    if not sp:  # f and g: 2 all-reduces forward (after attn.proj, mlp.proj), 2 backward (before qkv, fc;
        # SwiGLU's gate and up share one f at the MLP's entry)
        assert per_layer == {"tp.all_reduce": 4 * 2 * (t - 1) / t * act}
    else:  # all-gathers: 2 forward, 2 re-gathers (3 with gate and up) + 2 in g_sp backward; reduce-scatters
        # 2 + 2; the gradient all-reduce of the 6 replicated vectors (ln1, ln2 w and b, two row biases)
        regathers = 3 if mlp == "swiglu" else 2
        assert per_layer == {"tp.all_gather": (4 + regathers) * (t - 1) / t * act,
                             "tp.reduce_scatter": 4 * (t - 1) / t * act, "tp.all_reduce": 6 * 2 * (t - 1) / t * h * e}


# ----------------------------------------------------------------------------- config and plans


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=3", "model.n_heads=4", "model.d_model=36"], "model.n_heads (4) is not divisible by parallel.tp (3)"),
    (["parallel.tp=8", "model.n_heads=8", "model.d_model=36"], "model.d_model (36) is not divisible by parallel.tp"),
    (["parallel.tp=3", "model.n_heads=3", "model.d_model=48", "model.d_ff=100"],
     "the MLP hidden size model.d_ff (100) is not divisible by parallel.tp (3)"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=33"],
     "model.seq_len (33) divisible by parallel.tp (2)"),
])
def test_validate_rejects_indivisible_tp_layouts_naming_the_values(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    assert message in str(e.value), str(e.value)


def test_validate_rejects_tp_larger_than_the_processes():
    with pytest.raises(ConfigError, match=r"parallel.tp \(4\) is larger than the number of processes \(2\)"):
        validate(load_config(None, ["parallel.tp=4"]), 2)
    validate(load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true"]), 2)


def test_plan_errors_name_the_module():
    model = _Toy()
    with pytest.raises(UserError, match=r"\['nope\.\*'\] match no module"):
        apply_tp_plan(copy.deepcopy(model), {"nope.*": Column()}, None)
    with pytest.raises(UserError, match="block.inner is Dropout, Column needs Linear"):
        apply_tp_plan(copy.deepcopy(model), {"block.inner": Column()}, None)


# ----------------------------------------------------------------------------- command line


def test_cli_trains_with_tp2_and_reports_the_single_process_loss(tmp_path):
    sets = {**TINY, "parallel.tp": 2, "train.steps": 2, "train.dtype": "fp32"}
    argv = [sys.executable, "-m", "scaletrain", "train", "--nproc", "2", "--out", str(tmp_path / "o")]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in (tmp_path / "o/metrics.jsonl").read_text().splitlines()]
    ref_losses, _ = train_reference({"train.steps": 2, "train.dtype": "fp32"})
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # fp32: the tp sums run in another order; measured ~1e-7 relative
        assert abs(r["loss"] - ref_losses[r["step"]]) < 1e-5 * ref_losses[r["step"]]
    assert rows[0]["mem_activations"] > 0
