"""Expert parallelism: the experts of each MoE layer split over an `ep` group carved from data parallelism.

GShard (Lepikhin et al., arXiv 2006.16668) and Switch (Fedus et al., arXiv 2101.03961): every rank routes
its own tokens with the (replicated) router, then one all-to-all sends each rank the slots of the experts
it holds, the local experts run, and a second all-to-all brings the results back for the combine. Shapes
are fixed by the capacity (E experts x G groups x K slots x C), so both all-to-alls have equal splits and
their backward is the same all-to-all on the gradients.

`apply_ep(engine, sequence_parallel, mesh, comm)`:
- keeps this rank's E / ep experts of each MoE layer (slices of the full, already initialised stacked
  weights, under the same names, so expert e has the same values in every layout) and turns the layer's
  `experts` module into `ExpertParallelExperts` (the all-to-all version; nothing else of the model changes);
- sets `gather_state` so the full state gathers the expert shards over ep (after tp's own gather);
- expert parameters are marked `_st_expert`: `build_engine` then uses `ExpertParallelOptimizer`, which
  sums their gradients over the expert-data-parallel group (the ranks holding the same experts) and the
  dense gradients over the whole dp group, and takes one global gradient norm.

With tensor parallelism the experts are replicated over tp (each tp rank runs the whole MoE layer on the
replicated block input); ep groups then live inside each tp slice of dp. With sequence parallelism each tp
rank routes and runs the tokens of its own sequence shard (over the ep group of its tp slice), and the
local experts' gradients are summed over tp, as the replicated parameters' are. `moe_metrics` gathers the MoE
layers' statistics of a step (load per expert, dropped tokens, auxiliary and z losses) over all ranks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import Config, OptimConfig, ParallelConfig
from scaletrain.config.sizes import moe_layers
from scaletrain.distributed.comm import CommStats, collective_device, group_size
from scaletrain.distributed.mesh import Mesh
from scaletrain.model.moe import Experts, moe_modules
from scaletrain.parallel.data_parallel import ReplicatedOptimizer
from scaletrain.parallel.engine import EngineOptimizer
from scaletrain.parallel.norms import clip_coefficient, global_grad_norm
from scaletrain.parallel.tensor_parallel import all_reduce_grad_hook
from scaletrain.parallel.tp_plan import ShardSpec
from scaletrain.parallel.zero import ZeroOptimizer

# --------------------------------------------------------------------------- all-to-all


def all_to_all(x: torch.Tensor, group, stats: CommStats | None, timer: Counter | None = None) -> torch.Tensor:
    """Equal-split all-to-all along dim 0: chunk j of `x` goes to rank j; chunk j of the result came from j."""
    n = group_size(group)
    if n == 1:
        return x
    t0 = time.perf_counter()
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    if stats is not None:
        stats.add("ep.all_to_all", (n - 1) / n * x.numel() * x.element_size())
    if timer is not None:
        timer["all_to_all_s"] += time.perf_counter() - t0
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats, timer):
        ctx.group, ctx.stats, ctx.timer = group, stats, timer
        return all_to_all(x, group, stats, timer)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, ctx.stats, ctx.timer), None, None, None


class ExpertParallelExperts(Experts):
    """`Experts` holding E / ep of the experts; forward takes and returns all E experts' slots (E, G, K, C)
    of this rank's tokens, exchanging them with the ep group around the local expert computation."""

    group: Any
    stats: CommStats | None
    timer: Counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = group_size(self.group)
        E, rest = x.shape[0], x.shape[1:]
        if self.slot_ids is not None and n > 1:  # global dropout: the ids of every ep rank's slots, rank order
            ids = [torch.empty_like(self.slot_ids) for _ in range(n)]
            dist.all_gather(ids, self.slot_ids.contiguous(), group=self.group)
            self.slot_ids = torch.cat(ids)
        recv = _AllToAll.apply(x, self.group, self.stats, self.timer)  # chunk j: rank j's slots of my experts
        local = recv.view(n, E // n, *rest).transpose(0, 1)  # (E/ep, ep, G, K, C)
        out = super().forward(local).transpose(0, 1)  # (ep, E/ep, G, K, C): chunk j goes back to rank j
        return _AllToAll.apply(out, self.group, self.stats, self.timer).view(E, *rest)


# --------------------------------------------------------------------------- the pass


def apply_ep(engine, sequence_parallel: bool, mesh: Mesh, comm: CommStats) -> None:
    """Shard the experts of the engine's MoE layers over mesh's ep group (see the module docstring)."""
    group, n, r = mesh.group("ep"), mesh.size("ep"), mesh.local_rank("ep")
    # sequence parallelism: each tp rank runs the experts on its own sequence shard's tokens, so an expert's
    # gradient is summed over tp (the hook `mark_replicated` put on the full parameter; the shard needs its own)
    sp_sum = sequence_parallel and mesh.size("tp") > 1
    sharded: list[str] = []
    for mname, mod in engine.module.named_modules():
        if not isinstance(mod, Experts):
            continue
        mod.expert_offset = r * (mod.n_total // n)  # this rank's first expert
        for pname, p in list(mod.named_parameters(recurse=False)):
            per = p.shape[0] // n
            local = nn.Parameter(p.detach()[r * per: (r + 1) * per].clone(), requires_grad=p.requires_grad)
            local.__dict__.update({k: v for k, v in p.__dict__.items() if k.startswith("_st_")})  # tp marks
            local._st_expert = True
            local._st_ep_shard = (ShardSpec(0), r, n)  # where the local experts sit in the stacked tensor
            if sp_sum and getattr(p, "_st_tp_replicated", False):
                local.register_hook(all_reduce_grad_hook(mesh.group("tp"), comm))
            setattr(mod, pname, local)
            sharded.append(f"{mname}.{pname}")
        mod.__class__ = ExpertParallelExperts
        mod.group, mod.stats, mod.timer = group, comm, Counter()
    inner = engine.gather_state
    engine.gather_state = lambda local: gather_experts(inner(local) if inner else local, sharded, group)


def gather_experts(state: dict[str, torch.Tensor], names: list[str], group) -> dict[str, torch.Tensor]:
    """The state with each sharded expert weight all-gathered over ep along dim 0 (collective)."""
    n = group_size(group)
    out = dict(state)
    for name in names:
        if name in out and n > 1:
            t = out[name].contiguous()
            pieces = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(pieces, t, group=group)
            out[name] = torch.cat(pieces, 0)
    return out


def all_to_all_seconds(module: nn.Module) -> float:
    """Seconds this rank spent in expert all-to-alls since the timers were last cleared (and clears them)."""
    total = 0.0
    for m in module.modules():
        if isinstance(m, ExpertParallelExperts):
            total += m.timer.pop("all_to_all_s", 0.0)
    return total


# --------------------------------------------------------------------------- gradients


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, "_st_expert", False)


class ExpertParallelOptimizer(EngineOptimizer):
    """Two optimizers behind one interface, one global gradient norm: the dense parameters with gradients
    reduced over dp, the expert parameters over the expert-data-parallel group edp (the ranks holding the same
    experts), as DeepSpeed-MoE and Megatron do. Each part is replicated (`parallel.zero=0`) or a ZeroOptimizer
    of the run's stage over its own group — the experts' optimizer state, gradients and (stage 3) parameters are
    sharded over edp, i.e. over dp / ep ranks."""

    def __init__(self, dense: EngineOptimizer, experts: EngineOptimizer):
        self.dense, self.experts = dense, experts

    @classmethod
    def from_config(cls, module: nn.Module, params: list[nn.Parameter], optim: OptimConfig, par: ParallelConfig,
                    lr: float, mesh: Mesh, comm: CommStats) -> ExpertParallelOptimizer:
        """`optim.name` at base learning rate `lr`: replicated (parallel.zero=0) or ZeRO parts over dp and edp."""
        dense = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        d, e = ("dp_cp", "edp_cp") if par.cp > 1 else ("dp", "edp")  # context parallelism: cp ranks reduce too
        if par.zero == 0:
            return cls(ReplicatedOptimizer.from_config(dense, optim, par, lr, mesh, comm, dim=d),
                       ReplicatedOptimizer.from_config(experts, optim, par, lr, mesh, comm, dim=e))
        return cls(ZeroOptimizer.from_config(module, optim, par, lr, mesh, comm, params=dense, dim=d),
                   ZeroOptimizer.from_config(module, optim, par, lr, mesh, comm, params=experts, dim=e))

    @property
    def parts(self) -> tuple[EngineOptimizer, ...]:
        return self.dense, self.experts

    def begin_micro(self, index: int, count: int) -> None:
        for o in self.parts:
            o.begin_micro(index, count)

    def finish_backward(self) -> None:
        for o in self.parts:
            o.finish_backward()

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        return torch.stack([o.unscale_(inv_scale) for o in self.parts]).any()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # each distinct gradient element counts once over the world (see each part's local_grad_sq)
        norm = global_grad_norm(self.local_grad_sq(), world=True)
        if max_norm > 0:
            self.scale_grads_(clip_coefficient(norm, max_norm))
        return norm

    def expert_grad_sq(self) -> torch.Tensor:
        """|G|² of the expert parameters' (reduced, unclipped) gradients, summed over the world (collective)."""
        return global_grad_norm(self.experts.local_grad_sq(), world=True) ** 2

    def local_grad_sq(self) -> torch.Tensor:
        return sum(o.local_grad_sq() for o in self.parts)

    def scale_grads_(self, coef: float | torch.Tensor) -> None:
        for o in self.parts:
            o.scale_grads_(coef)

    def step(self, lr: float | None = None) -> None:
        for o in self.parts:
            o.step(lr)

    def zero_grad(self) -> None:
        for o in self.parts:
            o.zero_grad()

    @property
    def owns_params(self) -> bool:
        return any(o.owns_params for o in self.parts)

    def begin_step(self) -> None:
        for o in self.parts:
            o.begin_step()

    @contextmanager
    def params_gathered(self) -> Iterator[None]:
        with ExitStack() as stack:
            for o in self.parts:
                stack.enter_context(o.params_gathered())
            yield

    def gather_params(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for o in self.parts:
            local = o.gather_params(local)
        return local

    def use_arena(self, arena: Any) -> None:
        for o in self.parts:
            o.use_arena(arena)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        a, b = (o.memory_tensors() for o in self.parts)
        return {k: a[k] + b[k] for k in a}


# --------------------------------------------------------------------------- metrics


def moe_metrics(module: nn.Module, cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """This step's MoE statistics over all ranks (collective over the world; every rank calls it, pipeline
    stages without MoE layers contribute zeros): `loss_aux` and `loss_z` (unweighted, summed over layers,
    each a mean over the global batch), per-layer expert load (fraction of assignments per expert,
    before capacity) and dropped fraction, the total dropped count, and the all-to-all time."""
    layers = moe_layers(cfg.model)
    E = cfg.model.moe.experts
    vec = torch.zeros(len(layers) + 1, 4 + E, dtype=torch.float64)  # last row: all-to-all seconds
    for m in moe_modules(module):
        vec[layers.index(m.layer)] += m.stats.vector(E)
    vec[-1, 0] = all_to_all_seconds(module)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:  # on the backend's device (NCCL needs CUDA tensors), back on the host for the metrics
        vec = vec.to(collective_device(), copy=True)
        dist.all_reduce(vec)
        vec = vec.cpu()
    a2a_s, vec = float(vec[-1, 0]) / world, vec[:-1]
    if not cfg.parallel.sequence_parallel:
        vec /= mesh.size("tp")  # tensor-parallel ranks computed the same statistics (with sp: their own tokens')
    tokens = cfg.tokens_per_step
    load = vec[:, 4:] / vec[:, 4:].sum(1, keepdim=True).clamp_min(1)
    return {
        "loss_aux": float(vec[:, 0].sum()) / tokens,
        "loss_z": float(vec[:, 1].sum()) / tokens,
        "moe_layers": layers,
        "moe_load": [[round(float(v), 6) for v in row] for row in load],
        "moe_dropped_frac": [float(d) / max(float(a), 1.0) for d, a in zip(vec[:, 2], vec[:, 3])],
        "moe_dropped": int(round(float(vec[:, 2].sum()))),
        "moe_all_to_all_s": a2a_s,  # expert all-to-all time in this step (forward and backward), mean over ranks
    }
