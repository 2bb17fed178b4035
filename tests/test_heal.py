"""Healing a restarted replica from a live peer (distributed/heal.py): the joining rank ends with the live rank's
parameters and optimizer state bit for bit, a corrupted chunk is detected and sent again, a chunk that stays
corrupt refuses the heal and leaves the joining rank's state untouched."""

import pytest
import torch
import torch.distributed as dist

from scaletrain.distributed.heal import HealError, load_training_state, recv_state, send_state, training_state
from tests.harness import run_ranks

CHUNK = 512  # bytes: the tiny model's state spans many chunks


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, opt, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model, opt) -> torch.Tensor:
    parts = [p.detach().flatten() for p in model.parameters()]
    for s in opt.state.values():
        parts += [s["exp_avg"].flatten(), s["exp_avg_sq"].flatten(), s["step"].flatten().double()]
    return torch.cat(parts)


def _heal(rank, world, mode):
    """Rank 0 is the live replica (3 steps taken), rank 1 the restarted one (fresh, other seed)."""
    model, opt = _model(seed=rank)
    if rank == 0:
        for k in range(3):
            _step(model, opt, k)
    before = _flat(model, opt).clone()
    tamper = None
    if mode == "once":
        tamper = lambda i, attempt, b: b if (i, attempt) != (2, 0) else b.flip(0)  # noqa: E731
    elif mode == "always":
        tamper = lambda i, attempt, b: b if i != 1 else torch.where(torch.arange(b.numel()) == 7, b ^ 1, b)  # noqa: E731
    try:
        if rank == 0:
            stats = send_state(training_state(model, opt, 3), 1, chunk_bytes=CHUNK, retries=2, tamper=tamper)
            step = 3
        else:
            state, stats = recv_state(0, chunk_bytes=CHUNK, retries=2)
            step = load_training_state(model, opt, state)
    except HealError as e:
        return {"error": str(e), "before": before, "after": _flat(model, opt)}
    healed = _flat(model, opt).clone()
    _step(model, opt, step)  # the next step, same data on both: equal only if the optimizer state came across
    dist.barrier()
    return {"healed": healed, "next": _flat(model, opt), "step": step, "retries": stats.retries,
            "chunks": stats.chunks, "bytes": stats.bytes}


@pytest.mark.parametrize("mode", ["clean", "once"])
def test_joining_replica_gets_live_state_bit_for_bit(mode):
    live, joined = run_ranks(_heal, 2, mode, timeout=120)
    assert joined["step"] == 3
    assert joined["chunks"] == live["chunks"] > 3  # the state spans several chunks
    assert torch.equal(joined["healed"], live["healed"])  # parameters + AdamW moments + step counts
    assert torch.equal(joined["next"], live["next"])  # and the next step computes the same update
    assert joined["retries"] == live["retries"] == (1 if mode == "once" else 0)  # the bad chunk was caught, resent


def test_chunk_that_stays_corrupt_refuses_the_heal():
    live, joined = run_ranks(_heal, 2, "always", timeout=120)
    assert "chunk 1 failed its checksum 3 times" in joined["error"]
    assert "chunk 1 failed its checksum 3 times" in live["error"]
    assert torch.equal(joined["after"], joined["before"])  # nothing of the corrupt state was loaded
