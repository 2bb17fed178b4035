"""validate()'s rules for the supervision of launched runs: the heartbeat and the flight recorder
(multinode/heartbeat.py, multinode/flight.py; docs/multinode.md).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

from scaletrain.config.rules import rule
from scaletrain.config.schema import Config, ParallelConfig


@rule("combinations")
def supervision(cfg: Config, world_size: int | None) -> list[str]:
    """Heartbeat and flight recorder bounds."""
    p = cfg.parallel
    errors = []
    if not (p.heartbeat_s == 0 or 0.5 <= p.heartbeat_s < p.timeout_s):
        errors.append(f"parallel.heartbeat_s ({p.heartbeat_s}) must be 0 (off) or at least 0.5 and below "
                      f"parallel.timeout_s ({p.timeout_s})")
    if p.sync != "bsp" and p.heartbeat_s != ParallelConfig().heartbeat_s:
        errors.append(f"parallel.heartbeat_s ({p.heartbeat_s}) is used only with parallel.sync=bsp, got "
                      f"parallel.sync={p.sync}: asynchronous runs are not supervised by the heartbeat")
    if not 0 <= p.flight_recorder <= 100_000:
        errors.append(f"parallel.flight_recorder ({p.flight_recorder}) must be between 0 (off) and 100000 entries")
    return errors
