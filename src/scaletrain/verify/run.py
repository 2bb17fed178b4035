"""Prove that a parallel layout computes what the single-process run computes.

Runs the given config twice on the same model, data and seed — once as one process, once on the layout's
N local processes — in fp64 by default, and compares the loss of every step and every final parameter
(gathered from its shards). Prints the largest differences and PASS/FAIL against the tolerance; exit 1
on FAIL. The parallel run is started through the same launcher as `scaletrain train`; run under torchrun
(or srun) the parallel side is the whole job, on every node (`verify/spanning.py`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from scaletrain.config import Config, load_config, validate
from scaletrain.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: `scaletrain --help` must not pay for it
    import torch

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=64", "train.steps=4",
         "train.eval_every=0", "train.warmup_steps=2", "train.checkpoint_every=0"]


def run(cfg: Config, env=None) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    from scaletrain.train.runner import make_trainer

    t = make_trainer(cfg, None, env)  # the Trainer, or an asynchronous mode's runner (parallel.sync)
    return t.run().losses, t.full_state()


def layout_words(cfg: Config) -> str:
    """The layout as verify's header names it, e.g. 'dp=2 tp=2 pp=1 zero=1 tp_mode=2.5d tp_depth=2'."""
    p = cfg.parallel
    words = f"dp={p.dp} tp={p.tp} pp={p.pp} zero={p.zero}"
    if p.tp_mode != "1d":  # 2d / 2.5d / 3d tensor parallelism (docs/tensor_parallel.md)
        words += f" tp_mode={p.tp_mode}" + (f" tp_depth={p.tp_depth}" if p.tp_mode == "2.5d" else "")
    if p.cp > 1:  # context parallelism (docs/context_parallel.md)
        words += f" cp={p.cp} cp_mode={p.cp_mode}"
    return words


def reference_config(cfg: Config) -> Config:
    """The single-process run of `cfg`'s model, data, recipe and seed (refusing what cannot match it)."""
    m = cfg.model
    if cfg.world_size > 1 and m.dropout_impl == "torch" and (m.dropout > 0 or m.moe.expert_dropout > 0):
        raise UserError("model.dropout_impl=torch draws dropout masks from per-rank random streams, so a parallel "
                        "layout drops other elements than one process and cannot match it; use "
                        "model.dropout_impl=global (the default) to verify a layout with dropout")
    ref_cfg = load_config(None, [])
    ref_cfg.model, ref_cfg.train, ref_cfg.optim, ref_cfg.data, ref_cfg.memory = (
        cfg.model, cfg.train, cfg.optim, cfg.data, cfg.memory)
    return validate(ref_cfg, 1)


def report(ref_losses, ref_state, losses, state, rtol: float, atol: float) -> int:
    import torch

    ok = True
    print(f"{'step':>5} {'single-process':>18} {'parallel':>18} {'|diff|':>10}")
    for step in sorted(ref_losses):
        diff = abs(losses[step] - ref_losses[step])
        ok &= diff <= atol + rtol * abs(ref_losses[step])
        print(f"{step:>5} {ref_losses[step]:>18.12f} {losses[step]:>18.12f} {diff:>10.2e}")
    big_name, big = "", 0.0
    for name, ref in ref_state.items():
        got = state[name].to(ref.dtype)
        diff = float((got - ref).abs().max()) if ref.numel() else 0.0
        if diff > big or not big_name:
            big_name, big = name, diff
        ok &= bool(torch.allclose(got, ref, rtol=rtol, atol=atol))
    print(f"parameters: {len(ref_state)} tensors, largest parameter difference {big:.2e} ({big_name or '-'}); "
          "each must be within atol + rtol x |single-process value|")
    print(f"{'PASS' if ok else 'FAIL'} (rtol {rtol:g}, atol {atol:g})")
    sys.stdout.flush()
    return 0 if ok else 1
