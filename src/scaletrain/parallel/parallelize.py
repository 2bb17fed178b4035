"""Turn a config and a mesh into the Engine a rank trains with, by passes over the plain model.

Order (DESIGN.md): build on meta -> materialise and init by (seed, name) -> apply_tp -> apply_ep -> apply_cp ->
split_pp -> apply_fp8 -> apply_recompute -> ... -> the optimizer (replicated, ZeRO, ZeRO-Infinity or expert
parallelism's pair).
Each pass lives in the module of its parallel dimension or memory technique and receives only the sub-configs and
groups it needs; `build_engine` is the one place that reads the whole Config. The Engine and the optimizer interface
are in `engine.py`.
"""

from __future__ import annotations

import torch

from scaletrain.config import Config
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh
from scaletrain.model import build_gpt, count_params
from scaletrain.parallel.data_parallel import ReplicatedOptimizer
from scaletrain.parallel.engine import Engine, EngineOptimizer
from scaletrain.parallel.zero import ZeroOptimizer


def build_engine(cfg: Config, mesh: Mesh, device: torch.device, dtype: torch.dtype, comm: CommStats) -> Engine:
    """The passes, in order. Each takes the engine so far and the sub-configs and groups it needs."""
    m, p, t, mem = cfg.model, cfg.parallel, cfg.train, cfg.memory
    if p.offload == "nvme":  # ZeRO-Infinity materialises one unit at a time (parallel/zero_nvme.py)
        from scaletrain.parallel.zero_nvme import meta_gpt

        engine = Engine(meta_gpt(m, dtype))
    else:
        engine = Engine(build_gpt(m, t.seed, device, dtype))
    engine.n_params = count_params(engine.module)  # of the whole model, before any pass shards it
    if m.dropout > 0 or m.moe.expert_dropout > 0:
        from scaletrain.model.dropout import dropout_context

        engine.dropout = dropout_context(engine.module)  # None with model.dropout_impl=torch
    if p.tp > 1 and p.tp_mode != "1d":
        from scaletrain.parallel.tensor_nd import apply_tp_nd

        apply_tp_nd(engine, m, t.micro_batch, mesh, comm)  # 2d / 2.5d / 3d: the grid's layers, activations split too
    elif p.tp > 1:
        from scaletrain.parallel.tp_plan import apply_tp

        apply_tp(engine, m, p.sequence_parallel, mesh, comm)  # column/row/vocab-parallel modules, sets loss_fn
    if m.moe.experts and p.ep > 1:
        from scaletrain.parallel.experts import apply_ep

        apply_ep(engine, p.sequence_parallel, mesh, comm)  # this rank's experts, all-to-all dispatch; after tp
    if p.cp > 1:
        from scaletrain.parallel.context import apply_cp

        apply_cp(engine, m, p, mesh, comm)  # this rank's positions, ring / Ulysses attention; after tp, before pp
    if p.pp > 1:
        from scaletrain.parallel.pipeline.stage import split_pp

        split_pp(engine, m, p, t, mesh, comm, p.microbatches or cfg.grad_accum)  # this rank's stage(s), runner
    if t.precision == "fp8":
        from scaletrain.parallel.fp8 import apply_fp8

        # the blocks' linear layers this rank holds (tp's included: after tp / ep / pp), before recompute, autocast
        # and compile, whose wrappers must see the FP8 layers (torchtitan's order)
        apply_fp8(engine, m, t, mesh, comm, device)
    if mem.recompute != "none" or mem.offload_activations:
        from scaletrain.memory.recompute import apply_recompute

        apply_recompute(engine, mem, mesh.group("tp"))  # wraps blocks in activation checkpoints
    if mem.compress != "none":
        from scaletrain.memory.compress import apply_compress_pass

        apply_compress_pass(engine, mem.compress, m)  # encodes saved activations (Gist)
    if t.dtype in ("bf16", "fp16"):
        from scaletrain.memory.precision import apply_precision

        apply_precision(engine.module)  # layer norms in fp32; the optimizers keep fp32 masters
    if t.precision == "autocast-bf16" or (t.precision == "fp8" and t.dtype == "fp32"):
        from scaletrain.memory.autocast import apply_autocast

        apply_autocast(engine.module, device)  # fp32 parameters, bf16 matmuls and attention (fp8: around its layers)
    if t.compile:
        from scaletrain.parallel.compile import apply_compile

        apply_compile(engine)  # each block compiled, after tp / recompute, before dp / ZeRO (torchtitan's order)
    if m.share_blocks:
        from scaletrain.parallel.shared_blocks import gather_shared_once

        gather_shared_once(engine)  # a shared block's weights gathered once for the full state, under every name
    engine.optimizer = _optimizer(engine, cfg, mesh, comm, device)
    if p.zero == 3 and p.offload != "nvme":
        from scaletrain.parallel.zero_gather import report_gathered

        report_gathered(engine)  # mem_params_gathered: the most ZeRO-3 parameter bytes gathered at once
        if t.fp8_all_gather:
            from scaletrain.parallel.zero_fp8 import gather_fp8

            gather_fp8(engine.optimizer, engine.module)  # the FP8 layers' weights all-gathered as float8 bytes
    if mem.contiguous or mem.count_allocations:
        from scaletrain.memory.contiguous import apply_contiguous_and_probe

        apply_contiguous_and_probe(engine, mem, device)  # ZeRO-R contiguous buffers; allocation count of a step
    return engine


def _optimizer(engine: Engine, cfg: Config, mesh: Mesh, comm: CommStats, device: torch.device) -> EngineOptimizer:
    """The engine's optimizer over the parameters the passes left: expert parallelism's pair, the replicated one
    (parallel.zero=0), ZeRO-Infinity (offload=nvme) or ZeRO."""
    o, p, lr = cfg.optim, cfg.parallel, cfg.train.lr
    params = [q for q in engine.module.parameters() if q.requires_grad]
    if any(getattr(q, "_st_expert", False) for q in params):
        from scaletrain.parallel.experts import ExpertParallelOptimizer

        return ExpertParallelOptimizer.from_config(engine.module, params, o, p, lr, mesh, comm)  # experts: edp
    if p.zero == 0:
        return ReplicatedOptimizer.from_config(params, o, p, lr, mesh, comm, dim=_grad_dim(cfg))
    if p.offload == "nvme":
        from scaletrain.device.accounting import add_memory_report
        from scaletrain.parallel.zero_nvme import NvmeZeroOptimizer

        opt = NvmeZeroOptimizer.from_config(engine.module, cfg.model, o, p, cfg.train.seed, lr, mesh, comm, device)
        add_memory_report(engine, opt.file_bytes)  # the bytes each category keeps in files
        return opt
    return ZeroOptimizer.from_config(engine.module, o, p, lr, mesh, comm, dim=_grad_dim(cfg))


def _grad_dim(cfg: Config) -> str:
    """The group the optimizer reduces gradients over: dp, dp x depth for 2.5d tensor parallelism (its depth
    layers hold the same weights, parallel/tensor_nd/tp2p5d.py), or dp x cp under context parallelism (its ranks
    hold the same weights and other tokens, parallel/context/)."""
    if cfg.parallel.tp_mode == "2.5d":
        return "dp_dep"
    return "dp_cp" if cfg.parallel.cp > 1 else "dp"
