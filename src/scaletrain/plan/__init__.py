"""scaletrain.plan: predict memory, time and communication of parallel layouts before any process starts.

Two halves. `analytic/` is the cost model of any layout on any cluster, without torch, split by
term: `inputs` (layout, training, assumptions), `params`, `flops`, `memory` (bytes
per category), `comm` (links and collective times), `zero3`, `pipeline` (schedules in closed form), `step_time`
(step time, MFU, bytes per dimension), `tp_nd` (2D / 2.5D / 3D tensor parallelism), `offload_costs`
(ZeRO-Infinity), `estimate` (the entry: `estimate(model, gpu, training, layout)`), `async_costs` (synchronisation
of the asynchronous algorithms). `exact/` predicts our own runs on the meta device and this machine, importing
the analytic half (never the reverse): `run_memory` (exact bytes per category, `predict_run`), `tp_nd_memory`,
`probe` (what `--calibrate` measures), `run_time` (the step composed from it), `run_comm` (collectives timed in
place), `run_calibrate` (the profile in the run's processes).

Beside them: `hardware` (GPU catalog, cluster files), `catalog` (model dimensions), `calibrate` (measure this
machine), `search` (enumerate and rank layouts), `report` (table, explanation, JSON, PNG), `budget` (the memory
budget before launch, from `predict_run`); the command is `scaletrain.commands.plan`. The trainer uses
`predict_run(cfg)` to log `plan_mem_*` next to its measurements.
"""

from __future__ import annotations

from scaletrain import lazy

_EXPORTS = {"predict_run": "exact.run_memory"}  # loaded on first use: `scaletrain plan` starts without torch

__all__ = sorted(_EXPORTS)
__getattr__ = lazy.exports(__name__, _EXPORTS)
