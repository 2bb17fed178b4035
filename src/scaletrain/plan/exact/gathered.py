"""`mem_params_gathered` predicted: the most ZeRO-3 parameter bytes gathered at once during a step of our runs
(parallel/zero.py, measured by parallel/zero_gather.py), from the units the engine builds (Rajbhandari et al., arXiv
1910.02054 Sec. 5.3; FSDP's reshard_after_forward).

Each unit (the root: embeddings, final norm, head; each block; under expert parallelism also each block's experts,
sharded over dp / ep ranks) gathers its padded flat buffer, ceil(numel / n) x n elements over its n ranks.

- Kept gathered (parallel.reshard_after_forward=false; or pp > 1, where a stage gathers once per step): every unit is
  gathered by the end of the forward, so the peak is their sum.
- Resharded after forward: the root is gathered through the forward (and again from the head's backward), a block
  from its forward (or backward) to its end, and the next block in execution order is prefetched, so the peak is the
  root plus the largest two consecutive blocks. Not predicted (None) where the unit hooks run in another order:
  every:k segments (a segment's later blocks are called twice) and expert parallelism (two optimizers' prefetches).
"""

from __future__ import annotations

import math

import torch.nn as nn

from scaletrain.config import Config
from scaletrain.config.parse import parse_recompute
from scaletrain.plan.exact.cp_memory import dp_cp_ranks


def gathered_param_bytes(cfg: Config, stages: list[nn.Module]) -> int | None:
    """The peak over pipeline ranks (`stages`: each rank's module on the meta device), or None where not predicted
    (no ZeRO-3, ZeRO-Infinity's staging buffers, the orders above)."""
    from scaletrain.parallel.zero import group_params

    par = cfg.parallel
    if par.zero != 3 or par.offload == "nvme":
        return None
    keep = not par.reshards_after_forward
    experts = cfg.model.moe.experts > 0 and par.ep > 1
    if not keep and (experts or parse_recompute(cfg.memory.recompute).kind == "every"):
        return None
    n = dp_cp_ranks(par)  # ZeRO shards over dp x cp (context parallelism)
    dp = n * (par.tp_depth if par.tp_mode == "2.5d" else 1)
    peak = 0
    for module in stages:
        params = [p for p in module.parameters() if p.requires_grad]
        parts = [([p for p in params if not getattr(p, "_st_expert", False)], dp),
                 ([p for p in params if getattr(p, "_st_expert", False)], max(1, n // par.ep))]
        units = [math.ceil(sum(p.numel() for p in g) / n) * n * g[0].element_size()
                 for own, n in parts if own for g in group_params(module, 3, par.bucket_mb, params=own)]
        if keep:
            peak = max(peak, sum(units))
        else:
            root, blocks = units[0], units[1:]
            peak = max(peak, root + max((a + b for a, b in zip(blocks, blocks[1:])), default=sum(blocks)))
    return peak
