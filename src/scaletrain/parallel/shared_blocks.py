"""Shared blocks (WideNet, Xue et al. arXiv 2107.11817; ALBERT's cross-layer sharing, arXiv 1909.11942) under the
parallel passes.

`model.share_blocks` makes every block's attention and MLP (or MoE layer) block 0's modules (model/gpt.py's
`share_block_weights`). The passes need little to respect that:

- tensor parallelism (tp_plan.py) and expert parallelism (experts.py) walk `named_modules()`, which lists a shared
  module once (under block 0), so its layers are sharded and its experts split once, and every block keeps using the
  one (now sharded) module: the tying survives the pass. Autograd sums a shared weight's gradient over the layers
  before any gradient hook (tp's all-reduce, the optimizer's reduction) sees it;
- ZeRO-3 (zero.py's `default_units`) makes each shared module a unit of its own, so it is gathered for each layer
  that calls it and its gradient, summed over the layers, is reduce-scattered once;
- the full state (`Engine.full_state`, what equivalence tests and exports read) lists a shared weight under every
  block's name, as the plain model's state dict does: `gather_shared_once` gathers it once, under block 0's name,
  and gives every alias that value (the gathers of tp and ep know only the names they sharded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


def alias_names(module: nn.Module) -> dict[str, str]:
    """{alias: first name} for every parameter reachable under several names (shared blocks, tied embeddings)."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {a: ns[0] for ns in names.values() for a in ns[1:]}


def gather_shared_once(engine) -> None:
    """Wrap the engine's `gather_state` (set by tp / ep) so that each shared parameter is gathered once, under its
    first name, and its other names get the gathered value. A no-op without a gather (nothing is sharded)."""
    inner: Callable | None = engine.gather_state
    if inner is None:
        return

    def gather(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        aliases = {a: c for a, c in alias_names(engine.module).items() if a in local and c in local}
        full = inner({k: v for k, v in local.items() if k not in aliases})
        return {**full, **{a: full[c] for a, c in aliases.items()}}

    engine.gather_state = gather


def shared_modules(units: list[nn.Module]) -> list[nn.Module]:
    """The outermost modules found inside more than one of `units`, in the order first met."""
    seen: dict[int, int] = {}
    first: list[nn.Module] = []
    for u in units:
        for m in u.modules():
            if m is not u:
                seen[id(m)] = seen.get(id(m), 0) + 1
                if seen[id(m)] == 2:
                    first.append(m)
    inner = {id(c) for m in first for c in m.modules() if c is not m}
    return [m for m in first if id(m) not in inner]
