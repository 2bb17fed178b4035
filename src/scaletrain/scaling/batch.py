"""`scaletrain batch-size --max`: the largest micro-batch that fits a memory limit, by real training steps.

Each trial builds the configured model in one process with `train.micro_batch = train.global_batch = b`
and runs one real optimizer step (forward, backward, clip, AdamW) with the project's trainer. What the
trial needs is measured, not predicted:

- on CUDA, the allocator's peak `torch.cuda.max_memory_allocated` over building and stepping (its
  statistics reset before each trial); an out-of-memory error means "does not fit". The limit is the
  device's total memory unless `--memory-limit` is given.
- on CPU, which has no allocator statistics worth trusting, the project's accounting
  (`scaletrain.device.accounting`): the bytes of the distinct storages of parameters, gradients and
  optimizer state after the step (`tensor_bytes`), plus the bytes autograd saved for backward during the
  forward (`SavedTensorCounter`). Temporaries that live only inside one operation (e.g. the gradient of
  the logits) are not in it, so it is a lower bound of the true peak. `--memory-limit` is required.

The search doubles b from 1 until a trial does not fit (or reaches `--cap`), then bisects between the
last size that fitted and the first that did not, so it finds the exact largest b in about
2·log2(b) trials, assuming memory grows with b (it does: activations are linear in b).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from scaletrain.errors import UserError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """`2GiB`, `512 MiB`, `1.5GB`, `2e9` or `2G` (= GiB) as bytes; UserError naming the bad value.

    KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; kB/MB/GB/TB powers of 1000.
    """
    m = re.fullmatch(r"\s*([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise UserError(f"--memory-limit must be a size such as 2GiB, 512MiB, 1.5GB or 2e9, got {text!r}")
    try:
        value = float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise UserError(f"--memory-limit must be a size such as 2GiB, 512MiB, 1.5GB or 2e9, got {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise UserError(f"--memory-limit must be positive, got {text!r}")
    return int(value)


@dataclass
class Trial:
    micro_batch: int
    bytes: int | None
    """Measured bytes (CPU: accounted total; CUDA: peak allocated); None after an out-of-memory error."""
    fits: bool
    parts: dict[str, int] = field(default_factory=dict)
    """CPU: params, grads, optim, activations."""


@dataclass
class MaxBatch:
    device: str
    method: str
    memory_limit: int
    max_micro_batch: int
    cap_reached: bool
    trials: list[Trial]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"device": self.device, "method": self.method, "memory_limit": self.memory_limit,
                "max_micro_batch": self.max_micro_batch, "cap_reached": self.cap_reached,
                "trials": [asdict(t) for t in self.trials], "notes": self.notes}


def search_max(measure: Callable[[int], Trial], cap: int) -> tuple[int, bool, list[Trial]]:
    """Largest b in [1, cap] with measure(b).fits, by doubling then bisection (memory grows with b).

    Returns (b, cap_reached, trials in the order run); b = 0 if even 1 does not fit.
    """
    trials: list[Trial] = []

    def fits(b: int) -> bool:
        trials.append(measure(b))
        return trials[-1].fits

    lo, hi = 0, None  # lo fits (0: nothing yet); hi does not
    b = 1
    while b <= cap:
        if not fits(b):
            hi = b
            break
        lo = b
        b *= 2
    if hi is None:
        if lo == cap:
            return lo, True, trials
        hi = cap + 1  # everything up to the last doubling fitted; bisect up to the cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, lo == cap, trials


def trial_config(cfg, micro_batch: int):
    """The config of one trial: one process, one micro-batch of `micro_batch` per step, one step."""
    import copy

    from scaletrain.config import ParallelConfig, validate

    c = copy.deepcopy(cfg)
    p, t = c.parallel, c.train
    c.parallel = ParallelConfig(zero=p.zero, offload=p.offload, bucket_mb=p.bucket_mb)  # memory passes stay
    t.micro_batch = t.global_batch = micro_batch
    t.steps, t.eval_every, t.log_noise_scale = 1, 0, False
    return validate(c, 1)


def single_process_notes(cfg) -> list[str]:
    p = cfg.parallel
    if (p.dp, p.tp, p.pp, p.ep) == (1, 1, 1, 1):
        return []
    return [f"measured in one process holding the whole model: parallel.dp ({p.dp}), tp ({p.tp}), pp ({p.pp}) "
            f"and ep ({p.ep}) set to 1"]


def measure_cpu(cfg, micro_batch: int, limit: int) -> Trial:
    """One real step; bytes = parameters + gradients + optimizer state + saved activations (accounting)."""
    from scaletrain.device.accounting import tensor_bytes
    from scaletrain.train.trainer import Trainer

    trainer = Trainer(trial_config(cfg, micro_batch))
    trainer.train_step(1)
    held = trainer.engine.optimizer.memory_tensors()
    parts = {"params": tensor_bytes(held["params"]), "grads": tensor_bytes(held["grads"]),
             "optim": tensor_bytes(held["optim"]), "activations": int(trainer.engine.activation_bytes)}
    del trainer
    gc.collect()
    total = sum(parts.values())
    return Trial(micro_batch, total, total <= limit, parts)


def measure_cuda(cfg, micro_batch: int, limit: int) -> Trial:
    """One real step; bytes = torch.cuda.max_memory_allocated since a reset; OOM = does not fit."""
    import torch

    from scaletrain.train.trainer import Trainer

    c = trial_config(cfg, micro_batch)
    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    trainer = None
    try:
        trainer = Trainer(c)
        trainer.train_step(1)
        torch.cuda.synchronize(device)
        peak: int | None = int(torch.cuda.max_memory_allocated(device))
    except torch.cuda.OutOfMemoryError:
        peak = None
    finally:
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    return Trial(micro_batch, peak, peak is not None and peak <= limit)


def find_max_micro_batch(cfg, memory_limit: int | None = None, cap: int = 16384) -> MaxBatch:
    """The largest train.micro_batch of `cfg`'s model that fits `memory_limit` bytes (see the module doc)."""
    from scaletrain.distributed.process_group import pick_device

    if cap < 1:
        raise UserError(f"--cap must be >= 1, got {cap}")
    device = pick_device(cfg.train.device, 0)
    if device.type == "cuda":
        import torch

        total = int(torch.cuda.get_device_properties(device).total_memory)
        limit = memory_limit if memory_limit is not None else total
        method, measure = "cuda max_memory_allocated", measure_cuda
    else:
        if memory_limit is None:
            raise UserError("on CPU give --memory-limit (e.g. 2GiB): there is no device memory to fill")
        limit, method, measure = memory_limit, "accounting: params + grads + optimizer state + saved activations", \
            measure_cpu
    trial_config(cfg, 1)  # a config that cannot run fails here, once, with validate()'s message
    best, cap_reached, trials = search_max(lambda b: measure(cfg, b, limit), cap)
    if best == 0:
        need = trials[0].bytes
        what = "runs out of memory" if need is None else f"needs {need:,} bytes"
        raise UserError(f"micro_batch 1 {what}, more than the memory limit of {limit:,} bytes")
    return MaxBatch(device.type, method, limit, best, cap_reached, trials, single_process_notes(cfg))


def _mib(n: int | None) -> str:
    return "OOM" if n is None else f"{n / 2**20:,.1f}"


def print_result(r: MaxBatch) -> None:
    print(f"device {r.device}; memory limit {r.memory_limit:,} bytes ({_mib(r.memory_limit)} MiB); method: {r.method}")
    for note in r.notes:
        print(f"note: {note}")
    cpu = r.device == "cpu"
    head = ["micro_batch"] + (["params", "grads", "optim", "activations"] if cpu else []) + \
        ["total MiB" if cpu else "peak MiB", "fits"]
    rows = []
    for t in sorted(r.trials, key=lambda t: t.micro_batch):
        rows.append([str(t.micro_batch)] + ([_mib(t.parts[k]) for k in ("params", "grads", "optim", "activations")]
                                            if cpu else []) + [_mib(t.bytes), "yes" if t.fits else "no"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    cap = " (the --cap; larger sizes were not tried)" if r.cap_reached else ""
    print(f"largest micro_batch that fits: {r.max_micro_batch}{cap}  ({len(r.trials)} trials)")


def run(args: argparse.Namespace) -> int:
    if not args.max:
        raise UserError("batch-size needs --max (find the largest micro-batch that fits a memory limit)")
    limit = parse_bytes(args.memory_limit) if args.memory_limit is not None else None
    from scaletrain.config import load_config

    cfg = load_config(args.config, args.set)
    result = find_max_micro_batch(cfg, limit, args.cap)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print_result(result)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "batch-size", help="the largest micro-batch that fits a memory limit (real forward/backward passes)",
        description=__doc__.splitlines()[0])
    p.add_argument("--max", action="store_true", help="find the largest train.micro_batch that fits")
    p.add_argument("--config", metavar="FILE", help="training config YAML (default: the built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--memory-limit", metavar="BYTES",
                   help="e.g. 2GiB, 512MiB, 1.5GB, 2e9 (required on CPU; default on CUDA: the device's memory)")
    p.add_argument("--cap", type=int, default=16384, metavar="N", help="largest micro-batch to try (default 16384)")
    p.add_argument("--json", action="store_true", help="print the result and every trial as JSON")
    p.set_defaults(func=run)
