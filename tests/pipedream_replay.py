"""PipeDream's replay (arXiv 1806.03377): recompute in one process what every stage computed, from the version log.

Written independently of the pipeline executor: a plain fp64 loop over the minibatches that keeps every stage's
weight versions (version k: the weights after optimizer step k) and, for minibatch t, evaluates the whole model
with each stage's parameters at the version the log says that stage's forward read, takes the gradient, clips it
by its global norm and lets AdamW apply it to the newest weights. Which parameter belongs to which stage follows
from the names and the uniform partition (blocks [s L/p, (s+1) L/p) on stage s, the embeddings on the first and
the head on the last).
"""

from __future__ import annotations

import copy

import torch
from harness import make_config


def stage_of(name: str, n_layers: int, p: int) -> int:
    if name.startswith("blocks."):
        return int(name.split(".")[1]) // (n_layers // p)
    return 0 if name.startswith(("wte", "wpe")) else p - 1


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


def replay(overrides: dict, rows: list[dict], p: int) -> tuple[dict, dict]:
    """(losses by step, final parameters) recomputed from the version log rows of all stages."""
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.model import build_gpt, loss_sum
    from scaletrain.train.schedule import lr_at

    cfg = make_config({k: v for k, v in overrides.items() if not k.startswith(("parallel.", "_"))})
    t, o = cfg.train, cfg.optim
    model = build_gpt(cfg.model, t.seed, "cpu", torch.float64)
    named = dict(model.named_parameters())
    params = list(named.values())
    opt = torch.optim.AdamW([{"params": [q for q in params if q.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), cfg.model.seq_len, t.global_batch,
                         t.seed, cfg.data.val_fraction, cfg.model.vocab_size)
    versions = {0: {n: q.detach().clone() for n, q in named.items()}}
    used = forward_versions(rows)
    losses = {}
    for step in range(1, t.steps + 1):
        at = copy.deepcopy(model)
        with torch.no_grad():
            for n, q in at.named_parameters():
                q.copy_(versions[used[(step, stage_of(n, cfg.model.n_layers, p))]][n])
        x, y = loader.global_batch_at(step)
        loss = loss_sum(at(x), y) / cfg.tokens_per_step
        loss.backward()
        losses[step] = loss.item()
        for q, g in zip(named.values(), at.parameters()):
            q.grad = g.grad.clone()
        norm = torch.sqrt(sum(q.grad.square().sum() for q in params)).item()
        if t.grad_clip > 0 and t.grad_clip / (norm + 1e-6) < 1:
            for q in params:
                q.grad.mul_(t.grad_clip / (norm + 1e-6))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        versions[step] = {n: q.detach().clone() for n, q in named.items()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
