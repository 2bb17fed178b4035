"""model.share_blocks (WideNet arXiv 2107.11817, ALBERT arXiv 1909.11942): one set of attention / MLP (or MoE)
weights for every block, per-block norms, the shared gradient the sum over layers; plain dp equals one process."""

from __future__ import annotations

import pytest
import torch
from harness import TINY, assert_same_run, make_config, train_parallel, train_reference

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


@pytest.mark.parametrize("key,value,word", [
    ("model.reversible", "true", "reversible"), ("parallel.tp", 2, "parallel.tp=2"),
    ("parallel.pp", 2, "parallel.pp=2"), ("parallel.zero", 3, "parallel.zero=3"),
    ("model.dropout", 0.1, "dropout"), ("model.moe.every", 2, "every=2"),
    ("model.moe.router_noise", 1.0, "router_noise"), ("parallel.ep", 2, "parallel.ep=2"),
])
def test_share_blocks_refuses_layouts_not_made_to_work(key, value, word):
    sets = [f"{k}={v}" for k, v in {**TINY, **WIDENET, key: value}.items()]
    with pytest.raises(ConfigError, match=word):
        validate(load_config(None, sets), world_size=2)


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
