"""validate()'s rules for pipeline parallelism: parallel.schedule, parallel.partition and the schedule's
constraints on the resolved micro-batch count (`check.validate_pipeline`; GPipe arXiv 1811.06965, 1F1B / 2BW arXiv
2006.09503, interleaved arXiv 2104.04473, zero bubble H1 and V arXiv 2401.10241, DualPipeV arXiv 2412.19437).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.rules import rule
from scaletrain.config.schema import PARTITION_KINDS, SCHEDULES, Config

V_ON_NCCL = ("parallel.schedule=zb-v runs on CPU (gloo) only: its two same-direction streams need sends that never "
             "block, which NCCL does not promise for large messages (use zb-h1 on GPUs)")


def v_on_nccl(schedule: str) -> str:
    """Why a V schedule (zb-v, dualpipev) is refused on CUDA / NCCL: check.py shows both deadlock under blocking
    sends."""
    return V_ON_NCCL.replace("zb-v", schedule)


@rule("inputs")
def partition_syntax(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.partition is a way or block counts even without pipeline stages (with pp > 1, `schedule` says it)."""
    part = cfg.parallel.partition
    if cfg.parallel.pp == 1 and part not in PARTITION_KINDS and not all(x.strip().isdigit() for x in part.split(",")):
        return [f"parallel.partition must be uniform, params, time, ends or block counts like 2,3,3; got {part!r}"]
    return []


@rule("values")
def schedule_name(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.schedule names a schedule of parallel/pipeline/schedules.py."""
    if cfg.parallel.schedule not in SCHEDULES:
        return [f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {cfg.parallel.schedule!r}"]
    return []


@rule("resolved")
def schedule(cfg: Config, world_size: int | None) -> list[str]:
    """The schedule's constraints on the resolved micro-batch count, and what needs pp > 1."""
    m, p = cfg.model, cfg.parallel
    accum = cfg.grad_accum
    if p.microbatches and p.microbatches != accum:  # config/validate.py says it
        return []
    if p.pp > 1:
        from scaletrain.parallel.pipeline.check import validate_pipeline  # the schedules' code, only when pp > 1

        errors = validate_pipeline(m.n_layers, p.pp, p.virtual_stages, accum, p.schedule, p.partition)
        if p.schedule in ("zb-v", "dualpipev") and cfg.train.device == "cuda":
            errors.append(v_on_nccl(p.schedule))
        if p.zero == 3 and p.schedule == "2bw":
            errors.append("parallel.zero=3 with parallel.schedule=2bw is not available: PipeDream-2BW keeps its "
                          "two weight versions in the module's parameters, which ZeRO-3 holds only as shards")
        return errors
    if p.virtual_stages > 1 or p.schedule in ("2bw", "pipedream"):
        what = (f"parallel.virtual_stages ({p.virtual_stages})" if p.virtual_stages > 1
                else f"parallel.schedule={p.schedule}")
        return [f"{what} needs parallel.pp > 1, got parallel.pp ({p.pp})"]
    return []


@rule("resolved")
def pipedream(cfg: Config, world_size: int | None) -> list[str]:
    """What PipeDream's weight stashing and its replay proof (arXiv 1806.03377) are made to work with: dp, the plain
    model without shared or random parts, fp32/fp64/bf16 without loss scaling; the rest is refused with a reason."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.schedule != "pipedream" or p.pp == 1:
        return []
    why = "with parallel.schedule=pipedream"
    refusals = [
        (p.zero > 0, f"parallel.zero ({p.zero}) > 0 {why}: the stashed weight versions live in the module's "
                     "parameters, which ZeRO keeps in its flat buffers"),
        (p.tp > 1, f"parallel.tp ({p.tp}) > 1 {why}: the stashed versions are not wired to tensor parallelism"),
        (m.tie_embeddings, f"model.tie_embeddings=true {why}: the first and last stages would share one weight at two "
                           "different versions; set model.tie_embeddings=false"),
        (m.dropout > 0, f"model.dropout ({m.dropout}) > 0 {why}: the version-log replay does not redraw the masks"),
        (bool(m.moe.experts), f"model.moe.experts ({m.moe.experts}) > 0 {why}: routers' random streams are keyed by "
                              "the step, and a stage runs several minibatches' forwards in one step"),
        (t.dtype == "fp16", f"train.dtype=fp16 {why}: the dynamic loss scaler skips steps, and a skipped update would "
                            "leave stashed versions of minibatches already in flight"),
        (p.offload != "none", f"parallel.offload={p.offload} {why}: the offloaded copies hold one weight version"),
        (p.sync != "bsp", f"parallel.sync={p.sync} {why}: asynchronous data parallelism keeps its own versions"),
        (t.precision == "fp8", f"train.precision=fp8 {why}: the FP8 scales are not kept per stashed version"),
        (m.reversible or m.share_blocks, f"model.{'reversible' if m.reversible else 'share_blocks'}=true {why}: "
                                         "not wired to the stashed versions"),
        # PipeDream's stages do not step together: nothing may need all stages' values every step
        (t.on_nan == "skip", f"train.on_nan=skip {why}: whether to skip a step would be decided by all stages "
                             "together every step (a barrier across the pipeline); use train.on_nan=stop"),
        (t.log_noise_scale, f"train.log_noise_scale=true {why}: it needs the whole model's gradient norm every step "
                            "(a barrier across the pipeline)"),
        (cfg.memory.budget_gb > 0, f"memory.budget_gb ({cfg.memory.budget_gb}) > 0 {why}: the in-run budget check "
                                   "takes the maximum over all ranks every step (a barrier across the pipeline)"),
    ]
    mem = cfg.memory
    lossy = [c for c in mem.compress.split(",") if c.strip() in ("bf16", "int8")]
    refusals.append((bool(lossy) and mem.recompute != "none",
                     f"memory.compress={mem.compress} with memory.recompute={mem.recompute} {why}: the recomputation "
                     "starts from the compressed checkpoint, which the version-log replay that proves PipeDream does "
                     "not model (each saver alone is proven, tests/test_pipedream_savers.py)"))
    policy = mem.recompute.split(":")[0]
    refusals.append((policy in ("nth", "ops"), f"memory.recompute={mem.recompute} {why}: not proven against the "
                     "version-log replay (full, every:k and attn-core are: tests/test_pipedream_savers.py)"))
    if t.compile:  # the memory savers are proven against the replay (tests/test_pipedream_savers.py); compile is not
        refusals.append((True, f"train.compile=true {why}: not proven against the version-log replay "
                               "(tests/test_pipedream.py)"))
    return [msg for bad, msg in refusals if bad]
