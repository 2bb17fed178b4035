"""The checkpointing policies beside full and every:k (tests/test_recompute.py): `nth:k` (torchtitan's selective layer:
blocks 0, k, 2k, ... by global index are full checkpoints), `ops:<kinds>` (torchtitan's selective op: torch's selective
activation checkpointing keeps the outputs of the listed op kinds) and `attn-core` (Korthikanti et al., arXiv
2205.05198; `selective` is its old name).

Claims:
- every policy gives losses and gradients bit-identical to `none` in one process (fp32 and fp64, with dropout, whose
  masks the recomputation must replay), and the same run as one process in fp64 (rtol 1e-10, atol 1e-12, the fp64
  layout tolerance of tests/harness.py) under tp, tp + sp, pp (1F1B, interleaved; PipeDream-2BW against its own run
  without recomputation, bit for bit), ZeRO-3, expert parallelism and partitioned + offloaded checkpoints;
- each keeps exactly what its definition says, from the model's dimensions (L blocks, n = B*T tokens, e bytes):
      none - nth:2             = 2 (per-layer - block input)       blocks 0 and 2 of 4 keep only their inputs
      ops:matmul - full        = L n (3C + C + f + C) e             qkv, attention projection, fc, MLP projection
      ops:attention - full     = L n (C + nh) e                     the flash kernel's output and log-sum-exp
      none - attn-core         = L n nh e                           the log-sum-exp only, with flash attention
- the planner's `mem_activations` (plan/exact/run_memory.py) equals the trainer's measurement to the byte for them,
  on one process (bf16, fp16, autocast-bf16, SwiGLU, RoPE, both dropouts, MoE) and two (tp, sp, pp, ep, ZeRO-3);
- what ops:... cannot compose with is refused by validate() with the reason.
"""

from __future__ import annotations

import pytest
import torch
from harness import TINY, assert_same_run, make_config, measured_and_planned, run_ranks, train_reference

from scaletrain.config import load_config, validate
from scaletrain.config.parse import parse_recompute
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.errors import ConfigError
from scaletrain.parallel.parallelize import build_engine

pytestmark = pytest.mark.usefixtures("one_thread")

L, C, NH, T, B, V = 4, 32, 4, 32, 2, 256
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
POLICIES = ("full", "attn-core", "nth:2", "ops:matmul", "ops:attention", "ops:matmul+attention")


def one_pass(dtype: str, recompute: str, dropout: float):
    """Loss, gradients by name and saved bytes of one forward/backward of a fresh engine."""
    sets = [f"model.n_layers={L}", f"model.d_model={C}", f"model.n_heads={NH}", f"model.seq_len={T}",
            f"memory.recompute={recompute}", f"model.dropout={dropout}"]
    cfg = validate(load_config(None, sets))
    engine = build_engine(cfg, Mesh.build(ParallelDims()), torch.device("cpu"), DTYPES[dtype], CommStats())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    torch.manual_seed(7)
    loss = engine.forward_backward([(x, y)], 1.0)
    return loss, {n: p.grad.clone() for n, p in engine.module.named_parameters()}, engine.activation_bytes


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_policies_are_bit_identical_to_none_and_keep_what_they_name(dtype, dropout):
    runs = {m: one_pass(dtype, m, dropout) for m in ("none", *POLICIES)}
    for mode in POLICIES:
        assert torch.equal(runs[mode][0], runs["none"][0]), mode
        for name, grad in runs["none"][1].items():
            assert torch.equal(runs[mode][1][name], grad), (mode, name)
    saved = {m: r[2] for m, r in runs.items()}
    e, n, f = DTYPES[dtype].itemsize, B * T, 4 * C
    block_input = n * C * e
    per_layer = (saved["none"] - saved["full"]) // L + block_input
    assert saved["none"] - saved["nth:2"] == 2 * (per_layer - block_input)
    if dropout == 0.0:
        assert saved["ops:matmul"] - saved["full"] == L * n * (3 * C + C + f + C) * e
        assert saved["ops:attention"] - saved["full"] == L * n * (C + NH) * e
        assert saved["ops:matmul+attention"] - saved["full"] == L * n * (6 * C + f + NH) * e
        assert saved["none"] - saved["attn-core"] == L * n * NH * e
        assert saved["full"] < saved["ops:attention"] < saved["ops:matmul"] < saved["none"]
    else:  # unfused attention (layout-independent masks): no fused kernel to keep; its two products are matmuls
        assert saved["ops:matmul"] - saved["full"] == L * n * (6 * C + f + NH * T) * e  # scores nh x T, with v C
        assert saved["ops:attention"] == saved["full"] and saved["ops:matmul+attention"] == saved["ops:matmul"]


def test_policy_names_aliases_and_malformed_values():
    assert parse_recompute("selective") == parse_recompute("attn-core")  # the old name stays accepted
    assert parse_recompute("nth:1").kind == parse_recompute("every:1").kind == "full"
    assert (parse_recompute("nth:3").kind, parse_recompute("nth:3").k) == ("nth", 3)
    mode = parse_recompute("OPS:attention,matmul")
    assert (mode.kind, mode.ops, mode.spec) == ("ops", {"matmul", "attention"}, "ops:matmul+attention")
    for bad, words in (("nth:0", "nth:k"), ("ops:", "op kind"), ("ops:matmul+softmax", "op kind softmax"),
                       ("layers:2", "attn-core")):
        with pytest.raises(ConfigError, match=words):
            make_config({**TINY, "memory.recompute": bad})


@pytest.mark.parametrize("sets, words", [
    ({"memory.offload_activations": True}, "memory.offload_activations=True is not available"),
    ({"memory.compress": "int8"}, "memory.compress=int8 is not available"),
    ({"memory.contiguous": True}, "memory.contiguous=True is not available"),
    ({"memory.partition_checkpoints": True, "parallel.tp": 2}, "partition_checkpoints needs memory.recompute full"),
    ({"parallel.pp": 2, "parallel.schedule": "zb-h1"}, "zb-h1 is not available: zero bubble"),
    ({"parallel.tp": 4, "parallel.tp_mode": "2d"}, "tp_mode=2d is not available"),
    ({"train.compile": True}, "train.compile=true is not available"),
    ({"model.reversible": True}, "reversible blocks keep no activations"),
])
def test_what_the_op_policy_cannot_compose_with_is_refused(sets, words):
    with pytest.raises(ConfigError, match=words):
        validate(load_config(None, [f"{k}={v}" for k, v in {**TINY, "memory.recompute": "ops:matmul", **sets}.items()]),
                 4)


SMALL = {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": 32, "model.vocab_size": 257,
         "train.steps": 1, "train.global_batch": 8, "train.micro_batch": 2, "train.eval_every": 0}
ONE_RANK = [
    {"memory.recompute": "ops:matmul+attention", "train.dtype": "bf16", "model.mlp": "swiglu",
     "model.position": "rope", "model.bias": False},
    {"memory.recompute": "ops:attention", "train.dtype": "fp16"},
    {"memory.recompute": "ops:matmul", "model.dropout": 0.1, "train.dtype": "bf16"},
    {"memory.recompute": "ops:matmul", "model.dropout": 0.1, "model.dropout_impl": "torch"},
    {"memory.recompute": "ops:matmul+attention", "train.precision": "autocast-bf16", "model.mlp": "swiglu"},
    {"memory.recompute": "ops:matmul", "model.moe.experts": 4, "model.moe.router": "expert_choice",
     "model.mlp": "swiglu", "train.dtype": "bf16"},
    {"memory.recompute": "nth:2", "model.n_layers": 4, "model.position": "rope", "train.dtype": "fp64"},
    {"memory.recompute": "nth:3", "model.n_layers": 4, "memory.offload_activations": True},
    {"memory.recompute": "nth:2", "model.n_layers": 4, "model.moe.experts": 4, "model.moe.every": 2,
     "train.dtype": "bf16"},
]


@pytest.mark.parametrize("overrides", ONE_RANK, ids=lambda o: ",".join(f"{k.split('.')[-1]}={v}" for k, v in o.items()))
def test_planner_predicts_the_policies_to_the_byte_one_process(overrides):
    from scaletrain.train.trainer import Trainer

    trainer = Trainer(make_config({**SMALL, **overrides}))
    trainer.run()
    for key, (measured, planned) in measured_and_planned(trainer).items():
        assert planned == measured, (key, planned, measured)


DROP = {"train.steps": 3, "model.dropout": 0.1}
TWO_RANK_RUNS = {  # name -> (overrides, the single-process model they are compared with)
    "tp-ops": ({**DROP, "parallel.tp": 2, "memory.recompute": "ops:matmul+attention"}, "drop"),
    "tp-sp-ops": ({"train.steps": 3, "parallel.tp": 2, "parallel.sequence_parallel": True, "model.mlp": "swiglu",
                   "model.position": "rope", "memory.recompute": "ops:matmul"}, "swiglu-rope"),
    "pp-interleaved-ops": ({**DROP, "parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
                            "model.n_layers": 4, "memory.recompute": "ops:matmul"}, "drop-4"),
    "pp-nth": ({**DROP, "parallel.pp": 2, "model.n_layers": 4, "memory.recompute": "nth:2"}, "drop-4"),
    "z3-ops": ({**DROP, "parallel.dp": 2, "parallel.zero": 3, "model.n_layers": 4,
                "memory.recompute": "ops:matmul"}, "drop-4"),
    "ep-ops": ({"train.steps": 3, "parallel.dp": 2, "parallel.ep": 2, "model.moe.experts": 4,
                "memory.recompute": "ops:matmul"}, "moe"),
    "tp-nth-partition-offload": ({"train.steps": 3, "parallel.tp": 2, "model.n_layers": 3, "memory.recompute": "nth:2",
                                  "memory.partition_checkpoints": True, "memory.offload_activations": True}, "3"),
    "2bw-none": ({**DROP, "parallel.pp": 2, "parallel.schedule": "2bw", "model.n_layers": 4}, None),
    "2bw-ops": ({**DROP, "parallel.pp": 2, "parallel.schedule": "2bw", "model.n_layers": 4,
                 "memory.recompute": "ops:matmul"}, None),
}
REFERENCES = {"drop": DROP, "swiglu-rope": {"train.steps": 3, "model.mlp": "swiglu", "model.position": "rope"},
              "drop-4": {**DROP, "model.n_layers": 4}, "3": {"train.steps": 3, "model.n_layers": 3},
              "moe": {"train.steps": 3, "model.moe.experts": 4}}


def _two_ranks(rank, world):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for name, (over, _) in TWO_RANK_RUNS.items():
        t = Trainer(make_config({**TINY, **over}), None, DistEnv(rank, world, 0, "test"))
        losses = t.run().losses
        out[name] = (losses, t.full_state(), measured_and_planned(t))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, timeout=300)[0]


@pytest.fixture(scope="module")
def references():
    return {name: train_reference(over) for name, over in REFERENCES.items()}


@pytest.mark.parametrize("name", [n for n, (_, ref) in TWO_RANK_RUNS.items() if ref is not None])
def test_policies_under_tp_sp_pp_zero3_and_ep_match_single_process(two_ranks, references, name):
    assert_same_run(references[TWO_RANK_RUNS[name][1]], two_ranks[name][:2], rtol=1e-10, atol=1e-12)


def test_op_policy_under_pipedream_2bw_is_bit_identical_to_its_run_without_recomputation(two_ranks):
    assert_same_run(two_ranks["2bw-none"][:2], two_ranks["2bw-ops"][:2], rtol=0, atol=0)


def test_planner_predicts_the_policies_to_the_byte_two_processes(two_ranks):
    wrong = [(n, key, planned, measured) for n in TWO_RANK_RUNS for key, (measured, planned) in two_ranks[n][2].items()
             if planned != measured]
    assert not wrong, wrong
