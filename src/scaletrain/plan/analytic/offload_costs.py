"""The cost formulas of ZeRO-Infinity (parallel.offload=nvme): bytes moved, bytes kept, and time, per rank and step.

Rajbhandari et al., "ZeRO-Infinity", arXiv 2104.07857. The engine is `parallel/zero_nvme.py`; these formulas
describe it from the sizes of its units' shards (elements per rank, `shards`) and its element sizes (`e` of the
parameters, `grad_e` of the gradients and moments, fp32 masters when `low`), and are checked against what a run
measures (tests/test_offload_nvme.py): the bytes read and written every step, the resident bytes per category and
the size of the files. `chunk` is the streamed step's `config.sizes.NVME_STEP_CHUNK` (elements of a shard updated at
once). Torch-free: the analytic planner uses them too.
"""

from __future__ import annotations


def io_per_step(shards: list[int], e: int, low: bool, grad_e: int, micro: int, nvme_grads: bool) -> tuple[int, int]:
    """(bytes read, bytes written) per optimizer step by one rank, for units with shards of `shards` elements.

    Reads: every unit's parameter shard twice per micro-batch (gathered for its forward and again for its
    backward), the gradient shard for accumulation after the first micro-batch, and in the step the master,
    both moments and the gradient. Writes: the gradient shard every micro-batch, and in the step the master,
    both moments and (bf16/fp16) the new low-precision parameter shard."""
    S = sum(shards)
    me = 4 if low else e
    grads = grad_e if nvme_grads else 0
    read = 2 * micro * S * e + (micro - 1) * S * grads + S * (me + 2 * grad_e + grads)
    write = micro * S * grads + S * (me + 2 * grad_e + (e if low else 0))
    return read, write


def file_bytes(shards: list[int], e: int, low: bool, grad_e: int, nvme_grads: bool) -> int:
    """Bytes of one rank's shard files."""
    S = sum(shards)
    return S * (e + (4 if low else 0) + 2 * grad_e + (grad_e if nvme_grads else 0))


def resident_bytes(shards: list[int], e: int, low: bool, grad_e: int, depth: int, nvme_grads: bool,
                   chunk: int) -> dict[str, int]:
    """Resident bytes per category between steps (as the engine's `memory_tensors` counts them): parameter staging
    (depth + 1 buffers of the largest shard), gradient staging (nvme_grads; else the gradient shards) and the
    optimizer's depth + 1 staging sets of min(chunk, largest shard) elements. During a step two gathered
    units and transient flat gradients come on top, as in in-memory ZeRO-3 (`working_bytes`)."""
    big = max(shards)
    staged = min(chunk, big)
    me = 4 if low else e
    return {"params": (depth + 1) * big * e,
            "grads": (depth + 1) * big * grad_e if nvme_grads else sum(shards) * grad_e,
            "optim": (depth + 1) * staged * (me + 3 * grad_e + (e if low else 0))}


def working_bytes(units: list[int], e: int, grad_e: int) -> int:
    """Transient bytes of a ZeRO-3 step on top of the resident ones (in memory or nvme): the two largest gathered
    units (current and prefetch) and up to three flat gradients of the largest unit in reduction."""
    big = sorted(units, reverse=True)[:2]
    return sum(big) * e + 3 * max(units) * grad_e


def step_time(shards: list[int], e: int, low: bool, grad_e: int, micro: int, nvme_grads: bool, read_bw: float,
              write_bw: float, compute: float, optimizer: float, chunk: int) -> tuple[float, float]:
    """(exposed I/O of the forward/backward, time of the streamed optimizer step) in seconds.

    One disk serves reads and writes, so their times add. Forward/backward: the parameter reads (2 per unit and
    micro-batch) and the gradient writes / accumulation reads run behind `compute` (read ahead, written behind);
    what exceeds it is exposed, plus the first unit's read, which nothing hides. Step: the state reads and writes
    overlap AdamW's arithmetic (`optimizer`, the in-memory step's time) chunk by chunk: the slower of the two,
    plus one chunk's read to fill the pipeline."""
    S = sum(shards)
    me = 4 if low else e
    g = grad_e if nvme_grads else 0
    fb_io = 2 * micro * S * e / read_bw + micro * S * g / write_bw + (micro - 1) * S * g / read_bw
    exposed = max(0.0, fb_io - compute) + shards[0] * e / read_bw
    state_io = S * (me + 2 * grad_e + g) / read_bw + S * (me + 2 * grad_e + (e if low else 0)) / write_bw
    fill = min(chunk, max(shards)) * (me + 2 * grad_e + g) / read_bw
    return exposed, max(state_io, optimizer) + fill
