"""The compute dtype of train.precision: `autocast-bf16` computes matmuls and attention in bf16 under torch.autocast
(memory/autocast.py applies the region; the attention probe of device/attention.py, below memory/, reads the dtype
here), `dtype` computes in train.dtype."""

from __future__ import annotations

from typing import Any

import torch

AUTOCAST_DTYPES = {"autocast-bf16": torch.bfloat16}  # train.precision -> the dtype autocast computes in


def autocast_dtype(cfg: Any) -> torch.dtype | None:
    """The autocast compute dtype of the run, or None when it computes in train.dtype (fp8 with train.dtype=fp32
    runs autocast-bf16 around its FP8 layers, memory/fp8.py)."""
    if cfg.train.precision == "fp8" and cfg.train.dtype == "fp32":
        return torch.bfloat16
    return AUTOCAST_DTYPES.get(cfg.train.precision)
