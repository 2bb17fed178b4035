"""The registry of validation rules: each feature keeps the checks of its config keys beside its code, in a torch-free
`rules.py` (model/rules.py, memory/rules.py, parallel/rules.py, ...), and registers them here with `@rule`.

config/ imports nothing of the engine, so validate() cannot import the features' checks; instead the features'
rule modules import this registry (a downward import) and `scaletrain/__init__.py` imports every rule module, so
the rules are registered whenever any scaletrain module is. validate() refuses to run with an empty registry.

A rule is `(cfg, world_size) -> list[str]`: one plain-language line per violated constraint, naming the values
(`world_size` is None when the number of processes is not known). Each rule belongs to a stage; the stages run in
the order of `STAGES`, and some run only when everything before them passed (their rules would divide by zero,
or parse what another rule reports as malformed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from scaletrain.config.schema import Config

Rule = Callable[["Config", "int | None"], list[str]]
StageName = Literal["inputs", "values", "resolved", "combinations", "final"]


@dataclass(frozen=True)
class Stage:
    name: StageName
    doc: str
    needs_clean: bool  # runs only when every earlier stage found nothing
    stops: bool  # validate() raises after this stage when it found something


STAGES = (
    Stage("inputs", "every number is usable at all (finite, positive sizes, bounds later rules divide by)",
          needs_clean=False, stops=True),
    Stage("values", "each key's value set and range, and pairs that need nothing resolved", False, False),
    Stage("resolved", "what needs every value above valid: the micro-batch count and the pipeline schedule", True,
          False),
    Stage("combinations", "the features' own constraints and how they combine with the layout and each other",
          False, False),
    Stage("final", "what needs every other rule passed (e.g. pipeline chunk boundaries against recompute "
          "segments)", True, False),
)

_RULES: dict[str, list[Rule]] = {name: [] for name in get_args(StageName)}


def rule(stage: StageName) -> Callable[[Rule], Rule]:
    """Register `fn(cfg, world_size) -> list[str]` as a validation rule of `stage`; returns `fn` unchanged."""
    if stage not in _RULES:
        raise ValueError(f"unknown validation stage {stage!r} (stages: {', '.join(_RULES)})")

    def register(fn: Rule) -> Rule:
        rules = _RULES[stage]
        same = [i for i, r in enumerate(rules) if (r.__module__, r.__qualname__) == (fn.__module__, fn.__qualname__)]
        if same:  # a rule module reloaded: its new function replaces the old one in place
            rules[same[0]] = fn
        else:
            rules.append(fn)
        return fn

    return register


def registered(stage: StageName) -> tuple[Rule, ...]:
    """The rules of `stage`, in the order they were registered."""
    return tuple(_RULES[stage])


def count() -> int:
    """How many rules are registered over all stages."""
    return sum(len(rules) for rules in _RULES.values())
