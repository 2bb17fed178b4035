"""The multi-process harness reuses its ranks between runs (tests/harness.py): a run in reused ranks computes what
a run in fresh processes computes, bit for bit, and a failing rank does not poison the next run, nor does a run that
leaves a fake in place of a torch function (it fails, naming the function)."""

from __future__ import annotations

import os

import pytest
import torch
from harness import TINY, _train_rank, run_ranks

DP2 = {**TINY, "parallel.dp": 2, "parallel.zero": 1, "model.dropout": 0.1, "train.steps": 3}


def _changes_process_state(rank, world, _):
    """A run that leaves a non-default dtype and an environment variable behind, then trains."""
    os.environ["SCALETRAIN_HARNESS_PROBE"] = "left behind"
    torch.set_default_dtype(torch.float64)
    return os.environ.get("SCALETRAIN_HARNESS_PROBE")


def _state_seen(rank, world, _):
    return torch.get_default_dtype(), os.environ.get("SCALETRAIN_HARNESS_PROBE")


def _fails_on_rank_1(rank, world, _):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def _fakes_cuda(rank, world, _):
    """What a test of GPU code paths on a CPU machine does, without putting the real function back."""
    torch.cuda.is_available = lambda: True
    return torch.cuda.is_available()


def _cuda_seen(rank, world, _):
    return torch.cuda.is_available()


def test_reused_ranks_compute_what_fresh_processes_compute():
    fresh = run_ranks(_train_rank, 2, DP2, timeout=180, fresh=True)[0]
    first = run_ranks(_train_rank, 2, DP2, timeout=180)[0]
    run_ranks(_changes_process_state, 2, None)
    assert run_ranks(_state_seen, 2, None) == [(torch.float32, None)] * 2  # the parent's environment, default dtype
    again = run_ranks(_train_rank, 2, DP2, timeout=180)[0]
    for run in (first, again):
        assert run[0] == fresh[0]  # losses of every step, exactly
        assert run[1].keys() == fresh[1].keys()
        assert all(torch.equal(run[1][k], fresh[1][k]) for k in fresh[1])


def test_a_failing_rank_is_reported_and_the_next_run_starts_clean():
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose"):
        run_ranks(_fails_on_rank_1, 2, None, timeout=60)
    assert run_ranks(_state_seen, 2, None) == [(torch.float32, None)] * 2


def test_a_run_that_leaves_a_torch_function_replaced_fails_naming_it_and_the_next_run_gets_the_real_one():
    """A fake left in a reused rank (tests/test_multi_gpu_readiness.py once left torch.cuda and
    torch.distributed.init_process_group replaced: the next test's gloo start waited out a 300 s store timeout)."""
    with pytest.raises(RuntimeError, match=r"the run left torch\.cuda\.is_available replaced in this reused rank"):
        run_ranks(_fakes_cuda, 2, None, timeout=60)
    assert run_ranks(_cuda_seen, 2, None) == [torch.cuda.is_available()] * 2
