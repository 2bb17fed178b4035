"""`scaletrain sample`: generate text from a run's newest checkpoint, whatever layout wrote it.

The checkpoint stores every parameter by name and global shape (docs/checkpoints.md), so the plain GPT is rebuilt
from the checkpoint's own config and its `model/` tensors are read whole, with no process group. Decoding:
temperature-scaled top-k sampling, or greedy (the most likely token) with `--temperature 0`, over the last
`model.seq_len` tokens. A mixture-of-experts model dispatches tokens in groups of `model.moe.group_tokens`
(GShard's local groups), so it is run on the shape it was trained on: a (train.micro_batch, model.seq_len) window
holding the context in its first row, right-padded with token 0 (causal attention keeps the padding out of the
context's logits; as in training, a group's expert capacity is shared by the tokens in it).
"""

from __future__ import annotations

import torch

from scaletrain.errors import UserError


def load_model(directory):
    """(config, plain GPT in fp32 in eval mode) from a checkpoint directory."""
    from scaletrain.config import config_from_dict
    from scaletrain.model import build_gpt
    from scaletrain.train import checkpoint as ckpt

    meta = ckpt.read_meta(directory)
    cfg = config_from_dict(meta["config"])
    model = build_gpt(cfg.model, cfg.train.seed, "cpu", torch.float32)
    state = ckpt.read_tensors(directory, "model/", dtype=torch.float32)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise UserError(f"checkpoint {directory} has no model/{missing[0]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    return cfg, model.eval()


def next_logits(model, ctx: torch.Tensor, cfg) -> torch.Tensor:
    """Logits (1, V) of the token after the context `ctx` (1, T <= seq_len)."""
    if not cfg.model.moe.experts:
        return model(ctx)[:, -1]
    T = ctx.shape[1]
    window = torch.zeros(cfg.train.micro_batch, cfg.model.seq_len, dtype=ctx.dtype)  # (B, T) as in training
    window[0, :T] = ctx[0]
    return model(window)[:1, T - 1]


@torch.no_grad()
def generate(model, idx: torch.Tensor, tokens: int, cfg, temperature: float, top_k: int,
             generator: torch.Generator) -> torch.Tensor:
    """Append `tokens` tokens to `idx` (1, T)."""
    for _ in range(tokens):
        logits = next_logits(model, idx[:, -cfg.model.seq_len:], cfg)
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            top = torch.topk(logits / temperature, min(top_k, logits.shape[-1]))
            nxt = top.indices.gather(-1, torch.multinomial(torch.softmax(top.values, -1), 1, generator=generator))
        idx = torch.cat([idx, nxt], dim=1)
    return idx
