"""`scaletrain replay --out RUN` for a PipeDream run (parallel.schedule=pipedream; Narayanan et al., SOSP 2019; Harlap
et al., arXiv 1806.03377): recompute in one process, from the run's version log, what every stage computed, and
compare the losses of its logged steps and its final parameters with the run's (docs/pipeline.md).

Written from the paper and independent of the pipeline executor: one plain model (`build_gpt`, fp64) keeps every
weight version it still needs (version k: the weights after optimizer step k); for minibatch t it evaluates the whole
model with each stage's parameters at the version that stage's forward read (from the log: the last forward of the
minibatch before its backward, so a minibatch dropped at a drain and forwarded again counts once), takes the gradient
of the mean token loss, clips each stage's part by that stage's own norm (as the run's stages do: they never wait for
each other) and lets the run's optimizer apply it to the newest weights at the step's learning rate. Which stage
holds a parameter is what each rank wrote beside its log (`rank<N>.params.json`), so any partition replays.
Activation compression (bf16 / int8) rounds what the backward reads, so the replay encodes its saved activations the
same way (the engine pass's layout-independent settings); the other memory savers change where an activation lives,
not its value. The tests' own loop (tests/pipedream_replay.py)
is a second, separate implementation that checks runs and this module alike.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.config import Config
from scaletrain.errors import CheckpointError, UserError

RTOL, ATOL = 1e-10, 1e-12
"""The replay's bound (fp64): the run and the replay add the same terms in other orders; measured 2e-15."""


@dataclass
class PipeDreamLog:
    """The version log of one data-parallel replica: every forward and backward row, and each parameter's stage."""

    rows: list[dict]
    stage_of: dict[str, int]


def _read_json_lines(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise CheckpointError(f"{path}: line {n} is not JSON") from None
    return rows


def load_log(out: Path, p: int) -> PipeDreamLog:
    """The rows of one replica (the first rank of each stage) and the stage of every parameter."""
    folder = out / "pipedream_versions"
    files = sorted(folder.glob("rank*.jsonl"), key=lambda f: int(f.stem[4:]) if f.stem[4:].isdigit() else -1)
    if not files:
        raise CheckpointError(f"{out}: no PipeDream version log ({folder}/rank<N>.jsonl); did the run finish?")
    rows: dict[int, list[dict]] = {}
    stage_of: dict[str, int] = {}
    for f in files:
        side = f.with_suffix(".params.json")
        if not side.is_file():
            raise CheckpointError(f"{side} is missing: the replay needs each rank's parameter names")
        try:
            meta = json.loads(side.read_text())
        except json.JSONDecodeError:
            raise CheckpointError(f"{side} is not JSON") from None
        stage = int(meta["stage"])
        if stage not in rows:
            rows[stage] = _read_json_lines(f)
            stage_of.update({n: stage for n in meta["params"]})
    if sorted(rows) != list(range(p)):
        raise CheckpointError(f"{folder}: logs of stages {sorted(rows)}, the run has parallel.pp ({p}) stages")
    return PipeDreamLog([r for s in sorted(rows) for r in rows[s]], stage_of)


def forward_versions(rows: list[dict]) -> dict[tuple[int, int], int]:
    """(minibatch, stage) -> the version of the forward whose backward ran."""
    last: dict[tuple[int, int], int] = {}
    used: dict[tuple[int, int], int] = {}
    for r in rows:
        key = (r["minibatch"], r["stage"])
        if r["pass"] == "forward":
            last[key] = r["version"]
        elif key not in last:
            raise CheckpointError(f"version log: the backward of minibatch {key[0]} on stage {key[1]} has no forward")
        else:
            used[key] = last[key]
    return used


def _compressed(model: torch.nn.Module, cfg: Config):
    if cfg.memory.compress == "none":
        return contextlib.nullcontext()
    from scaletrain.memory.compress import ActivationCompressor, int8_block

    comp = ActivationCompressor(cfg.memory.compress, min_numel=0, block=int8_block(cfg.model), leaves=True)
    comp.swap_activations(model)
    comp.hold(model)
    return comp


def replay(cfg: Config, log: PipeDreamLog, steps: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """(loss by step, final parameters) of the first `steps` minibatches recomputed from `log`."""
    from scaletrain.data import BatchLoader, load_corpus
    from scaletrain.model import build_gpt, loss_sum
    from scaletrain.optim import build_optimizer, config_hyper, decay_groups, lr_multiplier
    from scaletrain.parallel.norms import clip_coefficient
    from scaletrain.train.schedule import lr_at

    t = cfg.train
    model = build_gpt(cfg.model, t.seed, "cpu", torch.float64)
    named = dict(model.named_parameters())
    unknown = sorted(set(named) - set(log.stage_of))
    if unknown:
        raise CheckpointError(f"version log: no stage holds {', '.join(unknown[:3])}")
    params = list(named.values())
    opt = build_optimizer(cfg.optim.name, decay_groups(params, cfg.optim.weight_decay), **config_hyper(cfg.optim, t.lr))
    loader = BatchLoader(load_corpus(cfg.data), cfg.model.seq_len, t.global_batch, t.seed, cfg.data.val_fraction,
                         cfg.model.vocab_size)
    used = forward_versions(log.rows)
    versions = {0: {n: q.detach().clone() for n, q in named.items()}}
    losses: dict[int, float] = {}
    for step in range(1, steps + 1):
        at = copy.deepcopy(model)  # the model minibatch `step` saw: each stage at its forward's version
        with torch.no_grad():
            for n, q in at.named_parameters():
                key = (step, log.stage_of[n])
                if key not in used:
                    raise CheckpointError(f"version log: no backward of minibatch {step} on stage {key[1]}")
                q.copy_(versions[used[key]][n])
        x, y = loader.global_batch_at(step)
        with _compressed(at, cfg):
            logits = at(x)
        loss = loss_sum(logits, y) / cfg.tokens_per_step
        loss.backward()
        losses[step] = loss.item()
        grads = {n: g.grad for n, g in at.named_parameters()}
        for stage in set(log.stage_of.values()):  # each stage clipped by its own norm, as the run's stages do
            mine = [n for n in grads if log.stage_of[n] == stage]
            norm = torch.sqrt(sum(grads[n].square().sum() for n in mine))
            coef = clip_coefficient(norm, t.grad_clip) if t.grad_clip > 0 else 1.0
            for n in mine:
                named[n].grad = grads[n] * coef
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t) * lr_multiplier(cfg.optim)
        opt.step()
        versions[step] = {n: q.detach().clone() for n, q in named.items()}
        oldest = min((v for (mb, _), v in used.items() if mb > step), default=step)
        for v in [v for v in versions if v < oldest]:  # no later minibatch reads them
            del versions[v]
    return losses, {n: q.detach().clone() for n, q in named.items()}


def _run_losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        raise CheckpointError(f"{out}: no metrics.jsonl")
    return {int(r["step"]): float(r["loss"]) for r in _read_json_lines(path) if "loss" in r and "step" in r}


def cmd_replay_pipedream(out: Path, cfg: Config, as_json: bool) -> int:
    """Replay the PipeDream run in `out` and compare; exit 0 when every logged loss and final parameter agree."""
    from scaletrain.train.checkpoint import read_meta, read_tensors, usable_latest

    if cfg.train.dtype != "fp64":
        raise UserError(f"{out}: replaying a PipeDream run needs train.dtype=fp64, got {cfg.train.dtype} (the replay "
                        "checks agreement to rtol 1e-10, which only fp64 runs can show)")
    found, _ = usable_latest(out / "checkpoints")
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {out / 'checkpoints'}")
    step = int(read_meta(found)["step"])
    saved = read_tensors(found, "model/", torch.float64)
    log = load_log(out, cfg.parallel.pp)
    t0 = time.perf_counter()
    losses, params = replay(cfg, log, step)
    seconds = time.perf_counter() - t0
    run_losses = {s: v for s, v in _run_losses(out).items() if s <= step}
    loss_diff = max((abs(run_losses[s] - losses[s]) / max(abs(losses[s]), 1e-30) for s in run_losses), default=0.0)
    param_diff = max(float((params[k] - saved[k]).abs().max() / max(float(params[k].abs().max()), 1e-30))
                     for k in saved)
    ok = loss_diff <= RTOL and param_diff <= RTOL + ATOL and set(saved) == set(params)
    rows = log.rows
    summary = {"run": str(out), "schedule": "pipedream", "vertical_sync": cfg.parallel.vertical_sync,
               "pp": cfg.parallel.pp, "step": step, "forwards": sum(r["pass"] == "forward" for r in rows),
               "backwards": sum(r["pass"] == "backward" for r in rows), "losses_compared": len(run_losses),
               "max_rel_loss_diff": loss_diff, "max_rel_param_diff": param_diff, "tolerance": RTOL, "pass": ok,
               "replay_s": seconds}
    if as_json:
        json.dump(summary, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"replayed {step} minibatches of the PipeDream run {out} (pp {cfg.parallel.pp}, vertical sync "
              f"{str(cfg.parallel.vertical_sync).lower()}; {summary['forwards']} forwards, {summary['backwards']} "
              f"backwards logged) in {seconds:.1f} s")
        print(f"largest relative difference: loss {loss_diff:.3g} over {len(run_losses)} logged steps, parameters "
              f"{param_diff:.3g} (tolerance {RTOL:g}): " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1
