"""Layout-independent initialisation: every value is a function of (seed, parameter name) only.

Each parameter gets its own random stream, seeded from a hash of `seed:name`, and is drawn at its full
(unsharded) shape in float64 before it is cast. So a tensor- or pipeline-parallel rank that holds a slice
of `blocks.3.mlp.fc.weight` gets exactly the values of that slice in the single-device model, whatever
the layout, dtype or device. GPT-2 scheme: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L))
(Radford et al. 2019), biases 0, layer-norm gains 1.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

Init = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from (seed, name) by BLAKE2b: stable across runs, processes and platforms."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _normal(std: float) -> Init:
    return lambda shape, g: torch.randn(shape, generator=g, dtype=torch.float64) * std


def _const(value: float) -> Init:
    return lambda shape, g: torch.full(shape, value, dtype=torch.float64)


def _fan_in_truncated(scale: float, fan_in_dim: int) -> Init:
    """Switch Transformer init: truncated normal (at 2 std) with std sqrt(scale / fan_in)."""

    def draw(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float64)
        std = math.sqrt(scale / shape[fan_in_dim])
        return nn.init.trunc_normal_(out, 0.0, std, -2 * std, 2 * std, generator=g)

    return draw


def moe_rules(n_layers: int, switch_init_scale: float = 0.0) -> list[tuple[str, Init]]:
    """Router and expert weights (model/moe.py): stacked expert weights are (E, in, out), drawn at full
    shape so expert e's values are the same whatever the expert-parallel layout. Default: the GPT scheme
    (the experts' output projection scaled like `proj`); with `switch_init_scale` s > 0 all of them are
    truncated normals with std sqrt(s / fan_in) (Fedus et al., arXiv 2101.03961, Sec. 2.3)."""
    if switch_init_scale > 0:
        routers = r"\.mlp\.(router|noise|expert_router|expert_noise)\.weight$"  # expert_*: the hierarchical MoE's
        return [(routers, _fan_in_truncated(switch_init_scale, -1)),
                (r"\.mlp\.experts\.\w+_weight$", _fan_in_truncated(switch_init_scale, -2))]
    return [(r"\.mlp\.experts\.proj_weight$", _normal(0.02 / math.sqrt(2 * n_layers)))]


def gpt_rules(n_layers: int, switch_init_scale: float = 0.0) -> list[tuple[str, Init]]:
    """(regex on the parameter name, initialiser), first match wins."""
    return [
        *moe_rules(n_layers, switch_init_scale),
        (r"\.bias$", _const(0.0)),
        (r"(^|\.)ln[^.]*\.weight$", _const(1.0)),
        (r"\.proj\.weight$", _normal(0.02 / math.sqrt(2 * n_layers))),
        (r".*", _normal(0.02)),
    ]


def init_value(name: str, shape: tuple[int, ...], seed: int, rules: list[tuple[str, Init]]) -> torch.Tensor:
    """The float64 initial value of the full parameter `name`."""
    g = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    for pattern, fn in rules:
        if re.search(pattern, name):
            return fn(tuple(shape), g)
    raise KeyError(f"no initialisation rule matches {name}")


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, rules: list[tuple[str, Init]]) -> None:
    """Fill every (already materialised) parameter of `model` from (seed, name)."""
    for name, p in model.named_parameters():  # tied parameters appear once, under their first name
        p.copy_(init_value(name, tuple(p.shape), seed, rules).to(p.dtype))


@contextmanager
def no_normal_init() -> Iterator[None]:
    """`nn.init.normal_` does nothing inside: for modules built on the meta device, whose values are never read
    (`init_parameters` initialises the materialised model). torch's meta kernel of `normal_` (nn.Embedding's own
    initialisation) imports torch._dynamo: about 1.2 s of CPU in every process that builds or sizes a model."""
    saved = nn.init.normal_
    nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        nn.init.normal_ = saved
