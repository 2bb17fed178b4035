"""Test-only fault injection: plausible bugs a mixed-precision or parallel layout could have.

A proof that "layout X computes what one process computes" is only worth its tolerance: each fault below is
injected on the parallel side of a comparison, and the comparison must then fail. Nothing here ships in
scaletrain; it patches a `Trainer` (or its config overrides) inside a test's own processes.

- `grad_clip x10`     the clip threshold ten times too large (a wrong unit, a forgotten world-size factor)
- `weight_decay 0`    decoupled weight decay silently off (a parameter-group bug)
- `lr x1.1`           the learning rate 10% off (a schedule off by a step, a wrong multiplier)
- `drop a micro-batch` one micro-batch's gradient lost at step 2 on data-parallel rank 0 (a bucket reduced
                      before the last micro-batch, an accumulation hook that fires once too often); its loss is
                      still counted, only its gradient is missing
- `skip unscale`      the fp16 loss scale never divided out of the gradients (the overflow check still runs)
"""

from __future__ import annotations

CONFIG_FAULTS = {
    "grad_clip x10": lambda o: {**o, "train.grad_clip": 10 * o["train.grad_clip"]},
    "weight_decay 0": lambda o: {**o, "optim.weight_decay": 0.0},
    "lr x1.1": lambda o: {**o, "train.lr": 1.1 * o["train.lr"]},
}
RUNTIME_FAULTS = ("drop a micro-batch", "skip unscale")
FAULTS = (*CONFIG_FAULTS, *RUNTIME_FAULTS)


def faulty_overrides(overrides: dict, fault: str | None) -> dict:
    """The config overrides with a config-level fault applied (unchanged for runtime faults and None)."""
    return CONFIG_FAULTS[fault](overrides) if fault in CONFIG_FAULTS else overrides


def inject(trainer, fault: str | None) -> None:
    """Patch a built trainer with a runtime fault (no-op for config-level faults and None)."""
    if fault == "drop a micro-batch":
        loss_fn, seen = trainer.engine.loss_fn, {"calls": 0}

        def dropping(logits, targets):
            loss = loss_fn(logits, targets)
            if trainer.step == 2 and trainer.dp_rank == 0:
                seen["calls"] += 1
                if seen["calls"] == 1:  # the first micro-batch of step 2: value kept, gradient lost
                    return loss.detach() + 0 * loss
            return loss

        trainer.engine.loss_fn = dropping
    elif fault == "skip unscale":
        opt = trainer.engine.optimizer
        unscale = opt.unscale_
        opt.unscale_ = lambda inv_scale: unscale(1.0)  # still checks for inf/NaN, never divides
    elif fault is not None and fault not in CONFIG_FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
