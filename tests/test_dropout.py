"""Layout-independent dropout (model/dropout.py): every mask is a hash of (seed, step, site, global element
index), so each parallel dimension drops exactly what one process drops.

Equivalence (fp64, losses of every step and every final parameter, rtol 1e-10 / atol 1e-12 as for dropout 0):
dp 2 with accumulation, tp 2 with and without sequence parallelism, pp 2 with 1F1B, interleaved and ZB-H1,
ep 2 with expert dropout, recompute full and selective. With torch's dropout (`model.dropout_impl=torch`) the same
comparison fails at the first step, and `scaletrain verify` refuses it with the reason.
"""

import math

import pytest
import torch
from harness import TINY, assert_same_run, make_config, train_parallel_many, train_reference

from scaletrain.model.dropout import DropoutContext, GlobalDropout, hash32, keep_mask

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL, ATOL = 1e-10, 1e-12
DROP = {"model.dropout": 0.1}


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_hash_drops_a_fraction_p_and_is_independent_across_keys(p):
    n = 2_000_000
    index = torch.arange(n)
    a, b = keep_mask(index, 1, p), keep_mask(index, 2, p)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs((1 - a.double().mean().item()) - p) < 5 * sigma
    both = (~a & ~b).double().mean().item()  # two keys drop the same element with probability p^2
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)
    assert hash32(index[:4], 7).tolist() == hash32(index[:4], 7).tolist()  # a pure function


def test_global_indices_follow_rows_and_offsets():
    """A rank holding rows 2-3 and heads 2-3 of 4 draws the slice of the mask one process draws for all."""
    ctx = DropoutContext(seed=5, step=3)
    whole = GlobalDropout(0.5, ctx, ("head", "seq", "seq"))
    whole.site = part_site = "blocks.0.attn.attn_dropout"
    x = torch.ones(4, 4, 3, 3, dtype=torch.float64)
    full = whole(x)
    part = GlobalDropout(0.5, ctx, ("head", "seq", "seq"))
    part.site, part.offsets = part_site, {1: (2, 4)}
    ctx.row = 2
    assert torch.equal(part(torch.ones(2, 2, 3, 3, dtype=torch.float64)), full[2:, 2:])
    ctx.step = 4  # another step draws another mask
    assert not torch.equal(part(torch.ones(2, 2, 3, 3, dtype=torch.float64)), full[2:, 2:])


def _check(configs, world):
    for cfg, par in zip(configs, train_parallel_many(configs, world)):
        single = {k: v for k, v in cfg.items() if not k.startswith("parallel.") and k != "memory.recompute"}
        assert_same_run(train_reference(single), par, RTOL, ATOL), cfg


def test_dropout_matches_single_process_under_dp_tp_sp_and_recompute():
    acc = {**DROP, "train.micro_batch": 1}  # 4 micro-batches per dp rank
    _check([{**acc, "parallel.dp": 2, "memory.recompute": "full"}, {**DROP, "parallel.tp": 2},
            {**DROP, "parallel.tp": 2, "parallel.sequence_parallel": True, "memory.recompute": "selective"}], 2)


def test_dropout_matches_single_process_under_pipeline_schedules():
    deep = {**DROP, "model.n_layers": 4}
    _check([{**DROP, "parallel.pp": 2}, {**DROP, "parallel.pp": 2, "parallel.schedule": "zb-h1"},
            {**deep, "parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2}], 2)


def test_dropout_and_expert_dropout_match_single_process_under_expert_parallelism():
    moe = {**DROP, "model.moe.experts": 4, "model.moe.expert_dropout": 0.2, "model.moe.group_tokens": 16}
    _check([{**moe, "parallel.dp": 2, "parallel.ep": 2},
            {**moe, "parallel.tp": 2, "parallel.sequence_parallel": True}], 2)


def test_torch_dropout_differs_from_single_process():
    """The reason for the global implementation: torch's per-rank random streams drop other elements."""
    cfg = {**DROP, "model.dropout_impl": "torch", "parallel.dp": 2}
    par = train_parallel_many([cfg], 2)[0]
    ref = train_reference({**DROP, "model.dropout_impl": "torch"})
    assert abs(par[0][1] - ref[0][1]) > 1e-6


def test_dropout_is_active_and_resumes_exactly(tmp_path):
    """Dropout changes the loss; a run stopped after 2 steps and resumed gives the uninterrupted run's losses."""
    from scaletrain.train.trainer import Trainer

    over = {**TINY, **DROP, "train.checkpoint_every": 2}
    whole = Trainer(make_config(over)).run().losses
    plain = Trainer(make_config({**over, "model.dropout": 0.0})).run().losses
    assert abs(whole[1] - plain[1]) > 1e-4
    Trainer(make_config(over), tmp_path).run(stop_after=2)
    resumed = Trainer(make_config(over), tmp_path).run().losses
    assert resumed == {s: whole[s] for s in (3, 4)}


def test_verify_refuses_torch_dropout_with_the_reason(capsys):
    from scaletrain.cli import main

    code = main(["verify", "--small", "--set", "parallel.dp=2", "--set", "model.dropout=0.1",
                 "--set", "model.dropout_impl=torch"])
    err = capsys.readouterr().err
    assert code == 2 and "per-rank random streams" in err and len(err.strip().splitlines()) == 1
