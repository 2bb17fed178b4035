"""Readers of the config values that are small languages of their own: memory.recompute (`every:k`, `ops:matmul`),
memory.compress (a list of modes), train.profile_steps (`a:b`) and parallel.slow_ranks (`rank:factor,...`).

Each is read by validate()'s rules and by the layers that act on it (the recomputation and compression passes, the
planner, the profiler, straggler injection), so it lives here, below all of them; a value that does not parse raises
`ConfigError` with the one-line message validate() reports. Torch-free, like the rest of config/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scaletrain.config.schema import COMPRESS_MODES, RECOMPUTE_ALIASES, RECOMPUTE_OPS
from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class RecomputeMode:
    """A parsed memory.recompute policy: `kind` of schema.RecomputeKind, `k` for every:k and nth:k, `ops` (the op kinds
    of schema.RecomputeOp) for ops:..."""

    kind: str
    k: int = 1
    ops: frozenset[str] = frozenset()

    @property
    def spec(self) -> str:
        """The canonical spelling (`selective` reads `attn-core`, `every:1` and `nth:1` read `full`)."""
        if self.kind in ("every", "nth"):
            return f"{self.kind}:{self.k}"
        if self.kind == "ops":
            return "ops:" + "+".join(o for o in RECOMPUTE_OPS if o in self.ops)
        return self.kind

    def checkpointed(self, block: int) -> bool:
        """Whether block `block` (global index) is a checkpoint that runs its forward again in backward."""
        return self.kind in ("full", "every", "ops") or (self.kind == "nth" and block % self.k == 0)

    @property
    def checkpoints_blocks(self) -> bool:
        """Whether whole blocks (or segments) are checkpoints keeping only their inputs: full, every:k, nth:k."""
        return self.kind in ("full", "every", "nth")


_RECOMPUTE_FORMS = ("none, full, every:k, nth:k (k >= 1), ops:<kinds> (" + ", ".join(RECOMPUTE_OPS) +
                    ", joined by +) or attn-core (old name: selective)")


def parse_recompute(spec: str) -> RecomputeMode:
    """memory.recompute -> RecomputeMode; ConfigError naming the value otherwise. `every:1` and `nth:1` are `full`."""
    s = str(spec).strip().lower()
    s = RECOMPUTE_ALIASES.get(s, s)
    if s in ("none", "full", "attn-core"):
        return RecomputeMode(s)
    head, sep, rest = s.partition(":")
    if sep and head in ("every", "nth"):
        try:
            k = int(rest)
        except ValueError:
            k = 0
        if k >= 1:
            return RecomputeMode("full") if k == 1 else RecomputeMode(head, k)
    if sep and head == "ops":
        kinds = {o.strip() for o in rest.replace(",", "+").split("+")} - {""}
        bad = sorted(kinds - set(RECOMPUTE_OPS)) or ([] if kinds else ["(none)"])
        if bad:
            raise ConfigError(f"memory.recompute={spec}: op kind {', '.join(bad)} is not one of "
                              f"{', '.join(RECOMPUTE_OPS)} (join several with +, e.g. ops:matmul+attention)")
        return RecomputeMode("ops", ops=frozenset(kinds))
    raise ConfigError(f"memory.recompute must be {_RECOMPUTE_FORMS}, got {spec!r}")


def parse_modes(spec: str | Sequence[str] | None) -> frozenset[str]:
    """memory.compress: `"none"`, one mode, a comma/plus-separated string (`"relu-mask,int8"`) or a list -> set of
    modes (without `none`)."""
    if spec is None:
        return frozenset()
    parts = spec.replace("+", ",").split(",") if isinstance(spec, str) else list(spec)
    modes = {str(p).strip().lower() for p in parts if str(p).strip()}
    bad = sorted(modes - set(COMPRESS_MODES))
    if bad:
        raise ConfigError(f"memory.compress mode {', '.join(bad)} is not one of {', '.join(COMPRESS_MODES)}")
    if "none" in modes and len(modes) > 1:
        others = ", ".join(sorted(modes - {"none"}))
        raise ConfigError(f"memory.compress 'none' cannot be combined with {others}")
    if {"bf16", "int8"} <= modes:
        raise ConfigError("memory.compress takes one of bf16 and int8, not both")
    return frozenset(modes - {"none"})


def parse_steps(spec: str) -> tuple[int, int] | None:
    """train.profile_steps: `a:b` (or `a`) -> (a, b), inclusive optimizer steps; "" -> None. ConfigError on anything
    else."""
    spec = spec.strip()
    if not spec:
        return None
    parts = spec.split(":")
    try:
        nums = [int(x) for x in parts]
    except ValueError:
        nums = []
    if len(parts) not in (1, 2) or len(nums) != len(parts):
        raise ConfigError(f"train.profile_steps must be a:b (first and last step to profile), got {spec!r}")
    a, b = nums[0], nums[-1]
    if not 1 <= a <= b:
        raise ConfigError(f"train.profile_steps ({spec}) needs 1 <= a <= b, got a={a}, b={b}")
    return a, b


def parse_slow_ranks(spec: str, dp: int) -> dict[int, float]:
    """parallel.slow_ranks: `"1:0.5,3:2"` -> {1: 0.5, 3: 2.0}, data-parallel rank -> extra time as a fraction of its
    compute."""
    out: dict[int, float] = {}
    if not spec.strip():
        return out
    for item in spec.split(","):
        rank, sep, factor = item.strip().partition(":")
        try:
            r, f = int(rank), float(factor)
        except ValueError:
            raise ConfigError(f"parallel.slow_ranks: expected rank:factor items such as 1:0.5, got {spec!r}") from None
        if not sep or not 0 <= r < dp or not f >= 0 or f == float("inf"):
            raise ConfigError(f"parallel.slow_ranks: {item.strip()!r} needs a data-parallel rank in [0, "
                              f"parallel.dp ({dp})) and a finite factor >= 0")
        if r in out:
            raise ConfigError(f"parallel.slow_ranks: rank {r} given twice in {spec!r}")
        out[r] = f
    return out
