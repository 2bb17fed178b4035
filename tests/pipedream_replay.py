"""PipeDream's replay (arXiv 1806.03377): recompute in one process what every stage computed, from the version log.

Written independently of the pipeline executor: a plain fp64 loop over the minibatches that keeps every stage's
weight versions (version k: the weights after optimizer step k) and, for minibatch t, evaluates the whole model
with each stage's parameters at the version the log says that stage's forward read, takes the gradient, clips each
stage's part by that stage's own norm (PipeDream's stages do not wait for each other, docs/pipeline.md) and lets
AdamW apply it to the newest weights. Which parameter belongs to which stage follows
from the names and the uniform partition (blocks [s L/p, (s+1) L/p) on stage s, the embeddings on the first and
the head on the last).

Memory savers: recomputation, activation offload and contiguous buffers change where a saved activation lives or
when it is rebuilt, never its value, so the replay runs without them: a run with them must equal it. Activation
compression rounds what the backward reads (Gist, lossy for bf16 / int8), so the replay encodes the saved
activations of its one model the same way (`memory.compressor`, the layout-independent settings of the engine's
pass: every float activation, one int8 scale per `int8_block` entries), which is what the minibatch's backward
reads in one process.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import torch
from harness import clip_and_step, plain_setup


def stage_of(name: str, n_layers: int, p: int) -> int:
    if name.startswith("blocks."):
        return int(name.split(".")[1]) // (n_layers // p)
    return 0 if name.startswith(("wte", "wpe")) else p - 1


def clip_per_stage(named: dict, grad_clip: float, n_layers: int, p: int) -> None:
    """Scale each stage's gradients by min(1, grad_clip / (its own norm + 1e-6)) (no-op for grad_clip 0)."""
    stages: dict[int, list] = {}
    for n, q in named.items():
        stages.setdefault(stage_of(n, n_layers, p), []).append(q)
    for qs in stages.values():
        norm = torch.sqrt(sum(q.grad.square().sum() for q in qs)).item()
        if grad_clip > 0 and grad_clip / (norm + 1e-6) < 1:
            for q in qs:
                q.grad.mul_(grad_clip / (norm + 1e-6))


def forward_versions(rows: list[dict]) -> dict[tuple[int, int], int]:
    """(minibatch, stage) -> the version of the forward whose backward ran (a minibatch dropped at a drain is
    forwarded again: the last forward before the backward counts)."""
    last: dict[tuple[int, int], int] = {}
    used: dict[tuple[int, int], int] = {}
    for r in rows:
        key = (r["minibatch"], r["stage"])
        if r["pass"] == "forward":
            last[key] = r["version"]
        else:
            used[key] = last[key]
    return used


def _compressed(model, cfg):
    """The saved activations of `model`'s forward encoded as memory.compress says (a no-op context for none)."""
    if cfg.memory.compress == "none":
        return contextlib.nullcontext()
    from scaletrain.memory.compress import ActivationCompressor, int8_block

    comp = ActivationCompressor(cfg.memory.compress, min_numel=0, block=int8_block(cfg.model), leaves=True)
    comp.swap_activations(model)
    comp.hold(model)
    return comp


def replay(overrides: dict, rows: list[dict], p: int, norms: dict | None = None) -> tuple[dict, dict]:
    """(losses by step, final parameters) recomputed from the version log rows of all stages; `norms` (when given)
    gets each step's whole-gradient norm before clipping."""
    from scaletrain.model import loss_sum

    cfg, model, opt, loader = plain_setup(overrides)
    named = dict(model.named_parameters())
    params = list(named.values())
    versions = {0: {n: q.detach().clone() for n, q in named.items()}}
    used = forward_versions(rows)
    losses = {}
    for step in range(1, cfg.train.steps + 1):
        at = copy.deepcopy(model)
        with torch.no_grad():
            for n, q in at.named_parameters():
                q.copy_(versions[used[(step, stage_of(n, cfg.model.n_layers, p))]][n])
        x, y = loader.global_batch_at(step)
        with _compressed(at, cfg):
            logits = at(x)
        loss = loss_sum(logits, y) / cfg.tokens_per_step
        loss.backward()
        losses[step] = loss.item()
        for q, g in zip(named.values(), at.parameters()):
            q.grad = g.grad.clone()
        if norms is not None:
            norms[step] = torch.sqrt(sum(q.grad.square().sum() for q in params)).item()
        clip_per_stage(named, cfg.train.grad_clip, cfg.model.n_layers, p)
        clip_and_step(params, opt, step, replace(cfg.train, grad_clip=0.0))  # lr of the step, AdamW
        versions[step] = {n: q.detach().clone() for n, q in named.items()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
