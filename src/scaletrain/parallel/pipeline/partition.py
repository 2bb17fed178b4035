"""Which blocks go to which pipeline stage: PipeDream's dynamic program that minimises the slowest stage
(Narayanan et al., arXiv 1806.03377, section 3.1), the equal split and the split that counts the embedding and
the head as one block each (`balance`, `uniform`, `ends`: the torch-free `balance.py`, shared with the planner).

Costs come from parameter counts (`param_costs`, a proxy for memory and, for dense blocks, compute) or
from per-layer forward+backward times measured in a short profile (`profile_costs`). `uniform` is the
equal split that `validate()` assumes by default (n_layers divisible by pp x virtual_stages).
"""

from __future__ import annotations

import statistics
import time

import torch

from scaletrain.config import ModelConfig
from scaletrain.parallel.pipeline.balance import (  # noqa: F401  (the torch-free half, re-exported)
    LayerCosts,
    Partition,
    balance,
    ends,
    stage_costs,
    uniform,
)

# --------------------------------------------------------------------------- costs


def param_costs(cfg: ModelConfig) -> LayerCosts:
    """Parameters per block; embeddings (wte, wpe) on the first stage, ln_f + lm_head on the last.

    The head counts its V x C weight even when tied to the embedding: the last stage holds its own copy.
    """
    from scaletrain.model.dropout import DropoutContext
    from scaletrain.model.gpt import make_block

    with torch.device("meta"):
        block = sum(p.numel() for p in make_block(cfg, 0, DropoutContext()).parameters())
    C, V = cfg.d_model, cfg.vocab_size
    embed = V * C + (cfg.seq_len * C if cfg.position == "learned" else 0)
    head = V * C + C * (2 if cfg.bias else 1)
    return LayerCosts(tuple(float(block) for _ in range(cfg.n_layers)), float(embed), float(head), "params")


def profile_costs(model: torch.nn.Module, micro_batch: int, repeats: int = 3, seed: int = 0) -> LayerCosts:
    """Forward + backward seconds of each block, the embeddings and the head (with the loss) of a plain
    GPT, measured one layer at a time on a random micro-batch: the median of `repeats` runs after one
    warm-up. The model's gradients are reset to None afterwards."""
    from scaletrain.model import loss_sum

    cfg = model.cfg
    device, dtype = model.wte.weight.device, model.wte.weight.dtype
    B, T, C = micro_batch, cfg.seq_len, cfg.d_model
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device)
    h = torch.randn(B, T, C, generator=g, dtype=torch.float64).to(device, dtype)
    rope = model.rope(T, device)

    def embed() -> None:
        x = model.wte(idx)
        if model.wpe is not None:
            x = x + model.wpe(torch.arange(T, device=device))
        x.backward(torch.ones_like(x))

    def block(i: int):
        def run() -> None:
            x = h.detach().requires_grad_()
            y = model.blocks[i](x, rope)
            y.backward(torch.ones_like(y))
        return run

    def head() -> None:
        x = h.detach().requires_grad_()
        loss_sum(model.lm_head(model.ln_f(x)), idx).backward()

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    try:
        blocks = tuple(timed(block(i)) for i in range(cfg.n_layers))
        return LayerCosts(blocks, timed(embed), timed(head), "s")
    finally:
        for p in model.parameters():
            p.grad = None
