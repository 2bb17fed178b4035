"""The bytes of PipeDream's stashed weight versions (Harlap et al., arXiv 1806.03377, section 3.3) per rank: what
`scaletrain train` logs as `mem_stash` (the frozen copies `parallel/pipeline/stash.WeightStash` holds besides the live
weights, at their peak), exact: `stash_copies(p, r, vertical_sync)` copies of stage r's parameters, the most loaded
stage's (docs/pipeline.md, "Memory")."""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.parallel.pipeline.pipedream import stash_copies


def stash_bytes(cfg: Config, per_stage: list[dict[str, int]]) -> dict[str, int]:
    """{"plan_mem_stash": bytes} for a PipeDream run (per_stage: `run_memory.model_state_bytes_per_stage`), else {}."""
    p = cfg.parallel.pp
    if cfg.parallel.schedule != "pipedream" or p == 1:
        return {}
    copies = [stash_copies(p, r, cfg.parallel.vertical_sync) * per_stage[r]["params"] for r in range(p)]
    return {"plan_mem_stash": int(max(copies))}
