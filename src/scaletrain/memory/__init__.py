"""Memory savers: activation recomputation, compression (Gist, Jain et al. 2018), mixed precision, offload, contiguous
arenas and the memory budget.

The names below are loaded on first use (PEP 562), so importing `scaletrain.memory.rules`, the torch-free validation
rules that scaletrain/__init__.py registers, does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.memory.compress import (
        ActivationCompressor,
        CompressionStats,
        KindStats,
        MaskedActivation,
        apply_compress,
        pack_bits,
        unpack_bits,
    )

_EXPORTS = {name: "compress" for name in ("ActivationCompressor", "CompressionStats", "KindStats", "MaskedActivation",
                                          "apply_compress", "pack_bits", "unpack_bits")}
__all__ = ["ActivationCompressor", "CompressionStats", "KindStats", "MaskedActivation", "apply_compress", "pack_bits",
           "unpack_bits"]

__getattr__ = lazy.exports(__name__, _EXPORTS)
