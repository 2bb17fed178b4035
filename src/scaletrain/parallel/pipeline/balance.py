"""Which blocks go to which pipeline stage, without torch: the equal split, PipeDream's dynamic program that
minimises the slowest stage, and the split that counts the embedding and the head as one block each.

The model is a chain: embeddings, blocks 0..L-1, final norm and head. A partition gives each of the
S = pp x virtual_stages stages a consecutive, non-empty run of blocks; the embeddings always belong to
stage 0 and the head to stage S-1. `balance` is the dynamic program of PipeDream (Narayanan et al., arXiv
1806.03377, section 3.1) without its replication option: with prefix sums P,

    A(s, j) = min over i < j of max(A(s-1, i), cost(blocks i..j-1))

is the best bottleneck for the first j blocks on s stages, O(S L^2) in all. `ends` gives the first and the
last stage one block fewer than the others for the embedding and the head (Megatron-core's
account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split; the Llama 3 paper, arXiv
2407.21783 Sec. 3.3.2: 126 layers on 16 stages as 7, 8 x 14, 7).

The engine (`partition.py`, which adds the costs measured with torch) and the planner (`plan/analytic/stages.py`)
both split with these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def ends(n_layers: int, n_stages: int, costs: LayerCosts | None = None) -> Partition:
    """The embedding and the head count as one block each: L + 2 units split as `uniform` splits blocks (the
    remainder on the first stages), then stage 0 gives one unit to the embedding and stage S-1 one to the head.
    126 blocks on 16 stages: 7, 8 x 14, 7 (Llama 3 405B)."""
    _check(n_layers, n_stages)
    q, r = divmod(n_layers + 2, n_stages)
    units = [q + (1 if s < r else 0) for s in range(n_stages)]
    units[0] -= 1
    units[-1] -= 1
    if min(units) < 1:  # e.g. 3 blocks on 3 stages: the ends cannot give one up
        raise ConfigError(f"parallel.partition=ends cannot split model.n_layers ({n_layers}) into {n_stages} stages"
                          " of at least one block each once the embedding and the head count as one block")
    blocks = tuple(units)
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
        prev = best[s - 1]
        for j in range(s, L - (n_stages - s) + 1):
            for i in _valley(lambda i: prev[i][0], lambda i: seg(i, j), s - 1, j):  # noqa: B023 (used at once)
                c = seg(i, j)
                cand = (max(prev[i][0], c), prev[i][1] + c * c)
                if _better(cand, best[s][j]):
                    best[s][j], cut[s][j] = cand, i
    blocks, j = [], L
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        blocks.append(j - i)
        j = i
    blocks.reverse()
    return Partition(tuple(blocks), stage_costs(blocks, costs))


def _valley(before, last, lo: int, hi: int) -> range:
    """The cuts i in [lo, hi) where max(before(i), last(i)) is within the tolerance of its minimum: `before` (the
    best bottleneck of the blocks before i) never falls as i grows and `last` (the stage from i on) never rises, so
    the maximum falls then rises and its minimisers are one run around the crossing, found by bisection. The
    dynamic program looks only at these (the full scan's result, in O(log L) instead of O(L) per cell)."""
    a, b = lo, hi  # first i with before(i) >= last(i), or hi
    while a < b:
        mid = (a + b) // 2
        if before(mid) >= last(mid):
            b = mid
        else:
            a = mid + 1
    f = lambda i: max(before(i), last(i))  # noqa: E731
    best = min(f(i) for i in (a - 1, a) if lo <= i < hi)
    tol = 1e-12 * max(1.0, abs(best))
    left, right = max(a - 1, lo), min(a, hi - 1)
    while left > lo and f(left - 1) <= best + tol:
        left -= 1
    while right + 1 < hi and f(right + 1) <= best + tol:
        right += 1
    return range(left, right + 1)


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
