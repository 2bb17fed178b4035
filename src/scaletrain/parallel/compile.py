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

What it is not made to work with is refused by `compile_errors` (validate()), each with its reason.
"""

from __future__ import annotations

import os
from typing import Any

import torch

REFUSED = {  # (condition on the config, reason)
    "zb": (lambda c: c.parallel.pp > 1 and c.parallel.schedule == "zb-h1",
           "the zero-bubble schedule splits each block's backward into an input pass and a weight pass, while a "
           "compiled block has one backward (it would run twice, retaining its graph)"),
    "tp": (lambda c: c.parallel.tp > 1,
           "the tensor-parallel layers' collectives inside each block break its graph, and the pieces recompile per "
           "block until torch.compile falls back to eager; compile is made to work with dp, ZeRO 0-3 and pp"),
    "moe": (lambda c: c.model.moe.experts > 0,
            "mixture-of-experts routing has data-dependent shapes and Python-side statistics"),
    "dropout": (lambda c: c.model.dropout > 0 or c.model.moe.expert_dropout > 0,
                "layout-independent dropout keys its masks by Python values that change every micro-batch "
                "(recompiling the blocks), and torch's compiled dropout draws from another stream than eager"),
    "compress": (lambda c: c.memory.compress != "none",
                 "activation compression packs saved tensors with saved-tensor hooks inside the blocks"),
    "offload_activations": (lambda c: c.memory.offload_activations,
                            "activation offload moves saved tensors with saved-tensor hooks inside the blocks"),
    "partition_checkpoints": (lambda c: c.memory.partition_checkpoints,
                              "partitioned checkpoints gather with saved-tensor hooks inside the blocks"),
    "reversible": (lambda c: c.model.reversible,
                   "reversible blocks recompute their inputs in a custom backward that compile is not proven with"),
    "contiguous": (lambda c: c.memory.contiguous,
                   "the contiguous arenas hand out saved tensors through hooks inside the blocks"),
    "tp_mode": (lambda c: c.parallel.tp_mode != "1d",
                "the 2D / 2.5D / 3D layers' collectives inside each block break its graph"),
}
KEYS = {"zb": "parallel.schedule", "tp": "parallel.tp", "moe": "model.moe.experts", "dropout": "model.dropout",
        "compress": "memory.compress", "offload_activations": "memory.offload_activations",
        "partition_checkpoints": "memory.partition_checkpoints", "reversible": "model.reversible",
        "contiguous": "memory.contiguous", "tp_mode": "parallel.tp_mode"}


def compile_errors(cfg: Any) -> list[str]:
    """One line per setting train.compile=true is refused with."""
    if not cfg.train.compile:
        return []
    errors = []
    name = compile_backend()
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        errors.append(f"{BACKEND_ENV}={name} is not a torch.compile backend "
                      f"(known: {', '.join(torch._dynamo.list_backends(exclude_tags=()))})")
    for key, (applies, why) in REFUSED.items():
        if applies(cfg):
            value = _value(cfg, KEYS[key])
            errors.append(f"train.compile=true with {KEYS[key]}={value} is not available: {why}")
    return errors


def _value(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


BACKEND = "inductor"  # what train.compile uses
BACKEND_ENV = "SCALETRAIN_COMPILE_BACKEND"  # another torch.compile backend, e.g. aot_eager (same capture, no codegen)


def compile_backend() -> str:
    """The torch.compile backend of train.compile: inductor, or the one $SCALETRAIN_COMPILE_BACKEND names (`aot_eager`
    runs the captured graphs as they are: it tells a capture problem from a code-generation one, and the tests use it
    to keep compile time out of their budget)."""
    return os.environ.get(BACKEND_ENV) or BACKEND


def apply_compile(engine: Any, backend: str | None = None) -> int:
    """Compile the forward of every transformer block the engine's module holds; returns how many."""
    from scaletrain.memory.recompute import block_runs

    blocks = [b for run in block_runs(engine.module) for b in run]
    for b in blocks:
        b.forward = torch.compile(b.forward, backend=backend or compile_backend())
    return len(blocks)
