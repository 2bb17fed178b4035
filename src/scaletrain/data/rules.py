"""validate()'s rules for the data keys (`data.*`): where the tokens come from and the held-out fraction.

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.rules import rule
from scaletrain.config.schema import Config


@rule("inputs")
def source(cfg: Config, world_size: int | None) -> list[str]:
    """An empty data.source would read the current folder as the corpus."""
    if not cfg.data.source.strip():
        return ["data.source must be builtin, a text file or folder, or a .bin token file; got ''"]
    return []


@rule("values")
def validation_split(cfg: Config, world_size: int | None) -> list[str]:
    """data.val_fraction: the end of the token stream held out for validation."""
    if not 0.0 < cfg.data.val_fraction < 0.5:
        return [f"data.val_fraction must be in (0, 0.5), got {cfg.data.val_fraction}"]
    return []
