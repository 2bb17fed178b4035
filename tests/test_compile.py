"""train.compile=true: compiled blocks compute what eager blocks compute.

fp64 on CPU, TorchInductor (C++ kernels built with the machine's compiler): the fused kernels sum in another order
than eager's, measured at most 1.5e-14 relative on the final parameters over 4 steps; the tolerance is 1e-12 (that of
the fp64 layout tests). The compiled run's blocks share one graph and nothing breaks it. That is the one inductor run
of this file (one tiny model): code generation costs about 15 s of CPU time, which counts against the test budget.
The layouts (dp 2 x ZeRO-3, whose hooks gather and release the parameters around each compiled block; ZeRO-Offload;
pp 2 with 1F1B, GPipe, 2BW, interleaved) and the compositions that change the graph (recomputation full / selective /
every:k, bf16, fp16, autocast-bf16, nvme offload) go through the same capture (TorchDynamo) and autograd tracing
(AOTAutograd) with the aot_eager backend ($SCALETRAIN_COMPILE_BACKEND), which runs the captured graphs without
generating code: what they add to inductor's numerics proven here is how the graph is captured and run around the
parallel machinery.
"""

import pytest
import torch
from harness import assert_same_run, train_parallel_many, train_reference

from scaletrain.parallel.compile import BACKEND_ENV

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def eager():
    return train_reference({})


def test_compiled_blocks_equal_eager_in_fp64_and_share_one_graph(eager):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = train_reference({"train.compile": True})
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph for all blocks
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_same_run(eager, compiled, 1e-12, 1e-12)


def test_compiled_zero3_and_pipeline_equal_single_process_eager(eager, monkeypatch):
    """Layouts equal to the single-process run, compiled; PipeDream-2BW (one step of weight delay, so not equal to
    it) and the interleaved schedule (4 layers: another model) compiled against their eager selves."""
    layouts = [{"parallel.dp": 2, "parallel.zero": 3}, {"parallel.pp": 2},
               {"parallel.pp": 2, "parallel.schedule": "gpipe"},
               {"parallel.dp": 2, "parallel.zero": 1, "parallel.offload": "optimizer"}]
    pairs = [{"parallel.pp": 2, "parallel.schedule": "2bw"},
             {"parallel.pp": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2, "model.n_layers": 4}]
    jobs = [{**o, "train.compile": True} for o in layouts]
    jobs += [job for o in pairs for job in (o, {**o, "train.compile": True})]
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # inherited by the spawned ranks
    runs = train_parallel_many(jobs, 2, timeout=600)
    for run in runs[:len(layouts)]:
        assert_same_run(eager, run, 1e-10, 1e-12)
    for i in range(len(layouts), len(jobs), 2):
        assert_same_run(runs[i], runs[i + 1], 1e-10, 1e-12)


@pytest.mark.parametrize("overrides, tol", [
    ({"memory.recompute": "full"}, 1e-12),
    ({"memory.recompute": "selective"}, 1e-12),
    ({"memory.recompute": "every:2", "model.n_layers": 4}, 1e-12),
    ({"train.precision": "autocast-bf16", "train.dtype": "fp32"}, 1e-6),
    ({"train.dtype": "bf16"}, 1e-6),
    ({"train.dtype": "fp16"}, 1e-6),
], ids=["recompute full", "recompute selective", "recompute every:2", "autocast-bf16", "bf16", "fp16"])
def test_compositions_capture_the_same_computation(monkeypatch, overrides, tol):
    """aot_eager runs the captured forward and backward graphs as they are: equal to eager up to the order of
    operations the graph fixes (fp64 1e-12; autocast-bf16's fp32 sums 1e-6)."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    overrides = {**overrides, "train.steps": 2}
    assert_same_run(train_reference(overrides), train_reference({**overrides, "train.compile": True}), tol, tol)


def test_an_unknown_compile_backend_is_refused(monkeypatch):
    from harness import make_config

    from scaletrain.errors import ConfigError

    monkeypatch.setenv(BACKEND_ENV, "no-such-backend")
    with pytest.raises(ConfigError, match="SCALETRAIN_COMPILE_BACKEND=no-such-backend is not a torch.compile backend"):
        make_config({"train.compile": True})


def test_compiled_blocks_under_nvme_offload_equal_eager(monkeypatch):
    """ZeRO-Infinity materialises each block's parameters from files around the compiled block (aot_eager)."""
    from harness import TINY, make_config
    from torch._dynamo.utils import counters

    from scaletrain.train.trainer import Trainer

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    runs = []
    for compiled in (False, True):
        t = Trainer(make_config({**TINY, "parallel.zero": 3, "parallel.offload": "nvme", "train.steps": 2,
                                 "train.compile": compiled}))
        runs.append((t.run().losses, t.full_state()))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["stats"])
    assert_same_run(*runs, 1e-12, 1e-12)
