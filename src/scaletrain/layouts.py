"""The one enumeration of the layout space: every dimension scaletrain composes, its values, which combinations
`validate()` accepts, an all-pairs covering set of them, and the pairs `validate()` refuses.

A layout is one value per dimension (`DIMENSIONS`). `config(layout)` turns it into the run config of a small
model, and `reference_config(layout)` into the single-process run of the same model, data and seed it is
compared with. A layout is in the space when `validate()` accepts its config and every
dimension's value means something there (`meaningful`: a pipeline schedule needs pp > 1, sequence parallelism
and partitioned checkpoints need tp > 1, an uneven partition needs pp > 1).

`covering(world)` is a covering array of strength 2 over the space restricted to world sizes up to `world`:
every pair of values of any two dimensions that appears together in at least one accepted layout appears
together in at least one layout of the set (all-pairs testing; Cohen et al., "The AETG system", IEEE TSE 1997,
greedy construction: each new layout covers as many uncovered pairs as it can). Pairs that no accepted layout
contains are the refusals (`refused_pairs`), each with the message `validate()` gives; the docs' table of
refusals is generated from them. The CI runs `covering(4)`; `scaletrain verify --matrix` runs any of it on the
user's machine.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from scaletrain.config import Config, validate
from scaletrain.errors import ConfigError

DIMENSIONS: dict[str, tuple[Any, ...]] = {  # the first value of each is the default
    "dp": (1, 2, 4),
    "tp": (1, 2, 4),
    "pp": (1, 2, 4),
    "ep": (1, 2),
    "zero": (0, 1, 2, 3),
    "offload": ("none", "optimizer", "params"),
    "schedule": ("1f1b", "gpipe", "interleaved:2", "interleaved:3", "zb-h1", "2bw"),
    "sequence_parallel": (False, True),
    "recompute": ("none", "full", "selective", "every:2"),
    "partition_checkpoints": (False, True),
    "offload_activations": (False, True),
    "compress": ("none", "bf16", "int8"),
    "dtype": ("fp64", "fp32", "bf16", "fp16"),
    "optimizer": ("adamw", "adafactor", "sm3"),
    "moe": ("dense", "topk", "switch", "expert_choice"),
    "accumulation": (1, 2),
    "partition": ("uniform", "uneven"),
    "tie_embeddings": (True, False),
    "position": ("learned", "rope"),
    "mlp": ("gelu", "swiglu"),
    "dropout": (0.0, 0.1),
}
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

    def __getitem__(self, dim: str) -> Any:
        return dict(self.values)[dim]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    @property
    def world(self) -> int:
        return self["dp"] * self["tp"] * self["pp"]

    @property
    def name(self) -> str:
        """The non-default values, e.g. `dp2 tp2 zero=1 dtype=bf16` (`single` for the defaults)."""
        parts = [f"{d}{self[d]}" for d in ("dp", "tp", "pp", "ep") if self[d] != 1]
        parts += [f"{d}={v}" for d, v in self.values if d not in ("dp", "tp", "pp", "ep") and v != DIMENSIONS[d][0]]
        return " ".join(parts) or "single"


def meaningful(layout: Layout) -> str | None:
    """Why a value means nothing in this layout (None when every value does)."""
    if layout["schedule"] != "1f1b" and layout["pp"] == 1:
        return f"schedule={layout['schedule']} needs pp > 1"
    if layout["sequence_parallel"] and layout["tp"] == 1:
        return "sequence_parallel needs tp > 1"
    if layout["partition_checkpoints"] and layout["tp"] == 1:
        return "partition_checkpoints needs tp > 1"
    if layout["partition"] == "uneven" and layout["pp"] == 1:
        return "an uneven partition needs pp > 1"
    return None


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
    p.sequence_parallel = layout["sequence_parallel"]
    schedule, _, v = str(layout["schedule"]).partition(":")
    p.schedule, p.virtual_stages = schedule, int(v or 1)
    chunks = p.pp * p.virtual_stages
    m.n_layers = max(2, chunks)
    if layout["partition"] == "uneven":  # one block more on the first chunk
        m.n_layers = chunks + 1
        p.partition = ",".join(["2"] + ["1"] * (chunks - 1))
    moe = layout["moe"]
    if moe != "dense":
        m.moe.experts, m.moe.group_tokens = 4, 8
        m.moe.router = moe
        m.moe.every = 2 if moe == "switch" and m.n_layers >= 2 else 1
    micro = max(1, p.pp) * layout["accumulation"]  # pipeline schedules want at least pp micro-batches
    t.steps, t.micro_batch, t.global_batch = STEPS, MICRO_BATCH, MICRO_BATCH * p.dp * micro
    t.warmup_steps, t.eval_every, t.checkpoint_every, t.lr, t.dtype = 1, 0, 0, 3e-3, layout["dtype"]
    o.name = layout["optimizer"]
    if o.name != "adamw":
        m.bias = False  # an exactly-zero true gradient (the key bias) turns into full Adafactor/SM3 steps
    mem.recompute = layout["recompute"]
    mem.partition_checkpoints = layout["partition_checkpoints"]
    mem.offload_activations = layout["offload_activations"]
    mem.compress = layout["compress"]
    return c


def reference_config(layout: Layout) -> Config:
    """The single-process run of the same model, data, dtype and training recipe: `config(layout)` with every
    parallel setting at its default (the layout's layer count and global batch stay)."""
    c = config(layout)
    p, default = c.parallel, Config().parallel
    for name in ("dp", "tp", "pp", "ep", "zero", "offload", "schedule", "virtual_stages", "sequence_parallel",
                 "partition"):
        setattr(p, name, getattr(default, name))
    c.memory.partition_checkpoints = False
    return c


def refusal(layout: Layout) -> str | None:
    """Why the layout is not in the space: `validate()`'s message or `meaningful`'s reason; None if it is."""
    why = meaningful(layout)
    if why:
        return why
    try:
        validate(config(layout), layout.world)
    except ConfigError as e:
        return str(e)
    return None


def accepted(layout: Layout) -> bool:
    return refusal(layout) is None


def enumerate_space(world: int) -> Iterator[Layout]:
    """Every accepted layout of exactly `world` processes (lazily: the space is the product of all dimensions)."""
    if world not in WORLD_SIZES:
        raise ConfigError(f"world size must be one of {', '.join(map(str, WORLD_SIZES))}, got {world}")
    shapes = [(dp, tp, pp) for dp in DIMENSIONS["dp"] for tp in DIMENSIONS["tp"] for pp in DIMENSIONS["pp"]
              if dp * tp * pp == world]
    rest = [d for d in DIMENSIONS if d not in ("dp", "tp", "pp")]
    for dp, tp, pp in shapes:
        for combo in itertools.product(*(DIMENSIONS[d] for d in rest)):
            layout = Layout.of(dp=dp, tp=tp, pp=pp, **dict(zip(rest, combo)))
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
    the latter a block recomputation; parameter offload needs ZeRO-3 and optimizer offload ZeRO >= 1."""
    v = layout.as_dict()

    def want(dim: str, value: Any) -> None:
        if dim not in fixed:
            v[dim] = value

    for _ in range(3):
        if v["ep"] > 1:
            if v["moe"] == "dense":
                want("moe", "topk")
            if v["dp"] < v["ep"]:
                want("dp", v["ep"])
        if (v["schedule"] != "1f1b" or v["partition"] == "uneven") and v["pp"] == 1:
            want("pp", 2)
        if (v["sequence_parallel"] or v["partition_checkpoints"]) and v["tp"] == 1:
            want("tp", 2)
        if v["partition_checkpoints"] and v["recompute"] not in ("full", "every:2"):
            want("recompute", "full")
        if v["offload"] == "params" and v["zero"] != 3:
            want("zero", 3)
        if v["offload"] == "optimizer" and v["zero"] == 0:
            want("zero", 1)
        for dim in ("dp", "tp", "pp"):  # over the world limit: shrink what nobody asked for
            if v["dp"] * v["tp"] * v["pp"] > max_world and v[dim] > 2:
                want(dim, 2)
    return Layout.of(**v)


class _Search:
    """Accepted layouts of up to `max_world` processes: completions of partial layouts and AETG-style greedy
    candidates, with the acceptance of each layout cached."""

    def __init__(self, max_world: int, seed: int):
        self.max_world, self.rng = max_world, random.Random(seed)
        self.cache: dict[Layout, bool] = {}

    def ok(self, layout: Layout) -> bool:
        if layout not in self.cache:
            self.cache[layout] = layout.world <= self.max_world and accepted(layout)
        return self.cache[layout]

    def complete(self, fixed: dict[str, Any]) -> Layout | None:
        """An accepted layout with the `fixed` values: the defaults with what the fixed values need (`needs`),
        repaired by changing up to two other dimensions (None if there is none: the pair is refused)."""
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
        lay = Layout.of(**values)
        for _ in range(6):
            if self.ok(lay):
                return lay
            fixes = [Layout.of(**{**lay.as_dict(), d: v}) for d in DIMENSIONS if d not in dict(seed_pair)
                     for v in DIMENSIONS[d] if v != lay[d]]
            good = [f for f in fixes if self.ok(f)]
            if good:
                return max(good, key=lambda f: len(pairs_of(f) & uncovered))
            lay = self.rng.choice(fixes)  # no single change is accepted: take a random one and try again
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
            if lay is not None and (n := len(pairs_of(lay) & uncovered)) > best_n:
                best, best_n = lay, n
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


def refused_pairs(max_world: int = 8) -> list[tuple[Pair, str]]:
    """Every pair of values no accepted layout of up to `max_world` processes contains, with the reason
    `validate()` (or `meaningful`) gives for the pair on otherwise default values."""
    search = _Search(max_world, 0)
    out = []
    for pair in _all_pairs():
        if search.complete(dict(pair)) is None:
            closest = needs(Layout.of(**dict(pair)), set(dict(pair)), max_world)  # what it needs, then why not
            why = refusal(closest) if closest.world <= max_world else None
            out.append((pair, why or f"needs more than {max_world} processes"))
    return out


def refusal_table(max_world: int = 8) -> str:
    """The docs' table of refused pairs (markdown), generated from `validate()` and `meaningful`."""
    rows = ["| value | with | why not (what `validate()` says) |", "|---|---|---|"]
    for (a, b), why in refused_pairs(max_world):
        if why.startswith("needs more than"):
            continue  # a world-size limit, not a refusal
        rows.append(f"| {a[0]}={_show(a[1])} | {b[0]}={_show(b[1])} | {why} |")
    return "\n".join(rows) + "\n"


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


COVERING_FILE = "configs/covering.json"


def stored_covering() -> list[Layout]:
    """The covering set of up to 4 processes the CI runs, as generated by `python -m scaletrain.layouts` (kept
    in the package so every run tests the same layouts; tests/test_matrix.py checks it still covers every
    accepted pair)."""
    import json
    from importlib import resources

    data = json.loads(resources.files("scaletrain").joinpath(COVERING_FILE).read_text())
    return [Layout.of(**d) for d in data["layouts"]]


def main() -> None:
    """Regenerate the stored covering set: the smallest of several seeds (fewest 4-process layouts first)."""
    import json
    from pathlib import Path

    best = None
    for seed in range(4):
        cov = covering(4, seed=seed, candidates=100)
        key = (sum(lay.world == 4 for lay in cov), len(cov))
        print(f"seed {seed}: {len(cov)} layouts ({key[0]} on 4 processes)", flush=True)
        if best is None or key < best[0]:
            best = (key, seed, cov)
    path = Path(__file__).parent / COVERING_FILE
    path.write_text(json.dumps({"seed": best[1], "max_world": 4, "layouts": [lay.as_dict() for lay in best[2]]},
                               indent=0) + "\n")
    print(f"wrote {len(best[2])} layouts to {path}")


if __name__ == "__main__":
    main()
