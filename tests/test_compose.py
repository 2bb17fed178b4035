"""Compositions that used to be refused, each equal to the single-process run (fp64, losses of every step and
every final parameter): Adafactor / SM3 under tensor parallelism (with sequence parallelism, a padded vocabulary
and ZeRO), ...

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
