"""Activation recomputation (memory.recompute, partition_checkpoints, offload_activations).

Claims: every mode gives bit-identical losses and gradients to `none` (fp32 and fp64, with dropout, whose
masks the recomputation must replay), and keeps exactly the bytes its definition says it keeps, counted
independently from the model's dimensions (the term-by-term list of
`plan.exact.run_memory.implementation_activation_bytes`):

    none - full      = L * (per-layer saved - block input)     full keeps one B*T*C input per block
    full - every:k   = (L - ceil(L/k)) * block input            every:k keeps one input per segment
    none - selective = L * B*T*nh * e                           the flash kernel's log-sum-exp
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_same_run, run_ranks, train_reference

from scaletrain.config import load_config, validate
from scaletrain.config.parse import parse_recompute
from scaletrain.device.accounting import SavedTensorCounter, memory_reports
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.errors import ConfigError
from scaletrain.memory.recompute import apply_recompute
from scaletrain.model import build_gpt
from scaletrain.parallel.engine import Engine
from scaletrain.parallel.parallelize import build_engine

L, C, NH, T, B, V = 4, 32, 4, 32, 2, 256
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def make_cfg(**mem):
    sets = [f"model.n_layers={L}", f"model.d_model={C}", f"model.n_heads={NH}", f"model.seq_len={T}"]
    sets += [f"{k.replace('__', '.')}={v}" for k, v in mem.items()]
    return validate(load_config(None, sets))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def run_engine(dtype, **mem):
    """Loss, gradients by name and saved bytes of one forward/backward of a fresh engine."""
    cfg = make_cfg(**mem)
    engine = build_engine(cfg, Mesh.build(ParallelDims()), torch.device("cpu"), DTYPES[dtype], CommStats())
    torch.manual_seed(7)  # dropout stream
    loss = engine.forward_backward([batch()], 1.0)
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    return loss, grads, engine.activation_bytes, engine


def assert_bit_identical(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_modes_are_bit_identical_to_none_and_keep_fewer_bytes(dtype, dropout):
    e = DTYPES[dtype].itemsize
    n = B * T
    block_input = n * C * e
    per_layer = n * (8 * C + 2 * 4 * C + 4 + NH) * e  # GELU MLP, learned positions, flash attention
    runs = {m: run_engine(dtype, memory__recompute=m, model__dropout=dropout)
            for m in ("none", "full", "selective", "every:2", "every:3")}
    for mode in ("full", "selective", "every:2", "every:3"):
        assert_bit_identical(runs[mode], runs["none"])
    saved = {m: r[2] for m, r in runs.items()}
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["every:2"] < saved["full"]
    if dropout == 0.0:  # exact, from the dimensions
        assert saved["none"] - saved["full"] == L * (per_layer - block_input)
        assert saved["full"] - saved["every:2"] == (L - 2) * block_input
        assert saved["full"] - saved["every:3"] == (L - 2) * block_input  # segments of 3 + 1 blocks
        assert saved["none"] - saved["selective"] == L * n * NH * e
    else:  # the math kernel keeps the T x T softmax and dropout output; selective drops them
        assert saved["none"] - saved["selective"] > L * B * NH * T * T * e


def test_parse_recompute_and_validation_messages():
    assert parse_recompute("every:1").kind == "full"
    assert (parse_recompute("every:4").kind, parse_recompute("every:4").k) == ("every", 4)
    for bad in ("every:0", "every:x", "sometimes"):
        with pytest.raises(ConfigError, match="memory.recompute"):
            make_cfg(memory__recompute=bad)
    with pytest.raises(ConfigError, match="partition_checkpoints needs memory.recompute full"):
        make_cfg(memory__partition_checkpoints="true", memory__recompute="selective")


def test_eval_and_standalone_block_calls_are_unchanged_by_every_k():
    ref = build_gpt(make_cfg().model, 1234, torch.device("cpu"), torch.float64)
    cfg = make_cfg(memory__recompute="every:2")
    engine = Engine(build_gpt(cfg.model, 1234, torch.device("cpu"), torch.float64))
    apply_recompute(engine, cfg.memory)
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(engine.module(x), ref(x))
    h = torch.randn(B, T, C, dtype=torch.float64)
    # a later block of a segment called on its own (not with its leader's output) runs itself
    assert torch.equal(engine.module.blocks[1](h), ref.blocks[1](h))


def run_wrapped(dtype, mesh=None, **mem):
    """Like run_engine, but applying the pass by hand (to keep its statistics and choose the tp group)."""
    cfg = make_cfg(**mem)
    model = build_gpt(cfg.model, 1234, torch.device("cpu"), DTYPES[dtype])
    engine = Engine(model)
    stats = apply_recompute(engine, cfg.memory, mesh.group("tp") if mesh is not None else None)
    x, y = batch()
    counter = SavedTensorCounter(model.parameters())
    with counter.active():
        loss = engine.loss_fn(model(x), y)
    live_after_forward = stats.live
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, counter.bytes, counter.host_bytes, stats, live_after_forward


def test_offload_moves_checkpoints_to_host_buffers():
    block_input = B * T * C * 8
    full = run_wrapped("fp64", memory__recompute="full")
    off = run_wrapped("fp64", memory__recompute="full", memory__offload_activations="true")
    assert_bit_identical(off, full)
    assert full[2] - off[2] == L * block_input  # the block inputs left the device count ...
    assert off[3] == off[5] == off[4].peak == L * block_input  # ... and sit in host buffers until backward
    assert off[4].tensors == L and off[4].live == 0  # one copy per block, all freed by backward

    # through build_engine the host bytes reach the trainer's memory fields
    engine = run_engine("fp64", memory__recompute="full", memory__offload_activations="true")[3]
    assert memory_reports(engine) == {"mem_activations_host": L * block_input}

    none = run_wrapped("fp64")
    off_all = run_wrapped("fp64", memory__offload_activations="true")  # no recompute: blocks save to host
    assert_bit_identical(off_all, none)
    assert off_all[2] < none[2] / 4
    assert off_all[3] >= none[2] - off_all[2]  # views of one base are copied per save: at least as many bytes
    assert off_all[4].live == 0


DROP = {"model.dropout": 0.1, "train.steps": 3}  # dropout: the recomputation must replay every mask
TP = {**DROP, "parallel.tp": 2}
PP = {**DROP, "parallel.pp": 2, "model.n_layers": 4}
Z3 = {**DROP, "parallel.dp": 2, "parallel.zero": 3, "model.n_layers": 4}  # blocks gather their parameters
TWO_RANK_RUNS = {
    "dp2-full": {"train.steps": 3, "parallel.dp": 2, "memory.recompute": "full"},
    "tp-none": TP,
    "tp-full": {**TP, "memory.recompute": "full"},
    "tp-selective": {**TP, "memory.recompute": "selective"},
    "tp-every:2": {**TP, "memory.recompute": "every:2"},
    "tp-partition": {**TP, "memory.recompute": "full", "memory.partition_checkpoints": True},
    "tp-partition-offload": {**TP, "memory.recompute": "full", "memory.partition_checkpoints": True,
                             "memory.offload_activations": True},
    "pp-none": PP,
    "pp-full": {**PP, "memory.recompute": "full"},
    "pp-selective": {**PP, "memory.recompute": "selective"},
    "pp-every:2": {**PP, "memory.recompute": "every:2"},
    "pp-zb-none": {**PP, "parallel.schedule": "zb-h1"},
    "pp-zb-full": {**PP, "parallel.schedule": "zb-h1", "memory.recompute": "full"},
    "z3-none": Z3,
    "z3-full": {**Z3, "memory.recompute": "full"},
    "z3-selective": {**Z3, "memory.recompute": "selective"},
    "z3-every:2": {**Z3, "memory.recompute": "every:2"},
    "tp-int8": {**TP, "memory.compress": "int8"},  # compression composes too (tested in test_memory_wiring)
    "tp-full-int8": {**TP, "memory.recompute": "full", "memory.compress": "int8"},
    "tp-partition-int8": {**TP, "memory.recompute": "full", "memory.partition_checkpoints": True,
                          "memory.compress": "int8"},
    "tp-partition-offload-int8": {**TP, "memory.recompute": "full", "memory.partition_checkpoints": True,
                                  "memory.offload_activations": True, "memory.compress": "int8"},
    "pp-int8": {**PP, "memory.compress": "int8"},
}


def _two_ranks(rank, world):
    """Every two-process run of this file, in one spawn (starting processes dominates their time)."""
    from harness import TINY, make_config

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for name, over in TWO_RANK_RUNS.items():
        t = Trainer(make_config({**TINY, **over}), None, DistEnv(rank, world, 0, "test"))
        losses = t.run().losses
        out[name] = (losses, t.full_state(), t.memory())
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, timeout=240)[0]


def test_recompute_under_dp2_matches_single_process(two_ranks):
    assert_same_run(train_reference({"train.steps": 3}), two_ranks["dp2-full"][:2], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["tp", "pp", "pp-zb", "z3"])
def test_recompute_under_tp_pp_and_zero3_is_bit_identical_and_keeps_fewer_bytes(two_ranks, layout):
    base = two_ranks[f"{layout}-none"]
    modes = ("full",) if layout == "pp-zb" else ("full", "selective", "every:2")
    for mode in modes:
        run = two_ranks[f"{layout}-{mode}"]
        assert_same_run(base[:2], run[:2], rtol=0, atol=0)
        assert run[2]["mem_activations"] < base[2]["mem_activations"], mode
    if layout != "pp-zb":
        assert two_ranks[f"{layout}-every:2"][2]["mem_activations"] < two_ranks[f"{layout}-full"][2]["mem_activations"]


def test_partitioned_checkpoints_keep_one_tp_slice_and_gather_exactly(two_ranks):
    full, part, off = (two_ranks[k] for k in ("tp-full", "tp-partition", "tp-partition-offload"))
    half_inputs = 2 * B * T * C * 8 // 2  # TINY: 2 blocks, micro-batch 2, seq 32, d 32, fp64; half per tp rank
    assert_same_run(full[:2], part[:2], rtol=0, atol=0)
    assert_same_run(full[:2], off[:2], rtol=0, atol=0)
    assert full[2]["mem_activations"] - part[2]["mem_activations"] == half_inputs
    assert part[2]["mem_activations"] - off[2]["mem_activations"] == half_inputs
    assert off[2]["mem_activations_host"] == half_inputs


def test_partitioned_and_offloaded_checkpoints_stay_encoded_under_lossy_compression(two_ranks):
    # the checkpoint hooks are innermost: they encode a block input with the run's compressor, then keep a tp slice
    # of the int8 payload (and offload it); the values are exactly those of the unpartitioned int8 run
    full, part, off = (two_ranks[k] for k in ("tp-full-int8", "tp-partition-int8", "tp-partition-offload-int8"))
    half_payload = 2 * B * T * C // 2  # the int8 payload (one byte per entry) of half the block inputs per tp rank
    assert_same_run(full[:2], part[:2], rtol=0, atol=0)
    assert_same_run(full[:2], off[:2], rtol=0, atol=0)
    assert full[2]["mem_activations"] - part[2]["mem_activations"] == half_payload
    assert part[2]["mem_activations"] - off[2]["mem_activations"] == half_payload
    assert off[2]["mem_activations_host"] == half_payload


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_offloaded_and_arena_checkpoints_stay_encoded_under_lossy_compression(recompute):
    # offload and memory.contiguous move what the blocks keep; with int8 they move the encoding, so the run is the
    # plain int8 run bit for bit and the host holds one byte per kept entry (L block inputs with recompute=full)
    mem = {"memory__recompute": recompute, "memory__compress": "int8"}
    plain = run_engine("fp64", **mem)
    off = run_engine("fp64", **mem, memory__offload_activations="true")
    assert_bit_identical(off, plain)
    host = memory_reports(off[3])["mem_activations_host"]
    if recompute == "full":
        assert host == L * B * T * C
        assert_bit_identical(run_engine("fp64", **mem, memory__contiguous="true"), plain)
    else:  # everything the blocks save goes to the host, encoded: far less than the fp64 tensors would take
        assert 0 < host < memory_reports(run_engine("fp64", memory__offload_activations="true")[3])[
            "mem_activations_host"] / 4


def test_recompute_through_the_trainer_is_bit_identical_over_steps():
    over = {"model.dropout": 0.1, "train.steps": 3}
    ref = train_reference(over)
    for mode in ("full", "selective", "every:2"):
        assert_same_run(ref, train_reference({**over, "memory.recompute": mode}), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_int8_compression_under_tp_and_pp_tracks_the_loss_and_reports_its_ratio(two_ranks, layout):
    base, run = two_ranks[f"{layout}-none"], two_ranks[f"{layout}-int8"]
    for step, loss in base[0].items():
        assert abs(run[0][step] - loss) <= 5e-3  # the tolerance of test_memory_wiring
    assert 3.5 < run[2]["compress_ratio_int8"] <= 4.0  # fp64 -> int8 with one fp64 scale per 8 entries: 64/16
    assert run[2]["mem_activations"] < base[2]["mem_activations"] / 2


def test_recompute_replays_moe_routing_noise_and_counts_statistics_once():
    from harness import TINY, make_config

    from scaletrain.model.moe import moe_modules
    from scaletrain.train.trainer import Trainer

    over = {**TINY, "train.steps": 3, "model.n_layers": 4, "model.dropout": 0.1, "model.moe.experts": 4,
            "model.moe.router_noise": 1.0, "model.moe.random_routing": True}  # keyed random streams in routing

    def run(mode):
        t = Trainer(make_config({**over, "memory.recompute": mode}))
        losses = t.run().losses
        moe = [(m.key, m.stats.aux, m.stats.dropped, m.stats.assignments) for m in moe_modules(t.model)]
        return losses, t.full_state(), moe

    ref = run("none")
    for mode in ("full", "every:3"):
        got = run(mode)
        assert_same_run(ref[:2], got[:2], rtol=0, atol=0)
        assert got[2] == ref[2]  # statistics and stream offsets as without recomputation
