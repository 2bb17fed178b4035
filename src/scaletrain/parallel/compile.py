"""`train.compile=true`: each transformer block through `torch.compile` (TorchDynamo + TorchInductor).

Ansel et al., "PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode Transformation and Graph
Compilation" (ASPLOS 2024); the per-block placement and the pass order follow TorchTitan (Liang et al.,
arXiv 2410.06511): tensor parallelism and activation recomputation first, then compile, then data parallelism /
ZeRO. Compiling per block instead of the whole model keeps compile time flat in depth (every block has the same
code and shapes, so all blocks share one compiled graph: parameters are graph inputs, not constants) and leaves the
parallel machinery between blocks in eager mode: ZeRO-3's gather / release hooks run around each block's
`__call__`, outside the compiled region, and pipeline stages call blocks as before.

`apply_compile` replaces each block's `forward` on the instance by its compiled version (after recomputation has
wrapped it, so a checkpointed block compiles the checkpoint too); parameter names, state dicts and hooks are
untouched. Inductor fuses the elementwise work between matmuls (bias, GELU, residual adds, layer norms) on CPU
(C++/OpenMP with the machine's compiler) and GPU (Triton). fp64 runs compile too, which is what the equivalence
test uses.

What it is not made to work with is refused by validate() (`parallel/rules.py`), each with its reason.
"""

from __future__ import annotations

import os
from typing import Any

import torch

BACKEND = "inductor"  # what train.compile uses
BACKEND_ENV = "SCALETRAIN_COMPILE_BACKEND"  # another torch.compile backend, e.g. aot_eager (same capture, no codegen)


def compile_backend() -> str:
    """The torch.compile backend of train.compile: inductor, or the one $SCALETRAIN_COMPILE_BACKEND names (`aot_eager`
    runs the captured graphs as they are: it tells a capture problem from a code-generation one, and the tests use it
    to keep compile time out of their budget)."""
    return os.environ.get(BACKEND_ENV) or BACKEND


def compile_backend_errors() -> list[str]:
    """The backend train.compile would use, when torch.compile does not know it (validate() reports it)."""
    name, known = compile_backend(), torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        return [f"{BACKEND_ENV}={name} is not a torch.compile backend (known: {', '.join(known)})"]
    return []


def apply_compile(engine: Any, backend: str | None = None) -> int:
    """Compile the forward of every transformer block the engine's module holds; returns how many."""
    from scaletrain.memory.recompute import block_runs

    blocks = [b for run in block_runs(engine.module) for b in run]
    for b in blocks:
        b.forward = torch.compile(b.forward, backend=backend or compile_backend())
    return len(blocks)
