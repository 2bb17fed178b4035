"""Pipeline stages of a layout: which blocks each pipeline rank holds, and how many microbatch-chunks it keeps.

A layout splits the L blocks into S = pp x virtual_stages stages with the engine's rules (`parallel.partition`,
the torch-free `parallel/pipeline/balance.py` both use): `uniform` (L / S each; L must divide), `params` (PipeDream's
dynamic program over parameter counts, arXiv 1806.03377 Sec. 3.1, with the engine's costs: every block weighs what
block 0 weighs, the embedding is on the first stage, the head - a copy of a tied embedding - on the last), `time`
(the same program over this model's per-block, embedding and head times), `ends` (the embedding and the head count
as one block each: the first and the last stage get one block fewer, as Megatron-core's
account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split; Llama 3, arXiv 2407.21783 Sec.
3.3.2) or explicit block counts "7,8,...". Stage s lives on pipeline rank s mod pp as its chunk s // pp (Megatron's
interleaving, `parallel.pipeline.schedules.stage_to_rank_chunk`).

Per rank: its blocks (dense and mixture-of-experts ones counted apart: block i is an MoE block when
(i + 1) % moe_every == 0), and the microbatch-chunks it holds at its peak. With one chunk per rank the count is
closed: GPipe m, 1F1B / 2BW min(p - r, m) on rank r (PipeDream-flush, arXiv 2006.09503), ZB-H1 min(p, m); with several
chunks of different sizes the peak of the sum of their activations is found by walking the schedule's own action
list once per (schedule, p, m, v) (`inflight_vectors`), with the simulator's accounting (a chunk is held from its
forward to its last backward pass).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from scaletrain.config.schema import PARTITION_KINDS
from scaletrain.errors import ConfigError, UserError
from scaletrain.parallel.pipeline import balance
from scaletrain.plan.analytic.inputs import Layout, Recompute
from scaletrain.plan.analytic.params import StageParams, layer_kind_counts, param_counts
from scaletrain.plan.catalog import ModelSpec

PARTITIONS = PARTITION_KINDS  # uniform, params, time, ends; or block counts "2,3,3"


def check_partition(spec: str, n_layers: int, n_stages: int) -> None:
    """UserError naming the value when `spec` cannot split `n_layers` blocks into `n_stages` stages."""
    if spec not in PARTITIONS:
        try:
            counts = [int(x) for x in spec.split(",")]
        except ValueError:
            raise UserError(f"partition must be one of {', '.join(PARTITIONS)} or block counts like 7,8,8,7;"
                            f" got {spec!r}") from None
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
            raise UserError(f"partition ({spec}) must list pp x virtual_stages = {n_stages} positive block counts"
                            f" summing to the layers ({n_layers})")
        return
    if spec == "uniform" and n_layers % n_stages:
        raise UserError(f"layers ({n_layers}) is not divisible by pp x virtual_stages = {n_stages} (partition=uniform;"
                        " ends, params, time or block counts split them unevenly)")
    if spec == "ends":
        ends_blocks(n_layers, n_stages)
        return
    if n_layers < n_stages:
        raise UserError(f"layers ({n_layers}) is fewer than pp x virtual_stages = {n_stages} stages")


def ends_blocks(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Blocks per stage under `ends`: the engine's split (`balance.ends`: the embedding and the head count as one block
    each) and, where that leaves the first or the last stage without a block, the same split with those stages
    holding only the embedding or only the head - the Llama 3 405B layout (arXiv 2407.21783 Sec. 3.3.2: "the first
    model chunk on the first stage has only the embedding, and the last model chunk on the last stage has only output
    projection and loss calculation", 126 blocks on 16 x 8 chunks). The engine's parallel.partition=ends refuses
    such stages; the planner prices them (a layout of Megatron-core or of Meta's own pipeline)."""
    try:
        return balance.ends(n_layers, n_stages).blocks
    except ConfigError as e:
        units = list(balance.uniform(n_layers + 2, n_stages).blocks) if n_layers + 2 >= n_stages else [0]
        units[0] -= 1
        units[-1] -= 1
        if n_stages < 3 or min(units) < 0 or min(units[1:-1]) < 1:
            raise UserError(str(e).replace("parallel.partition=", "partition=").replace("model.n_layers", "layers")) \
                from None
        return tuple(units)


def is_moe_block(m: ModelSpec, i: int) -> bool:
    return bool(m.n_experts) and (i + 1) % m.moe_every == 0


@functools.lru_cache(maxsize=1024)
def split(m: ModelSpec, spec: str, n_stages: int, time_costs: balance.LayerCosts | None = None) -> tuple[int, ...]:
    """Blocks per stage (model order) under partition `spec`; `time_costs` are the per-block, embedding and head
    times the `time` rule balances (`step_time.block_time_costs`)."""
    L = m.n_layers
    check_partition(spec, L, n_stages)
    if spec == "uniform":
        return (L // n_stages,) * n_stages
    if spec == "ends":
        return ends_blocks(L, n_stages)
    if spec == "params":
        return balance.balance(param_costs(m), n_stages).blocks
    if spec == "time":
        if time_costs is None:
            raise UserError("partition=time needs the model's per-block times (a GPU to time them on)")
        return balance.balance(time_costs, n_stages).blocks
    return tuple(int(x) for x in spec.split(","))


@functools.lru_cache(maxsize=256)
def param_costs(m: ModelSpec) -> balance.LayerCosts:
    """The engine's costs for `params` (`parallel.pipeline.partition.param_costs`): every block weighs block 0's
    parameters, the embeddings (token + learned positions) are on the first stage, ln_f and the head (a copy of a
    tied embedding) on the last."""
    block = sum(layer_kind_counts(m, moe=is_moe_block(m, 0)))
    d = m.d_model
    embed = m.vocab_size * d + (m.seq_len * d if m.position == "learned" else 0)
    head = m.vocab_size * d + d * (2 if m.bias else 1)
    return balance.LayerCosts((float(block),) * m.n_layers, float(embed), float(head), "params")


@dataclass(frozen=True)
class RankGroup:
    """Pipeline ranks that hold the same blocks (and neither or the same end of the model): the first of them, the
    most loaded with the schedules' in-flight counts, which never grow with the rank."""

    rank: int
    count: int
    dense: int
    moe: int
    stages: tuple[int, ...]
    """The rank's stages, chunk by chunk."""


@dataclass(frozen=True)
class Stages:
    """The blocks of every stage and what each pipeline rank holds."""

    blocks: tuple[int, ...]
    """Blocks per stage, in model order (S = p x v stages)."""
    moe: tuple[int, ...]
    """Mixture-of-experts blocks per stage."""
    p: int
    v: int
    vee: bool = False
    """Stages placed in a V (zb-v, dualpipev): rank r holds stages r and 2p-1-r, the first and the last on rank 0."""

    def chunks(self, r: int) -> list[int]:
        """The stages of pipeline rank r, chunk by chunk."""
        if self.vee:
            return [r, 2 * self.p - 1 - r]
        return [c * self.p + r for c in range(self.v)]

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last stage (ln_f, the head, the logits): rank 0 in a V."""
        return 0 if self.vee else self.p - 1

    def rank_blocks(self, r: int) -> tuple[int, int]:
        """(dense, MoE) blocks of rank r."""
        total = sum(self.blocks[s] for s in self.chunks(r))
        moe = sum(self.moe[s] for s in self.chunks(r))
        return total - moe, moe

    @functools.cached_property
    def groups(self) -> tuple[RankGroup, ...]:
        """The ranks grouped by what they hold (first rank, last rank and equal middles apart), in rank order."""
        out: dict[tuple, list] = {}
        for r in range(self.p):
            ids = self.chunks(r)
            key = (tuple(self.blocks[s] for s in ids), tuple(self.moe[s] for s in ids), r == 0, r == self.last_rank)
            if key in out:
                out[key][1] += 1
            else:
                out[key] = [r, 1, *self.rank_blocks(r), tuple(ids)]
        return tuple(RankGroup(*g) for g in out.values())

    @functools.cached_property
    def heaviest_blocks(self) -> int:
        """The most blocks a rank holds."""
        return max(g.dense + g.moe for g in self.groups)

    def short(self) -> str:
        return run_length(self.blocks)


def run_length(blocks: tuple[int, ...]) -> str:
    """Blocks per stage in short: 7,8x14,7."""
    out: list[str] = []
    i = 0
    while i < len(blocks):
        j = i
        while j < len(blocks) and blocks[j] == blocks[i]:
            j += 1
        out.append(str(blocks[i]) + (f"x{j - i}" if j - i > 1 else ""))
        i = j
    return ",".join(out)


@functools.lru_cache(maxsize=1024)
def stages_of(m: ModelSpec, blocks: tuple[int, ...], p: int, v: int, vee: bool = False) -> Stages:
    moe, lo = [], 0
    for n in blocks:
        moe.append(sum(is_moe_block(m, i) for i in range(lo, lo + n)))
        lo += n
    return Stages(tuple(blocks), tuple(moe), p, v, vee)


def recomputed_blocks(m: ModelSpec, st: Stages, g: RankGroup, pol: Recompute) -> tuple[int, int]:
    """(dense, MoE) blocks of a rank of group `g` that the policy runs (partly) again in backward: none for `none`,
    the blocks 0, k, 2k, ... of the model for nth:k, all of them for the others."""
    if pol.kind == "none":
        return 0, 0
    if pol.kind != "nth":
        return g.dense, g.moe
    dense = moe = 0
    for s in g.stages:
        lo = sum(st.blocks[:s])
        for i in range(lo, lo + st.blocks[s]):
            if pol.checkpointed(i):
                moe += is_moe_block(m, i)
                dense += not is_moe_block(m, i)
    return dense, moe


def inflight_count(schedule: str, p: int, m: int, v: int, r: int) -> int:
    """Peak microbatch-chunks rank r holds, in closed form: GPipe all m·v; 1F1B and 2BW min(p - r, m); ZB-H1
    min(p, m) on every rank (its deferred weight passes keep their inputs, arXiv 2401.10241); interleaved Megatron's
    warm-up (p - r - 1)·2 + (v - 1)·p plus the one in steady state (arXiv 2104.04473)."""
    if schedule == "gpipe":
        return m * v
    if schedule == "zb-h1":
        return min(p, m)
    if schedule in ("zb-v", "dualpipev"):  # 2p (zb-v) or 2p + 1 (dualpipev) chunk-microbatches, from the lists
        return max(sum(counts) for counts in inflight_vectors(schedule, p, m, v)[r])
    if schedule == "interleaved" and v > 1:
        return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
    if schedule == "pipedream":  # p - r minibatches in flight across steps (arXiv 1806.03377), m = 1
        return p - r
    return min(p - r, m)


@functools.lru_cache(maxsize=256)
def inflight_vectors(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the counts of microbatches held per chunk after each of its forwards (where the peaks are; only
    the ones no other count vector exceeds in every chunk), from the schedule's compute order
    (`schedules.compute_order`, the order `build_schedule` gives the executor) with the simulator's accounting."""
    from scaletrain.parallel.pipeline.schedules import Op, compute_order

    out = []
    for order in compute_order(schedule, p, m, v):
        split_w = {(mb, c) for op, mb, c, *_ in order if op is Op.BACKWARD_WEIGHT}
        held = [0] * v
        seen: set[tuple[int, ...]] = set()
        for op, mb, c, *_ in order:
            if op is Op.FORWARD:
                held[c] += 1
                seen.add(tuple(held))
            elif op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) or (op is Op.BACKWARD_INPUT and (mb, c) not in split_w):
                held[c] -= 1
        out.append(_maximal(seen))
    return tuple(out)


def _maximal(vectors: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The vectors no other one reaches or exceeds in every component (the only candidates for a peak)."""
    kept: list[tuple[int, ...]] = []
    for x in sorted(vectors, key=sum, reverse=True):  # a vector can only be covered by one with a larger sum
        if not any(all(b >= a for a, b in zip(x, y)) for y in kept):
            kept.append(x)
    return tuple(kept)


def peak_chunk_bytes(schedule: str, p: int, m: int, v: int, r: int, chunk_bytes: list[float]) -> float:
    """The most bytes rank r holds at once when a microbatch of its chunk c holds `chunk_bytes[c]`: closed form when
    its chunks are equal, else the peak over the schedule's held counts."""
    if len(set(chunk_bytes)) == 1:
        return inflight_count(schedule, p, m, v, r) * chunk_bytes[0]
    return max(sum(n * b for n, b in zip(counts, chunk_bytes)) for counts in inflight_vectors(schedule, p, m, v)[r])


def pipeline_makespan(schedule: str, p: int, m: int, v: int, work: list[float], fill: list[float],
                      counts: list[int] | None = None) -> float:
    """One step's pipeline for per-rank work per microbatch `work[r]` (all its chunks, forward and backward) and,
    for ZB-H1, `fill[r]` = max(t_f + t_b - t_w, t_f) of the rank (or of `counts[i]` equal ranks each): the slowest
    rank sets the steady-state rhythm, the others' share sets the fill and drain:

    GPipe / 1F1B: (m - 1)·max W + sum W (for equal stages (m + p - 1) W, arXiv 1811.06965);
    interleaved:  m·max W + (p - 1)/(p v)·sum W ((m + (p - 1)/v) W, arXiv 2104.04473 Sec. 2.2.2);
    ZB-H1:        m·max W + (p - 1)/p·sum fill (m W + (p - 1) max(t_f + t_b - t_w, t_f), arXiv 2401.10241);
    ZB-V:         m·max W + (p - 1)/(2p)·sum fill (half of ZB-H1's fill and drain: each chunk is half a rank's
                  blocks, arXiv 2401.10241 sec. 6; equal to the simulator on equal stages, tests/test_pipeline_zbv.py);
        2BW:          m·max W (steady state, no flush, arXiv 2006.09503);
    PipeDream:    max W (m = 1; no flush and no barrier between the stages' steps, arXiv 1806.03377: the slowest
                  stage sets the pace, `simulate_free_steps` on `pipedream.build_pipedream_step`).

    Equal to `scaletrain.parallel.pipeline.simulate` on equal stages, and on equal blocks with a heavier head on the
    last stage for GPipe, 1F1B and (within 1%) interleaved and ZB-H1; on uneven partitions within the bounds that
    tests/test_plan_stages.py measures against the simulator."""
    counts = counts or [1] * len(work)
    heavy, total = max(work), sum(n * w for n, w in zip(counts, work))
    if p == 1 or schedule in ("2bw", "pipedream"):
        return m * heavy
    if schedule == "interleaved":
        return m * heavy + (p - 1) / (p * v) * total
    if schedule == "zb-h1":
        return m * heavy + (p - 1) / p * sum(n * f for n, f in zip(counts, fill))
    if schedule == "zb-v":
        return m * heavy + (p - 1) / (2 * p) * sum(n * f for n, f in zip(counts, fill))
    return (m - 1) * heavy + total


@functools.lru_cache(maxsize=512)
def v_makespan(schedule: str, p: int, m: int, f: tuple[float, ...], b: tuple[float, ...],
               w: tuple[float, ...]) -> float:
    """One step of a V schedule (zb-v, arXiv 2401.10241 sec. 6; dualpipev, arXiv 2412.19437) from its own lists:
    `simulate` of `build_schedule(schedule)` with rank r's forward f[r], input-gradient b[r] and weight-gradient w[r]
    per microbatch (both chunks together) split evenly over its two chunks; DualPipeV's overlapped slot costs its
    forward plus its backward (the overlap hides communication, not compute). DualPipeV has no closed form (its idle
    time depends on t_f, t_b, t_w piecewise), and ZB-V's (`pipeline_makespan`) is up to 4.4% slow with a head on rank
    0, so both V schedules are priced alike, by their lists (tests/test_pipeline_dualpipev.py)."""
    from scaletrain.parallel.pipeline.schedules import build_schedule
    from scaletrain.parallel.pipeline.simulate import simulate

    def halves(xs: tuple[float, ...]) -> list[list[float]]:
        return [[x / 2, x / 2] for x in xs]

    return simulate(build_schedule(schedule, p, m, 2), halves(f), halves(b), halves(w)).makespan


def rank_params(m: ModelSpec, lay: Layout, st: Stages) -> list[StageParams]:
    """Parameters one rank of every group of pipeline ranks (`Stages.groups`) holds: its blocks (matrices and
    column-parallel biases split over tp, the rest replicated, experts over ep), the vocabulary-parallel embedding
    (and learned positions) on the first,
    ln_f and the head - or, tied, a copy of the embedding as Megatron keeps it - on the last."""
    c = param_counts(m)
    t = lay.tp
    kinds = [layer_kind_counts(m, moe) for moe in (False, True)]
    emb = c.embedding / t
    out = []
    for g in st.groups:
        r, dense, moe = g.rank, g.dense, g.moe
        layers = sum(n * (tp / t + rep) for n, (tp, rep, _) in zip((dense, moe), kinds))
        expert = moe * kinds[1][2] / lay.ep
        if r == 0:
            layers += emb + c.position
        if r == st.last_rank:
            layers += c.final_norm + (c.head / t if c.head or st.p == 1 or st.vee else emb)
        out.append(StageParams(layers, expert))
    return out
