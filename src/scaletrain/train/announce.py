"""What `scaletrain train` says before its first step: the run in one line, then what it is waiting for.

No paper. Starting a run can take 10-30 s on a CPU (tokenizing the corpus once, importing torch in every
process, building the model), so as soon as the config is valid the launcher prints the layout, the parameter
count (`plan.analytic.params.total_params`, exactly what `model.gpt` builds), the steps and the output folder, notes a
warm-up as long as the run, and then one status line per slow phase.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scaletrain.config import Config


def _say(text: str) -> None:
    print(text, flush=True)


def first_line(cfg: Config, nproc: int, out: Path) -> None:
    """The run in one line (and a note when the warm-up covers the whole run)."""
    from scaletrain.plan.analytic.params import total_params
    from scaletrain.plan.catalog import from_model_config

    p, t = cfg.parallel, cfg.train
    layout = f"dp={p.dp} tp={p.tp} pp={p.pp} zero={p.zero}" + (f" ep={p.ep}" if cfg.model.moe.experts else "")
    layout += f" cp={p.cp} ({p.cp_mode})" if p.cp > 1 else ""
    resuming = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    _say(f"scaletrain train: {total_params(from_model_config(cfg.model)):,} parameters, {layout} on {nproc} "
         f"process{'es' if nproc > 1 else ''}, {t.steps} steps of {cfg.tokens_per_step:,} tokens, {t.dtype} "
         f"-> {out}{' (resuming)' if resuming else ''}")
    if t.warmup_steps >= t.steps:
        from scaletrain.train.schedule import lr_at

        _say(f"note: train.warmup_steps ({t.warmup_steps}) >= train.steps ({t.steps}): the learning rate only rises, "
             f"to {lr_at(t.steps, t):g} at the last step (train.lr is {t.lr:g}); set train.warmup_steps lower for "
             "a short run")


def status(text: str) -> None:
    """One line saying what the run is doing now (before the progress bar or the first metrics)."""
    _say(f"  {text} ...")
    sys.stdout.flush()


def resharded(found: Path, old: str, new: str) -> None:
    """What `--reshard` did, in one line: `resharded step_00000002 from dp=1 tp=1 pp=1 micro_batch=2 (1 process) to
    dp=1 tp=1 pp=1 micro_batch=1 (1 process): 65 tensors, 291,497 bytes read` (the checkpoint's tensors and stored
    bytes)."""
    from scaletrain.train import ckpt_index

    tensors = ckpt_index.read_index(found)["tensors"]
    stored = sum(int(c["length"]) for t in tensors.values() for c in t["chunks"])
    _say(f"resharded {found.name} from {old} to {new}: {len(tensors):,} tensors, {stored:,} bytes read")


def initialised(directory: Path, family: str, weights: dict) -> None:
    """What `--init-from` did, in one line: `initialised from DIR (gpt2 weights): 7,664 parameters in 16 tensors`."""
    n = sum(int(t.numel()) for t in weights.values())
    _say(f"initialised from {directory} ({family} weights): {n:,} parameters in {len(weights):,} tensors")
