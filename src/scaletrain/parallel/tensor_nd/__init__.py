"""2D, 2.5D and 3D tensor parallelism beside Megatron's 1D (`parallel.tensor_parallel`), selected by
`parallel.tp_mode` (docs/tensor_parallel.md):

    2d    Optimus, Xu et al., arXiv 2104.05343            tp2d.py    SUMMA on a q x q grid
    2.5d  Tesseract, Wang et al., arXiv 2105.14500        tp2p5d.py  d SUMMA layers, weights replicated over depth
    3d    Bian et al., arXiv 2105.14450                   tp3d.py    all-gather / reduce-scatter on a q x q x q cube

Unlike 1D, which replicates every activation between the sub-layers on the t ranks, these modes split the
activations too: a rank holds a block of the micro-batch's sequences times a block of the hidden features, so
activation memory and the per-rank messages shrink as the grid grows. `grid.py` places ranks and parameters,
`comm.py` holds the collectives (with byte accounting) and autograd operators, `summa.py` the SUMMA products,
`common.py` the split layer norm and the loss.

`apply_tp_nd(engine, model_cfg, micro_batch, mesh, comm)` is the engine pass (called by `parallelize.build_engine`
instead of `apply_tp` when tp_mode is not 1d): it swaps every linear of attention and MLP, the layer norms, the token
and position embeddings and the output head of the plain GPT for the mode's layers, each sliced from the full,
initialised weights (so each shard is exactly its part of the single-process values), sets the loss (the
vocabulary-parallel cross-entropy of the rank's sequences), tells the layout-independent dropout where the rank's
block sits, and sets `gather_state`, which rebuilds the plain model's state dict from the shards by each
parameter's `Placement`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import ModelConfig
from scaletrain.distributed.comm import CommStats, group_size
from scaletrain.parallel.tensor_nd.grid import Grid, Placement, shape_of


def make_plan(grid: Grid, micro_batch: int, d_model: int):
    """The grid mode's plan object (tp2d.Plan2D, tp2p5d.Plan2p5D or tp3d.Plan3D) for micro-batches of `micro_batch`
    sequences of width `d_model`."""
    mode = grid.shape.mode
    if mode == "2d":
        from scaletrain.parallel.tensor_nd.tp2d import Plan2D as plan
    elif mode == "2.5d":
        from scaletrain.parallel.tensor_nd.tp2p5d import Plan2p5D as plan
    elif mode == "3d":
        from scaletrain.parallel.tensor_nd.tp3d import Plan3D as plan
    else:
        raise ValueError(f"tp_mode {mode!r} is not a grid mode")
    return plan(grid, micro_batch, d_model)


def local_activation_shape(par, micro_batch: int, model: ModelConfig) -> tuple[int, int, int]:
    """This rank's block of a (micro_batch, seq_len, d_model) activation on the grid of `par` (what pipeline stages
    exchange)."""
    s = shape_of(par)
    return micro_batch // s.row_blocks, model.seq_len, model.d_model // s.q


# --------------------------------------------------------------------------- the pass


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def shard_gpt(model: nn.Module, plan) -> None:
    """Swap the plain GPT's modules for the plan's layers, in place (the same names, so state dicts, recomputation
    and pipeline stages see the plain model's structure)."""
    from scaletrain.model.block import MLP, CausalSelfAttention, SwiGLU
    from scaletrain.model.norm import RMSNorm

    tied = model.cfg.tie_embeddings
    for name, mod in list(model.named_modules()):
        if isinstance(mod, CausalSelfAttention):
            _swap(model, f"{name}.qkv", plan.linear(mod.qkv, "A", parts=3))
            _swap(model, f"{name}.proj", plan.linear(mod.proj, "B"))
        elif isinstance(mod, MLP):
            _swap(model, f"{name}.fc", plan.linear(mod.fc, "A"))
            _swap(model, f"{name}.proj", plan.linear(mod.proj, "B"))
        elif isinstance(mod, SwiGLU):
            _swap(model, f"{name}.gate", plan.linear(mod.gate, "A"))
            _swap(model, f"{name}.up", plan.linear(mod.up, "A"))
            _swap(model, f"{name}.proj", plan.linear(mod.proj, "B"))
        elif isinstance(mod, (nn.LayerNorm, RMSNorm)):
            _swap(model, name, plan.norm(mod))
    head = model.lm_head
    model.wte = plan.embedding(model.wte)
    if model.wpe is not None:
        model.wpe = plan.position(model.wpe)
    model.lm_head = plan.head(head, model.wte.weight if tied else None)


def place_dropout(module: nn.Module, plan, model: ModelConfig, micro_batch: int) -> None:
    """Where each layout-independent dropout's local block sits in the global tensor: the rank's first sequence
    (dim 0) and its hidden block (residual stream) or heads block (attention probabilities)."""
    from scaletrain.model.dropout import GlobalDropout

    q = plan.grid.q
    for m in module.modules():
        if not isinstance(m, GlobalDropout):
            continue
        if "head" in m.roles:
            m.offsets[0] = (plan.attention_rows()[0], micro_batch)
            local = model.n_heads // q
            m.offsets[1 + m.roles.index("head")] = (plan.head_block() * local, model.n_heads)
        else:
            m.offsets[0] = (plan.residual_rows()[0], micro_batch)
            local = model.d_model // q
            m.offsets[1 + m.roles.index("feature")] = (plan.feature_block() * local, model.d_model)


def placements(module: nn.Module) -> dict[str, tuple[Placement, tuple[int, ...]]]:
    """State-dict name -> (placement, plain shape) of every sharded parameter (a tied one under both names)."""
    out = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        spec = getattr(t, "_st_nd", None)
        if spec is not None:
            out[name] = spec
    return out


def gather_nd_state(local: dict[str, torch.Tensor], specs: dict, grid: Grid, group) -> dict[str, torch.Tensor]:
    """The plain model's state dict from every rank's shards (collective over the tp group): each shard is
    all-gathered and scattered into the plain tensor at its placement's global indices."""
    n = group_size(group)
    out: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        spec = specs.get(name)
        if spec is None:
            out[name] = t
            continue
        placement, shape = spec
        t = t.detach().contiguous()
        pieces = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(pieces, t, group=group)
        full = torch.zeros(shape, dtype=t.dtype, device=t.device).view(-1)
        for r, piece in enumerate(pieces):
            index = placement.global_index(shape, grid.shape.coords(r)).to(t.device)
            keep = index >= 0
            full[index[keep]] = piece.reshape(-1)[keep]
        out[name] = full.view(shape)
    return out


def apply_tp_nd(engine, model_cfg: ModelConfig, micro_batch: int, mesh, comm: CommStats) -> None:
    """Shard the engine's GPT over the mesh's tp grid (module docstring) for micro-batches of `micro_batch`
    sequences. Called by `build_engine` when tp_mode is 2d, 2.5d or 3d."""
    grid = Grid.from_mesh(mesh, comm)
    plan = make_plan(grid, micro_batch, model_cfg.d_model)
    model = engine.module
    shard_gpt(model, plan)
    engine.loss_fn = plan.loss(model.lm_head)
    place_dropout(model, plan, model_cfg, micro_batch)
    specs = placements(model)  # by plain names, before a pipeline stage replaces the tied head by a copy
    tp_group = mesh.group("tp")
    coords = grid.shape.coords(mesh.local_rank("tp"))
    for t in model.parameters():  # where each local element sits in the plain tensor (checkpoints: train/state.py)
        placed = getattr(t, "_st_nd", None)
        if placed is not None:
            t._st_nd_index = placed[0].global_index(tuple(placed[1]), coords)

    def gather_state(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return gather_nd_state(local, specs, grid, tp_group)

    engine.gather_state = gather_state
