"""The planner's activation bytes against the allocator (docs/memory.md, "What the allocator sees").

"To the byte" (tests/test_plan_memory.py) compares the planner with the engine's own count of the tensors autograd
saves (distinct storages seen by saved-tensor hooks). This compares it with what the CPU allocator reports to
torch.profiler in step 2 of a run with memory.count_allocations (memory/contiguous.py): `mem_alloc_backward_start`,
the bytes the forward/backward allocated and still holds when its first backward operation starts, and
`mem_alloc_peak`, the most it held at once. The differences, each explained and bounded before measuring:

- the loader's batch, (global_batch, seq_len + 1) int64: the planner counts it (the embedding saves a view of it),
  but the loader allocates it before the forward, so the measured region never sees it: - 8 B (T + 1) bytes;
- with recomputation, `torch.utils.checkpoint` keeps the CPU random-number state for each recomputed segment (a
  5,056-byte tensor that is no saved activation, so neither the planner nor the engine counts it): + that per
  segment of the micro-batch;
- the loss scalars (the loss, its scaled copy, the running total) are held but not saved for backward: a few
  8-byte values, bounded by 64 bytes; each MoE layer also holds its step statistics for the metrics (the expert
  load, E int64) and a few scalars: bounded by 8 (E + 4) bytes per MoE layer;
- the peak (without recomputation, at the loss's backward) adds the gradient of the log-probabilities and of the
  logits, fp32 (micro_batch, seq_len, padded vocabulary) each: at most 2 L + 64 bytes above the backward start, and
  at least L.
"""

from __future__ import annotations

import pytest
import torch
from harness import TINY, make_config

from scaletrain.config.sizes import moe_layers
from scaletrain.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SCALARS = 64  # the loss scalars held across the backward's start (see the module docstring)
CONFIGS = {
    "fp32": {},
    "bf16": {"train.dtype": "bf16"},
    "fp32 rope swiglu dropout": {"model.position": "rope", "model.mlp": "swiglu", "model.dropout": 0.1},
    "moe topk": {"model.moe.experts": 4, "model.moe.group_tokens": 8},
    "recompute full": {"memory.recompute": "full"},
    "recompute every:2, 4 layers": {"memory.recompute": "every:2", "model.n_layers": 4},
}


def _segments(cfg) -> int:
    """Recomputed segments of one micro-batch's forward (each keeps its CPU random-number state)."""
    kind = cfg.memory.recompute
    if kind == "full":
        return cfg.model.n_layers
    if kind.startswith("every:"):
        return cfg.model.n_layers // int(kind.split(":")[1])
    return 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_allocator_holds_the_planned_activations_at_the_backward(name):
    cfg = make_config({**TINY, "train.dtype": "fp32", "train.steps": 2, "memory.count_allocations": True,
                       **CONFIGS[name]})
    t = Trainer(cfg)
    for step in (1, 2):
        t.step = step
        t.train_step(step)
    mem = t.memory()
    planned = mem["plan_mem_activations"]
    assert planned == mem["mem_activations"]  # "to the byte": the engine's count of saved tensors
    loader = 8 * cfg.train.global_batch * (cfg.model.seq_len + 1)
    rng = torch.get_rng_state().numel() * _segments(cfg)
    expected = planned - loader + rng
    held = mem["mem_alloc_backward_start"]
    moe = 8 * (cfg.model.moe.experts + 4) * len(moe_layers(cfg.model)) if cfg.model.moe.experts else 0
    assert 0 <= held - expected <= SCALARS + moe, (name, held, planned, loader, rng)
    print(f"{name}: allocator {held:,} at the backward's start = plan {planned:,} - loader {loader:,} + rng {rng:,} "
          f"+ {held - expected} (loss scalars, MoE statistics); peak {mem['mem_alloc_peak']:,}")  # pytest -rP
    if not _segments(cfg):
        vocab = cfg.model.vocab_size
        logits = cfg.train.micro_batch * cfg.model.seq_len * vocab * 4
        assert logits <= mem["mem_alloc_peak"] - held <= 2 * logits + SCALARS, (name, mem["mem_alloc_peak"], held)
