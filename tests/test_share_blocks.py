"""model.share_blocks (WideNet arXiv 2107.11817, ALBERT arXiv 1909.11942): one set of attention / MLP (or MoE)
weights for every block, per-block norms, the shared gradient the sum over layers. dp, ZeRO-1/2/3, 1d tensor
parallelism (with and without sequence parallelism, with recomputation), expert parallelism with dp (and ZeRO-3) and
context parallelism equal one process in fp64 (parallel/shared_blocks.py); each layout keeps the distinct parameter
tensors the sharing implies and the plan's memory equals the engine's."""

from __future__ import annotations

import pytest
import torch
from harness import TINY, assert_same_run, make_config, run_ranks, train_parallel, train_reference

from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError
from scaletrain.model.gpt import GPT, loss_sum

WIDENET = {"model.share_blocks": "true", "model.n_layers": 3, "model.moe.experts": 4, "model.moe.every": 1}


def _model(overrides: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(make_config({**TINY, **overrides}).model).double()


def test_widenet_has_the_distinct_tensors_the_sharing_implies():
    shared, plain = _model(WIDENET), _model({**WIDENET, "model.share_blocks": "false"})
    per_block = {n.split(".", 2)[2] for n, _ in plain.named_parameters() if n.startswith("blocks.0.")}
    norms = {n for n in per_block if n.startswith(("ln1.", "ln2."))}
    n_plain = len(list(plain.parameters()))
    # one copy of attention + MoE, n_layers copies of the two norms
    assert len(list(shared.parameters())) == n_plain - (3 - 1) * (len(per_block) - len(norms))
    assert shared.blocks[2].mlp is shared.blocks[0].mlp and shared.blocks[1].attn is shared.blocks[0].attn
    assert shared.blocks[1].ln1 is not shared.blocks[0].ln1 and shared.blocks[2].ln2 is not shared.blocks[0].ln2


def test_shared_gradient_is_the_sum_of_the_per_layer_gradients():
    """Independent reference: an unshared model whose blocks hold copies of the same weights; the shared weight's
    gradient must be the sum of the copies' gradients, each norm's gradient its own layer's."""
    over = {"model.share_blocks": "true", "model.n_layers": 3}
    shared = _model(over)
    plain = _model({**over, "model.share_blocks": "false"})
    state = {k: v for k, v in shared.state_dict().items()}
    plain.load_state_dict(state)  # state_dict lists the shared modules under every block: copies into each
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    for m in (shared, plain):
        loss_sum(m(idx), tgt).backward()
    for name, p in shared.blocks[0].attn.named_parameters():
        total = sum(dict(b.attn.named_parameters())[name].grad for b in plain.blocks)
        torch.testing.assert_close(p.grad, total, rtol=1e-10, atol=1e-12)
    for name, p in shared.blocks[0].mlp.named_parameters():
        total = sum(dict(b.mlp.named_parameters())[name].grad for b in plain.blocks)
        torch.testing.assert_close(p.grad, total, rtol=1e-10, atol=1e-12)
    for i in range(3):
        torch.testing.assert_close(shared.blocks[i].ln1.weight.grad, plain.blocks[i].ln1.weight.grad,
                                   rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def widenet_reference():
    return train_reference(WIDENET)


def test_widenet_dp2_equals_one_process(widenet_reference):
    assert_same_run(widenet_reference, train_parallel({**WIDENET, "parallel.dp": 2}, 2), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("zero", [1, 2])
def test_widenet_under_zero_equals_one_process(widenet_reference, zero):
    """A shared weight is one parameter: ZeRO shards its optimizer state (and, at 2, its gradient) once."""
    got = train_parallel({**WIDENET, "parallel.dp": 2, "parallel.zero": zero}, 2)
    assert_same_run(widenet_reference, got, rtol=1e-9, atol=1e-11)


# --------------------------------------------------------------------------- the parallel layouts

DENSE = {"model.share_blocks": "true", "model.n_layers": 3}
# name: (reference, overrides), world 2 each; tp shards the shared attention (and the dense shared MLP), ep splits the
# shared experts, ZeRO-3 makes the shared attention and MoE layer units of their own, cp swaps the shared attention's
# core once
LAYOUTS = {
    # WideNet under tp: the shared MoE layer replicated over tp, its attention split; the shared modules re-run in
    # each block's checkpoint
    "tp2_recompute": (WIDENET, {"parallel.tp": 2, "memory.recompute": "full"}),
    "tp2_sp": (DENSE, {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),
    "dp2_ep2": (WIDENET, {"parallel.dp": 2, "parallel.ep": 2}),
    "dp2_zero3": (WIDENET, {"parallel.dp": 2, "parallel.zero": 3}),
    "dp2_ep2_zero3": (WIDENET, {"parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3}),
    "cp2": (DENSE, {"parallel.cp": 2}),  # ring attention swapped into the shared attention once
}


def _layout_rank(rank, world, runs):
    """Each run's (losses, full state) and, of this rank's engine, the distinct parameter tensors, whether the
    blocks still share one attention and MLP module, the ZeRO-3 flat groups (units holding parameters) and the
    measured memory next to the plan the trainer logged."""
    from harness import measured_and_planned

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for overrides in runs:
        t = Trainer(make_config({**TINY, **overrides}), None, DistEnv(rank, world, 0, "test"))
        result = t.run()
        state = t.full_state()
        blocks = t.engine.module.blocks
        opt = t.engine.optimizer
        parts = getattr(opt, "parts", (opt,))
        out.append({"run": (result.losses, state), "tensors": len(list(t.engine.module.parameters())),
                    "memory": measured_and_planned(t),
                    "tied": all(b.attn is blocks[0].attn and b.mlp is blocks[0].mlp for b in blocks),
                    "units": sum(len(getattr(o, "groups", [])) for o in parts if getattr(o, "stage", 0) == 3)})
    return out


@pytest.fixture(scope="module")
def dense_reference():
    return train_reference(DENSE)


@pytest.fixture(scope="module")
def layouts():
    """All layouts in one set of two processes (one start-up)."""
    runs = run_ranks(_layout_rank, 2, [{**ref, **over} for ref, over in LAYOUTS.values()], timeout=300)
    return {name: [r[i] for r in runs] for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_shared_blocks_layout_equals_one_process(name, layouts, dense_reference, widenet_reference):
    """Losses of every step and every final parameter (under every block's name) as one process, fp64: the bound
    is rtol 1e-9, atol 1e-11 (the other layouts' bound in this suite); measured differences are at most 1.8e-15
    absolute (docs/moe.md)."""
    ref = dense_reference if LAYOUTS[name][0] is DENSE else widenet_reference
    assert_same_run(ref, layouts[name][0]["run"], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_keeps_the_tensors_the_sharing_implies(name, layouts):
    """After the passes every block still calls block 0's attention and MLP, and each rank holds as many distinct
    parameter tensors as one process (tp and ep shard a tensor, they do not copy it per layer). Under ZeRO-3 the
    flat units are the root, one per block (its norms) and one per shared module (attention, MoE layer)."""
    ref, over = LAYOUTS[name]
    want = len(list(_model(ref).parameters()))
    for rank in layouts[name]:
        assert rank["tied"] and rank["tensors"] == want, (rank["tied"], rank["tensors"], want)
        n_layers = make_config({**TINY, **ref}).model.n_layers
        # ZeRO-3 units: root, one per block (its norms), the shared attention and MoE layer; with ep the experts'
        # optimizer has the shared MoE layer's experts as its one unit
        units = 1 + n_layers + 2 + (over.get("parallel.ep", 1) > 1) if over.get("parallel.zero") == 3 else 0
        assert rank["units"] == units, (rank["units"], units)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_memory_equals_the_engines_for_shared_blocks(name, layouts):
    """`plan` (run-exact, predict_run) counts a shared block's parameters, gradients and optimizer state once per
    rank under tp / ep / ZeRO-3 and its saved activations per layer: equal to the trainer's measurement to the byte
    on every rank (as tests/test_plan_memory.py does for the other layouts)."""
    for rank in layouts[name]:
        wrong = {k: (planned, measured) for k, (measured, planned) in rank["memory"].items() if planned != measured}
        assert not wrong, wrong


@pytest.mark.parametrize("overrides,word", [
    ({"model.reversible": "true"}, "reversible"), ({"parallel.pp": 2}, "parallel.pp=2"),
    ({"model.dropout": 0.1}, "dropout"), ({"model.moe.every": 2}, "every=2"),
    ({"model.moe.router_noise": 1.0}, "router_noise"),
    ({"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "nvme"}, "offload=nvme"),
    ({"model.moe.experts": 0, "parallel.tp": 4, "parallel.tp_mode": "2d"}, "tp_mode=2d"),
])
def test_share_blocks_refuses_layouts_not_made_to_work(overrides, word):
    sets = [f"{k}={v}" for k, v in {**TINY, **WIDENET, **overrides}.items()]
    with pytest.raises(ConfigError, match=word):
        validate(load_config(None, sets), world_size=4)


def test_plain_model_is_unchanged_by_the_key():
    a, b = _model({}), _model({"model.share_blocks": "false"})
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert a.blocks[1].attn is not a.blocks[0].attn and a.blocks[1].mlp is not a.blocks[0].mlp


def _sets(overrides: dict) -> list[str]:
    return [x for k, v in overrides.items() for x in ("--set", f"{k}={v}")]


def test_widenet_resumes_exactly_and_is_not_exported_to_hugging_face(tmp_path, capsys):
    """A run stopped at step 2 and resumed to 4 ends with the parameters of a straight 4-step run; the
    checkpoint holds the shared weights once; `export --format hf` refuses in one line and writes nothing."""
    from scaletrain.cli import main
    from scaletrain.train import checkpoint as ckpt

    base = {**TINY, **WIDENET, "train.checkpoint_every": 2}
    straight, resumed, to = tmp_path / "straight", tmp_path / "resumed", tmp_path / "hf"
    assert main(["train", "--out", str(straight), *_sets({**base, "train.steps": 4})]) == 0
    assert main(["train", "--out", str(resumed), *_sets({**base, "train.steps": 2})]) == 0
    assert main(["train", "--out", str(resumed), *_sets({**base, "train.steps": 4})]) == 0
    capsys.readouterr()
    a = ckpt.read_tensors(ckpt.latest(straight / "checkpoints"), "model/")
    b = ckpt.read_tensors(ckpt.latest(resumed / "checkpoints"), "model/")
    assert a.keys() == b.keys() and not any(k.startswith("blocks.1.attn") for k in a), sorted(a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert main(["export", str(resumed), "--format", "hf", "--to", str(to)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.share_blocks=true" in err, err
    assert not to.exists()


@pytest.mark.parametrize("moe", [0, 4])
def test_planner_counts_the_shared_weights_once(moe):
    from scaletrain.plan.analytic.params import total_params
    from scaletrain.plan.catalog import from_model_config

    over = {**WIDENET, "model.moe.experts": moe}
    cfg = make_config({**TINY, **over})
    built = sum(p.numel() for p in _model(over).parameters())
    assert total_params(from_model_config(cfg.model)) == built
