"""Which blocks go to which pipeline stage: PipeDream's dynamic program that minimises the slowest stage.

The model is a chain: embeddings, blocks 0..L-1, final norm and head. A partition gives each of the
S = pp x virtual_stages stages a consecutive, non-empty run of blocks; the embeddings always belong to
stage 0 and the head to stage S-1, and both are counted in those stages' costs. `balance` finds the
split whose most expensive stage is as cheap as possible, by the dynamic program of PipeDream
(Narayanan et al., arXiv 1806.03377, section 3.1) without its replication option: with prefix sums P,

    A(s, j) = min over i < j of max(A(s-1, i), cost(blocks i..j-1))

is the best bottleneck for the first j blocks on s stages, O(S L^2) in all.

Costs come from parameter counts (`param_costs`, a proxy for memory and, for dense blocks, compute) or
from per-layer forward+backward times measured in a short profile (`profile_costs`). `uniform` is the
equal split that `validate()` assumes by default (n_layers divisible by pp x virtual_stages).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scaletrain.config import ModelConfig
from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class LayerCosts:
    """Cost of each block, and of the parts that live on the first and the last stage."""

    blocks: tuple[float, ...]
    embed: float = 0.0  # token (+ position) embeddings: stage 0
    head: float = 0.0  # final norm + output projection (+ loss): stage S-1
    unit: str = ""  # "params" or "s"


@dataclass(frozen=True)
class Partition:
    """Blocks per stage, and each stage's cost under the costs it was balanced for."""

    blocks: tuple[int, ...]
    costs: tuple[float, ...] = ()

    @property
    def n_stages(self) -> int:
        return len(self.blocks)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """[lo, hi) block indices of every stage."""
        out, lo = [], 0
        for n in self.blocks:
            out.append((lo, lo + n))
            lo += n
        return out

    @property
    def bottleneck(self) -> float:
        return max(self.costs) if self.costs else 0.0


def stage_costs(blocks: Sequence[int], costs: LayerCosts) -> tuple[float, ...]:
    out, lo = [], 0
    for s, n in enumerate(blocks):
        c = sum(costs.blocks[lo: lo + n])
        c += costs.embed if s == 0 else 0.0
        c += costs.head if s == len(blocks) - 1 else 0.0
        out.append(c)
        lo += n
    return tuple(out)


def uniform(n_layers: int, n_stages: int, costs: LayerCosts | None = None) -> Partition:
    """n_layers / n_stages blocks per stage (the remainder, if any, on the first stages)."""
    _check(n_layers, n_stages)
    q, r = divmod(n_layers, n_stages)
    blocks = tuple(q + (1 if s < r else 0) for s in range(n_stages))
    return Partition(blocks, stage_costs(blocks, costs) if costs else ())


def balance(costs: LayerCosts, n_stages: int) -> Partition:
    """The contiguous split into `n_stages` non-empty stages with the smallest maximum stage cost.

    Ties are broken towards the split whose stages are most even (smaller sum of squared costs).
    """
    L = len(costs.blocks)
    _check(L, n_stages)
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int) -> float:  # blocks i..j-1 as one stage
        return prefix[j] - prefix[i] + (costs.embed if i == 0 else 0.0) + (costs.head if j == L else 0.0)

    inf = (float("inf"), float("inf"))
    # best[s][j] = (bottleneck, sum of squares) of the first j blocks on s stages; cut[s][j] = i.
    best = [[inf] * (L + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        for j in range(s, L - (n_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                c = seg(i, j)
                cand = (max(best[s - 1][i][0], c), best[s - 1][i][1] + c * c)
                if _better(cand, best[s][j]):
                    best[s][j], cut[s][j] = cand, i
    blocks, j = [], L
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        blocks.append(j - i)
        j = i
    blocks.reverse()
    return Partition(tuple(blocks), stage_costs(blocks, costs))


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = 1e-12 * max(1.0, abs(b[0])) if b[0] != float("inf") else 0.0
    if a[0] < b[0] - tol:
        return True
    return abs(a[0] - b[0]) <= tol and a[1] < b[1]


def _check(n_layers: int, n_stages: int) -> None:
    if n_stages < 1 or n_layers < n_stages:
        raise ConfigError(
            f"cannot split model.n_layers ({n_layers}) into {n_stages} pipeline stages of at least one block"
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
