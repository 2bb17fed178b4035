"""ZeRO-R contiguous buffers (memory.contiguous, arXiv 1910.02054 Sec. 6.3) and the allocation count of a step.

Claims:
- an arena's slots are reused; settling replaces a pool's buffers by one contiguous buffer of the peak slot count,
  moving live slots with their data; a later step that needs no more slots allocates nothing;
- with memory.contiguous=true losses and gradients are bit-identical to false (fp32 and fp64, dropout on) for every
  recompute mode that keeps checkpoints (full, every:k, selective, offloaded; selective on reversible blocks, where
  only the block being rebuilt holds its q, k, v), for ZeRO-2/3's gradient buffers, and
  on 2 ranks for dp x ZeRO-2/3 (also with NVMe offload), tp with partitioned checkpoints, and PipeDream-2BW, whose
  next batch keeps its checkpoints across the step boundary while the arena settles;
- after the first step nothing more is allocated for the arena (its buffer count stays, nothing grows late), and
  the step's allocator calls drop by exactly what the arena took over: one host buffer per offloaded checkpoint,
  one bucket buffer (plus a reduce-scatter output with dp > 1) per ZeRO-2/3 bucket and micro-batch;
- the CUDA count is the difference of two `torch.cuda.memory_stats` snapshots (tested on fabricated snapshots: no
  GPU here); `memory.count_allocations` puts the CPU count in the trainer's metrics from step 2 on.
"""

from __future__ import annotations

import gc

import pytest
import torch
from harness import TINY, make_config, run_ranks

from scaletrain.config import load_config, validate
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.errors import ConfigError
from scaletrain.memory.contiguous import AllocationCount, Arena, Held, count_allocations, cuda_count
from scaletrain.parallel.parallelize import build_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py

L, B, T = 4, 2, 32


# --------------------------------------------------------------------------- the arena


def test_arena_reuses_slots_and_settles_into_one_buffer_moving_live_data():
    arena = Arena()
    a, b, c = (arena.take((3, 2), torch.float64, "cpu") for _ in range(3))
    for i, s in enumerate((a, b, c)):
        s.tensor.fill_(i + 1.0)
    assert arena.stats.buffers == 3
    b.release()
    d = arena.take((3, 2), torch.float64, "cpu")  # reuses b's slot
    assert arena.stats.buffers == 3 and d.index == 1
    d.release()
    arena.settle()  # peak 3 slots, a and c live
    assert arena.stats.buffers == 4 and len(arena.pools[((3, 2), torch.float64, "cpu", False)].buffers) == 1
    assert torch.equal(a.tensor, torch.full((3, 2), 1.0, dtype=torch.float64))
    assert torch.equal(c.tensor, torch.full((3, 2), 3.0, dtype=torch.float64))
    e = arena.take((3, 2), torch.float64, "cpu")
    assert arena.stats.buffers == 4 and arena.stats.grown_late == 0  # the free third slot
    e.tensor.fill_(5.0)
    assert e.tensor.untyped_storage()._cdata == a.tensor.untyped_storage()._cdata  # one contiguous buffer
    assert torch.equal(a.tensor, torch.full((3, 2), 1.0, dtype=torch.float64))
    arena.take((3, 2), torch.float64, "cpu")  # a fourth at once: grows, counted
    assert arena.stats.grown_late == 1
    assert torch.equal(c.tensor, torch.full((3, 2), 3.0, dtype=torch.float64))


def test_a_held_slot_returns_to_its_pool_when_dropped():
    arena = Arena()
    held = Held(arena.take((4,), torch.float32, "cpu"))
    pool = held.slot.pool
    assert len(pool.live) == 1
    del held
    gc.collect()
    assert len(pool.live) == 0 and pool.free == [0]


# --------------------------------------------------------------------------- the engine, one process


def engine_runs(steps: int = 2, count_at: int = 2, **sets):
    """Per step: loss, gradients (module's, or ZeRO's gradient shards), allocator calls (at step `count_at` only)
    and the arena's buffer count; and the engine. fp32: the dtype where a changed kernel would show."""
    base = {"model.n_layers": L, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": T,
            "train.micro_batch": B, "train.global_batch": 2 * B, "model.dropout": 0.1}
    cfg = validate(load_config(None, [f"{k}={v}" for k, v in {**base, **sets}.items()]))
    engine = build_engine(cfg, Mesh.build(ParallelDims()), torch.device("cpu"), torch.float32, CommStats())
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(1, steps + 1):
        engine.dropout.at_micro(0, B, step)
        micro = [(torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g))
                 for _ in range(2)]
        if step == count_at:
            loss, count = count_allocations(lambda m=micro: engine.forward_backward(m, 1 / 128), "cpu")
        else:
            loss, count = engine.forward_backward(micro, 1 / 128), None
        opt = engine.optimizer
        grads = [gr.shard_grad.clone() for gr in opt.groups] if hasattr(opt, "groups") else \
            [p.grad.clone() for p in engine.module.parameters()]
        buffers = engine.arena.stats.buffers if hasattr(engine, "arena") else 0
        out.append((loss, grads, count.count if count else None, buffers))
        opt.zero_grad()
    return out, engine


MODES = {
    "full": {"memory.recompute": "full"},
    "every2": {"memory.recompute": "every:2"},
    "selective": {"memory.recompute": "selective"},
    "full-offload": {"memory.recompute": "full", "memory.offload_activations": "true"},
    "none-offload": {"memory.recompute": "none", "memory.offload_activations": "true"},
    "zero2": {"parallel.zero": 2},
    "zero3-full": {"parallel.zero": 3, "memory.recompute": "full"},
    "reversible-selective": {"model.reversible": "true", "memory.recompute": "selective"},
}
MICRO = 2
# block inputs; segment inputs; q, k, v per block; q, k, v of the one block a reversible backward rebuilds at a time
SLOTS = {"full": [L], "every2": [L // 2], "selective": [3 * L], "reversible-selective": [3]}


@pytest.mark.parametrize("mode", list(MODES))
def test_contiguous_is_bit_identical_and_allocates_its_arena_once(mode):
    ref, _ = engine_runs(**MODES[mode])
    got, engine = engine_runs(**MODES[mode], **{"memory.contiguous": "true"})
    for (l0, g0, *_), (l1, g1, *_) in zip(ref, got):
        assert torch.equal(l0, l1)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    arena = engine.arena
    assert arena.stats.grown_late == 0
    assert got[0][3] == got[1][3] > 0  # buffers: all allocated in step 1 (then settled), none in step 2
    assert all(len(p.buffers) == 1 for p in arena.pools.values())
    if mode in SLOTS:
        assert [p.peak for p in arena.pools.values()] == SLOTS[mode]
    saved = ref[1][2] - got[1][2]  # allocator calls of step 2 the arena took over
    buckets = len(getattr(engine.optimizer, "groups", ()))
    expected = {"full-offload": L * MICRO,  # a host buffer per offloaded block input
                "zero2": buckets * MICRO, "zero3-full": buckets * MICRO}  # a bucket buffer (dp = 1: no RS output)
    if mode in expected:
        assert saved == expected[mode]
    elif mode != "none-offload":  # device checkpoints: the same calls (op outputs), only kept in the arena
        assert saved == 0


@pytest.mark.parametrize("sets, words", [
    (["memory.contiguous=true"], "memory.contiguous has nothing to hold"),
    (["memory.count_allocations=true", "train.profile_steps=1:3"], r"train.profile_steps \(1:3\) also records"),
])
def test_what_contiguous_and_the_count_cannot_do_is_refused(sets, words):
    with pytest.raises(ConfigError, match=words):
        validate(load_config(None, sets))


# --------------------------------------------------------------------------- allocation counts


def test_cuda_count_is_the_difference_of_two_memory_stats_snapshots():
    before = {"allocation.all.allocated": 100, "allocated_bytes.all.allocated": 10_000,
              "allocated_bytes.all.peak": 1, "reserved_bytes.all.peak": 1}
    after = {"allocation.all.allocated": 142, "allocated_bytes.all.allocated": 18_192,
             "allocated_bytes.all.peak": 6_000, "reserved_bytes.all.peak": 20_971_520}
    c = cuda_count(before, after)
    assert c == AllocationCount(42, 8_192, 6_000, 20_971_520)
    assert c.fields() == {"mem_alloc_count": 42, "mem_alloc_bytes": 8_192, "mem_cuda_allocated_peak": 6_000,
                          "mem_cuda_reserved_peak": 20_971_520}
    assert AllocationCount(3, 24).fields() == {"mem_alloc_count": 3, "mem_alloc_bytes": 24}


def test_cpu_count_sees_each_allocation():
    x = torch.randn(64, 64)
    _, none = count_allocations(lambda: None, "cpu")
    _, two = count_allocations(lambda: (x @ x).relu_().sum(), "cpu")  # the product and the sum
    assert none.count == 0 and two.count == 2 and two.bytes == 64 * 64 * 4 + 4


def test_trainer_logs_the_allocation_count_from_step_2():
    from scaletrain.train.trainer import Trainer

    sets = {**TINY, "train.steps": 2, "memory.count_allocations": "true", "memory.recompute": "full",
            "memory.offload_activations": "true"}
    rows = {}
    for contiguous in ("false", "true"):
        t = Trainer(make_config({**sets, "memory.contiguous": contiguous}))
        t.run()
        rows[contiguous] = t.memory()
    micro = TINY["train.global_batch"] // TINY["train.micro_batch"]
    # one host buffer per offloaded block input and micro-batch, now an arena slot
    assert rows["false"]["mem_alloc_count"] - rows["true"]["mem_alloc_count"] == TINY["model.n_layers"] * micro
    assert rows["true"]["mem_arena_bytes"] == TINY["model.n_layers"] * TINY["train.micro_batch"] * \
        TINY["model.seq_len"] * TINY["model.d_model"] * 8  # fp64 block inputs of one micro-batch
    assert "mem_arena_bytes" not in rows["false"]


# --------------------------------------------------------------------------- layouts, 2 ranks

LAYOUTS = {
    "dp2-zero2-full": {"parallel.dp": 2, "parallel.zero": 2, "memory.recompute": "full"},
    "dp2-zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "tp2-partitioned-every2": {"parallel.tp": 2, "memory.recompute": "every:2", "memory.partition_checkpoints": "true"},
    "pp2-2bw-full": {"parallel.pp": 2, "parallel.schedule": "2bw", "memory.recompute": "full"},
    "dp2-zero3-nvme": {"parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "nvme"},  # + offload_dir below
}


def _rank_pairs(rank, world, layouts):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = {}
    for name, overrides in layouts.items():
        pair = []
        for contiguous in ("false", "true"):
            cfg = make_config({**TINY, "model.n_layers": 4, "model.dropout": 0.1, "memory.count_allocations": "true",
                               **overrides, "memory.contiguous": contiguous})
            t = Trainer(cfg, None, DistEnv(rank, world, 0, "test"))
            losses = t.run().losses
            arena = getattr(t.engine, "arena", None)
            pair.append((losses, t.full_state(), t.memory(), arena.stats.grown_late if arena else None))
        out[name] = pair
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    layouts = {name: dict(lay) for name, lay in LAYOUTS.items()}
    layouts["dp2-zero3-nvme"]["parallel.offload_dir"] = str(tmp_path_factory.mktemp("nvme"))
    return run_ranks(_rank_pairs, 2, layouts, timeout=300)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_contiguous_layout_is_bit_identical_to_the_default(pairs, name):
    (l0, s0, m0, _), (l1, s1, m1, late) = pairs[name]
    assert l0 == l1
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert late == 0
    if name == "dp2-zero2-full":  # a bucket buffer and a reduce-scatter output per bucket and micro-batch
        assert m0["mem_alloc_count"] - m1["mem_alloc_count"] == 2 * 2  # one bucket, 2 micro-batches per rank
