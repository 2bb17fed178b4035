"""The training loop: build, (resume,) step, evaluate, log, checkpoint.

One optimizer step: set the step's learning rate; for each micro-batch of this data-parallel rank's slice
of the global batch, forward, loss = (sum of token cross-entropies) / (tokens of the global batch),
backward; sum gradients over the data-parallel group; clip by the global norm; AdamW (Loshchilov &
Hutter, arXiv 1711.05101). Because the loss is normalised by the global token count and gradients are
summed, the result equals the single-process run for any dp and micro-batch split.
"""

from __future__ import annotations

import json
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.data import BatchLoader, load_corpus
from scaletrain.device.accounting import memory_reports, peak_bytes, tensor_bytes
from scaletrain.device.attention import probe_run
from scaletrain.device.cuda_memory import cuda_memory_fields, planned_total
from scaletrain.device.timing import StepTimer
from scaletrain.distributed.comm import CommStats, all_reduce, all_reduce_max_list
from scaletrain.distributed.launch import hold_if_orphaned
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.distributed.process_group import DistEnv, pick_device
from scaletrain.errors import TrainingDiverged
from scaletrain.guards import AppendLines
from scaletrain.memory.precision import DynamicLossScaler
from scaletrain.model.init import name_seed
from scaletrain.model.moe import begin_step as begin_moe_step
from scaletrain.optim import lr_multiplier
from scaletrain.parallel.context import positions_of
from scaletrain.parallel.experts import moe_metrics
from scaletrain.parallel.parallelize import build_engine
from scaletrain.report.observers import RunObservers
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import resume
from scaletrain.train.pending import first_bad_loss, resolve_rows
from scaletrain.train.progress import Progress
from scaletrain.train.schedule import lr_at

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss (this invocation)
    val_losses: dict[int, float] = field(default_factory=dict)
    params: int = 0
    tokens_per_s: float = 0.0
    resumed_from: int = 0
    final_step: int = 0
    last_row: dict = field(default_factory=dict)  # the metrics of the last step


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | os.PathLike | None = None, env: DistEnv | None = None,
                 progress: bool = False, reshard: bool = False, init_from: str | os.PathLike | None = None):
        """`out_dir`: where checkpoints and metrics go; an existing run there is resumed (`reshard` lets it continue
        under another layout, `init_from` a Hugging Face directory to start a new run from; see train/resume.py)."""
        from scaletrain.parallel.zero_nvme import resolve_offload_dir
        from scaletrain.plan.budget import resident_meter
        from scaletrain.plan.exact.run_memory import nvme_io

        self.resident = resident_meter(cfg, env)  # memory.budget_gb / nvme: resident bytes measured per step
        cfg = resolve_offload_dir(cfg, out_dir)  # offload=nvme: the folder of the shard files
        self.nvme_plan = nvme_io(cfg) if cfg.parallel.offload == "nvme" else {}  # planned disk bytes per step
        self.cfg = cfg
        self.rank = env.rank if env else 0
        self.device = pick_device(cfg.train.device, env.local_rank if env else 0)
        self.dtype = DTYPES[cfg.train.dtype]
        self.out = Path(out_dir) if out_dir is not None else None
        self.progress = progress and self.rank == 0
        p, t = cfg.parallel, cfg.train

        self.mesh = Mesh.build(ParallelDims.from_config(p), p.timeout_s)
        # losses are summed over dp x cp: context-parallel ranks hold the other tokens of the same sequences
        self.dp_group, self.dp_rank = self.mesh.group("dp_cp"), self.mesh.local_rank("dp")
        self.comm = CommStats()

        self.loader = BatchLoader(load_corpus(cfg.data), cfg.model.seq_len, t.global_batch, t.seed,
                                  cfg.data.val_fraction, cfg.model.vocab_size,
                                  positions_of(p, cfg.model.seq_len, self.mesh))
        self.engine = build_engine(cfg, self.mesh, self.device, self.dtype, self.comm)
        self.model = self.engine.module
        self.attention = probe_run(cfg, self.device, self.dtype)  # the SDPA kernel that runs (device/attention.py)
        if self.out is not None and self.rank == 0:
            print(self.attention.line(), flush=True)
        self.timer = StepTimer(self.device)  # CUDA events on GPUs: no host synchronisation inside a step
        self.n_params = self.engine.n_params
        if p.slow_ranks:  # straggler injection for experiments (parallel/async_dp/straggler.py)
            from scaletrain.parallel.async_dp.straggler import Straggler, wrap_engine

            wrap_engine(self.engine, Straggler.for_rank(p.slow_ranks, p.dp, self.dp_rank))
        # Dropout stream: this trainer's own (per rank, restored exactly on resume), swapped into the
        # global generator only while the trainer computes, so two trainers in one process do not interact.
        # Tensor-parallel ranks share this stream (replicated regions must drop the same elements); split
        # regions draw from a per-tp-rank stream of their own (see parallel/tensor_parallel.py).
        self.rng_stream = f"dropout/dp{self.dp_rank}/pp{self.mesh.local_rank('pp')}"
        self.rng = _seeded_rng_state(name_seed(t.seed, self.rng_stream), self.device)
        self.lr_scale = lr_multiplier(cfg.optim)  # optim.lr_scale, or the optimizer's default
        self.step = 0
        self.skipped = 0
        self.scaler = DynamicLossScaler(t.loss_scale, 2.0, t.loss_scale_backoff, t.loss_scale_window,
                                        t.loss_scale_hysteresis, t.loss_scale_min) if t.dtype == "fp16" else None
        self.mem: dict[str, int] = {}
        self.noise = self.noise_probe = None
        if t.log_noise_scale:  # gradient noise scale (McCandlish et al.): hooks exist only when asked for
            from scaletrain.train.noise_scale import GradSqProbe, NoiseScaleEMA

            self.noise_probe, self.noise = GradSqProbe(list(self.model.parameters())), NoiseScaleEMA()
        if self.out is not None:
            self.saver = ckpt.Saver(self.ckpt_root, self.rank, t.keep_checkpoints, t.checkpoint_async, p.timeout_s)
            resume.resume(self, reshard, init_from)
        self.observers = RunObservers(self)  # run_info, TensorBoard, profiler, HTML report (report/observers.py)

    # ------------------------------------------------------------------ setup / resume

    @property
    def ckpt_root(self) -> Path:
        assert self.out is not None
        return self.out / "checkpoints"

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # ------------------------------------------------------------------ one step

    @contextmanager
    def own_rng(self):
        """Run with this trainer's RNG state in the global generators, and keep what it advanced to."""
        outer = ckpt.rng_state(self.device)
        ckpt.set_rng_state(self.rng, self.device)
        try:
            yield
        finally:
            self.rng = ckpt.rng_state(self.device)
            ckpt.set_rng_state(outer, self.device)

    def train_step(self, step: int, drain: bool = True) -> dict[str, Any]:
        """One optimizer step; its metrics as numbers. drain=False lets an asynchronous pipeline schedule (2bw)
        start step + 1's first forwards during this step; the next call must then be train_step(step + 1)."""
        row = self._lazy_step(step, drain)
        self._resolve([row])
        return row

    def _lazy_step(self, step: int, drain: bool = True) -> dict[str, Any]:
        """One optimizer step whose loss, gradient norm and time stay on the device until `_resolve`."""
        with self.own_rng():
            return self._train_step(step, drain)

    def _resolve(self, rows: list[dict[str, Any]]) -> None:
        """Turn the rows' device values into numbers with one host read (train/pending.py); a NaN/inf loss
        stops the run here under train.on_nan=stop, naming its first step. PipeDream: the rows' losses and gradient
        norms are first gathered over the pipeline, once for all of them (`PipelineExecutor.share_rows`)."""
        if getattr(getattr(self.engine, "pipeline", None), "stash", None) is not None:
            self.engine.pipeline.share_rows(rows)
        resolve_rows(rows, self.cfg.tokens_per_step)
        bad = first_bad_loss(rows) if self.scaler is None and self.cfg.train.on_nan == "stop" else None
        if bad is not None:
            raise TrainingDiverged(f"loss is {bad['loss']} at step {bad['step']} (seen on rank {self.rank}); "
                                   "set train.on_nan=skip to skip such steps")

    @property
    def overlaps_steps(self) -> bool:
        """Whether consecutive steps may overlap: PipeDream-2BW with parameters the optimizer updates in
        place (not ZeRO's flat buffers) and no MoE routers (their random streams are keyed by step)."""
        p = self.cfg.parallel
        return p.pp > 1 and p.schedule in ("2bw", "pipedream") and p.zero == 0 and not self.cfg.model.moe.experts

    def _train_step(self, step: int, drain: bool = True) -> dict[str, Any]:
        if self.resident is not None:
            self.resident.begin(self.device)
        mark = self.timer.begin()
        cfg = self.cfg
        self.comm.reset()
        lr = lr_at(step, cfg.train) * self.lr_scale
        micro = self.loader.micro_batches(step, self.dp_rank, cfg.parallel.dp, cfg.train.micro_batch,
                                          device=self.device)
        opt = self.engine.optimizer
        scale = self.scaler.scale if self.scaler is not None else 1.0
        first_row = self.dp_rank * (cfg.train.global_batch // cfg.parallel.dp)  # this rank's first row of the step
        if cfg.model.moe.experts:  # key the routers' random streams by (step, global row); reset statistics
            begin_moe_step(self.model, cfg.train.seed, step, first_row)
        if self.engine.dropout is not None:  # layout-independent dropout masks: keyed by (seed, step, global row)
            self.engine.dropout.seed, self.engine.dropout.step = cfg.train.seed, step
            self.engine.dropout.base_row = first_row
        if self.noise_probe is not None:
            self.noise_probe.reset()
        if not drain and self.overlaps_steps:  # the loader is a pure function of the step
            self.engine.next_micro = lambda k=1: self.loader.micro_batches(  # k: PipeDream's later minibatches
                step + k, self.dp_rank, cfg.parallel.dp, cfg.train.micro_batch, device=self.device)
        else:
            self.engine.next_micro = None
        self.engine.step = step
        total = self.engine.forward_backward(micro, scale / cfg.tokens_per_step)
        # No host synchronisation unless a decision needs a value (docs/gpu.md): the loss stays a device tensor,
        # summed over dp in place, and is read with the log line (`_resolve`).
        all_reduce(total, self.dp_group)
        loss = total / scale
        moe = moe_metrics(self.model, cfg, self.mesh) if cfg.model.moe.experts else {}  # (reads its statistics)
        if moe:  # the loss breakdown: cross-entropy plus the weighted auxiliary and z-losses it was trained on
            w = cfg.model.moe
            moe["loss_ce"] = loss
            aux_weight = 1.0 if w.aux_loss == "importance" else w.aux_loss_weight  # importance's loss_aux is weighted
            loss = loss + (aux_weight * moe["loss_aux"] + w.z_loss_weight * moe["loss_z"])
        # Skip decisions are taken by every rank together: flags all-reduced with MAX over the world, in one
        # collective and one host read — the one synchronisation such a step keeps, since whether to step depends
        # on it. Gradients are checked for inf/NaN only where that can change the decision (fp16's loss scaler,
        # or train.on_nan=skip); a plain step pays for neither the check nor the reduction, and a NaN loss under
        # train.on_nan=stop stops the run when the loss is read (the same number on every rank: summed over dp,
        # computed whole on every tp rank, broadcast over pp).
        check_grads = self.scaler is not None or cfg.train.on_nan == "skip"
        overflow = False
        if check_grads:
            flags = torch.stack([~torch.isfinite(loss), opt.unscale_(1.0 / scale)]).to(torch.float64)
            overflow = any(all_reduce_max_list(flags))
        grad_norm: Any = float("nan")
        noise: dict[str, float] = {}
        if overflow:
            self.skipped += 1  # fp16 overflow (or on_nan=skip): nobody updates, the scale backs off
        else:
            # expert parallelism: the expert part of |G_big|², before clipping scales it (noise scale only)
            expert_sq = opt.expert_grad_sq() if self.noise is not None and cfg.parallel.ep > 1 else 0.0
            grad_norm = opt.clip_grad_norm(cfg.train.grad_clip)  # a device tensor; clipping needs no read
            if self.noise is not None:  # the noise scale's estimators need the values (a read per step)
                noise = self._noise_scale(float(grad_norm), scale, float(expert_sq))
            opt.step(lr)
        if self.scaler is not None:
            self.scaler.update(overflow)
        if not self.mem:
            self._measure_static()  # gradients and optimizer state exist only now
        opt.zero_grad()
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": None,
               "step_time_s": self.timer.end(mark)}  # tokens_per_s from the step time when resolved
        if self.scaler is not None or overflow:
            row.update(skipped=overflow, skipped_total=self.skipped)
            if self.scaler is not None:
                row["loss_scale"] = scale
        row.update({f"comm_{kind}_bytes": n for kind, n in sorted(self.comm.bytes.items())})  # sent by this rank
        row.update(opt.step_report())  # offload=nvme: bytes read and written this step, next to the formula
        row.update(self.nvme_plan)
        if self.resident is not None:  # stops the run (on every rank) when over memory.budget_gb
            row.update(self.resident.end(self.device, step))
        row.update(moe)
        row.update(noise)
        if self.engine.fp8 is not None:  # train.precision=fp8: its layers, and the float8 GEMMs this rank ran
            row.update(self.engine.fp8.step_fields())
        return row

    def _noise_scale(self, grad_norm: float, scale: float, expert_sq: float = 0.0) -> dict[str, float]:
        """This step's gradient noise scale metrics: small batch = one micro-batch, big = the global batch.

        Under expert parallelism an expert's gradient in one backward holds the same micro-batch of each of the
        ep ranks (ep x micro_batch sequences): the expert parameters are estimated at that small batch, the
        others at one micro-batch, and the two unbiased estimates are added (`NoiseScaleEMA.update_parts`)."""
        from scaletrain.train.noise_scale import small_batch_sq

        t, ep = self.cfg.train, self.cfg.parallel.ep
        dense, expert = self.noise_probe.take_parts()
        dense_sq = small_batch_sq(dense, t.global_batch // t.micro_batch, t.global_batch, t.micro_batch, scale)
        parts = [(dense_sq, t.micro_batch, grad_norm**2 - expert_sq, t.global_batch)]
        if ep > 1:
            b = t.micro_batch * ep
            parts.append((small_batch_sq(expert, t.global_batch // b, t.global_batch, b, scale), b, expert_sq,
                          t.global_batch))
        row = self.noise.update_parts(parts)
        row["noise_scale_tokens"] = row["noise_scale"] * self.cfg.model.seq_len
        return row

    def evaluate(self) -> float:
        total = 0.0
        for i in range(self.cfg.train.eval_batches):
            micro = self.loader.micro_batches(i, self.dp_rank, self.cfg.parallel.dp, self.cfg.train.micro_batch,
                                              self.loader.val, self.device)
            total += self.engine.eval_loss(micro)
        t = torch.tensor(total, dtype=torch.float64, device=self.device)
        all_reduce(t, self.dp_group)
        return float(t) / (self.cfg.train.eval_batches * self.cfg.tokens_per_step)

    # ------------------------------------------------------------------ memory

    def _measure_static(self) -> None:
        """Bytes this rank holds per category after its first step, maxed over ranks."""
        held = self.engine.optimizer.memory_tensors()
        local = {
            "mem_params": tensor_bytes(held["params"]),
            "mem_grads": tensor_bytes(held["grads"]),
            "mem_optim": tensor_bytes(held["optim"]),
            "mem_activations": self.engine.activation_bytes,
            **memory_reports(self.engine),  # the memory passes' own fields (offloaded bytes, compression ratio)
        }
        self.observers.first_memory(local, self.step, peak_bytes(self.device))  # per rank, for the report
        keys = list(local)
        maxed = dict(zip(keys, all_reduce_max_list([float(local[k]) for k in keys])))
        self.mem = {k: int(v) if k.startswith("mem_") else v for k, v in maxed.items()}
        self.mem.update(plan_memory(self.cfg))  # the planner's prediction beside the measurement

    def memory(self) -> dict[str, int]:
        """Measured bytes per category and the peak so far (max over ranks); on CUDA also the allocator's peaks
        beside the planner's total (device/cuda_memory.py; host-side statistics: no device read); with
        memory.count_allocations, the allocator calls of step 2 (memory/contiguous.py)."""
        from scaletrain.memory.contiguous import allocation_report

        local = {"mem_peak": peak_bytes(self.device), **cuda_memory_fields(self.device)}
        stash = getattr(getattr(self.engine, "pipeline", None), "stash", None)
        if stash is not None:  # PipeDream: its stashed weight copies at their peak so far (plan_mem_stash beside it)
            local["mem_stash"] = stash.peak_bytes
        peaks = {k: int(v) for k, v in zip(local, all_reduce_max_list([float(v) for v in local.values()]))}
        return {**self.mem, **allocation_report(self.engine), **peaks,
                **(planned_total(self.mem) if len(local) > 1 else {})}

    # ------------------------------------------------------------------ loop

    def save(self) -> None:
        """Checkpoint the current step (collective; in the background with train.checkpoint_async)."""
        if self.out is not None:
            resume.save(self)

    def wait_for_checkpoint(self) -> None:
        """Finish an asynchronous save in flight (collective)."""
        if self.out is not None:
            self.saver.wait()

    def run(self, stop_after: int | None = None) -> TrainResult:
        """Train to `train.steps` (or `stop_after` steps, for tests); returns this invocation's results."""
        t = self.cfg.train
        result = TrainResult(params=self.n_params, resumed_from=self.step)
        metrics = AppendLines(self.out / "metrics.jsonl") if self.out is not None and self.rank == 0 else None
        bar = Progress(t.steps, self.step) if self.progress else None
        tokens, elapsed = 0, 0.0
        last = min(t.steps, stop_after) if stop_after is not None else t.steps
        pending: list[dict[str, Any]] = []  # rows whose device values are not read yet
        try:
            every = t.checkpoint_every
            while self.step < last:
                hold_if_orphaned()
                self.step += 1
                # 2bw: drain the pipeline before a checkpoint and at the end (nothing of step + 1 in flight)
                saving = self.out is not None and ((every and self.step % every == 0) or self.step == t.steps)
                with self.observers.step(self.step):
                    row = self._lazy_step(self.step, drain=saving or self.step == last)
                pending.append(row)
                logged = self.step % t.log_every == 0 or self.step == t.steps
                if self.step == 1 or logged:
                    row.update(self.memory())
                evaluating = t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps)
                if logged or saving or evaluating or self.step == last:
                    self._resolve(pending)  # one host read for the steps since the last one (train/pending.py)
                    for r in pending:
                        result.losses[r["step"]] = r["loss"]
                        tokens += self.cfg.tokens_per_step
                        elapsed += r["step_time_s"]
                    result.last_row = row
                    pending.clear()
                    if bar is not None:
                        bar.update(self.step, row)
                if evaluating:
                    row["val_loss"] = result.val_losses[self.step] = self.evaluate()
                if metrics is not None and logged:
                    hold_if_orphaned()
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                    self.observers.log(row)
                every = t.checkpoint_every
                if self.out is not None and ((every and self.step % every == 0) or self.step == t.steps):
                    if metrics is not None:
                        os.fsync(metrics.fileno())
                    self.save()
                    self.observers.checkpoint(self.step, self.engine.write_trace)
        finally:
            self.observers.stop()
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
        self.wait_for_checkpoint()
        if self.out is not None and self.engine.write_trace is not None:
            self.engine.write_trace(self.out)  # pipeline timeline of a measured step (rank 0 writes)
        self.observers.finish()
        result.final_step = self.step
        result.tokens_per_s = tokens / elapsed if elapsed else 0.0
        return result

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) parameters by name, on CPU — what equivalence tests compare."""
        return self.engine.full_state()


def plan_memory(cfg: Config) -> dict[str, int]:
    """The planner's per-rank memory prediction for this run (`plan_mem_*`), or {} if it cannot say."""
    try:
        from scaletrain.plan import predict_run
    except ImportError:
        return {}
    try:
        return {k: int(v) for k, v in predict_run(cfg).items()}
    except (ValueError, KeyError, ZeroDivisionError):
        return {}


def _seeded_rng_state(seed: int, device: torch.device) -> dict[str, Any]:
    outer = ckpt.rng_state(device)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    state = ckpt.rng_state(device)
    ckpt.set_rng_state(outer, device)
    return state
