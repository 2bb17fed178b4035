"""The pipeline pass: keep this rank's stage(s) of the plain GPT and hand the engine a schedule executor.

`split_pp(engine, model, par, train, mesh, comm, microbatches)` runs after tensor parallelism and before data
parallelism (DESIGN.md). The model is cut into S = pp x virtual_stages consecutive stages (a `partition.Partition`);
global stage s lives on pipeline rank s % pp as local chunk s // pp, or in a V for zb-v (rank r holds stages r
and 2pp-1-r; `schedules.rank_chunk_to_stage`).
This rank keeps only its chunks, in one `PipelineStages` module whose parameters keep the plain
model's names (`wte.weight`, `blocks.5.attn.qkv.weight`, ...), so initialisation by (seed, name),
checkpoints and the equivalence tests see the same names as the single-process run.

Tied embeddings (Press & Wolf, arXiv 1608.05859) across the pipeline: stage 0 owns `wte.weight` (the
parameter the optimizer updates); the last stage holds a copy as `lm_head.weight`, a buffer that requires
grad, so it is in the state dict under its plain name but not in the optimizer or the gradient norm. Each
step the executor sends the weight from the first to the last stage before use, and the copy's gradient
from the last to the first stage, where it is added before the first stage's last weight-gradient pass,
i.e. before data parallelism or ZeRO reduce it. Megatron-LM instead keeps two parameters and all-reduces
their gradients after the data-parallel reduction (arXiv 2104.04473); that needs the tied weight at the
same offset of both stages' gradient buffers once ZeRO shards them, which the order used here does not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import ModelConfig, ParallelConfig, TrainConfig
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh
from scaletrain.errors import ConfigError
from scaletrain.parallel.pipeline import partition as part
from scaletrain.parallel.pipeline.schedules import build_schedule, rank_chunk_to_stage


class PipelineStages(nn.Module):
    """The stages (chunks) of a GPT held by one pipeline rank, with the plain model's parameter names.

    Local chunk c is global stage `stage_ids[c]` and runs blocks `bounds[c]` = [lo, hi). Stage 0 also
    runs the embeddings (wte, wpe, drop); the last stage also runs ln_f and lm_head and returns logits.
    """

    def __init__(self, model: nn.Module, stage_ids: list[int], bounds: list[tuple[int, int]], n_stages: int,
                 seq_shards: int = 1):
        super().__init__()
        self.cfg = model.cfg
        self.seq_shards = seq_shards  # hidden states hold T / seq_shards positions (sequence parallelism)
        self.positions = getattr(model, "positions", None)  # context parallelism: this rank's global positions
        self.stage_ids, self.bounds, self.n_stages = list(stage_ids), list(bounds), n_stages
        self.has_first, self.has_last = 0 in stage_ids, n_stages - 1 in stage_ids
        if self.has_first:  # registration order as in GPT, so buckets and state dicts line up
            self.wte = model.wte
            self.wpe = model.wpe
            self.drop = model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for lo, hi in self.bounds for i in range(lo, hi)})
        if self.has_last:
            self.ln_f = model.ln_f
            self.lm_head = model.lm_head
        self.tied_copy: torch.Tensor | None = None
        if self.has_last and self.cfg.tie_embeddings and not self.has_first:
            # The last stage's copy of the tied weight: a buffer the executor refreshes from stage 0.
            copy = model.lm_head.weight.detach().clone().requires_grad_()
            del self.lm_head.weight
            self.lm_head.register_buffer("weight", copy)
            self.tied_copy = copy

    def chunk_params(self, c: int) -> list[torch.Tensor]:
        """Tensors whose gradients local chunk c produces: its parameters (and the tied copy)."""
        s, (lo, hi) = self.stage_ids[c], self.bounds[c]
        mods: list[nn.Module] = []
        if s == 0:
            mods += [m for m in (self.wte, self.wpe) if m is not None]
        mods += [self.blocks[str(i)] for i in range(lo, hi)]
        if s == self.n_stages - 1:
            mods += [self.ln_f, self.lm_head]
        seen, out = set(), []
        for m in mods:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        if s == self.n_stages - 1 and self.tied_copy is not None:
            out.append(self.tied_copy)
        return out

    def forward_chunk(self, c: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run local chunk c. x: token ids (B, T) on stage 0, else hidden states (B, T, C).

        Returns (output, boundary): output is (B, T, C), or logits (B, T, V) on the last stage; boundary
        is the tensor whose gradient the stage's input-gradient pass computes: the chunk input, or on
        stage 0 the embedding output (its gradient feeds the embeddings' weight gradients).
        """
        s, (lo, hi) = self.stage_ids[c], self.bounds[c]
        if s == 0:
            T = x.shape[1]
            h = self.wte(x)  # (B, T, C)
            if self.wpe is not None:
                pos = torch.arange(T, device=x.device) if self.positions is None else self.positions.to(x.device)
                h = h + self.wpe(pos)
            x = self.drop(h)
            rope = self._rope(T, x.device)
        else:
            rope = self._rope(x.shape[1] * self.seq_shards, x.device)
        boundary = x
        for i in range(lo, hi):
            x = self.blocks[str(i)](x, rope)
        if s == self.n_stages - 1:
            x = self.lm_head(self.ln_f(x))  # (B, T, V)
        return x, boundary

    def _rope(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        from scaletrain.model.gpt import rope_for

        return rope_for(self.cfg, T, device, self.positions)


# --------------------------------------------------------------------------- the pass


def resolve_partition(model_cfg: ModelConfig, par: ParallelConfig, micro_batch: int, model: nn.Module,
                      how: str | part.Partition | None = None) -> part.Partition:
    """The partition to use: `uniform` (default), `params`, `time`, `ends`, explicit "2,3,3", or a Partition
    (`how`, else `par.partition`).

    `time` profiles `model` on micro-batches of `micro_batch` sequences on global rank 0 and broadcasts, so every
    rank agrees on the split.
    """
    S = par.pp * par.virtual_stages
    L = model_cfg.n_layers
    how = how if how is not None else par.partition
    if isinstance(how, part.Partition):
        result = how
    elif how == "uniform":
        result = part.uniform(L, S, part.param_costs(model_cfg))
    elif how == "params":
        result = part.balance(part.param_costs(model_cfg), S)
    elif how == "ends":
        result = part.ends(L, S, part.param_costs(model_cfg))
    elif how == "time":
        costs = [part.profile_costs(model, micro_batch)] if _rank() == 0 else [None]
        if dist.is_initialized():
            dist.broadcast_object_list(costs, src=0)
        result = part.balance(costs[0], S)
    else:
        try:
            blocks = tuple(int(x) for x in str(how).split(","))
        except ValueError:
            raise ConfigError(f"pipeline partition must be uniform, params, time, ends or block counts like 2,3,3;"
                              f" got {how!r}") from None
        result = part.Partition(blocks)
    if len(result.blocks) != S or sum(result.blocks) != L or min(result.blocks) < 1:
        raise ConfigError(f"pipeline partition {list(result.blocks)} must give each of parallel.pp x"
                          f" parallel.virtual_stages = {S} stages at least one of the {L} blocks")
    return result


def split_pp(engine, model_cfg: ModelConfig, par: ParallelConfig, train: TrainConfig, mesh: Mesh, comm: CommStats,
             microbatches: int, partition: str | part.Partition | None = None) -> None:
    """Replace engine.module by this rank's stages and set engine.runner / eval_runner / gather_state; the schedule
    runs `microbatches` micro-batches of `train.micro_batch` sequences per step."""
    from scaletrain.parallel.pipeline.executor import PipelineExecutor

    p, v = par.pp, par.virtual_stages
    if mesh.size("pp") != p:
        raise ConfigError(f"mesh has pp={mesh.size('pp')} but parallel.pp is {p}")
    model = engine.module
    plan = resolve_partition(model_cfg, par, train.micro_batch, model, partition)
    r = mesh.local_rank("pp")
    stage_ids = [rank_chunk_to_stage(r, c, p, par.schedule) for c in range(v)]
    bounds = plan.bounds
    shards = par.tp if par.sequence_parallel else 1
    stages = PipelineStages(model, stage_ids, [bounds[s] for s in stage_ids], p * v, shards)
    engine.module = stages
    engine.pp_partition = plan

    m = microbatches
    if par.schedule in ("zb-v", "dualpipev") and dist.is_initialized() and "nccl" in str(
            dist.get_backend(mesh.group("pp"))).lower():
        from scaletrain.parallel.pipeline.rules import v_on_nccl

        raise ConfigError(v_on_nccl(par.schedule))
    act_shape = (train.micro_batch, model_cfg.seq_len // (shards * par.cp), model_cfg.d_model)  # cp: its tokens
    if par.tp_mode != "1d":  # 2d tensor parallelism: this rank's block
        from scaletrain.parallel.tensor_nd import local_activation_shape

        act_shape = local_activation_shape(par, train.micro_batch, model_cfg)
    executor = PipelineExecutor(
        stages=stages,
        actions=build_schedule(par.schedule, p, m, v)[r],
        schedule=par.schedule, rank=r, p=p, m=m, v=v,
        group=mesh.group("pp"), peers=list(mesh.members["pp"]),
        act_shape=act_shape,
        comm=comm, tied=model_cfg.tie_embeddings, trace_call=min(2, train.steps), vertical_sync=par.vertical_sync,
    )
    engine.pipeline = executor
    engine.runner = executor.run
    engine.eval_runner = executor.run_eval
    engine.write_trace = executor.write_trace
    inner = engine.gather_state  # tensor parallelism's gather, if any, runs first

    def gather_state(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        full = inner(local) if inner is not None else local
        full = gather_pipeline_state(full, mesh.group("pp"))
        if model_cfg.tie_embeddings and "wte.weight" in full:
            full["lm_head.weight"] = full["wte.weight"]  # the last stage's copy may be a step old
        return full

    engine.gather_state = gather_state


def gather_pipeline_state(local: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Union of the pipeline ranks' state dicts (plain names), on every rank, on CPU."""
    mine = {k: v.detach().cpu() for k, v in local.items()}
    if group is None:
        return mine
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    full: dict[str, torch.Tensor] = {}
    for d in parts:
        full.update(d)
    return full


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
