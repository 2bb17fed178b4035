"""Compositions that used to be refused, each equal to the single-process run (fp64, losses of every step and
every final parameter): Adafactor / SM3 under tensor parallelism (with sequence parallelism, a padded vocabulary
and ZeRO); expert parallelism with ZeRO 1-3 (experts sharded over edp); MoE under tensor parallelism without dense
blocks and with sequence parallelism (each rank routes its shard, random routing streams sliced by position),
also with expert parallelism;
ZeRO-3 with pipeline parallelism under every synchronous schedule (a stage gathered once per step).

Tolerance: rtol 1e-10, atol 1e-12 (fp64; the layouts differ from one process only in summation order, measured
differences ~1e-15). Without the all-reduce of the factored statistics over tp the runs diverge at step 2.
"""

import pytest
from harness import assert_same_run, train_parallel_many, train_reference

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL, ATOL = 1e-10, 1e-12

# model.bias=false: the attention key bias has an exactly-zero true gradient and SM3 / Adafactor normalise its
# rounding noise into a full step (see test_zero.py); vocab 257 is padded to 258 over tp 2, so the last row of
# rank 1's embedding shard is padding that must not enter the column statistics.
FACTORED = {"model.bias": False, "model.vocab_size": 257}
ADAFACTOR = {**FACTORED, "optim.name": "adafactor", "optim.relative_step": True}
SM3 = {**FACTORED, "optim.name": "sm3", "optim.momentum": 0.5}


def test_adafactor_and_sm3_with_tp2_match_single_process():
    configs = [{**ADAFACTOR, "parallel.tp": 2}, {**SM3, "parallel.tp": 2, "parallel.sequence_parallel": True}]
    for cfg, par in zip(configs, train_parallel_many(configs, 2)):
        assert_same_run(train_reference({k: v for k, v in cfg.items() if not k.startswith("parallel.")}), par,
                        RTOL, ATOL)


def test_adafactor_and_sm3_with_dp2_tp2_and_zero_match_single_process():
    ada = {**ADAFACTOR, "optim.use_beta1": True, "optim.relative_step": False}
    configs = [{**ada, "parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 1},
               {**SM3, "parallel.dp": 2, "parallel.tp": 2, "parallel.zero": 3}]
    for cfg, par in zip(configs, train_parallel_many(configs, 4)):
        assert_same_run(train_reference({k: v for k, v in cfg.items() if not k.startswith("parallel.")}), par,
                        RTOL, ATOL)


MOE = {"model.moe.experts": 4, "model.moe.group_tokens": 16}


def test_expert_parallelism_with_zero_1_2_3_matches_single_process():
    """Dense parameters sharded over dp, experts over edp (dp 4 x ep 2: 2 ranks each), with CPU offload and with
    Adafactor/SM3 (their statistics of a stack of experts combined over ep)."""
    two = [{**MOE, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 1},
           {**MOE, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 2, "parallel.offload": "optimizer"},
           {**MOE, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3, "parallel.offload": "params"},
           {**MOE, **ADAFACTOR, "parallel.dp": 2, "parallel.ep": 2, "parallel.zero": 3},
           {**MOE, **SM3, "parallel.dp": 2, "parallel.ep": 2}]
    four = [{**MOE, "parallel.dp": 4, "parallel.ep": 2, "parallel.zero": 3}]
    for configs, world in ((two, 2), (four, 4)):
        for cfg, par in zip(configs, train_parallel_many(configs, world)):
            single = {k: v for k, v in cfg.items() if not k.startswith("parallel.")}
            assert_same_run(train_reference(single), par, RTOL, ATOL), cfg


def test_moe_with_tensor_and_sequence_parallelism_matches_single_process():
    """Experts and routers replicated over tp; with sequence parallelism each rank routes the dispatch groups of
    its sequence shard and the router noise / random routing / switch jitter follow the token (sliced streams)."""
    noisy = {**MOE, "model.moe.router_noise": 0.5, "model.moe.random_routing": True}
    configs = [{**noisy, "model.moe.every": 1, "parallel.tp": 2},
               {**noisy, "model.moe.every": 1, "parallel.tp": 2, "parallel.sequence_parallel": True},
               {**MOE, "model.mlp": "swiglu", "model.moe.router": "switch", "model.moe.router_noise": 0.1,
                "model.moe.every": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}]
    for cfg, par in zip(configs, train_parallel_many(configs, 2)):
        single = {k: v for k, v in cfg.items() if not k.startswith("parallel.")}
        assert_same_run(train_reference(single), par, RTOL, ATOL), cfg


def test_sequence_parallelism_with_expert_parallelism_matches_single_process():
    """dp 2 x tp 2 x ep 2: each tp rank routes its sequence shard and exchanges the slots with the ep group of
    its tp slice; the local experts' gradients are summed over tp (without that sum: 5.9e-4 relative loss and
    2.1e-2 gradient-norm differences), replicated and under ZeRO-3 (experts sharded over edp)."""
    base = {**MOE, "model.moe.every": 1, "parallel.dp": 2, "parallel.tp": 2, "parallel.ep": 2,
            "parallel.sequence_parallel": True}
    configs = [{**base, "model.moe.router_noise": 0.5, "model.moe.random_routing": True},
               {**base, "model.moe.router": "switch", "parallel.zero": 3}]
    for cfg, par in zip(configs, train_parallel_many(configs, 4)):
        single = {k: v for k, v in cfg.items() if not k.startswith("parallel.")}
        assert_same_run(train_reference(single), par, RTOL, ATOL), cfg


def test_zero3_with_pipeline_parallelism_matches_single_process():
    """Each stage's parameters sharded over its dp group, gathered when the step begins (and for evaluation),
    gradients reduce-scattered per micro-batch; every synchronous schedule, with CPU parameter offload."""
    base = {"train.eval_every": 2}
    two = [{**base, "parallel.pp": 2, "parallel.zero": 3, "parallel.schedule": s} for s in ("gpipe", "zb-h1")]
    two.append({**base, "parallel.pp": 2, "parallel.zero": 3, "parallel.schedule": "interleaved",
                "parallel.virtual_stages": 2, "model.n_layers": 4})
    four = [{**base, "parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 3},
            {**base, "parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "params",
             "parallel.schedule": "zb-h1", "train.micro_batch": 1}]
    for configs, world in ((two, 2), (four, 4)):
        for cfg, par in zip(configs, train_parallel_many(configs, world)):
            single = {k: v for k, v in cfg.items() if not k.startswith("parallel.")}
            assert_same_run(train_reference(single), par, RTOL, ATOL), cfg


def test_zero3_with_2bw_is_refused_with_a_reason():
    from scaletrain.config import load_config, validate
    from scaletrain.errors import ConfigError

    cfg = load_config(None, ["parallel.pp=2", "parallel.zero=3", "parallel.schedule=2bw"])
    with pytest.raises(ConfigError, match="PipeDream-2BW keeps its two weight versions"):
        validate(cfg)
