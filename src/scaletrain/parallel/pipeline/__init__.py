"""Pipeline parallelism: schedules as data (GPipe arXiv 1811.06965, 1F1B / 2BW arXiv 2006.09503,
interleaved 1F1B arXiv 2104.04473, zero bubble arXiv 2401.10241), their static checks, simulation and
drawing. See docs/pipeline.md.

The names below are loaded on first use (PEP 562): importing `scaletrain.parallel.pipeline.rules`, which the
package root registers, loads no schedule code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.parallel.pipeline.check import check_schedule, validate_pipeline
    from scaletrain.parallel.pipeline.schedules import (
        SCHEDULES,
        Action,
        Op,
        build_schedule,
        rank_chunk_to_stage,
        stage_layout,
        stage_to_rank_chunk,
    )
    from scaletrain.parallel.pipeline.simulate import Event, SimResult, simulate

_EXPORTS = {"check_schedule": "check", "validate_pipeline": "check", "Event": "simulate", "SimResult": "simulate",
            **{name: "schedules" for name in ("SCHEDULES", "Action", "Op", "build_schedule",
                                                                      "rank_chunk_to_stage", "stage_layout",
                                                                      "stage_to_rank_chunk")}}
__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "Op",
    "SimResult",
    "build_schedule",
    "check_schedule",
    "rank_chunk_to_stage",
    "simulate",
    "stage_layout",
    "stage_to_rank_chunk",
    "validate_pipeline",
]

__getattr__ = lazy.exports(__name__, _EXPORTS)
lazy.keep_functions(__name__, {"simulate": "simulate"})  # also the name of simulate.py
