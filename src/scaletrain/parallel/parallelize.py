"""Turn a config and a mesh into the Engine a rank trains with, by passes over the plain model.

Order (DESIGN.md): build on meta -> materialise and init by (seed, name) -> apply_tp -> split_pp ->
apply_dp / apply_zero. Each pass lives in the module of its parallel dimension and receives only the
groups it needs. The Engine is what the trainer drives: forward/backward over this rank's micro-batches,
the global gradient norm, the (possibly sharded) optimizer step, and the state to checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import Config
from scaletrain.device.accounting import SavedTensorCounter
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh
from scaletrain.model import build_gpt, count_params, loss_sum
from scaletrain.model.moe import set_grad_scale
from scaletrain.parallel.data_parallel import BucketedAllReduce


def is_norm_owner(p: torch.Tensor) -> bool:
    """Whether this rank's copy of `p` counts in the global gradient norm (passes mark duplicates False)."""
    return getattr(p, "_st_norm_owner", True)


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices and embeddings, none on biases and norm gains."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def global_grad_norm(local_sq: torch.Tensor, world: bool) -> torch.Tensor:
    """sqrt of the sum over all ranks of their owned squared-gradient contributions (a 0-dim device tensor)."""
    if world and dist.is_initialized():
        dist.all_reduce(local_sq)
    return local_sq.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) as a device tensor: gradients are always multiplied by it (by exactly 1
    when the norm is within bounds), so clipping needs no host read of the norm (torch's clip_grad_norm_ does
    the same)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def _sq_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads)
    return torch.stack([n.double() for n in norms]).square().sum()


class ReplicatedOptimizer:
    """Plain data parallelism (ZeRO stage 0): the full optimizer on every rank, gradients bucket-all-reduced.

    With bf16/fp16 parameters pass `masters`: fp32 copies the optimizer updates (it must have been built
    over them); gradients then accumulate and are all-reduced in fp32, and the updated masters are copied
    back into the low-precision parameters after each step.
    """

    def __init__(self, params: list[nn.Parameter], opt: torch.optim.Optimizer, group: dist.ProcessGroup | None,
                 bucket_mb: float = 25.0, comm: CommStats | None = None, reduce: str = "sum",
                 masters: list[torch.Tensor] | None = None, world_norm: bool = True):
        self.params, self.opt, self.group, self.masters = params, opt, group, masters
        # world_norm: the norm's owners are spread over the world (tp shards, pp stages) and one all-reduce
        # sums them; False when the model is only replicated over `group`: every rank has the whole norm.
        self.world_norm = world_norm
        self.reducer = BucketedAllReduce(params, group, bucket_mb, comm,
                                         grad_dtype=masters[0].dtype if masters else None)
        self.grads = [self.reducer.grad_of(p) for p in params]
        for m, g in zip(masters or [], self.grads):
            m.grad = g
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        self.mean = reduce == "mean"

    @classmethod
    def from_config(cls, params: list[nn.Parameter], cfg: Config, mesh: Mesh, comm: CommStats, dim: str = "dp"):
        """Over mesh's `dim` group: dp, or edp for expert parameters (parallel/experts.py)."""
        from scaletrain.optim import build_optimizer, config_hyper  # adamw, adafactor or sm3

        low = params[0].dtype in (torch.bfloat16, torch.float16)
        masters = [p.detach().float().clone().requires_grad_(True) for p in params] if low else None
        targets = masters or params
        name = cfg.optim.name
        # Adafactor / SM3 under tensor parallelism (or over a stack of experts split by expert parallelism): a rank
        # holds slices of the tensors, so their row / column statistics are combined over tp (and ep) by
        # ShardedFactored; otherwise the plain optimizer.
        experts = dim == "edp" and cfg.parallel.ep > 1
        factored_tp = name != "adamw" and (cfg.parallel.tp > 1 or experts)
        opt = None if factored_tp else build_optimizer(name, decay_groups(targets, cfg.optim.weight_decay),
                                                       **config_hyper(cfg))
        # The norm needs a world all-reduce only when its owners are spread over tp / pp / ep ranks.
        spread = cfg.parallel.tp * cfg.parallel.pp * getattr(cfg.parallel, "ep", 1) > 1 or dim != "dp"
        out = cls(params, opt, mesh.group(dim), cfg.parallel.bucket_mb, comm, masters=masters, world_norm=spread)
        if factored_tp:
            from scaletrain.parallel.zero_factored import DEFAULTS, ShardedFactored, tp_pieces

            pieces = tp_pieces(params, targets, out.grads, mesh.group("tp"))
            groups = [mesh.group("tp"), mesh.group("ep") if experts else None]
            out.opt = ShardedFactored(name, pieces, groups, {**DEFAULTS[name], **config_hyper(cfg)},
                                      cfg.optim.weight_decay)
        return out

    def begin_micro(self, index: int, count: int) -> None:
        self.reducer.begin_micro(index, count)

    def finish_backward(self) -> None:
        self.reducer.finish()
        if self.mean and self.group is not None and self.reducer.sync:
            torch._foreach_div_(self.grads, dist.get_world_size(self.group))

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        """Multiply the gradients by `inv_scale`; a bool device tensor: whether any of this rank's is inf or NaN."""
        if inv_scale != 1.0:
            torch._foreach_mul_(self.grads, inv_scale)
        return ~torch.isfinite(_sq_norm(self.grads, self.grads[0].device))

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: the replicas of its group count on group
        rank 0, the elements tensor or pipeline parallelism holds twice on their owner only."""
        owned = [g for p, g in zip(self.params, self.grads) if is_norm_owner(p)] if self.dp_rank == 0 else []
        return _sq_norm(owned, self.params[0].device)

    def scale_grads_(self, coef: float | torch.Tensor) -> None:
        torch._foreach_mul_(self.grads, coef)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` by the global norm; returns the norm before clipping (0-dim device tensor)."""
        if self.world_norm:
            norm = global_grad_norm(self.local_grad_sq(), world=True)
        else:
            norm = _sq_norm(self.grads, self.params[0].device).sqrt()
        if max_norm > 0:
            self.scale_grads_(clip_coefficient(norm, max_norm))
        return norm

    def step(self, lr: float | None = None) -> None:
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        self.opt.step()
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {"opt": self.opt.state_dict(), "masters": self.masters or []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["opt"])
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.masters, state["masters"])

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        states = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": list(self.params), "grads": self.reducer.grad_tensors(),
                "optim": states + list(self.masters or [])}


@dataclass
class Engine:
    """One rank's share of the model and how to train it.

    Passes fill the optional parts: tensor parallelism swaps `loss_fn` for the vocab-parallel loss and
    sets `gather_state`; pipeline parallelism sets `runner` (the schedule executor), which replaces the
    plain micro-batch loop and must return the same loss on every rank of the pipeline.
    """

    module: nn.Module
    optimizer: Any = None  # ReplicatedOptimizer | ZeroOptimizer: begin_micro, finish_backward, clip, step, state
    loss_fn: Any = loss_sum  # (logits, targets) -> sum of token losses on this rank
    runner: Any = None  # (engine, micro, scale) -> loss tensor; None = the plain loop below
    eval_runner: Any = None  # (engine, micro) -> float loss sum; None = plain forward
    gather_state: Any = None  # (local state dict) -> full state dict (unsharded), on every rank
    pipeline: Any = None  # the pipeline executor (set by split_pp)
    write_trace: Any = None  # (out dir) -> paths: the pipeline's measured timeline, written by rank 0
    next_micro: Any = None  # () -> the next step's micro-batches, set by the trainer when a schedule may
    #                         start the next step early (2bw); None = finish (drain) this step completely
    activation_bytes: int = 0
    n_params: int = 0  # parameters of the whole (unsharded) model
    dropout: Any = None  # the model's DropoutContext (layout-independent dropout), set per micro-batch

    def forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; returns its share of the loss (detached)."""
        set_grad_scale(self.module, scale)  # MoE layers add their weighted auxiliary losses with this scale
        if self.runner is not None:
            return self.runner(self, micro, scale)
        total = torch.zeros((), dtype=torch.float64, device=micro[0][0].device)
        for i, (x, y) in enumerate(micro):
            self.optimizer.begin_micro(i, len(micro))
            if self.dropout is not None:
                self.dropout.at_micro(i, x.shape[0])
            if not self.activation_bytes and i == 0:
                counter = SavedTensorCounter(self.module.parameters())
                with counter.active():
                    loss = self.loss_fn(self.module(x), y) * scale
                self.activation_bytes = counter.bytes
            else:
                loss = self.loss_fn(self.module(x), y) * scale
            loss.backward()
            total += loss.detach()
        self.optimizer.finish_backward()
        return total

    @torch.no_grad()
    def eval_loss(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if self.eval_runner is not None:
            return self.eval_runner(self, micro)
        self.module.eval()
        total = sum(float(self.loss_fn(self.module(x), y)) for x, y in micro)
        self.module.train()
        return total

    def state_dict(self) -> dict[str, Any]:
        """What this rank checkpoints: its module state (unless ZeRO-3 holds the parameters) and optimizer."""
        owns = getattr(self.optimizer, "owns_params", False)
        state = {"model": {} if owns else self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        versions = getattr(self.pipeline, "versions", None)
        if versions is not None:  # PipeDream-2BW: the older weight version is part of the state
            state["stale_weights"] = versions.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not getattr(self.optimizer, "owns_params", False):
            self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        versions = getattr(self.pipeline, "versions", None)
        if versions is not None:
            versions.load_state_dict(state.get("stale_weights", []))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full, unsharded parameters by name on CPU (gathered where sharded)."""
        local = self.module.state_dict()
        if hasattr(self.optimizer, "gather_params"):
            local = self.optimizer.gather_params(local)  # ZeRO-3: parameters live as shards
        full = self.gather_state(local) if self.gather_state is not None else local
        return {k: v.detach().cpu().clone() for k, v in full.items()}


def build_engine(cfg: Config, mesh: Mesh, device: torch.device, dtype: torch.dtype, comm: CommStats) -> Engine:
    """The passes, in order. Each takes the engine so far and the groups it needs."""
    if cfg.parallel.offload == "nvme":  # ZeRO-Infinity materialises one unit at a time (memory/offload_nvme.py)
        from scaletrain.memory.offload_nvme import meta_gpt

        engine = Engine(meta_gpt(cfg.model, dtype))
    else:
        engine = Engine(build_gpt(cfg.model, cfg.train.seed, device, dtype))
    engine.n_params = count_params(engine.module)  # of the whole model, before any pass shards it
    if cfg.model.dropout > 0 or cfg.model.moe.expert_dropout > 0:
        from scaletrain.model.dropout import dropout_context

        engine.dropout = dropout_context(engine.module)  # None with model.dropout_impl=torch
    if cfg.parallel.tp > 1 and cfg.parallel.tp_mode != "1d":
        from scaletrain.parallel.tensor_nd import apply_tp_nd

        apply_tp_nd(engine, cfg, mesh, comm)  # 2d / 2.5d / 3d: the grid's layers, activations split too
    elif cfg.parallel.tp > 1:
        from scaletrain.parallel.tensor_parallel import apply_tp

        apply_tp(engine, cfg, mesh, comm)  # swaps modules for column/row/vocab-parallel ones, sets loss_fn
    if cfg.model.moe.experts and cfg.parallel.ep > 1:
        from scaletrain.parallel.experts import apply_ep

        apply_ep(engine, cfg, mesh, comm)  # keeps this rank's experts, all-to-all dispatch; after tp's gather
    if cfg.parallel.pp > 1:
        from scaletrain.parallel.pipeline.stage import split_pp

        split_pp(engine, cfg, mesh, comm)  # keeps this rank's stage(s), sets runner
    if cfg.memory.recompute != "none" or cfg.memory.offload_activations:
        from scaletrain.memory.recompute import apply_recompute

        apply_recompute(engine, cfg, mesh)  # wraps blocks in activation checkpoints
    if cfg.memory.compress != "none":
        from scaletrain.memory.compress import apply_compress_pass

        apply_compress_pass(engine, cfg)  # encodes saved activations (Gist)
    if cfg.train.dtype in ("bf16", "fp16"):
        from scaletrain.memory.precision import apply_precision

        apply_precision(engine.module)  # layer norms in fp32; the optimizers keep fp32 masters
    if cfg.train.precision == "autocast-bf16":
        from scaletrain.memory.autocast import apply_autocast

        apply_autocast(engine.module, device)  # fp32 parameters, bf16 matmuls and attention in the forward
    if cfg.train.compile:
        from scaletrain.parallel.compile import apply_compile

        apply_compile(engine)  # each block compiled, after tp / recompute, before dp / ZeRO (torchtitan's order)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if any(getattr(p, "_st_expert", False) for p in params):
        from scaletrain.parallel.experts import ExpertParallelOptimizer

        engine.optimizer = ExpertParallelOptimizer.from_config(engine.module, params, cfg, mesh, comm)  # experts: edp
    elif cfg.parallel.zero == 0:
        engine.optimizer = ReplicatedOptimizer.from_config(params, cfg, mesh, comm, dim=_grad_dim(cfg))
    elif cfg.parallel.offload == "nvme":
        from scaletrain.memory.offload_nvme import nvme_optimizer

        engine.optimizer = nvme_optimizer(engine, cfg, mesh, comm, device)
    else:
        engine.optimizer = zero_from_config(engine.module, cfg, mesh, comm, dim=_grad_dim(cfg))
    if cfg.memory.contiguous or cfg.memory.count_allocations:
        from scaletrain.memory.contiguous import apply_contiguous_and_probe

        apply_contiguous_and_probe(engine, cfg, device)  # ZeRO-R contiguous buffers; allocation count of a step
    return engine


def _grad_dim(cfg: Config) -> str:
    """The group the optimizer reduces gradients over: dp, or dp x depth for 2.5d tensor parallelism (its depth
    layers hold the same weights, parallel/tensor_nd/tp2p5d.py)."""
    return "dp_dep" if cfg.parallel.tp_mode == "2.5d" else "dp"


def zero_from_config(module: nn.Module, cfg: Config, mesh: Mesh, comm: CommStats, params=None, dim: str = "dp"):
    """The run's ZeroOptimizer over mesh's `dim` group (dp, or edp for expert parameters), for `params` (all of
    the module's by default)."""
    from scaletrain.optim import config_hyper
    from scaletrain.parallel.zero import ZeroOptimizer

    o = cfg.optim
    return ZeroOptimizer(
        module, cfg.parallel.zero, mesh.group(dim), lr=cfg.train.lr, betas=(o.beta1, o.beta2),
        eps=o.eps, weight_decay=o.weight_decay, bucket_mb=cfg.parallel.bucket_mb, offload=cfg.parallel.offload,
        comm=comm, optimizer=o.name, hyper=config_hyper(cfg) if o.name != "adamw" else None,
        tp_group=mesh.group("tp"), ep_group=mesh.group("ep") if dim == "edp" else None, params=params,
        gather="step" if cfg.parallel.pp > 1 else "unit")
