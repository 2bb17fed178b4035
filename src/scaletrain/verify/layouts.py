"""The one enumeration of the layout space: every dimension scaletrain composes, its values, which combinations
`validate()` accepts, all-pairs covering sets of them, and the pairs no accepted layout contains (docs/verify.md).

A layout is one value per dimension (`DIMENSIONS`). `config(layout)` turns it into the run config of a small
model, and `reference_config(layout)` into the single-process run of the same model, data and seed it is
compared with. A layout is in the space when `validate()` accepts its config, which also refuses a value that would
mean nothing there (config/ignored.py: a pipeline schedule or partition needs pp > 1, sequence parallelism and
partitioned checkpoints need tp > 1); `meaningless` holds what validate() would accept and the run ignore (nothing
now). `enumerate_space(world)` lists them all, lazily (the product of the other dimensions is 4.2·10^7 combinations
per dp × tp × pp shape).

`covering(world)` is a covering array of strength 2 over the layouts of up to `world` processes: every pair of
values of two dimensions that appears together in some accepted layout appears together in at least one layout
of the set (all-pairs testing; Cohen et al., "The AETG system", IEEE TSE 1997, greedy construction: each new
layout is the best of several candidates that fix the most frequent uncovered pair and give every other
dimension, in random order, the value covering the most uncovered pairs; a candidate is then repaired by
hill-climbing on the number of constraints it breaks). Whether a pair occurs in an accepted layout is decided by
search (`_Search.complete`: the pair with what its values need, `needs`, changed in up to two more dimensions).
The sets for 1, 2, 4 and 8 processes are stored in configs/covering.json (`python -m scaletrain.verify.layouts`
regenerates them: 2.5 minutes of CPU, spread over `--procs` processes): tests/test_matrix.py runs the
4-process one and checks every stored set still covers every accepted pair; `scaletrain verify --matrix --world
N` runs the N-process one. The pairs no
accepted layout contains are the refusals (`refused_pairs`, `refusal_table`), each with `validate()`'s message.

Adding a dimension (e.g. `sync`, `precision`):
1. add it to `DIMENSIONS` (its default first) and to `MEANING`, and set it in `config` (and reset it in
   `reference_config` when it is a parallel setting the single-process run does not have);
2. if a value needs another dimension's value to mean something, refuse it without that value in validate()
   (a row of config/ignored.py, or the feature's rules.py), and add the completion to `needs` (what to set so that
   the pair becomes possible: it makes the search fast);
3. if its layouts need a different reference (like 2BW's stale-weight rule), say so in `matrix.run_reference`;
4. run `python -m scaletrain.verify.layouts` (covering.json; until then the stored layouts take the new default) and
   `python -m scaletrain.verify.layouts --docs docs/verify.md` (the tables), then `pytest tests/test_matrix.py`: every
   new pair is run and compared in CI, and a pair the stored sets miss fails
   `test_stored_covering_sets_are_accepted_and_miss_no_accepted_pair`.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from scaletrain.config import Config, validate
from scaletrain.errors import ConfigError
from scaletrain.optim import optimizer_spec

DIMENSIONS: dict[str, tuple[Any, ...]] = {  # the first value of each is the default
    "dp": (1, 2, 4),
    "tp": (1, 2, 4),
    "pp": (1, 2, 4),
    "ep": (1, 2),
    "zero": (0, 1, 2, 3),
    "offload": ("none", "optimizer", "params", "nvme"),
    "schedule": ("1f1b", "gpipe", "interleaved:2", "interleaved:3", "zb-h1", "2bw", "zb-v:2"),
    "sequence_parallel": (False, True),
    "recompute": ("none", "full", "attn-core", "every:2", "nth:2", "ops:matmul"),
    "partition_checkpoints": (False, True),
    "offload_activations": (False, True),
    "compress": ("none", "bf16", "int8"),
    "dtype": ("fp64", "fp32", "bf16", "fp16"),
    "optimizer": ("adamw", "adafactor", "sm3"),
    "moe": ("dense", "topk", "switch", "expert_choice", "importance", "hierarchical"),
    "accumulation": (1, 2),
    "partition": ("uniform", "uneven"),
    "tie_embeddings": (True, False),
    "position": ("learned", "rope"),
    "mlp": ("gelu", "swiglu"),
    "dropout": (0.0, 0.1),
    "tp_mode": ("1d", "2d"),
    "reversible": (False, True),
    "contiguous": (False, True),
    "cp": (1, 2),
    "cp_mode": ("ring", "ulysses"),
    "kv_heads": (0, 2, 1),
    "rope_scaling": ("none", "llama3"),
    "activation": ("gelu", "gelu_tanh"),
    "qkv_bias": (False, True),
    "reshard_after_forward": (None, False),
    "precision": ("dtype", "fp8"),
}
GRID = ("dp", "tp", "pp", "cp")  # the dimensions whose product is the number of processes
WORLD_SIZES = (1, 2, 4, 8)
MICRO_BATCH, SEQ_LEN, STEPS = 2, 32, 3


@dataclass(frozen=True)
class Layout:
    """One value per dimension (missing dimensions take their default)."""

    values: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, **values: Any) -> Layout:
        unknown = sorted(set(values) - set(DIMENSIONS))
        if unknown:
            raise ConfigError(f"unknown layout dimension(s) {', '.join(unknown)} (known: {', '.join(DIMENSIONS)})")
        full = {d: values.get(d, v[0]) for d, v in DIMENSIONS.items()}
        return cls(tuple(full.items()))

    def __post_init__(self) -> None:  # the values by dimension, for __getitem__ (not a field: eq and hash unchanged)
        object.__setattr__(self, "_by_dim", dict(self.values))

    def __getitem__(self, dim: str) -> Any:
        return self._by_dim[dim]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    @property
    def world(self) -> int:
        return self["dp"] * self["tp"] * self["pp"] * self["cp"]

    @property
    def name(self) -> str:
        """The non-default values, e.g. `dp2 tp2 zero=1 dtype=bf16` (`single` for the defaults)."""
        parts = [f"{d}{self[d]}" for d in ("dp", "tp", "pp", "ep", "cp") if self[d] != 1]
        parts += [f"{d}={v}" for d, v in self.values
                  if d not in ("dp", "tp", "pp", "ep", "cp") and v != DIMENSIONS[d][0]]
        return " ".join(parts) or "single"


def meaningless(layout: Layout) -> list[str]:
    """The values that mean nothing in this layout although `validate()` accepts them. None: validate() refuses a
    pipeline schedule or partition without pp > 1 and sequence parallelism or partitioned checkpoints without tp > 1
    (config/ignored.py); a value the run ignores that validate() cannot see would go here."""
    return []


def meaningful(layout: Layout) -> str | None:
    """Why a value means nothing in this layout (None when every value does)."""
    return "; ".join(meaningless(layout)) or None


def config(layout: Layout) -> Config:
    """The run config of `layout` (not validated): a small GPT (d_model 32, 4 heads, sequence 32, vocabulary 257 —
    padded under tensor parallelism), 3 steps; layers, micro-batches and MoE groups chosen so that every layout
    of the space can run it."""
    c = Config()
    m, p, t, o, mem = c.model, c.parallel, c.train, c.optim, c.memory
    m.d_model, m.n_heads, m.seq_len, m.vocab_size = 32, 4, SEQ_LEN, 257
    m.mlp, m.position, m.tie_embeddings, m.dropout = layout["mlp"], layout["position"], layout["tie_embeddings"], \
        layout["dropout"]
    p.dp, p.tp, p.pp, p.ep, p.zero, p.offload = (layout[k] for k in ("dp", "tp", "pp", "ep", "zero", "offload"))
    p.sequence_parallel, p.tp_mode = layout["sequence_parallel"], layout["tp_mode"]
    p.cp, p.cp_mode = layout["cp"], layout["cp_mode"]
    m.reversible = layout["reversible"]
    schedule, _, v = str(layout["schedule"]).partition(":")
    p.schedule, p.virtual_stages = schedule, int(v or 1)
    chunks = p.pp * p.virtual_stages
    per = 2 if layout["recompute"] == "every:2" else 1  # chunks hold whole every:2 segments (memory/rules.py)
    m.n_layers = max(2, chunks * per)
    if layout["partition"] == "uneven":  # one segment more on the first chunk
        m.n_layers = (chunks + 1) * per
        p.partition = ",".join([str(2 * per)] + [str(per)] * (chunks - 1))
    moe = layout["moe"]
    if moe != "dense":
        m.moe.experts, m.moe.group_tokens = 4, 8
        m.moe.router = moe if moe in ("topk", "switch", "expert_choice") else "topk"
        if moe in ("importance", "hierarchical"):  # Shazeer's losses (with the noise the load loss needs); two levels
            m.moe.aux_loss, m.moe.router_noise = "importance", 0.5
            if moe == "hierarchical":
                m.moe.groups, m.moe.top_k = 2, 1
        m.moe.every = 2 if moe == "switch" and m.n_layers >= 2 else 1
    # pipeline schedules want at least pp micro-batches, ZB-V 2 pp - 1 and DualPipeV 2 pp (rank 0's warm-up): 2 pp
    micro = max(1, p.pp) * (2 if schedule in ("zb-v", "dualpipev") else 1) * layout["accumulation"]
    t.steps, t.micro_batch, t.global_batch = STEPS, MICRO_BATCH, MICRO_BATCH * p.dp * micro
    t.warmup_steps, t.eval_every, t.checkpoint_every, t.lr, t.dtype = 1, 0, 0, 3e-3, layout["dtype"]
    o.name = layout["optimizer"]
    if optimizer_spec(o.name).factored:
        m.bias = False  # an exactly-zero true gradient (the key bias) turns into full Adafactor/SM3 steps
    mem.recompute = layout["recompute"]
    mem.partition_checkpoints = layout["partition_checkpoints"]
    mem.offload_activations = layout["offload_activations"]
    mem.compress = layout["compress"]
    mem.contiguous = layout["contiguous"]
    m.n_kv_heads, m.activation = layout["kv_heads"], layout["activation"]
    if layout["rope_scaling"] == "llama3":  # Llama 3.1's RoPE; a short original context, so every band is scaled
        m.rope_theta, m.rope_scaling.type, m.rope_scaling.original_max_position_embeddings = 500000.0, "llama3", 16
    if layout["qkv_bias"]:  # Qwen2: biases on q, k and v only
        m.bias, m.qkv_bias = False, True
    p.reshard_after_forward = layout["reshard_after_forward"]
    t.precision = layout["precision"]  # fp8: the tensorwise recipe, emulated on the CPU
    return c


def reference_config(layout: Layout) -> Config:
    """The single-process run of the same model, data, dtype and training recipe: `config(layout)` with every
    parallel setting at its default (the layout's layer count and global batch stay)."""
    c = config(layout)
    p, default = c.parallel, Config().parallel
    for name in ("dp", "tp", "pp", "ep", "zero", "offload", "schedule", "virtual_stages", "sequence_parallel",
                 "partition", "tp_mode", "reshard_after_forward", "cp", "cp_mode"):
        setattr(p, name, getattr(default, name))
    c.memory.partition_checkpoints = False
    c.memory.contiguous = False  # bit-identical either way; with zero < 2 and no recompute it has nothing to hold
    c.memory.offload_activations = False  # where the checkpoints are kept (encoded or not) changes no value
    return c


def refusal(layout: Layout) -> str | None:
    """Why the layout is not in the space: `validate()`'s message or `meaningful`'s reason; None if it is."""
    try:
        validate(config(layout), layout.world)
    except ConfigError as e:
        return str(e)
    return meaningful(layout)


def accepted(layout: Layout) -> bool:
    return refusal(layout) is None


def enumerate_space(world: int) -> Iterator[Layout]:
    """Every accepted layout of exactly `world` processes (lazily: the space is the product of all dimensions)."""
    if world not in WORLD_SIZES:
        raise ConfigError(f"world size must be one of {', '.join(map(str, WORLD_SIZES))}, got {world}")
    shapes = [shape for shape in itertools.product(*(DIMENSIONS[d] for d in GRID)) if math.prod(shape) == world]
    rest = [d for d in DIMENSIONS if d not in GRID]
    for shape in shapes:
        for combo in itertools.product(*(DIMENSIONS[d] for d in rest)):
            layout = Layout.of(**dict(zip(GRID, shape)), **dict(zip(rest, combo)))
            if accepted(layout):
                yield layout


# --------------------------------------------------------------------------- all pairs

Pair = tuple[tuple[str, Any], tuple[str, Any]]


def pairs_of(layout: Layout) -> set[Pair]:
    items = layout.values
    return {(items[i], items[j]) for i in range(len(items)) for j in range(i + 1, len(items))}


def _all_pairs() -> list[Pair]:
    dims = list(DIMENSIONS)
    return [((a, va), (b, vb)) for i, a in enumerate(dims) for b in dims[i + 1:]
            for va in DIMENSIONS[a] for vb in DIMENSIONS[b]]


def needs(layout: Layout, fixed: set[str], max_world: int) -> Layout:
    """The layout with the other values its values need, where those dimensions are not `fixed` (a search
    heuristic: `validate()` still decides). Expert parallelism needs an MoE model and dp >= ep; a pipeline
    schedule or an uneven partition needs pp > 1; sequence parallelism and partitioned checkpoints need tp > 1,
    the latter a block recomputation; parameter and nvme offload need ZeRO-3 (nvme also tp = pp = ep = 1 and
    AdamW) and optimizer offload ZeRO >= 1; 2D tensor parallelism needs a 2 x 2 grid (tp = 4) of a dense AdamW
    model without the 1d memory savers; reversible blocks keep no activations to recompute, offload or compress;
    contiguous arenas need something to hold (a recomputation, offloaded activations or ZeRO-2/3); the op-level
    recomputation policy keeps its outputs where hooks cannot reach (no offload, compression, arenas, partitioned
    checkpoints, 2d grid or zero bubble); keeping ZeRO-3 parameters gathered needs ZeRO-3 without nvme offload; FP8
    needs fp32 or bf16 parameters and a dense 1d model without reversible blocks, arenas or nvme offload;
    grouped-query attention is split by the 1d tensor parallelism only; RoPE scaling needs RoPE and the tanh GELU the
    GELU MLP; Ulysses needs cp > 1, and cp > 1 the 1d tensor parallelism and a block or attn-core recomputation
    policy (not nth:k or ops:...)."""
    v = layout.as_dict()

    def want(dim: str, value: Any) -> None:
        if dim not in fixed:
            v[dim] = value

    for _ in range(3):
        if v["tp_mode"] == "2d":  # parallel/tensor_nd: what the grid does not compose with (validate() says why)
            want("tp", 4)
            for dim, value in (("sequence_parallel", False), ("offload", "none"), ("moe", "dense"), ("ep", 1),
                               ("optimizer", "adamw"), ("partition_checkpoints", False), ("compress", "none"),
                               ("offload_activations", False), ("reversible", False), ("contiguous", False),
                               ("cp", 1), ("kv_heads", 0)):
                want(dim, value)
            if v["zero"] >= 2:
                want("zero", 1)
            if v["schedule"] in ("zb-h1", "2bw", "zb-v:2", "dualpipev:2"):
                want("schedule", "1f1b")
        if v["reversible"]:  # model/reversible.py: nothing saved for a checkpoint, an offload or a codec
            if v["recompute"] in ("full", "every:2", "nth:2", "ops:matmul"):
                want("recompute", "attn-core")
            for dim, value in (("offload_activations", False), ("compress", "none")):
                want(dim, value)
            if v["schedule"] in ("zb-h1", "zb-v:2", "dualpipev:2"):
                want("schedule", "1f1b")
        if v["precision"] == "fp8":  # memory/rules.py: fp32 or bf16 parameters, the dense 1d-parallel model
            if v["dtype"] in ("fp64", "fp16"):
                want("dtype", "fp32")
            for dim, value in (("moe", "dense"), ("ep", 1), ("tp_mode", "1d"), ("reversible", False),
                               ("contiguous", False)):
                want(dim, value)
            if v["offload"] == "nvme":
                want("offload", "none")
        if v["contiguous"] and v["recompute"] == "none" and not v["offload_activations"] and v["zero"] < 2:
            want("recompute", "attn-core" if v["reversible"] else "full")
        if v["offload"] == "nvme":  # ZeRO-Infinity: one dp group of the plain model, AdamW streamed
            for dim in ("tp", "pp", "ep"):  # first: a fixed value that needs tp or pp > 1 wins (validate() says why)
                want(dim, 1)
            want("optimizer", "adamw")
        if v["rope_scaling"] != "none":  # RoPE's scaling needs RoPE; the tanh GELU the GELU MLP
            want("position", "rope")
        if v["activation"] != "gelu":
            want("mlp", "gelu")
        if v["ep"] > 1:
            if v["moe"] == "dense":
                want("moe", "topk")
            if v["dp"] < v["ep"]:
                want("dp", v["ep"])
        if (v["schedule"] != "1f1b" or v["partition"] == "uneven") and v["pp"] == 1:
            want("pp", 2)
        if (v["sequence_parallel"] or v["partition_checkpoints"]) and v["tp"] == 1:
            want("tp", 2)
        if v["partition_checkpoints"] and v["recompute"] not in ("full", "every:2", "nth:2"):
            want("recompute", "full")
        if v["recompute"] == "ops:matmul":  # memory/rules.py: torch's selective-checkpoint cache is out of their reach
            for dim, value in (("offload_activations", False), ("compress", "none"), ("contiguous", False),
                               ("tp_mode", "1d"), ("partition_checkpoints", False)):
                want(dim, value)
            if v["schedule"] in ("zb-h1", "zb-v:2", "dualpipev:2"):
                want("schedule", "1f1b")
        if v["reshard_after_forward"] is False:  # a ZeRO-3 choice; ZeRO-Infinity streams its units
            want("zero", 3)
            if v["offload"] == "nvme":
                want("offload", "none")
        if v["offload"] in ("params", "nvme") and v["zero"] != 3:
            want("zero", 3)
        if v["offload"] == "optimizer" and v["zero"] == 0:
            want("zero", 1)
        if v["cp_mode"] != "ring" and v["cp"] == 1:  # parallel/context: Ulysses needs cp > 1
            want("cp", 2)
        if v["cp"] > 1:  # what context parallelism does not compose with (validate() says why)
            want("tp_mode", "1d")
            if v["recompute"] in ("nth:2", "ops:matmul"):
                want("recompute", "full")
        for dim in GRID:  # over the world limit: halve what nobody asked for (a 2d grid keeps tp = 4)
            if dim == "tp" and v["tp_mode"] == "2d":
                continue
            while math.prod(v[d] for d in GRID) > max_world and v[dim] > 1 and dim not in fixed:
                v[dim] //= 2
    return Layout.of(**v)


_BROKEN: dict[tuple[Any, Layout], int] = {}


def broken_constraints(layout: Layout) -> int:
    """How many constraints `validate()` names for the layout (it joins its messages with "; "); 0 if it accepts
    it. Memoised per process and per `validate` function (a test may swap in another): the searches of every
    world size and the covering checks ask about the same layouts again and again."""
    key = (validate, layout)
    if key not in _BROKEN:
        try:
            validate(config(layout), layout.world)
            _BROKEN[key] = 0
        except ConfigError as e:
            _BROKEN[key] = str(e).count("; ") + 1
    return _BROKEN[key]


class _Search:
    """Accepted layouts of up to `max_world` processes: completions of partial layouts and AETG-style greedy
    candidates, with the acceptance of each layout cached."""

    def __init__(self, max_world: int, seed: int):
        self.max_world, self.rng = max_world, random.Random(seed)
        self.cache: dict[Layout, int] = {}  # layout -> violations (0: accepted)

    def ok(self, layout: Layout) -> bool:
        """violations(layout) == 0, without asking validate() about a layout over the world limit or with a value
        that means nothing (the same verdict: each of those is a violation by itself)."""
        if layout.world > self.max_world or meaningless(layout):
            return False
        return self.violations(layout) == 0

    def violations(self, layout: Layout) -> int:
        """How far a layout is from accepted: the values that mean nothing, the constraints `validate()` names
        (it joins its messages with "; ") and one per doubling over the world limit; 0 when accepted."""
        if layout not in self.cache:
            over = (layout.world // self.max_world).bit_length() - 1 if layout.world > self.max_world else 0
            self.cache[layout] = over + len(meaningless(layout)) + broken_constraints(layout)
        return self.cache[layout]

    def complete(self, fixed: dict[str, Any]) -> Layout | None:
        """An accepted layout with the `fixed` values: the defaults with what the fixed values need (`needs`),
        repaired by changing up to two other dimensions (None if there is none: the pair is refused)."""
        if math.prod(fixed.get(d, 1) for d in GRID) > self.max_world:
            return None  # the fixed values alone need more processes
        base = needs(Layout.of(**fixed), set(fixed), self.max_world)
        if self.ok(base):
            return base
        start = base.as_dict()
        free = [d for d in DIMENSIONS if d not in fixed]
        for d in free:
            for v in DIMENSIONS[d]:
                if v != start[d] and self.ok(lay := Layout.of(**{**start, d: v})):
                    return lay
        for d1, d2 in itertools.combinations(free, 2):
            for v1 in DIMENSIONS[d1]:
                for v2 in DIMENSIONS[d2]:
                    if v1 != start[d1] and v2 != start[d2] and self.ok(lay := Layout.of(**{**start, d1: v1, d2: v2})):
                        return lay
        return None

    def candidate(self, seed_pair: Pair, uncovered: set[Pair]) -> Layout | None:
        """AETG: fix `seed_pair`, then in random order give each other dimension the value that covers the most
        uncovered pairs with the values chosen so far; repair (one dimension at a time, most coverage first)
        until the layout is accepted."""
        values = dict(seed_pair)
        for d in self.rng.sample([d for d in DIMENSIONS if d not in values], k=len(DIMENSIONS) - 2):
            def gain(v: Any, d: str = d) -> int:
                return sum(((e, values[e]), (d, v)) in uncovered or ((d, v), (e, values[e])) in uncovered
                           for e in values)
            values[d] = max(DIMENSIONS[d], key=lambda v: (gain(v), self.rng.random()))
        fixed = set(dict(seed_pair))
        lay = needs(Layout.of(**values), fixed, self.max_world)  # what the chosen values need
        for _ in range(8):  # hill-climb: one dimension at a time, fewest broken constraints, then most coverage
            if self.ok(lay):
                return lay
            fixes = [Layout.of(**{**lay.as_dict(), d: v}) for d in DIMENSIONS if d not in fixed
                     for v in DIMENSIONS[d] if v != lay[d]]
            lay = min(fixes, key=lambda f: (self.violations(f), -len(pairs_of(f) & uncovered), self.rng.random()))
        return None


def covering(max_world: int = 4, seed: int = 0, candidates: int = 30) -> list[Layout]:
    """A covering array of strength 2 of the accepted layouts of up to `max_world` processes (module docstring):
    each new layout is the best of `candidates` greedy ones. Deterministic for a given seed."""
    search = _Search(max_world, seed)
    feasible = {pair for pair in _all_pairs() if search.complete(dict(pair)) is not None}
    uncovered = set(feasible)
    chosen: list[Layout] = []
    while uncovered:
        # AETG's first choice: the value in the most uncovered pairs, with one of its uncovered partners
        count: dict[tuple[str, Any], int] = {}
        for a, b in uncovered:
            count[a] = count.get(a, 0) + 1
            count[b] = count.get(b, 0) + 1
        top = max(sorted(count, key=str), key=lambda x: count[x])
        seed_pair = min((q for q in uncovered if top in q), key=lambda q: (str(q[0]), str(q[1])))
        best = search.complete(dict(seed_pair))  # always accepted: it covers the seed pair at least
        best_n = len(pairs_of(best) & uncovered)
        for _ in range(candidates):
            lay = search.candidate(seed_pair, uncovered)
            # the most new pairs; among equals the fewest processes (what the set costs to run)
            if lay is not None and ((n := len(pairs_of(lay) & uncovered)), -lay.world) > (best_n, -best.world):
                best, best_n = lay, n
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


def refused_pairs(max_world: int = 8, layouts: list[Layout] | None = None) -> list[tuple[Pair, str]]:
    """Every pair of values no accepted layout of up to `max_world` processes contains, with the reason `validate()`
    (or `meaningful`) gives for the pair with what its values need. With `layouts` (a covering set of that world),
    only the pairs it misses are searched — the others are accepted by construction."""
    search = _Search(max_world, 0)
    covered = set().union(*map(pairs_of, layouts)) if layouts else set()
    out = []
    for pair in _all_pairs():
        if pair not in covered and search.complete(dict(pair)) is None:
            closest = needs(Layout.of(**dict(pair)), set(dict(pair)), max_world)  # what it needs, then why not
            why = None
            if closest.world <= max_world:
                why = refusal(closest)
            out.append((pair, why or f"needs more than {max_world} processes"))
    return out


def uncovered_accepted(layouts: list[Layout], max_world: int) -> list[Pair]:
    """The pairs some accepted layout of up to `max_world` processes contains (an accepted completion exists) that
    `layouts` misses — empty for a covering set. Cheap: only the pairs the set misses are searched."""
    search = _Search(max_world, 0)
    covered = set().union(*map(pairs_of, layouts))
    return [pair for pair in _all_pairs() if pair not in covered and search.complete(dict(pair)) is not None]


def refusal_table(max_world: int = 8) -> str:
    """The docs' table of refused pairs (markdown), generated from `validate()` and `meaningful` over the pairs the
    stored covering set of `max_world` misses (tests/test_matrix.py checks it misses no accepted pair)."""
    rows = ["| value | with | why no layout has both (what `validate()` says) |", "|---|---|---|"]
    for (a, b), why in refused_pairs(max_world, stored_covering(max_world)):
        if why.startswith("needs more than"):
            continue  # a world-size limit, not a refusal
        rows.append(f"| {a[0]}={text(a[1])} | {b[0]}={text(b[1])} | {why} |")
    return "\n".join(rows) + "\n"


# What each dimension sets in the run config (`config`), for docs/verify.md's table.
MEANING = {
    "dp": "`parallel.dp`", "tp": "`parallel.tp`", "pp": "`parallel.pp`", "ep": "`parallel.ep`",
    "zero": "`parallel.zero`",
    "offload": "`parallel.offload` (`nvme`: shard files in the system's temporary folder, `parallel.offload_dir`)",
    "schedule": "`parallel.schedule` (`interleaved:v`, `zb-v:2`, `dualpipev:2`: `parallel.virtual_stages=v`)",
    "sequence_parallel": "`parallel.sequence_parallel`", "recompute": "`memory.recompute`",
    "partition_checkpoints": "`memory.partition_checkpoints`", "offload_activations": "`memory.offload_activations`",
    "compress": "`memory.compress`", "dtype": "`train.dtype`", "optimizer": "`optim.name`",
    "moe": "`model.moe.router` with 4 experts (`dense`: no experts; `importance`: topk with aux_loss=importance and "
           "router_noise 0.5; `hierarchical`: that with groups=2, top_k 1)",
    "accumulation": "`train.global_batch` = micro-batch 2 x dp x max(pp, 1) x this (gradient accumulation; zb-v, "
                    "dualpipev: twice that)",
    "partition": "`parallel.partition` (`uneven`: the first chunk holds one block or segment more)",
    "tie_embeddings": "`model.tie_embeddings`", "position": "`model.position`", "mlp": "`model.mlp`",
    "dropout": "`model.dropout`",
    "tp_mode": "`parallel.tp_mode` (`2d`: SUMMA on a q x q grid, tp = 4)",
    "reversible": "`model.reversible` (RevNet blocks, half-width F and G)",
    "contiguous": "`memory.contiguous` (ZeRO-R arenas for checkpoints and ZeRO-2/3 gradient buffers)",
    "cp": "`parallel.cp` (context parallelism: every sequence split over cp ranks)",
    "cp_mode": "`parallel.cp_mode` (`ring`: ring attention, 2 x cp load-balanced chunks; `ulysses`: all-to-all)",
    "kv_heads": "`model.n_kv_heads` of the 4 heads (0: multi-head; 2: grouped-query, copied when tp = 4; 1: "
                "multi-query)",
    "rope_scaling": "`model.rope_scaling.type` (`llama3`: with `model.rope_theta=500000`, original context 16)",
    "activation": "`model.activation` (`gelu_tanh`: GPT-2's tanh GELU)",
    "qkv_bias": "`model.qkv_bias` with `model.bias=false` (Qwen2's biases on q, k, v only)",
    "reshard_after_forward": "`parallel.reshard_after_forward` (`None`: unset, true without pp; `False`: ZeRO-3 "
                             "keeps gathered parameters from forward to backward)",
    "precision": "`train.precision` (`fp8`: the blocks' linear layers in float8, tensorwise recipe, emulated; compared "
                 "with the fp8 tolerances)",
}


def dimension_table() -> str:
    """docs/verify.md's table of dimensions (markdown), from `DIMENSIONS` and `MEANING`."""
    rows = ["| dimension | values (first: default) | sets |", "|---|---|---|"]
    for dim, values in DIMENSIONS.items():
        rows.append(f"| `{dim}` | {', '.join(text(v) for v in values)} | {MEANING.get(dim, '')} |")
    return "\n".join(rows) + "\n"


def update_docs(path: str) -> list[str]:
    """Rewrite the generated sections of a markdown file (between `<!-- NAME:begin -->` and `<!-- NAME:end -->`):
    `dimensions`, `refusals` and `tolerances`. Returns the names of the sections it rewrote."""
    from pathlib import Path

    from scaletrain.verify.tolerances import tolerance_table

    doc = Path(path)
    text_ = doc.read_text()
    done = []
    for name, make in (("dimensions", dimension_table), ("refusals", lambda: refusal_table(8)),
                       ("tolerances", tolerance_table)):
        begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
        if begin in text_ and end in text_:
            head, rest = text_.split(begin, 1)
            text_ = head + begin + make() + end + rest.split(end, 1)[1]
            done.append(name)
    doc.write_text(text_)
    return done


def text(value: Any) -> str:
    """A value as the command line writes it (`true`, `every:2`, `4`)."""
    return str(value).lower()


# --------------------------------------------------------------------------- the stored covering sets

COVERING_FILE = "configs/covering.json"
STORED_WORLDS = (1, 2, 4, 8)


def stored_covering(max_world: int = 4) -> list[Layout]:
    """The stored covering set of up to `max_world` processes (4: the one the CI runs), as `python -m
    scaletrain.verify.layouts` generated it: kept in the package so that every run tests the same layouts;
    tests/test_matrix.py checks that it is still accepted and still covers every accepted pair."""
    from importlib import resources

    from scaletrain.errors import UserError

    data = json.loads(resources.files("scaletrain").joinpath(COVERING_FILE).read_text())
    sets = data["sets"]
    if str(max_world) not in sets:
        raise UserError(f"no stored covering set for {max_world} processes (stored: {', '.join(sets)})")
    return [Layout.of(**{**dict(zip(data["dimensions"], row))}) for row in sets[str(max_world)]["layouts"]]


def cost(layouts: list[Layout]) -> tuple[int, int]:
    """What running a covering set costs, to compare candidate sets: process-steps (each layout's world; on a
    machine with fewer cores than processes time grows with it), then the number of layouts."""
    return sum(lay.world for lay in layouts), len(layouts)


def _construct(task: tuple[int, int, int]) -> tuple[int, int, list[Layout]]:
    """One greedy construction (a worker of `generate`): (max_world, seed, layouts)."""
    world, seed, candidates = task
    return world, seed, covering(world, seed=seed, candidates=candidates)


def generate(worlds: tuple[int, ...] = STORED_WORLDS, seeds: int = 3, candidates: int = 30,
             procs: int = 1) -> dict[int, tuple[int, list[Layout]]]:
    """For each world size, the cheapest (`cost`) covering set of `seeds` greedy constructions: {world: (seed,
    layouts)}. The constructions are independent; `procs` > 1 runs them in that many processes."""
    tasks = [(w, s, candidates) for w in worlds for s in range(seeds)]
    if procs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(procs) as pool:
            done = list(pool.map(_construct, tasks))
    else:
        done = [_construct(t) for t in tasks]
    best: dict[int, tuple[int, list[Layout]]] = {}
    for world, seed, cov in done:  # in task order: ties keep the lower seed
        if world not in best or cost(cov) < cost(best[world][1]):
            best[world] = (seed, cov)
    return best


def main(argv: list[str] | None = None) -> None:
    """`python -m scaletrain.verify.layouts [--seeds S] [--candidates C] [--procs P]`: regenerate configs/covering.json
    (every stored world size) and print what each set costs; `--docs FILE` rewrites the generated tables."""
    import argparse
    import os
    import time
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m scaletrain.verify.layouts", description=main.__doc__)
    ap.add_argument("--seeds", type=int, default=3, help="greedy constructions per world size (the cheapest is kept)")
    ap.add_argument("--candidates", type=int, default=30, help="AETG candidates per chosen layout")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1,
                    help="processes running the constructions (default: one per CPU core)")
    ap.add_argument("--docs", metavar="FILE", help="only rewrite the generated tables of FILE (docs/verify.md)")
    args = ap.parse_args(argv)
    if args.docs:
        print(f"rewrote {', '.join(update_docs(args.docs)) or 'nothing'} in {args.docs}")
        return
    t0 = time.time()
    best = generate(STORED_WORLDS, args.seeds, args.candidates, args.procs)
    sets = {}
    for world in STORED_WORLDS:
        seed, cov = best[world]
        sets[str(world)] = {"seed": seed, "layouts": [[lay[d] for d in DIMENSIONS] for lay in cov]}
        ws = [w for w in WORLD_SIZES if w <= world]
        sizes = " / ".join(str(sum(lay.world == w for lay in cov)) for w in ws)
        print(f"world <= {world}: {len(cov)} layouts ({sizes} on {' / '.join(map(str, ws))} processes), "
              f"{cost(cov)[0]} process-steps, seed {seed}", flush=True)
    path = Path(__file__).parent.parent / COVERING_FILE
    lines = ['{"generated_by": "python -m scaletrain.verify.layouts",',
             f' "dimensions": {json.dumps(list(DIMENSIONS))},', ' "sets": {']
    for i, (world, entry) in enumerate(sets.items()):
        rows = ",\n".join(f"   {json.dumps(row)}" for row in entry["layouts"])
        end = "," if i < len(sets) - 1 else ""
        lines.append(f'  "{world}": {{"seed": {entry["seed"]}, "layouts": [\n{rows}]}}{end}')
    lines.append(" }}")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path} ({time.time() - t0:.0f} s, {args.procs} process(es))")


if __name__ == "__main__":
    main()
