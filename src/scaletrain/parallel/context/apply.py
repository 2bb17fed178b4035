"""The context-parallel pass: `apply_cp(engine, model_cfg, par, mesh, comm)`, called once by `build_engine` after
tensor and expert parallelism and before the pipeline split (docs/context_parallel.md).

It gives the plain model this rank's global positions (`layout.local_positions`): learned position embeddings and
RoPE read them (`GPT.positions`, the pipeline stages copy them), every layout-independent dropout of the residual
stream places its sequence coordinates at them (with sequence parallelism, at this tp rank's shard of them), MoE
layers key their per-token random streams and expert-dropout slots by them. Then every attention module's
`attn_core` becomes the ring (`core.RingCore`) or Ulysses (`ulysses.UlyssesCore`) core over the cp group; nothing
else of the model changes. The loader gives the rank the same positions of every sequence (the trainer passes
`positions_of` to it), the loss is summed over dp x cp, and the optimizers reduce gradients over dp x cp
(`parallelize._grad_dim`, experts over edp x cp).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from scaletrain.config import ModelConfig, ParallelConfig
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh
from scaletrain.model.dropout import GlobalDropout
from scaletrain.model.moe import moe_modules
from scaletrain.parallel.context.comm import Ring
from scaletrain.parallel.context.core import RingCore
from scaletrain.parallel.context.layout import local_positions
from scaletrain.parallel.context.ulysses import UlyssesCore


def positions_of(par: ParallelConfig, seq_len: int, mesh: Mesh) -> torch.Tensor | None:
    """This rank's global positions of every sequence (None without context parallelism)."""
    if par.cp == 1:
        return None
    return local_positions(seq_len, par.cp, mesh.local_rank("cp"), par.cp_mode)


def attention_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose attention core the pass replaces (the blocks' `attn`)."""
    return [m for m in module.modules() if callable(getattr(m, "attn_core", None))]


def apply_cp(engine, model_cfg: ModelConfig, par: ParallelConfig, mesh: Mesh, comm: CommStats) -> None:
    """Split every sequence over mesh's cp group (module docstring). Called by `build_engine` when parallel.cp > 1."""
    n, T = mesh.size("cp"), model_cfg.seq_len
    everyone = [local_positions(T, n, j, par.cp_mode) for j in range(n)]  # the ring's dropout needs its peers'
    mine = everyone[mesh.local_rank("cp")]
    model = engine.module
    device = next(model.parameters()).device
    model.positions = mine.to(device if device.type != "meta" else torch.device("cpu"))
    tp, tp_rank = mesh.size("tp"), mesh.local_rank("tp")
    shard = mine.chunk(tp)[tp_rank] if par.sequence_parallel and tp > 1 else mine  # the residual stream's tokens
    for m in model.modules():
        if isinstance(m, GlobalDropout) and m.roles == ("seq", "feature"):
            m.offsets[1] = (shard, T)
        elif isinstance(m, GlobalDropout) and "head" in m.roles and par.cp_mode == "ulysses":
            # after the all-to-all this rank holds 1/n of its tp rank's heads, and the whole sequence
            dim = 1 + m.roles.index("head")
            start, total = m.offsets.get(dim, (0, model_cfg.n_heads))
            per = model_cfg.n_heads // (tp * n)
            m.offsets[dim] = (start + mesh.local_rank("cp") * per, total)
    for m in moe_modules(model):
        m.token_positions = (shard, T)
    if par.cp_mode == "ring":
        ring = Ring(mesh.group("cp"), mesh.members["cp"], mesh.rank, comm)
        for attn in attention_modules(model):
            attn.attn_core = RingCore(attn, ring, everyone, T)
    else:
        for attn in attention_modules(model):
            attn.attn_core = UlyssesCore(attn.attn_core, mesh.group("cp"), comm)
