"""The planner against published GPU runs it was not built on (issue 31): development rows, looked at while the
calibration of plan/analytic was being found, and held-out rows, written down with the error bound below before
the planner was run on them. docs/planner-validation.md section 1b prints both tables (`python
tests/test_plan_published.py`).

Every row: the model's exact dimensions, the layout and batch the source states, the metric it reports (tokens/s per
GPU, model or hardware TFLOP/s per GPU, MFU) and the source (paper table, repository path, documentation page).
Where a source is silent the row says what we assumed (`note`).
"""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.plan.analytic.estimate import estimate
from scaletrain.plan.analytic.inputs import Assumptions, Layout, Training
from scaletrain.plan.catalog import ModelSpec, get_model
from scaletrain.plan.hardware import get_gpu

HELD_OUT_BOUND = (0.35, 0.15)
"""Stated before the held-out rows were predicted: every row within 35%, the mean |error| within 15%."""

_MPT = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
        "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}


def mpt(size: str, seq: int) -> ModelSpec:
    """llm-foundry's benchmark MPT: GELU x4, learned positions, biases, tied embeddings, vocabulary 50368 (the
    NumParams column of the benchmark table is this count exactly)."""
    layers, d, heads = _MPT[size]
    return ModelSpec(f"mpt-{size}", layers, d, heads, 50368, seq, bias=True)


def nemo_gpt3(layers: int, d: int, heads: int) -> ModelSpec:
    """NeMo's GPT-3 configs (NeMo-Megatron-Launcher conf/training/gpt3): GELU x4, learned positions, biases, tied
    embeddings, vocabulary 50257, sequence 2048."""
    return ModelSpec(f"gpt3-nemo-{layers}x{d}", layers, d, heads, 50257, 2048, bias=True)


MPT_SRC = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
TT_A100_SRC = "pytorch/torchtitan docs/performance.md (64 A100 80GB, FSDP2; commit 0413364)"
TT_H100_SRC = "pytorch/torchtitan docs/performance.md Tables 1, 3 (Grand Teton H100 96GB HBM2e 500W, FSDP2)"
NEMO_SRC = "NeMo Framework 24.09 performance summary, pretraining at FP8 on DGX-H100"
LLAMA3_SRC = "Llama 3 paper, arXiv 2407.21783, Table 4"
MTNLG_SRC = "MT-NLG, arXiv 2201.11990 Sec. 2.4"


@dataclasses.dataclass(frozen=True)
class Row:
    source: str
    model: ModelSpec
    gpu: str
    gpus: int
    global_batch: int
    layout: Layout
    metric: str
    """tokens/s/GPU, model TFLOP/s, hardware TFLOP/s, MFU (%)."""
    published: float
    dtype: str = "bf16"
    attention: str = "flash"
    dp_overlap: bool = True
    tp_overlap: bool = False
    note: str = ""
    grad_bytes: int | None = None
    """Bytes per gradient element where the source states them (Llama 3: FP32 accumulation and reduce-scatter)."""
    kernels: str = "fused"
    """`eager` for the PyTorch frameworks whose source states no torch.compile (MPT llm-foundry's benchmark, torchtitan
    rows without it), `fused` for Megatron-LM / Megatron-core with TransformerEngine and Meta's Llama 3 run."""


def _fsdp(n: int, mb: int, ga: int, rec: str) -> Layout:
    return Layout(dp=n, zero=3, micro_batch=mb, recompute=rec)


DEV_ROWS = [
    # deep pipelines on thousands of GPUs (A100 80GB, Selene): DeepSpeed pipeline + Megatron tensor parallelism,
    # batch 1920 x 2048, 8-way tensor and 35-way pipeline parallelism, micro-batch 1, full recomputation
    *(Row(MTNLG_SRC, ModelSpec("mt-nlg-530b", 105, 20480, 128, 50272, 2048, dropout=True), "a100-80gb", n, 1920,
          Layout(dp=n // 280, tp=8, pp=35, micro_batch=1, recompute="full"), "hardware TFLOP/s", pub,
          attention="standard", dp_overlap=False) for n, pub in ((2240, 126), (2800, 121), (3360, 113))),
    # Llama 3 405B (Sec. 3.3.2 and Table 4): TP 8, CP 1, PP 16, 16M tokens of 8192 (M = 32 / 16 micro-batches of 1);
    # "the first model chunk on the first stage has only the embedding, and the last model chunk on the last stage has
    # only output projection and loss calculation" after one layer each went: chunks of one layer, (126 + 2) / 16 = 8
    # chunks per rank (V = 8); "without activation checkpointing"; FSDP sharding the optimizer states, gradients
    # accumulated over the micro-batches and reduce-scattered in FP32 once per step (ZeRO-1's one reduction per step,
    # 4-byte gradients; weights not resharded after forward)
    *(Row(LLAMA3_SRC, get_model("llama3-405b"), "h100-80gb", n, 2048,
          Layout(dp=n // 128, tp=8, pp=16, zero=1, micro_batch=1, sequence_parallel=True, schedule="interleaved",
                 virtual_stages=8, partition="ends"), "model TFLOP/s", pub, grad_bytes=4,
          note="V = 8 from Sec. 3.3.2's one-layer chunks; FSDP with FP32 gradient accumulation and reduce-scatter read"
               " as ZeRO-1 with 4-byte gradients")
      for n, pub in ((8192, 430), (16384, 400))),
    # small models on H100: torchtitan Llama 3.1 8B, FSDP, local batch 2, selective op checkpointing
    *(Row(TT_H100_SRC, get_model("llama3-8b"), "h100-96gb", n, 2 * n, _fsdp(n, 2, 1, "ops:matmul+attention"),
          "tokens/s/GPU", pub, note="selective op AC read as ops:matmul+attention (torchtitan recomputes every "
          "other matmul too); Table 1's FSDP row, without torch.compile", kernels="eager")
      for n, pub in ((8, 5762), (128, 5605))),
    # MPT on H100 and A100 80GB (FULL_SHARD, bf16): the rows looked at while modelling
    *(Row(MPT_SRC, mpt(size, seq), gpu, n, mb * ga * n, _fsdp(n, mb, ga, "full" if ac else "none"), "MFU", mfu,
          kernels="eager")
      for size, seq, n, gpu, mfu, mb, ga, ac in (
          ("7b", 2048, 8, "h100-80gb", 46.44, 6, 1, False), ("7b", 2048, 8, "a100-80gb", 64.23, 6, 2, False),
          ("13b", 2048, 64, "h100-80gb", 39.86, 2, 1, False), ("3b", 2048, 64, "h100-80gb", 40.8, 6, 3, False),
          ("1b", 2048, 8, "h100-80gb", 41.82, 14, 1, False), ("1b", 2048, 8, "a100-80gb", 59.86, 14, 4, False),
          ("760m", 2048, 8, "a100-80gb", 56.85, 24, 2, False), ("30b", 2048, 8, "a100-80gb", 55.3, 3, 21, True),
          ("30b", 2048, 32, "h100-80gb", 43.92, 14, 3, True), ("70b", 2048, 64, "h100-80gb", 42.57, 8, 4, True),
          ("70b", 2048, 64, "a100-80gb", 53.33, 8, 4, True), ("125m", 2048, 8, "a100-80gb", 44.79, 40, 2, False))),
]

HELD_OUT = [
    # torchtitan on 64 A100 80GB, FSDP2 (1D), sequence 8192 (Llama 3) / 4096 (Llama 2)
    *(Row(TT_A100_SRC, get_model(name), "a100-80gb", 64, lbs * 64, _fsdp(64, lbs, 1, rec), "tokens/s/GPU", wps,
          note="selective layer = nth:2, selective op = ops:matmul+attention; torch.compile not stated: eager",
          kernels="eager")
      for name, lbs, rec, wps in (
          ("llama3-8b", 1, "nth:2", 2904), ("llama3-8b", 1, "ops:matmul+attention", 2973),
          ("llama3-70b", 1, "full", 331), ("llama2-13b", 2, "none", 2162), ("llama2-13b", 2, "nth:2", 1914),
          ("llama2-13b", 2, "ops:matmul+attention", 1904), ("llama2-70b", 1, "ops:matmul+attention", 355),
          ("llama2-70b", 2, "full", 353))),
    # NeMo 24.09 at FP8 on DGX-H100 (Megatron-core with TransformerEngine: distributed optimizer, sequence
    # parallelism with tensor-parallel communication overlap); recomputation not stated: none assumed
    *(Row(NEMO_SRC, model, "h100-80gb", n, gbs,
          Layout(dp=n // (tp * pp), tp=tp, pp=pp, zero=1, micro_batch=mb, sequence_parallel=tp > 1,
                 schedule="interleaved" if vp > 1 else "1f1b", virtual_stages=vp), "tokens/s/GPU", tps, dtype="fp8",
          tp_overlap=True, note="no recomputation assumed")
      for model, n, gbs, mb, tp, pp, vp, tps in (
          (get_model("gpt3-175b"), 128, 256, 1, 4, 8, 6, 716), (get_model("gpt3-175b"), 512, 2048, 2, 4, 8, 6, 825),
          (get_model("llama2-7b"), 8, 128, 1, 1, 1, 1, 16934), (get_model("llama2-13b"), 16, 128, 1, 1, 4, 10, 8715),
          (get_model("llama2-70b"), 64, 128, 1, 4, 4, 20, 1728), (nemo_gpt3(24, 4096, 32), 64, 2048, 4, 1, 1, 1, 23406),
          (nemo_gpt3(44, 6144, 48), 64, 256, 2, 2, 1, 1, 5851))),
    # MPT at FP8 (TransformerEngine linears) on 8 H100 80GB, FULL_SHARD, no activation checkpointing
    *(Row(MPT_SRC, mpt(size, seq), "h100-80gb", 8, mb * ga * 8, _fsdp(8, mb, ga, "none"), "tokens/s/GPU", tps,
          dtype="fp8", kernels="eager") for size, seq, mb, ga, tps in (
          ("3b", 2048, 10, 6, 30586), ("3b", 512, 40, 6, 36527), ("1b", 512, 56, 4, 70315), ("1b", 8192, 2, 4, 32010))),
    # MPT on A100 40GB with 1600 Gb/s per node (RoCE), pure bf16, FULL_SHARD
    *(Row(MPT_SRC, mpt(size, 2048), "a100-40gb", n, mb * n, _fsdp(n, mb, 1, "full" if ac else "none"),
          "tokens/s/GPU", tps, kernels="eager") for size, n, mb, ac, tps in (
          ("7b", 64, 18, True, 3665), ("13b", 64, 16, True, 1976), ("30b", 128, 6, True, 865),
          ("3b", 64, 6, False, 9736), ("70b", 128, 4, True, 376))),
]


def predict(row: Row, a: Assumptions | None = None) -> float:
    train = Training(row.global_batch, row.dtype, row.attention, row.dp_overlap, kernels=row.kernels,
                     grad_bytes=row.grad_bytes)
    a = dataclasses.replace(a or Assumptions(), tp_comm_overlap=row.tp_overlap)
    est = estimate(row.model, get_gpu(row.gpu), train, row.layout, a, n_gpus=row.gpus)
    return {"tokens/s/GPU": est.tokens_per_s / row.gpus, "model TFLOP/s": est.model_tflops_per_gpu,
            "hardware TFLOP/s": est.hardware_tflops_per_gpu, "MFU": 100 * est.mfu}[row.metric]


def errors(rows: list[Row], a: Assumptions | None = None) -> list[float]:
    return [predict(r, a) / r.published - 1 for r in rows]


def test_held_out_rows_are_enough_and_new():
    assert len(HELD_OUT) >= 12 and len({(r.source, r.model.name, r.gpus, r.layout) for r in HELD_OUT}) == len(HELD_OUT)


def markdown(rows: list[Row]) -> str:
    lines = ["| source | model | GPU | GPUs | batch | layout | dtype | metric | published | predicted | error |",
             "|" + "---|" * 11]
    errs = []
    for r in rows:
        pred = predict(r)
        errs.append(pred / r.published - 1)
        lines.append(f"| {r.source} | {r.model.name} | {r.gpu} | {r.gpus} | {r.global_batch} | {r.layout.short()} |"
                     f" {r.dtype} | {r.metric} | {r.published:,} | {pred:,.4g} | {errs[-1]:+.1%} |")
    mean = sum(abs(e) for e in errs) / len(errs)
    lines.append(f"\nmax |error| {max(abs(e) for e in errs):.1%}, mean |error| {mean:.1%}, mean signed error "
                 f"{sum(errs) / len(errs):+.1%} over {len(errs)} rows")
    return "\n".join(lines)


def breakdown(rows: list[Row]) -> str:
    """The planner's step of each row in its parts (seconds and share), beside the published step it implies."""
    keys = ("compute", "recompute", "tp_comm", "pp_comm", "bubble", "dp_comm", "optimizer", "stragglers")
    lines = ["| model | GPUs | layout | " + " | ".join(keys) + " | planned step s | published step s |",
             "|" + "---|" * (len(keys) + 5)]
    for r in rows:
        train = Training(r.global_batch, r.dtype, r.attention, r.dp_overlap, kernels=r.kernels,
                         grad_bytes=r.grad_bytes)
        est = estimate(r.model, get_gpu(r.gpu), train, r.layout, Assumptions(tp_comm_overlap=r.tp_overlap),
                       n_gpus=r.gpus)
        b, step = est.time_breakdown, est.step_time_s
        parts = " | ".join(f"{b[k]:.2f} ({b[k] / step:.0%})" for k in keys)
        lines.append(f"| {r.model.name} | {r.gpus:,} | {est.label()} | {parts} | {step:.2f} |"
                     f" {step * predict(r) / r.published:.2f} |")
    return "\n".join(lines)


def test_held_out_errors_as_measured():
    """Measured once the rows and bound above were committed (docs/planner-validation.md section 1b): 23 of the 24
    rows within the stated 35% (MPT-1B at FP8 with 8192-token sequences and 2 of them per GPU +38.7%), mean |error|
    10.9%, mean signed +4.0%. With eager PyTorch kernels modelled (`Assumptions.eager_mem_traffic`, fitted on the
    eager / compiled pairs of tests/test_plan_h100.py, none of these rows): all 24 within 35%, max 23.8% (the same
    MPT-1B row), mean 9.0%, mean signed -1.9%."""
    e = errors(HELD_OUT)
    mean = sum(abs(x) for x in e) / len(e)
    assert all(abs(x) <= HELD_OUT_BOUND[0] for x in e) and mean <= HELD_OUT_BOUND[1]
    assert (round(max(abs(x) for x in e), 3), round(mean, 3), round(sum(e) / len(e), 3)) == (0.238, 0.09, -0.019)


def test_development_errors_as_measured():
    """The rows the calibration was diagnosed on (no bound was set for them): max 36.7%, mean |error| 16.2% before the
    eager kernels were modelled; max 31.5% (MT-NLG, unchanged), mean 10.5% after; mean 9.6% with the Llama 3 rows
    configured as the paper states (`test_llama3_405b_rows_follow_the_papers_own_pipeline`)."""
    e = errors(DEV_ROWS)
    assert (round(max(abs(x) for x in e), 3), round(sum(abs(x) for x in e) / len(e), 3)) == (0.315, 0.096)


def test_the_margin_beside_each_candidate_is_the_held_out_90th_percentile():
    import statistics

    from scaletrain.plan.report import TRUST

    assert TRUST == round(statistics.quantiles([abs(x) for x in errors(HELD_OUT)], n=10)[8], 2)


def test_exposed_p2p_and_dp_cannot_explain_the_mt_nlg_gap():
    """docs/planner.md "Calibration at scale": on the MT-NLG rows (26-32% optimistic) the exposed pipeline p2p is
    0.5% of the predicted step and the (unoverlapped) data-parallel all-reduce 0.8-1.1%. Even if every one of the 8
    tensor-parallel ranks sent the whole activation (no scatter/gather; DeepSpeed's pipeline engine does partition
    it, runtime/pipe/engine.py's PartitionedTensor) and the all-reduce took twice as long, the step would grow
    by under 6% and each row would stay over 18% optimistic: the gap is elsewhere."""
    for r in (r for r in DEV_ROWS if r.source == MTNLG_SRC):
        est = estimate(r.model, get_gpu(r.gpu), Training(r.global_batch, r.dtype, r.attention, r.dp_overlap),
                       r.layout, Assumptions(tp_comm_overlap=r.tp_overlap), n_gpus=r.gpus)
        b = est.time_breakdown
        assert b["pp_comm"] / est.step_time_s < 0.006 and b["dp_comm"] / est.step_time_s < 0.012
        extra = (7 * b["pp_comm"] + b["dp_comm"]) / est.step_time_s  # the added time of that worst case
        assert extra < 0.06 and predict(r) / r.published / (1 + extra) - 1 > 0.18


def llama3_rows_as_assumed_before() -> list[Row]:
    """The Llama 3 rows as they were before the paper's pipeline was read: V = 2, ZeRO-0, 2-byte gradients."""
    return [dataclasses.replace(r, grad_bytes=None, layout=dataclasses.replace(r.layout, zero=0, virtual_stages=2))
            for r in DEV_ROWS if r.source == LLAMA3_SRC]


def test_llama3_405b_rows_follow_the_papers_own_pipeline():
    """docs/planner-validation.md "Deep pipelines at scale": the Llama 3 rows were 6% and 16% pessimistic with V = 2,
    an assumption; Sec. 3.3.2's one-layer end chunks give V = 8 (`test_plan_stages.py`), its bubble formula
    (PP - 1) / (V M) is the planner's interleaved closed form, and it says the MFU drop from 8K to 16K GPUs "is due to
    the lower batch size per DP group". Measured with V = 8: +3.3% and +1.8%; the predicted drop 8.4% against the
    published 7.0% (430 -> 400), where V = 2 (the same data parallelism) predicts 17.9%."""
    rows = [r for r in DEV_ROWS if r.source == LLAMA3_SRC]
    assert [round(predict(r) / r.published - 1, 3) for r in rows] == [0.033, 0.018]
    assert round(1 - predict(rows[1]) / predict(rows[0]), 3) == 0.084 and round(1 - 400 / 430, 3) == 0.07
    v2 = [dataclasses.replace(r, layout=dataclasses.replace(r.layout, virtual_stages=2)) for r in rows]
    assert round(1 - predict(v2[1]) / predict(v2[0]), 3) == 0.179

    def memory_gb(r: Row) -> float:
        train = Training(r.global_batch, grad_bytes=r.grad_bytes)
        return round(estimate(r.model, get_gpu(r.gpu), train, r.layout, Assumptions(), n_gpus=r.gpus).memory["total"]
                     / 1e9)

    # the rows before (V = 2, ZeRO-0, 2-byte gradients) did not fit in 80 GB; the planner's ZeRO-3, which
    # reduce-scatters every micro-batch against the paper's FP32 accumulation, would be 17-18% pessimistic; the
    # paper's layout is over 80 GB in the planner too (Megatron's interleaved warm-up, not Meta's schedule)
    before = llama3_rows_as_assumed_before()
    z3 = [dataclasses.replace(r, layout=dataclasses.replace(r.layout, zero=3)) for r in rows]
    assert [memory_gb(r) for r in before] == [176, 141] and [memory_gb(r) for r in rows] == [117, 108]
    assert [round(predict(r) / r.published - 1, 3) for r in before + z3] == [-0.062, -0.161, -0.178, -0.169]
    # the pipeline's p2p (V = 8: eight sends per pass) is charged exposed; the paper's asynchronous p2p hiding all of
    # it would make the rows about 7% and 5% optimistic
    hidden = []
    for r in rows:
        est = estimate(r.model, get_gpu(r.gpu), Training(r.global_batch, grad_bytes=r.grad_bytes), r.layout,
                       Assumptions(), n_gpus=r.gpus)
        hidden.append(round(predict(r) * est.step_time_s / (est.step_time_s - est.time_breakdown["pp_comm"])
                            / r.published - 1, 3))
    assert hidden == [0.069, 0.05], hidden


def _deepspeed_train_schedule(p: int, m: int, swap: bool = False) -> list[list[tuple]]:
    """Per stage, DeepSpeed's `TrainSchedule` (deepspeed/runtime/pipe/schedule.py, the engine of MT-NLG) as ordered
    instructions: 2(m + p - 1) steps, forward on even stages at even steps and on odd stages at odd steps; a forward
    step receives its activation and then sends the previous step's gradient, a backward step sends the previous
    step's activation and then receives its gradient (`swap`: the other order, as in other DeepSpeed versions); every
    send and receive is blocking and paired."""
    out = []
    for s in range(p):
        cmds, prev = [], -1
        for step in range(2 * (m + p - 1)):
            fwd = step % 2 == s % 2
            mb = (step // 2 - s // 2 if fwd else step // 2 - p + (s + 1) // 2) if step % 2 == 0 else \
                ((step - 1) // 2 - s // 2 if fwd else (step - 1) // 2 - p + 1 + s // 2)
            ok, had = 0 <= mb < m, 0 <= prev < m
            if fwd:
                pair = [("recv", s - 1, ("act", mb))] * (ok and s > 0) + [("send", s - 1, ("grad", prev))] * (
                    had and s > 0)
            else:
                pair = [("send", s + 1, ("act", prev))] * (had and s < p - 1) + [("recv", s + 1, ("grad", mb))] * (
                    ok and s < p - 1)
            cmds += pair[::-1 if swap else 1] + [("F",) if fwd else ("B",)] * ok
            prev = mb
        out.append(cmds)
    return out


def _rendezvous_makespan(lists: list[list[tuple]], tf: list[float], tb: list[float], msg: float) -> float:
    """Each stage runs its list in order; a send and its receive start when both sides reach them (NCCL's blocking
    point-to-point) and take `msg` seconds."""
    pos, clock, waiting = [0] * len(lists), [0.0] * len(lists), {}
    while any(pos[r] < len(lists[r]) for r in range(len(lists))):
        moved = False
        for r, cmds in enumerate(lists):
            while pos[r] < len(cmds):
                op = cmds[pos[r]]
                if op[0] in ("F", "B"):
                    clock[r] += tf[r] if op[0] == "F" else tb[r]
                else:
                    key = (r, op[1], op[2]) if op[0] == "send" else (op[1], r, op[2])
                    if key not in waiting:
                        waiting[key] = r
                        break
                    if waiting[key] == r:
                        break
                    other = waiting.pop(key)
                    clock[r] = clock[other] = max(clock[r], clock[other]) + msg
                    pos[other] += 1
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return max(clock)


def test_deepspeeds_lockstep_pipeline_schedule_costs_what_1f1b_costs():
    """docs/planner-validation.md "Deep pipelines at scale": MT-NLG ran DeepSpeed's pipeline engine, whose schedule
    pairs neighbouring stages at every step with blocking sends. Simulated with the MT-NLG rows' own per-stage times
    (the planner's forward and backward of each stage, the head on the last) its makespan equals the planner's 1F1B
    closed form within 0.1% with free messages, and the planner's p2p time per message (0.5 ms) adds 1.0%: the
    schedule is not the 26-32% (measured: +0.0%, +1.0% at 2,240 GPUs)."""
    from scaletrain.plan.analytic.estimate import pipeline_stages
    from scaletrain.plan.analytic.stages import pipeline_makespan
    from scaletrain.plan.analytic.step_time import layer_times, pipeline_times

    r = DEV_ROWS[0]
    gpu, a = get_gpu(r.gpu), Assumptions()
    train = Training(r.global_batch, r.dtype, r.attention, r.dp_overlap)
    lay, m = r.layout, r.global_batch // r.layout.dp
    st = pipeline_stages(r.model, gpu, train, lay, a)
    pt = pipeline_times(r.model, gpu, train, lay, a, m, layer_times(r.model, gpu, train, lay, a), st)
    assert set(st.blocks) == {3}  # 3 blocks on every stage, the head (pt.*_last) on the last
    tf = [pt.fwd] * (lay.pp - 1) + [pt.fwd_last]
    tb = [pt.bwd] * (lay.pp - 1) + [pt.bwd_last]
    lists = _deepspeed_train_schedule(lay.pp, m)
    free = _rendezvous_makespan(lists, tf, tb, 0.0)
    closed = pipeline_makespan("1f1b", lay.pp, m, 1, [f + b for f, b in zip(tf, tb)], [])
    sent = _rendezvous_makespan(lists, tf, tb, pt.pp)
    assert _rendezvous_makespan(_deepspeed_train_schedule(lay.pp, m, swap=True), tf, tb, pt.pp) == pytest.approx(sent)
    assert round(pt.pp * 1e3, 1) == 0.5
    # the head makes the last stage 4.3% heavier; the planner's steady state runs at its pace already (+3.7% of the
    # pipeline over equal stages)
    equal = (m + lay.pp - 1) * (pt.fwd + pt.bwd + 2 * pt.pp)
    assert (round(tf[-1] / tf[0] - 1, 3) > 0, round((tf[-1] + tb[-1]) / (tf[0] + tb[0]) - 1, 3),
            round(pt.pipe / equal - 1, 3)) == (True, 0.043, 0.037)
    assert (round(free / closed - 1, 4), round(sent / pt.pipe - 1, 4)) == (0.0, 0.0), (free / closed, sent / pt.pipe)


def test_mt_nlg_runs_each_microbatch_slower_than_megatron_lm_on_the_same_layout():
    """The paper's own iteration times (arXiv 2201.11990 Sec. 2.4: 60.1, 50.2, 44.4 s for batch 1920 on 280, 350 and
    420 DGX A100, i.e. 240, 192, 160 micro-batches per pipeline) against Megatron-LM's 530B runs with the same tp 8 x
    pp 35, micro-batch 1 on the same Selene (arXiv 2104.04473 Table 2: 171, 167, 159 TFLOP/s on 560, 1,120, 2,240 GPUs,
    batch 2240): per 1F1B cycle, T / (m + p - 1), Megatron-LM takes 0.177-0.179 s at every size (no per-step
    overhead), MT-NLG 0.219-0.229 s, growing with the data-parallel degree (8 -> 12). The planner's cycle (stragglers
    in) 0.166 s is Megatron-LM's; the 24-29% per cycle is what the planner lacks, and no source times it."""
    def hw_flops(batch: int, vocab: int) -> float:  # the papers' eq. 3, full recomputation
        s, layers, h = 2048, 105, 20480
        return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))

    megatron = [hw_flops(2240, 51200) / (tf * 1e12 * n) / (2240 // (n // 280) + 34)
                for n, tf in ((560, 171), (1120, 167), (2240, 159))]
    mt_nlg = [t / (1920 // (n // 280) + 34) for n, t in ((2240, 60.1), (2800, 50.2), (3360, 44.4))]
    assert [round(x, 3) for x in megatron] == [0.179, 0.178, 0.177]
    assert [round(x, 3) for x in mt_nlg] == [0.219, 0.222, 0.229]
    r = DEV_ROWS[0]
    est = estimate(r.model, get_gpu(r.gpu), Training(r.global_batch, r.dtype, r.attention, r.dp_overlap), r.layout,
                   Assumptions(), n_gpus=r.gpus)
    b = est.time_breakdown
    cycle = (b["bubble"] / (r.layout.pp - 1)) * (1 + b["stragglers"] / (est.step_time_s - b["stragglers"]
                                                                     - b["dp_comm"]))
    assert round(cycle, 3) == 0.166 and round(mt_nlg[0] / megatron[2] - 1, 2) == 0.24
    # the cycle grows 4.3% from 2,240 to 3,360 GPUs; the slowest-of-N term grows 0.2% there
    from scaletrain.plan.analytic.step_time import straggler_factor

    assert round(mt_nlg[2] / mt_nlg[0] - 1, 3) == 0.043
    assert round(straggler_factor(3360, 0.05) / straggler_factor(2240, 0.05) - 1, 3) == 0.002
    # the published times as T = (m + p - 1) x + c through the 2,240- and 3,360-GPU rows, checked on the third
    x = (60.1 - 44.4) / (240 - 160)
    c = 60.1 - (240 + 34) * x
    assert (round(x, 3), round(c, 1), round((192 + 34) * x + c, 1)) == (0.196, 6.3, 50.7)
    # the data-parallel all-reduce in FP32 instead of bf16 adds 0.36 s of the 12.4 s gap
    fp32 = estimate(r.model, get_gpu(r.gpu), Training(r.global_batch, r.dtype, r.attention, r.dp_overlap,
                                                     grad_bytes=4), r.layout, Assumptions(), n_gpus=r.gpus)
    assert round(fp32.step_time_s - est.step_time_s, 2) == 0.36 and round(60.1 - est.step_time_s, 1) == 12.4


if __name__ == "__main__":
    print("Development rows\n")
    print(markdown(DEV_ROWS))
    print("\nHeld-out rows\n")
    print(markdown(HELD_OUT))
    print("\nDeep pipelines at scale: the planned step in its parts\n")
    print(breakdown([r for r in DEV_ROWS if r.source in (MTNLG_SRC, LLAMA3_SRC)]))
    print("\nThe Llama 3 rows as assumed before (V = 2, ZeRO-0, 2-byte gradients)\n")
    print(breakdown(llama3_rows_as_assumed_before()))
