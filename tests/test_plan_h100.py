"""The planner's step time against our own H100 runs, and the fit of its one constant for eager PyTorch kernels
(issue 31, "calibration at scale"; docs/planner.md and docs/planner-validation.md section 1c).

Our runs: benchmarks/RESULTS.md "GPU fast path" (one H100 80GB SXM, GPT-3 125M / 350M / 1.3B, sequence 2048, a
global batch of 8 sequences, autocast-bf16 with fp32 parameters and AdamW; eager and compiled blocks). Each is
predicted as `scaletrain plan --config FILE --gpu h100-80gb` predicts it: the config through `config_layout` and
`config_training` (train.compile -> fused kernels, else eager).

`Assumptions.eager_mem_traffic` is fitted on two eager / compiled pairs, the same model on the same GPU with only
the kernels changed: ours at 125M (0.0611 s eager, 0.0528 s with compiled blocks) and torchtitan's Llama 3.1 8B on 8
H100 96GB (docs/performance.md Table 1: FSDP 5,762 tokens/s per GPU, FSDP + torch.compile 6,667). Each pair gives
the traffic at which the predicted ratio equals the measured one; the constant is their mean. Nothing held out
(tests/test_plan_published.py) is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
from test_plan_published import DEV_ROWS, TT_H100_SRC, errors, predict

from scaletrain.commands.plan import config_layout, config_training
from scaletrain.config import load_config, validate
from scaletrain.plan.analytic.estimate import estimate
from scaletrain.plan.analytic.inputs import Assumptions
from scaletrain.plan.catalog import from_model_config
from scaletrain.plan.hardware import get_gpu

H100 = get_gpu("h100-80gb")
SIZES = {"125m": (12, 768, 12, 8), "350m": (24, 1024, 16, 4), "1.3b": (24, 2048, 16, 2)}
"""layers, d_model, heads, micro-batch (benchmarks/bench_gpu.py)."""
OURS = [  # (size, variant, measured step seconds: benchmarks/RESULTS.md "GPU fast path", the trainer's column)
    ("125m", "eager", 0.0611), ("125m", "compile", 0.0528), ("125m", "compile full", 0.0601),
    ("350m", "eager", 0.1460), ("350m", "compile selective", 0.1779), ("1.3b", "eager", 0.3868)]


@functools.cache
def our_config(size: str, variant: str):
    """The benchmark's config of the row; train.compile is set after validate(), whose compile rule would import
    torch._dynamo (seconds) for a flag the planner only reads."""
    layers, d, heads, micro = SIZES[size]
    sets = {"model.n_layers": layers, "model.d_model": d, "model.n_heads": heads, "model.seq_len": 2048,
            "model.vocab_size": 50304, "train.micro_batch": micro, "train.global_batch": 8,
            "train.precision": "autocast-bf16", "memory.recompute": variant.split()[1] if " " in variant else "none"}
    cfg = validate(load_config(None, [f"{k}={v}" for k, v in sets.items()]), 1)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile="compile" in variant))


def planned_step(size: str, variant: str, a: Assumptions | None = None) -> float:
    cfg = our_config(size, variant)
    est = estimate(from_model_config(cfg.model), H100, config_training(cfg), config_layout(cfg), a or Assumptions(),
                   n_gpus=1)
    return est.step_time_s


PAIRS = (0.0611 / 0.0528, 6667 / 5762)
"""Measured eager / compiled: step-time ratio (ours, 125M), throughput ratio (torchtitan Table 1)."""


def _titan_row():
    return next(r for r in DEV_ROWS if r.source == TT_H100_SRC and r.gpus == 8)


def predicted_pair(i: int, traffic: float) -> float:
    """Pair i's predicted eager / compiled ratio with `eager_mem_traffic = traffic`."""
    a = Assumptions(eager_mem_traffic=traffic)
    if i == 0:
        return planned_step("125m", "eager", a) / planned_step("125m", "compile", a)
    titan = _titan_row()
    return predict(dataclasses.replace(titan, kernels="fused"), a) / predict(titan, a)


def pair_traffic(i: int) -> float:
    """The traffic at which pair i's predicted ratio is the measured one (bisection; the ratio grows with it)."""
    lo, hi = 2.0, 8.0
    for _ in range(14):  # to 6 / 2^14 = 0.0004
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_pair(i, mid) < PAIRS[i] else (lo, mid)
    return (lo + hi) / 2


def test_eager_traffic_is_the_mean_of_the_two_eager_compiled_pairs():
    """Ours gives 3.30, torchtitan's 3.76 (its Llama blocks run more element-wise kernels per stored byte in eager mode
    - RMSNorm in fp32, RoPE - than our GPT's); their mean 3.53, rounded: 3.5."""
    x = [pair_traffic(0), pair_traffic(1)]
    assert [round(v, 2) for v in x] == [3.30, 3.76]
    assert Assumptions().eager_mem_traffic == round(sum(x) / 2 * 2) / 2 == 3.5


def dev_loss(traffic: float) -> float:
    """Sum of squared log errors of the development rows of eager frameworks at `traffic`."""
    a = Assumptions(eager_mem_traffic=traffic)
    return sum(math.log(1 + e) ** 2 for e in errors([r for r in DEV_ROWS if r.kernels == "eager"], a))


def test_the_eager_development_rows_alone_would_want_more():
    """Fitted to the 14 eager development rows instead (least squares of log error), the traffic would be 4.3, not
    3.5: what they miss on H100 beyond the eager kernels (our compiled rows stay 10-18% optimistic) would be taken for
    more eager traffic; the pairs measure the eager kernels alone."""
    assert dev_loss(4.3) < min(dev_loss(4.25), dev_loss(4.35))


def test_our_h100_runs_as_measured():
    """Measured step over planned, per row of benchmarks/RESULTS.md "GPU fast path" (before the eager term: 1.36,
    1.18, 1.10, 1.33, 1.54, 1.27). The eager rows now 11-15% optimistic, the compiled ones 10-18% (small GEMMs and
    the flash kernel at d 768-1024, not modelled) and 350M compiled with selective recomputation, which measured
    slower than eager, 54%."""
    ratios = [meas / planned_step(s, v) for s, v, meas in OURS]
    assert [round(x, 2) for x in ratios] == [1.15, 1.18, 1.10, 1.11, 1.54, 1.11]


def test_plan_kernels_flag_prices_eager_blocks_and_config_takes_it_from_train_compile(capsys, tmp_path):
    """`plan --kernels eager` adds the eager element-wise traffic to the same layout (and says so in --json);
    `plan --config` reads it from train.compile, so --kernels with it is refused in one line, exit 2."""
    import json

    from scaletrain.cli import main

    argv = ["plan", "--model", "gpt3-1.3b", "--gpu", "h100-80gb", "--gpus", "8", "--global-batch", "64",
            "--layout", "dp=8,tp=1,pp=1,zero=1,mb=2,recompute=none", "--top", "1", "--json"]
    steps = {}
    for kernels in ("fused", "eager"):
        assert main(argv + ["--kernels", kernels]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["training"]["kernels"] == kernels
        steps[kernels] = doc["candidates"][0]["step_time_s"]
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["candidates"][0]["step_time_s"] == steps["fused"]
    assert steps["eager"] > 1.05 * steps["fused"]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(our_config("125m", "eager").to_yaml())
    assert main(["plan", "--config", str(cfg), "--gpu", "h100-80gb", "--kernels", "eager"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kernels would be ignored" in err and "\n" not in err
    with pytest.raises(SystemExit) as bad:  # argparse's choices: one line, exit 2
        main(["plan", "--kernels", "jit"])
    assert bad.value.code == 2 and "invalid choice: 'jit'" in capsys.readouterr().err


def test_350m_compiled_selective_is_slower_by_far_more_than_its_recompute():
    """docs/planner-validation.md "Deep pipelines at scale" (350M): the planner charges the checkpointed attention
    core 5.6 ms per step under compile (0.110 s -> 0.116 s), the recomputed attention forward that the compiled graphs
    show (`python tests/test_plan_h100.py --compiled-graphs`); the measured 0.178 s is 0.048 s over the compiled
    block at 125M's measured / planned ratio (1.18): about 9x the recompute, not modelled."""
    plain, selective = planned_step("350m", "compile"), planned_step("350m", "compile selective")
    ratio = 0.0528 / planned_step("125m", "compile")
    assert (round(plain, 3), round(selective, 3), round((selective - plain) * 1e3, 1)) == (0.11, 0.116, 5.6)
    assert round(ratio, 2) == 1.18 and round(0.1779 - ratio * plain, 3) == 0.048


def compiled_graph_ops() -> str:
    """The aten operators of one compiled block's forward and backward graphs (AOTAutograd, min-cut partitioner), with
    and without the attention core checkpointed as benchmarks/bench_gpu.py's `plain_loop` does, and Dynamo's graph
    breaks: the evidence of section "Deep pipelines at scale" on the 350M compiled selective row (CPU, seconds)."""
    import collections

    import torch
    import torch.utils.checkpoint
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    from scaletrain.config.schema import ModelConfig
    from scaletrain.model.gpt import build_gpt

    counts: dict[tuple[bool, str], collections.Counter] = {}
    lines = []
    for checkpointed in (False, True):
        block = build_gpt(ModelConfig(n_layers=1, d_model=64, n_heads=4, vocab_size=256, seq_len=64), 0).blocks[0]
        if checkpointed:
            core = block.attn.attn_core
            block.attn.attn_core = lambda *a, _f=core: torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False)
        x = torch.randn(2, 64, 64, requires_grad=True)
        torch._dynamo.reset()
        ex = torch._dynamo.explain(block.forward)(x)
        lines.append(f"checkpointed core {checkpointed}: {ex.graph_count} graph(s), {ex.graph_break_count} break(s)")

        def compiler(name, flag=checkpointed):
            def run(gm, _inputs):
                counts[(flag, name)] = collections.Counter(
                    str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                return gm.forward
            return run

        def backend(gm, inputs, c=compiler):
            return aot_module_simplified(gm, inputs, fw_compiler=c("fw"), bw_compiler=c("bw"),
                                         partition_fn=min_cut_rematerialization_partition)

        torch._dynamo.reset()
        torch.compile(block.forward, backend=backend)(x).sum().backward()
    ops = sorted(set().union(*counts.values()))
    lines.append("| op | fw | bw | fw, core checkpointed | bw, core checkpointed |\n|---|---|---|---|---|")
    for op in ops:
        row = [counts[(flag, side)][op] for flag in (False, True) for side in ("fw", "bw")]
        if row[:2] != row[2:]:
            lines.append(f"| {op} | " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if "--compiled-graphs" in sys.argv:
        print(compiled_graph_ops())
