"""Independent references for the single-process trainer, written from the papers (and torch's own optimizers), not
from scaletrain's optimizer, MoE, precision or trainer modules: tests/test_references.py checks that the trainer
computes what they compute, so the layout matrix, which compares every layout with that trainer, inherits the trust.

What is shared with scaletrain is only what is not under test: the plain GPT's forward (compared with Hugging Face
in tests/test_hf_interop.py), the data loader (a pure function of the step) and the initialisation. Everything the
trainer adds is written here again: the loop (micro-batches, the loss normalised by the tokens of the global batch,
clipping by torch's `clip_grad_norm_`, the learning-rate schedule), and

- SM3-II (Anil et al., arXiv 1901.11150, the cover of each dimension's slices, with the authors' momentum and
  decoupled weight decay);
- Adafactor (Shazeer & Stern, arXiv 1804.04235, Algorithms 4 and 5 with the paper's row and column *sums*, the
  relative step and parameter scaling, update clipping, Tensor2Tensor's optional first moment, decoupled weight
  decay), where torch.optim.Adafactor does not implement it (a first moment, a constant step size);
- a mixture-of-experts layer as loops over groups and tokens: noisy top-k gating's top-k and GShard capacity
  (Shazeer et al. arXiv 1701.06538, Lepikhin et al. arXiv 2006.16668: first choices before second, in token order),
  Switch's top-1 with its unnormalised gate and load-balancing loss n Σ f_i P_i (Fedus et al. arXiv 2101.03961),
  ST-MoE's router z-loss (Zoph et al. arXiv 2202.08906), expert choice (Zhou et al. arXiv 2202.09368);
- mixed precision (Micikevicius et al., arXiv 1710.03740): a bf16/fp16 model, fp32 master weights and gradient
  accumulators, the loss scaled before backward and the gradients unscaled after, a step skipped when a gradient
  is not finite, the dynamic scale backed off after `hysteresis` overflows and doubled after `window` clean steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------- the loop


def lr_at_step(step: int, t) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay from lr to min_lr at the last step (SGDR without
    restarts, Loshchilov & Hutter arXiv 1608.03983), or constant."""
    if step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0))) / 2


def decay_split(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings, none on vectors (biases, norm gains)."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def plain_loop(cfg, make_optimizer, lr_scale: float = 1.0, moe_kind: str | None = None) -> tuple[dict, dict]:
    """Train `cfg`'s model on `cfg`'s data for train.steps steps with `make_optimizer(param_groups)` in fp64:
    (losses by step, final parameters by name). `moe_kind`: replace every MoE layer with `LoopMoE`."""
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.model import build_gpt

    t, m = cfg.train, cfg.model
    model = build_gpt(m, t.seed, "cpu", torch.float64)
    loops = swap_moe(model, m.moe) if moe_kind else []
    params = list(model.parameters())
    opt = make_optimizer(decay_split(params, cfg.optim.weight_decay))
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), m.seq_len, t.global_batch, t.seed,
                         cfg.data.val_fraction, m.vocab_size)
    tokens = t.global_batch * m.seq_len
    losses = {}
    for step in range(1, t.steps + 1):
        x, y = loader.global_batch_at(step)
        total = 0.0
        for xm, ym in zip(x.split(t.micro_batch), y.split(t.micro_batch)):
            loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten(), reduction="sum") / tokens
            for layer in loops:  # the auxiliary losses of this micro-batch's groups and tokens (means over the step)
                aux, z = layer.last
                groups = tokens // m.moe.group_tokens
                loss = loss + m.moe.aux_loss_weight * aux / groups + m.moe.z_loss_weight * z / tokens
            loss.backward()
            total += loss.item()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at_step(step, t) * lr_scale
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = total
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- SM3-II


class PaperSM3(torch.optim.Optimizer):
    """SM3-II with the cover {slices of each dimension}: per step ν(i) = min over the sets holding i of μ(r) + g(i)²,
    μ(r) = max of ν over set r, w -= lr g / √ν (0 where ν = 0); momentum m = β m + (1 - β) g/√ν as in the authors'
    code; decoupled weight decay w *= 1 - lr λ."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is None:
                    continue
                g, st = w.grad, self.state[w]
                dims = max(w.dim(), 1)
                if not st:
                    st["mu"] = [torch.zeros(w.shape[d] if w.dim() else 1, dtype=w.dtype) for d in range(dims)]
                    st["m"] = torch.zeros_like(w)
                views = [mu.view([-1 if i == d else 1 for i in range(w.dim())]) if w.dim() else mu.view(())
                         for d, mu in enumerate(st["mu"])]
                low = views[0]
                for v in views[1:]:
                    low = torch.minimum(low, v)
                nu = low + g * g
                for d in range(dims):
                    others = [i for i in range(w.dim()) if i != d]
                    st["mu"][d] = (nu.amax(dim=others) if others else nu).reshape(-1).clone()
                u = torch.where(nu > 0, g / nu.sqrt(), torch.zeros_like(g))
                if group["momentum"] > 0:
                    st["m"] = group["momentum"] * st["m"] + (1 - group["momentum"]) * u
                    u = st["m"]
                w.mul_(1 - group["lr"] * group["weight_decay"])
                w.sub_(group["lr"] * u)


# ----------------------------------------------------------------------------- Adafactor


class PaperAdafactor(torch.optim.Optimizer):
    """Adafactor, Algorithms 4 (≥ 2-D: every trailing n x m matrix) and 5 (vectors) with sums: R_t = β̂ R + (1 - β̂)
    (G² + ε1) 1_m, C_t likewise over rows, V̂ = R C / (1ᵀ R); β̂2t = 1 - t^-decay; U = G / √V̂, clipped to RMS d; the
    step α Û with α = max(ε2, RMS(X)) ρ, ρ = min(lr, 1/√t) (relative) or α = lr; first moment (T2T) M = β1 M + (1 -
    β1) α Û; decoupled decay X *= 1 - lr λ (α from X before the decay)."""

    def __init__(self, params, lr: float, relative: bool, decay: float, d: float, beta1: float | None,
                 weight_decay: float = 0.0, eps1: float = 1e-30, eps2: float = 1e-3):
        super().__init__(params, {"lr": lr, "relative": relative, "decay": decay, "d": d, "beta1": beta1,
                                  "weight_decay": weight_decay, "eps1": eps1, "eps2": eps2})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for X in group["params"]:
                G, st = X.grad, self.state[X]
                st["t"] = t = st.get("t", 0) + 1
                b2 = 1 - t ** (-group["decay"])
                G2 = G * G + group["eps1"]
                if X.dim() >= 2:
                    n, m = X.shape[-2:]
                    rows, cols = G2.sum(-1), G2.sum(-2)  # (G² + ε1) 1_m and 1_nᵀ (G² + ε1)
                    st["R"] = rows if t == 1 else b2 * st["R"] + (1 - b2) * rows
                    st["C"] = cols if t == 1 else b2 * st["C"] + (1 - b2) * cols
                    V = st["R"].unsqueeze(-1) * st["C"].unsqueeze(-2) / st["R"].sum(-1)[..., None, None]
                else:
                    st["V"] = G2 if t == 1 else b2 * st["V"] + (1 - b2) * G2
                    V = st["V"]
                U = G / V.sqrt()
                U = U / max(1.0, (U.square().mean().sqrt() / group["d"]).item())
                if group["relative"]:
                    alpha = max(group["eps2"], X.square().mean().sqrt().item()) * min(group["lr"], 1 / math.sqrt(t))
                else:
                    alpha = group["lr"]
                step = alpha * U
                if group["beta1"] is not None:
                    st["M"] = (1 - group["beta1"]) * step if t == 1 else \
                        group["beta1"] * st["M"] + (1 - group["beta1"]) * step
                    step = st["M"]
                X.mul_(1 - group["lr"] * group["weight_decay"])
                X.sub_(step)


# ----------------------------------------------------------------------------- mixture of experts


class LoopMoE(nn.Module):
    """A mixture-of-experts layer computed token by token, group by group, reading the weights of the layer it
    replaces (router W_g (E, C), expert weights (E, C, F) and (E, F, C), GELU). `last` holds the (Σ over groups of
    the balance loss n Σ_i f_i P_i, Σ over tokens of (log Σ_j exp x_j)²) of its last forward (0 balance loss for
    expert choice)."""

    def __init__(self, moe, cfg):
        super().__init__()
        self.router, self.experts = moe.router, moe.experts  # the same parameters (and names) as the layer replaced
        self.cfg = cfg
        self.last = (0.0, 0.0)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.experts.fc_weight[e]) @ self.experts.proj_weight[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        c = self.cfg
        S, E = c.group_tokens, c.experts
        flat = x.reshape(-1, C)
        outs, aux_sum, z_sum = [], 0.0, 0.0
        for g0 in range(0, flat.shape[0], S):
            xs = flat[g0: g0 + S]
            logits = xs @ self.router.weight.T  # (S, E)
            probs = logits.softmax(-1)
            z_sum = z_sum + torch.logsumexp(logits, -1).square().sum()
            k = 1 if c.router == "switch" else c.top_k
            K = min(S, max(1, math.ceil(c.capacity_factor * k * S / E - 1e-9)))
            if c.router == "expert_choice":
                chosen = [[] for _ in range(S)]
                for e in range(E):
                    # the K best tokens of the group; a tie goes to the earlier token
                    order = sorted(range(S), key=lambda s, e=e: (-float(probs[s, e].detach()), s))[:K]
                    for s in order:
                        chosen[s].append((e, probs[s, e]))
            else:
                top = [sorted(range(E), key=lambda e, s=s: (-float(logits[s, e].detach()), e))[:k] for s in range(S)]
                gates = [logits[s, top[s]].softmax(-1) if c.router == "topk" else probs[s, top[s]] for s in range(S)]
                load, chosen = [0] * E, [[] for _ in range(S)]
                for j in range(k):  # GShard: every token's first choice before any second choice, in token order
                    for s in range(S):
                        e = top[s][j]
                        if load[e] < K:
                            load[e] += 1
                            chosen[s].append((e, gates[s][j]))
                f = torch.tensor([sum(top[s][0] == e for s in range(S)) / S for e in range(E)], dtype=x.dtype)
                aux_sum = aux_sum + E * (f * probs.mean(0)).sum()
            for s in range(S):
                y = torch.zeros(C, dtype=x.dtype)
                for e, w in chosen[s]:
                    y = y + w * self.expert(e, xs[s])
                outs.append(y)
        self.last = (aux_sum, z_sum)
        return torch.stack(outs).view(B, T, C)


def swap_moe(model: nn.Module, moe_cfg) -> list[LoopMoE]:
    """Replace every MoE layer of `model` with a `LoopMoE` on its weights; returns them."""
    from scaletrain.model.moe import MoE

    out = []
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            loop = LoopMoE(module, moe_cfg)
            setattr(parent, name.rpartition(".")[2], loop)
            out.append(loop)
    return out


# ----------------------------------------------------------------------------- mixed precision


class LossScale:
    """fp16's dynamic loss scale: an overflow skips the step and, after `hysteresis` overflows since the scale last
    changed, multiplies it by `backoff` (not below `minimum`); `window` clean steps in a row double it."""

    def __init__(self, scale: float, window: int, backoff: float, hysteresis: int, minimum: float):
        self.scale, self.window, self.backoff = scale, window, backoff
        self.hysteresis, self.minimum = hysteresis, minimum
        self.clean, self.overflows = 0, 0

    def after(self, overflow: bool) -> None:
        if overflow:
            self.clean = 0
            self.overflows += 1
            if self.overflows >= self.hysteresis:
                self.scale, self.overflows = max(self.minimum, self.scale * self.backoff), 0
        else:
            self.clean += 1
            if self.clean == self.window:
                self.scale, self.clean, self.overflows = self.scale * 2, 0, 0


def mixed_precision_loop(cfg) -> tuple[dict, dict, list]:
    """`cfg` (train.dtype bf16 or fp16, AdamW) trained as the paper does: the model in the 16-bit dtype, fp32 masters
    updated by torch's AdamW (foreach), each micro-batch's 16-bit gradients added into fp32 accumulators, the loss
    (from fp32 logits) times the scale, unscaling, the skip on a non-finite gradient, clipping of the fp32 gradients
    (torch's clip_grad_norm_); returns (losses, final 16-bit parameters, [(step, scale used, skipped)])."""
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.model import build_gpt

    t, m, o = cfg.train, cfg.model, cfg.optim
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[t.dtype]
    model = build_gpt(m, t.seed, "cpu", low)
    for mod in model.modules():  # layer norms in fp32 (the paper keeps reductions in fp32)
        if isinstance(mod, nn.LayerNorm):
            mod.forward = (lambda ln: lambda x: F.layer_norm(
                x.float(), ln.normalized_shape, ln.weight.float(), None if ln.bias is None else ln.bias.float(),
                ln.eps).to(x.dtype))(mod)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(decay_split(masters, o.weight_decay), lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            foreach=True)
    scaler = LossScale(t.loss_scale, t.loss_scale_window, t.loss_scale_backoff, t.loss_scale_hysteresis,
                       t.loss_scale_min) if t.dtype == "fp16" else None
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), m.seq_len, t.global_batch, t.seed,
                         cfg.data.val_fraction, m.vocab_size)
    tokens = t.global_batch * m.seq_len
    losses, scales = {}, []
    for step in range(1, t.steps + 1):
        scale = scaler.scale if scaler else 1.0
        acc = [torch.zeros_like(w) for w in masters]
        x, y = loader.global_batch_at(step)
        total = 0.0
        for xm, ym in zip(x.split(t.micro_batch), y.split(t.micro_batch)):
            loss = F.cross_entropy(model(xm).float().flatten(0, 1), ym.flatten(), reduction="sum") / tokens
            (loss * scale).backward()
            total += loss.item()
            for a, p in zip(acc, params):
                a.add_(p.grad.float())
                p.grad = None
        for a in acc:
            a.div_(scale)
        overflow = scaler is not None and not all(bool(torch.isfinite(a).all()) for a in acc)
        if not overflow:
            for w, a in zip(masters, acc):
                w.grad = a
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(masters, t.grad_clip)
            for g in opt.param_groups:
                g["lr"] = lr_at_step(step, t)
            opt.step()
            with torch.no_grad():
                for p, w in zip(params, masters):
                    p.copy_(w)
        if scaler:
            scaler.after(overflow)
        losses[step] = total
        scales.append((step, scale, overflow))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, scales
