"""Parallelism on torch.distributed: data parallel (bucketed, overlapped), ZeRO 1-3 with offload, and the
passes that apply tensor and pipeline parallelism to the plain model.

For your own `nn.Module`, two small entry points (`api.py`):

    import scaletrain.parallel as stp
    opt = stp.zero(model, stage=3, lr=3e-4, weight_decay=0.1)      # or stp.data_parallel(model, torch.optim.AdamW(...))

The names are loaded on first use (scaletrain/lazy.py), so importing `scaletrain.parallel.rules` (and the pipeline's
and the asynchronous modes' rules), the torch-free validation rules the package root registers, imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.parallel.api import data_parallel, zero
    from scaletrain.parallel.data_parallel import ReplicatedOptimizer
    from scaletrain.parallel.zero import ZeroOptimizer

__all__ = ["ReplicatedOptimizer", "ZeroOptimizer", "data_parallel", "zero"]
__getattr__ = lazy.exports(__name__, {"ReplicatedOptimizer": "data_parallel", "ZeroOptimizer": "zero"})
lazy.keep_functions(__name__, {"zero": "api", "data_parallel": "api"})  # also the names of zero.py, data_parallel.py
