"""Reversible blocks (model.reversible: RevNet arXiv 1707.04585, Reformer arXiv 2001.04451).

Claims:
- the custom backward (rebuild each block's input from its output, then differentiate) gives the gradients autograd
  gives through the same forward, in fp64 to 1e-10 relative (measured: <= 6e-16), with layout-independent and
  torch dropout, RoPE, SwiGLU and mixture-of-experts blocks (top-k with router noise, random routing and expert
  dropout; switch; expert choice);
- saved activations and the peak of a forward+backward do not grow with depth (equal at 2, 4 and 8 blocks), while
  the standard block's grow by its per-layer bytes and full recomputation's by one B·T·C input per block;
- the reversible model trained in any layout (dp, ZeRO 1-3, tp, tp + sp, pp with 1F1B / GPipe / interleaved,
  experts over ep, ZeRO-3 with NVMe offload; world size 2) equals its own single-process run, fp64, with dropout:
  every step's loss and every final parameter within rtol 1e-10 (measured: <= 3e-13 relative to each tensor's
  max); PipeDream-2BW equals the single-process 2BW rule (dp x tp and dp x pp x ZeRO-3 on 4 ranks:
  `scaletrain verify`, docs/memory.md);
- the planner's `mem_activations` equals the measurement in every one of those layouts, to the byte (and in one
  process under bf16 and with selective recomputation); the analytic
  cost model counts the built model's parameters, depth-independent activations and one more forward per block;
- selective recomputation on top is bit-identical; what has nothing to act on is refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from harness import TINY, make_config, measured_and_planned, run_ranks, train_reference

from scaletrain.config import load_config, validate
from scaletrain.device.accounting import SavedTensorCounter, TensorPeak
from scaletrain.errors import ConfigError
from scaletrain.model import build_gpt, loss_sum
from scaletrain.model.dropout import begin_step
from scaletrain.model.moe import begin_step as begin_moe_step
from scaletrain.model.reversible import ReversibleBlock, reversible_blocks

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py

RTOL = 1e-10  # equivalence: 3 orders of magnitude above the measured 3e-13
GRAD_RTOL = 1e-10  # gradient check (measured <= 6e-16)


def model_config(**sets):
    base = {"model.n_layers": 4, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": 16,
            "model.reversible": "true"}
    return validate(load_config(None, [f"{k}={v}" for k, v in {**base, **sets}.items()]))


def grads_of(model, idx, tgt, custom: bool, seed: int = 11):
    """Loss and parameter gradients through the custom backward or plain autograd: two micro-batches whose forwards
    both run before the one backward (as GPipe does), so the reverse pass must restore what each forward read."""
    for b in reversible_blocks(model):
        b.custom_backward = custom
    begin_step(model, 5, 3, 0)  # layout-independent dropout: masks keyed by (seed, step, row)
    ctx = model.blocks[0].context
    begin_moe_step(model, 5, 3, 0)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # torch's dropout stream
    rows = idx.shape[0] // 2
    losses = []
    for i in range(2):
        ctx.at_micro(i, rows)
        losses.append(loss_sum(model(idx[i * rows:(i + 1) * rows]), tgt[i * rows:(i + 1) * rows]))
    loss = losses[0] + losses[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


VARIANTS = {
    "plain": {},
    "dropout": {"model.dropout": 0.1},
    "torch-dropout": {"model.dropout": 0.1, "model.dropout_impl": "torch"},
    "rope-swiglu-nobias": {"model.position": "rope", "model.mlp": "swiglu", "model.bias": "false"},
    "moe": {"model.moe.experts": 4, "model.moe.every": 2, "model.moe.group_tokens": 16, "model.moe.router_noise": 0.5,
            "model.moe.random_routing": "true", "model.moe.expert_dropout": 0.1, "model.dropout": 0.1},
    "switch": {"model.moe.experts": 4, "model.moe.group_tokens": 16, "model.moe.router": "switch",
               "model.moe.router_noise": 0.1},
    "expert-choice": {"model.moe.experts": 4, "model.moe.group_tokens": 16, "model.moe.router": "expert_choice"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_custom_backward_matches_autograd_through_the_same_forward(variant):
    cfg = model_config(**VARIANTS[variant])
    model = build_gpt(cfg.model, 1, "cpu", torch.float64)
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)
    loss_c, grads_c = grads_of(model, idx, tgt, custom=True)
    loss_a, grads_a = grads_of(model, idx, tgt, custom=False)
    assert torch.equal(loss_c, loss_a)  # the same forward
    for name, want in grads_a.items():
        err = (grads_c[name] - want).abs().max() / want.abs().max().clamp_min(1e-300)
        assert err <= GRAD_RTOL, f"{name}: relative error {float(err):.3g}"


def test_the_inverse_rebuilds_the_block_input():
    cfg = model_config()
    block = build_gpt(cfg.model, 1, "cpu", torch.float64).blocks[0]
    assert isinstance(block, ReversibleBlock)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        y = block(x)
    assert not torch.equal(y, x)
    assert (block.inverse(y) - x).abs().max() <= 1e-13 * x.abs().max()


def _saved_and_peak(mode: str, layers: int) -> tuple[int, int]:
    """Saved-activation bytes of one forward and the peak tensor bytes of forward + backward (gradients
    preallocated, so the peak is what the step's activations and temporaries need)."""
    import types

    from scaletrain.memory.recompute import apply_recompute

    sets = {"model.n_layers": layers, "model.d_model": 64, "model.seq_len": 32,
            "model.reversible": str(mode == "reversible").lower()}
    if mode == "full":
        sets["memory.recompute"] = "full"
    cfg = model_config(**sets)
    model = build_gpt(cfg.model, 1, "cpu", torch.float64)
    if mode == "full":
        apply_recompute(types.SimpleNamespace(module=model), cfg.memory)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    counter = SavedTensorCounter(model.parameters())
    with TensorPeak() as peak:
        with counter.active():
            loss = loss_sum(model(idx), idx)
        loss.backward()
    return counter.bytes, peak.peak


def test_saved_activations_and_peak_do_not_grow_with_depth():
    depths = (2, 4, 8)
    runs = {mode: [_saved_and_peak(mode, L) for L in depths] for mode in ("standard", "full", "reversible")}
    rev_saved, rev_peak = zip(*runs["reversible"])
    assert len(set(rev_saved)) == 1 and len(set(rev_peak)) == 1, runs["reversible"]
    block_input = 2 * 32 * 64 * 8  # B·T·C·e: what full recomputation keeps per block
    full = [s for s, _ in runs["full"]]
    assert full[1] - full[0] == 2 * block_input and full[2] - full[1] == 4 * block_input
    std = [s for s, _ in runs["standard"]]
    per_layer = (std[1] - std[0]) // 2
    assert std[2] - std[1] == 4 * per_layer > 4 * block_input
    assert rev_saved[0] < full[0] < std[0]


def test_selective_recomputation_on_reversible_blocks_is_bit_identical():
    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.parallel.parallelize import build_engine

    out = []
    for recompute in ("none", "selective"):
        cfg = model_config(**{"model.dropout": 0.1, "memory.recompute": recompute, "train.micro_batch": 2})
        engine = build_engine(cfg, Mesh.build(ParallelDims()), torch.device("cpu"), torch.float64, CommStats())
        g = torch.Generator().manual_seed(0)
        micro = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))]
        loss = engine.forward_backward(micro, 1.0)
        out.append((loss, {n: p.grad.clone() for n, p in engine.module.named_parameters()}))
    assert torch.equal(out[0][0], out[1][0])
    for name in out[0][1]:
        assert torch.equal(out[0][1][name], out[1][1][name]), name


@pytest.mark.parametrize("extra", [{}, {"model.mlp": "swiglu", "model.position": "rope", "model.bias": "false"},
                                   {"model.moe.experts": 4, "model.moe.every": 2}])
def test_analytic_planner_knows_reversible_blocks(extra):
    """The cost model's ModelSpec(reversible=True): parameter count (and tensor count) of the model we build,
    activations that do not depend on depth, and one more forward of the blocks in the hardware FLOPs."""
    from scaletrain.model import count_params
    from scaletrain.plan.analytic.estimate import estimate
    from scaletrain.plan.analytic.flops import forward_flops_per_token, step_flops
    from scaletrain.plan.analytic.inputs import Layout, Training
    from scaletrain.plan.analytic.params import param_counts
    from scaletrain.plan.catalog import from_model_config
    from scaletrain.plan.hardware import get_gpu

    acts = []
    for layers in (4, 16):
        cfg = model_config(**{"model.n_layers": layers, "model.d_model": 64, **extra})
        spec = from_model_config(cfg.model)
        model = build_gpt(cfg.model, 1, "meta")
        assert param_counts(spec).tensors == len(list(model.parameters()))
        from scaletrain.plan.analytic.params import total_params

        assert total_params(spec) == count_params(model)
        acts.append(estimate(spec, get_gpu("a100-80gb"), Training(16, "fp32"), Layout(micro_batch=8)).memory[
            "activations"])
        model_f, hw_f = step_flops(spec, 1000, "none")
        mats, attn, _ = forward_flops_per_token(spec)
        assert hw_f == pytest.approx(model_f + 1000 * (mats + attn) + 3000 * (mats - forward_flops_per_token(
            spec, padded=False)[0]))
    assert acts[0] == acts[1]


# --------------------------------------------------------------------------- layouts against one process

BASE = {**TINY, "model.reversible": "true", "model.n_layers": 4, "model.dropout": 0.1}
MOE = {**BASE, "model.moe.experts": 4, "model.moe.every": 2, "model.moe.group_tokens": 16}
TWO = {
    "dp2": {"parallel.dp": 2},
    "dp2-zero1": {"parallel.dp": 2, "parallel.zero": 1},
    "dp2-zero2": {"parallel.dp": 2, "parallel.zero": 2},
    "dp2-zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
    "pp2-1f1b": {"parallel.pp": 2, "parallel.schedule": "1f1b"},
    "pp2-gpipe": {"parallel.pp": 2, "parallel.schedule": "gpipe"},
    "pp2-interleaved": {"parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2},
    "dp2-ep2-moe": {"parallel.dp": 2, "parallel.ep": 2, "_base": "moe"},
    "dp2-zero3-nvme": {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "nvme"},  # + offload_dir below
}
TWO_BW = {"model.reversible": "true", "model.n_layers": 4, "parallel.pp": 2, "parallel.schedule": "2bw",
          "train.micro_batch": 2, "train.global_batch": 4, "train.steps": 4}


def _overrides(layout: dict) -> dict:
    layout = dict(layout)
    base = MOE if layout.pop("_base", None) == "moe" else BASE
    return {**base, **layout}


def _rank_runs(rank, world, layouts):
    """Each layout trained on these ranks: losses, full final parameters and rank 0's measured vs planned memory."""
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = {}
    for name, overrides in layouts.items():
        t = Trainer(make_config(overrides), None, DistEnv(rank, world, 0, "test"))
        losses = t.run().losses
        state = t.full_state()
        out[name] = (losses, state, measured_and_planned(t))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_pipeline_exec import reference_2bw

    two = {name: _overrides(lay) for name, lay in TWO.items()}
    two["dp2-zero3-nvme"]["parallel.offload_dir"] = str(tmp_path_factory.mktemp("nvme"))
    two["pp2-2bw"] = {**TINY, **TWO_BW}
    results = run_ranks(_rank_runs, 2, two, timeout=300)[0]  # one set of processes for all (start-up is the cost)
    refs = {"base": train_reference(BASE), "moe": train_reference(MOE)}
    ref_2bw = reference_2bw({**TINY, **TWO_BW})
    refs["2bw"] = (ref_2bw["losses"], ref_2bw["state"])
    return results, refs


def _assert_close_run(got, ref):
    losses, state = got[:2]
    ref_losses, ref_state = ref
    assert losses.keys() == ref_losses.keys()
    for step, want in ref_losses.items():
        assert abs(losses[step] - want) <= RTOL * abs(want), f"step {step}: {losses[step]!r} vs {want!r}"
    assert state.keys() == ref_state.keys()
    for name, want in ref_state.items():
        err = (state[name] - want).abs().max() / want.abs().max().clamp_min(1e-300)
        assert err <= RTOL, f"{name}: relative error {float(err):.3g}"


@pytest.mark.parametrize("name", list(TWO))
def test_reversible_layout_matches_its_single_process_run(runs, name):
    results, refs = runs
    layout = TWO[name]
    _assert_close_run(results[name], refs["moe" if layout.get("_base") == "moe" else "base"])


def test_reversible_pipedream_2bw_matches_the_single_process_2bw_rule(runs):
    results, refs = runs
    _assert_close_run(results["pp2-2bw"], refs["2bw"])


@pytest.mark.parametrize("name", [*TWO, "pp2-2bw"])
def test_planner_predicts_reversible_activation_bytes_exactly(runs, name):
    results, _ = runs
    mem = results[name][2]
    for category in ("activations", "params", "grads", "optim"):
        measured, planned = mem[category]
        assert measured == planned, (category, measured, planned)


@pytest.mark.parametrize("extra", [{"train.dtype": "bf16"}, {"train.dtype": "bf16", "model.position": "rope"},
                                   {"train.dtype": "fp32", "memory.recompute": "selective"}])
def test_planner_predicts_reversible_bytes_in_low_precision_and_with_selective(extra):
    """One process: under bf16 the final norm saves an fp32 copy, so the last chunk's output stream counts as well
    (plan.exact.run_memory.reversible_chunk_bytes); selective recomputation adds nothing to what the forward keeps."""
    from scaletrain.train.trainer import Trainer

    t = Trainer(make_config({**BASE, "train.steps": 1, **extra}))
    t.run()
    for category, (measured, planned) in measured_and_planned(t).items():
        assert measured == planned, (category, measured, planned)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("sets, words", [
    ({"model.d_model": 33, "model.n_heads": 3}, ["model.d_model (33) must be even"]),
    ({"model.d_model": 24, "model.n_heads": 8}, ["12 features", "model.n_heads (8)"]),
    ({"model.d_model": 24, "model.n_heads": 12, "model.position": "rope"}, ["even head size", "= 1"]),
    ({"memory.recompute": "full"}, ["memory.recompute=full", "keep no activations"]),
    ({"memory.recompute": "every:2"}, ["memory.recompute=every:2"]),
    ({"memory.offload_activations": "true"}, ["memory.offload_activations"]),
    ({"memory.compress": "int8"}, ["memory.compress=int8"]),
    ({"parallel.pp": 2, "parallel.schedule": "zb-h1", "model.n_layers": 4}, ["zb-h1"]),
    ({"parallel.tp": 3, "model.d_model": 54, "model.n_heads": 3, "model.mlp": "swiglu"},
     ["halves' MLP hidden size (128)", "parallel.tp (3)"]),
])
def test_reversible_refuses_with_a_reason(sets, words):
    cfg = load_config(None, [f"{k}={v}" for k, v in {"model.reversible": "true", **sets}.items()])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_reversible_odd_split_on_the_command_line_is_one_line_exit_2(capsys, tmp_path):
    from scaletrain.cli import main

    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--set", "model.reversible=true", "--set", "model.d_model=33",
                 "--set", "model.n_heads=3"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "model.d_model (33) must be even" in lines[0], lines[0]
    assert not out.exists()


def test_plan_command_line_reversible_flag(capsys):
    """`scaletrain plan --reversible` (custom dimensions): the estimate is of the reversible model (fewer
    parameters, activations that do not grow with depth, while the standard model's do); an odd hidden size is one
    line, exit 2."""
    import json

    from scaletrain.cli import main

    def plan(layers, *extra):
        code = main(["plan", "--layers", str(layers), "--hidden", "256", "--heads", "4", "--vocab", "256",
                     "--seq-len", "64", "--gpus", "1", "--global-batch", "8", "--layout", "dp=1,micro_batch=8",
                     "--json", *extra])
        assert code == 0
        doc = json.loads(capsys.readouterr().out)
        return doc["model"], doc["candidates"][0]["memory_bytes"]["activations"]

    (std8, a8), (std16, a16) = plan(8), plan(16)
    (rev8, r8), (rev16, r16) = plan(8, "--reversible"), plan(16, "--reversible")
    assert rev8["reversible"] and not std8["reversible"]
    assert rev16["params"] < std16["params"] and r8 == r16 < a8 < a16
    code = main(["plan", "--layers", "4", "--hidden", "33", "--heads", "3", "--vocab", "256", "--seq-len", "64",
                 "--gpus", "1", "--global-batch", "8", "--reversible"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "hidden size (33) in two halves: it must be even" in lines[0], lines[0]
