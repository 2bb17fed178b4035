"""Mixture-of-experts layer: a router, capacity-limited dispatch per token group, expert MLPs, combine.

Papers and the symbols used below:
- Shazeer et al., arXiv 1701.06538 (noisy top-k gating): H(x) = x W_g + ε · softplus(x W_noise),
  G(x) = softmax(KeepTopK(H(x), k)). Our ε ~ N(0, 1) is multiplied by `router_noise` (0 disables it).
  `aux_loss=importance`: its importance and load losses; `groups > 1`: its two-level hierarchical MoE (appendix B),
  experts numbered group-major (expert i·b + j is expert j of group i); the formulas are in model/moe_gating.py.
- Lepikhin et al., arXiv 2006.16668 (GShard): tokens are dispatched in *local groups* of S tokens, each
  expert taking at most K tokens of a group (its capacity); first choices of all tokens are placed before
  second choices; random routing keeps a token's second expert only with probability 2 · g2 (g1 + g2 = 1).
- Fedus et al., arXiv 2101.03961 (Switch): top-1 routing, gate p_i(x) not renormalised; the router runs in
  fp32 whatever the model dtype (selective precision); load-balancing loss n · Σ_i f_i · P_i with f_i the
  fraction of a group's tokens whose first choice is expert i and P_i the mean router probability of i;
  multiplicative input jitter U(1 - ε, 1 + ε) as switch noise; smaller init (see `model.init`).
- Zoph et al., arXiv 2202.08906 (ST-MoE): router z-loss, mean over tokens of (log Σ_j exp x_j)².
- Zhou et al., arXiv 2202.09368 (expert choice): S = softmax(X W_g) (n × e); each expert takes its top-K
  tokens of the group by score, K = n · c / e; a token may be taken by several experts or by none.

Shapes: B batch, T sequence, C d_model, F expert hidden, E experts, G groups of S = group_tokens tokens,
K capacity slots per expert and group. Routing produces, per group, the token in each of the E × K slots
(S marks an empty slot) and its combine weight. Capacity depends only on S, so the result of a group does
not depend on which rank holds which expert: an expert-parallel pass swaps `MoE.experts` (input and output
(E, G, K, C)) for an all-to-all version and nothing else changes. Dropped tokens get zero MoE output (the
residual carries them) and are counted.

The auxiliary losses are summed token-weighted (S · aux per group, z² per token) like the cross-entropy, so
the trainer's global normalisation (1 / tokens of the global batch) applies to them unchanged; they are
added to the gradient by `AttachAux` with the engine's loss scale (`set_grad_scale`), so no extra
reduction (and no pipeline stage without MoE layers waiting on one) is needed. Random numbers (noise,
random routing) come from per-row streams keyed by (seed, layer, step, global row of the batch), so they
do not depend on the layout either. No distributed code here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.config import MoEConfig
from scaletrain.config.sizes import capacity, experts_per_token
from scaletrain.model.moe_gating import hierarchical_importance_load_sum, importance_load_sum, selection_probability

# --------------------------------------------------------------------------- routing (pure functions)


@dataclass
class Routing:
    slot_token: torch.Tensor  # (G, E, K) int64: token index in its group, S for an empty slot
    slot_weight: torch.Tensor  # (G, E, K) combine weight, 0 for an empty slot
    aux: torch.Tensor  # scalar: Σ_groups S · n Σ_i f_i P_i (0 for expert choice), or the weighted importance + load
    z: torch.Tensor  # scalar: Σ_tokens (logsumexp of router logits)²
    load: torch.Tensor  # (E,) assignments each expert was chosen for, before capacity
    dropped: torch.Tensor  # scalar: assignments beyond capacity (token choice) / tokens no expert took (EC)
    assignments: torch.Tensor  # scalar: what `dropped` is a fraction of
    decision: tuple[torch.Tensor, ...] = ()
    """The discrete choices, which teacher-forced routing replays (`model/routing_tape.py`): token choice
    (expert (G, S, k), keep (G, S, k)); expert choice (slot_token,)."""


def z_loss_sum(logits: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of (log Σ_j exp x_j)² (ST-MoE eq. 5 times the token count)."""
    return torch.logsumexp(logits, dim=-1).square().sum()


def balance_loss_sum(probs: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Σ over groups of S · n Σ_i f_i P_i (Switch eq. 4); probs (G, S, E), first (G, S) first choices."""
    G, S, E = probs.shape
    f = F.one_hot(first, E).to(probs.dtype).mean(1)  # (G, E) fraction of tokens with first choice i
    P = probs.mean(1)  # (G, E) mean router probability
    return S * E * (f * P).sum()


def place_in_slots(expert: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor, E: int, K: int):
    """Token choice with capacity (GShard): expert, gate, keep (G, S, k) -> slot_token, slot_weight (G, E, K),
    kept (G, S, k). Choice j of every token is placed before choice j+1 of any; within a choice, in token
    order; an assignment whose position in its expert's buffer is >= K is dropped."""
    G, S, k = expert.shape
    onehot = F.one_hot(expert, E) * keep.unsqueeze(-1)  # (G, S, k, E)
    order = onehot.transpose(1, 2).reshape(G, k * S, E)  # choice-major, then token order
    pos = ((order.cumsum(1) - 1) * order).sum(-1).view(G, k, S).transpose(1, 2)  # (G, S, k)
    kept = keep & (pos < K)
    flat = torch.where(kept, expert * K + pos, E * K)  # E·K is a dump slot, cut off below
    tokens = torch.arange(S, device=expert.device).view(1, S, 1).expand(G, S, k)
    slot_token = torch.full((G, E * K + 1), S, dtype=torch.long, device=expert.device)
    slot_token = slot_token.scatter(1, flat.reshape(G, -1), tokens.reshape(G, -1))[:, : E * K]
    # Which of several writes to the dump slot lands is unspecified, and the dump slot stays in the storage of
    # slot_weight (e.g. what activation compression reads): set it to 0 after the scatter. Scatter's backward
    # needs only the index, so the in-place fill saves nothing for backward (a masked gate would save the mask).
    slot_weight = gate.new_zeros(G, E * K + 1).scatter(1, flat.reshape(G, -1), gate.reshape(G, -1))
    slot_weight[:, E * K] = 0
    slot_weight = slot_weight[:, : E * K]
    return slot_token.view(G, E, K), slot_weight.view(G, E, K), kept


def route_topk(logits: torch.Tensor, k: int, K: int, noise: torch.Tensor | None = None,
               uniform: torch.Tensor | None = None, noise_std: torch.Tensor | None = None,
               importance: tuple[float, float] | None = None, forced: tuple[torch.Tensor, ...] | None = None,
               ) -> Routing:
    """Noisy top-k gating (Shazeer): H = logits + noise; G = softmax over the top-k of H. `uniform` (G, S)
    turns on GShard random routing of the second expert (k = 2): kept iff uniform < 2 · g2. `importance`
    (w_importance, w_load) makes `aux` Shazeer's weighted importance + load losses (the load term needs
    `noise_std` (G, S, E), the noise's standard deviation) instead of Switch's f · P. `forced` (expert, keep)
    replaces the choices (teacher forcing); the gates are still this run's H at them."""
    G, S, E = logits.shape
    h = logits if noise is None else logits + noise
    if forced is None:
        top, expert = h.topk(k, dim=-1)  # (G, S, k), best first
    else:
        expert = forced[0]
        top = h.gather(-1, expert)
    gate = top.softmax(-1)  # = softmax(KeepTopK(H, k)) restricted to the kept entries
    keep = torch.ones_like(expert, dtype=torch.bool)
    if forced is not None:
        keep = forced[1]
    elif uniform is not None:
        keep[..., 1] = uniform < 2 * gate[..., 1].detach()
    slot_token, slot_weight, kept = place_in_slots(expert, gate, keep, E, K)
    if importance is None:
        aux = balance_loss_sum(h.softmax(-1), expert[..., 0])
    else:
        gates = gate.new_zeros(G, S, E).scatter(-1, expert, gate)  # G(x): the softmax over the kept top k
        probs = None if noise_std is None else selection_probability(logits, h, noise_std, k)
        aux = importance_load_sum(gates, probs, *importance)
    load = torch.bincount(expert[keep].flatten(), minlength=E)
    return Routing(slot_token, slot_weight, aux, z_loss_sum(logits), load, (keep & ~kept).sum(), keep.sum(),
                   (expert, keep))


def route_hierarchical(primary: torch.Tensor, secondary: torch.Tensor, k: int, K: int,
                       noise: tuple[torch.Tensor, torch.Tensor] | None = None,
                       noise_std: tuple[torch.Tensor, torch.Tensor] | None = None,
                       importance: tuple[float, float] | None = None,
                       forced: tuple[torch.Tensor, ...] | None = None) -> Routing:
    """Two-level hierarchical MoE (Shazeer appendix B): primary logits (G, S, a) choose the top k groups by
    noisy top-k gating, secondary logits (G, S, a, b) of each chosen group its top k experts; expert i·b + j gets
    the combine weight G_primary(x)_i · G_i(x)_j. The k² choices are placed in the order (primary rank,
    secondary rank). `aux` is Switch's f · P over the a·b experts (P_ij = softmax(H_p)_i softmax(H_i)_j, f of
    the first choice) or, with `importance`, appendix B's importance and load losses. `forced` (expert, keep)
    replaces the k² choices (teacher forcing: groups and experts in the same order); the gates are this run's."""
    G, S, a = primary.shape
    b = secondary.shape[-1]
    hp, hs = (primary, secondary) if noise is None else (primary + noise[0], secondary + noise[1])
    if forced is None:
        top_p, group = hp.topk(k, dim=-1)  # (G, S, k)
    else:
        group = forced[0].view(G, S, k, k)[..., 0] // b
        top_p = hp.gather(-1, group)
    gate_p = top_p.softmax(-1)
    pick = group.unsqueeze(-1).expand(G, S, k, b)
    if forced is None:
        top_s, inner = hs.gather(2, pick).topk(k, dim=-1)  # (G, S, k, k)
    else:
        inner = forced[0].view(G, S, k, k) % b
        top_s = hs.gather(2, pick).gather(-1, inner)
    gate_s = top_s.softmax(-1)
    expert = (group.unsqueeze(-1) * b + inner).reshape(G, S, k * k)
    gate = (gate_p.unsqueeze(-1) * gate_s).reshape(G, S, k * k)
    keep = torch.ones_like(expert, dtype=torch.bool) if forced is None else forced[1]
    slot_token, slot_weight, kept = place_in_slots(expert, gate, keep, a * b, K)
    if importance is None:
        joint = (hp.softmax(-1).unsqueeze(-1) * hs.softmax(-1)).reshape(G, S, a * b)
        aux = balance_loss_sum(joint, expert[..., 0])
    else:
        gates = gate.new_zeros(G, S, a * b).scatter(-1, expert, gate).view(G, S, a, b)
        chosen = torch.zeros(G, S, a, dtype=torch.bool, device=primary.device).scatter(-1, group, True)
        pp = ps = None
        if noise_std is not None:
            pp = selection_probability(primary, hp, noise_std[0], k)
            ps = selection_probability(secondary, hs, noise_std[1], k)
        aux = hierarchical_importance_load_sum(gates, pp, ps, chosen, *importance)
    z = z_loss_sum(primary) + z_loss_sum(secondary.gather(2, pick))  # the gates a token ran
    load = torch.bincount(expert.flatten(), minlength=a * b)
    return Routing(slot_token, slot_weight, aux, z, load, (~kept).sum(), keep.sum(), (expert, keep))


def route_switch(logits: torch.Tensor, K: int, forced: tuple[torch.Tensor, ...] | None = None) -> Routing:
    """Switch top-1: expert argmax p_i(x), combine weight p_i(x) itself (not renormalised); `forced` (expert,
    keep) replaces the choice."""
    G, S, E = logits.shape
    probs = logits.softmax(-1)
    if forced is None:
        gate, expert = probs.max(-1, keepdim=True)  # (G, S, 1)
    else:
        expert = forced[0]
        gate = probs.gather(-1, expert)
    keep = torch.ones_like(expert, dtype=torch.bool)
    slot_token, slot_weight, kept = place_in_slots(expert, gate, keep, E, K)
    load = torch.bincount(expert.flatten(), minlength=E)
    return Routing(slot_token, slot_weight, balance_loss_sum(probs, expert[..., 0]), z_loss_sum(logits),
                   load, (~kept).sum(), keep.sum(), (expert, keep))


def route_expert_choice(logits: torch.Tensor, K: int, forced: tuple[torch.Tensor, ...] | None = None) -> Routing:
    """Expert choice: S = softmax over experts; each expert takes its top-K tokens of the group by score;
    `forced` (token (G, E, K),) replaces the choice."""
    G, S, E = logits.shape
    scores = logits.softmax(-1)  # (G, S, E)
    # Each expert's K best tokens of the group. Tokens that are mathematically equal (a run of one token at the
    # start of a sequence under rope) get scores equal up to the last bits, and those bits depend on summation
    # order, which differs between layouts. So the ranking key of an fp64 run is the score rounded to fp32, and
    # equal keys go to the earlier token (a stable sort; topk's order among ties depends on the other values of
    # the row): every layout then picks the same tokens. The weights stay exact.
    # The key is detached: only the indices are used, and sorting a tensor that needs grad saves all of them.
    key = (scores.float() if scores.dtype == torch.float64 else scores).detach()
    token = key.transpose(1, 2).sort(dim=-1, descending=True, stable=True).indices[..., :K].contiguous() \
        if forced is None else forced[0]  # (G, E, K)
    weight = scores.transpose(1, 2).gather(-1, token)
    taken = torch.zeros(G, S + 1, dtype=torch.long, device=logits.device).scatter_add_(
        1, token.reshape(G, -1), torch.ones_like(token.reshape(G, -1)))[:, :S]
    load = torch.full((E,), G * K, dtype=torch.long, device=logits.device)
    zero = logits.new_zeros(())
    return Routing(token, weight, zero, z_loss_sum(logits), load, (taken == 0).sum(),
                   torch.tensor(G * S, device=logits.device), (token,))


# --------------------------------------------------------------------------- modules


class AttachAux(torch.autograd.Function):
    """Identity on `out`; in backward, gives `aux` the gradient `scale` (the engine's loss scale), so the
    weighted auxiliary losses join the loss without changing what the model returns (Megatron-core's
    auxiliary-loss scaler does the same)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape, ctx.aux_dtype = scale, aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class Experts(nn.Module):
    """E expert MLPs (GELU or SwiGLU, no biases), weights stacked along dim 0 as (E, in, out); expert e's
    weights are `*_weight[e]` whatever the layout. Input and output (E, ..., C)."""

    def __init__(self, experts: int, d_model: int, d_ff: int, swiglu: bool, dropout: float | nn.Module = 0.0,
                 activation: str = "gelu"):
        super().__init__()
        self.swiglu = swiglu
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"  # model.activation of the GELU experts
        self.n_total, self.expert_offset = experts, 0  # expert parallelism: the first local expert's id
        self.slot_ids: torch.Tensor | None = None  # global ids of the slots of this forward (global dropout)
        if swiglu:
            self.gate_weight = nn.Parameter(torch.empty(experts, d_model, d_ff))
            self.up_weight = nn.Parameter(torch.empty(experts, d_model, d_ff))
        else:
            self.fc_weight = nn.Parameter(torch.empty(experts, d_model, d_ff))
        self.proj_weight = nn.Parameter(torch.empty(experts, d_ff, d_model))
        # expert dropout (Switch), on the hidden activations
        self.dropout = dropout if isinstance(dropout, nn.Module) else nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        E, C = x.shape[0], x.shape[-1]
        h = x.reshape(E, -1, C)  # (E, N, C)
        if self.swiglu:
            h = F.silu(torch.bmm(h, self.gate_weight)) * torch.bmm(h, self.up_weight)
        else:
            h = F.gelu(torch.bmm(h, self.fc_weight), approximate=self.approximate)
        return torch.bmm(self._drop(h), self.proj_weight).view(x.shape)

    def _drop(self, h: torch.Tensor) -> torch.Tensor:
        """Expert dropout; a layout-independent mask is keyed by (global slot, global expert, feature)."""
        if self.slot_ids is None or not self.training:
            return self.dropout(h)
        E, N, F_ = h.shape
        expert = torch.arange(E, device=h.device) + self.expert_offset
        index = (self.slot_ids.view(1, N, 1) * self.n_total + expert.view(E, 1, 1)) * F_ + \
            torch.arange(F_, device=h.device)
        return self.dropout(h, index=index)


@dataclass
class MoEStats:
    """What one MoE layer saw in training since `begin_step` (detached)."""

    aux: float = 0.0
    z: float = 0.0
    dropped: int = 0
    assignments: int = 0
    load: torch.Tensor | None = None  # (E,) int64

    def vector(self, E: int) -> torch.Tensor:
        load = self.load.double().cpu() if self.load is not None else torch.zeros(E, dtype=torch.float64)
        head = torch.tensor([self.aux, self.z, float(self.dropped), float(self.assignments)], dtype=torch.float64)
        return torch.cat([head, load])


class MoE(nn.Module):
    """Drop-in replacement of a block's MLP: route, dispatch per group, run the experts, combine."""

    def __init__(self, d_model: int, d_ff: int, mlp: str, moe: MoEConfig, dropout: float = 0.0, layer: int = 0,
                 make_dropout=None, activation: str = "gelu"):
        """`make_dropout(p, roles)` builds the dropout modules (nn.Dropout when None; the GPT passes its
        layout-independent ones, model/dropout.py); `activation` is the GELU experts' (model.activation)."""
        super().__init__()
        make = make_dropout or (lambda p, roles: nn.Dropout(p))
        self.cfg, self.layer, self.n_experts = moe, layer, moe.experts
        noisy = moe.router == "topk" and moe.router_noise > 0
        # hierarchical (groups > 1): `router` is the primary gate over the groups, `expert_router` the secondary
        # gates of all groups stacked group-major (rows i·b .. i·b + b - 1 are group i's W_g), likewise the noise
        first = moe.groups if moe.groups > 1 else moe.experts
        self.router = nn.Linear(d_model, first, bias=False)  # W_g
        self.noise = nn.Linear(d_model, first, bias=False) if noisy else None  # W_noise (Shazeer)
        if moe.groups > 1:
            self.expert_router = nn.Linear(d_model, moe.experts, bias=False)
            self.expert_noise = nn.Linear(d_model, moe.experts, bias=False) if noisy else None
        self.experts = Experts(moe.experts, d_model, d_ff, mlp == "swiglu",
                               make(moe.expert_dropout, ("expert", "slot", "feature")), activation)
        self.dropout = make(dropout, ("seq", "feature"))
        self.grad_scale = 1.0  # d(loss)/d(token-summed aux), set by the engine each step
        self.key = (0, 0, 0)  # (seed, step, next global row) of the random streams, set each step
        # (index, parts): this layer sees part `index` of `parts` equal slices of each sequence (sequence
        # parallelism sets it); a row's random stream is drawn whole and sliced, so draws follow the token
        self.seq_shard = (0, 1)
        # (positions, seq_len): the global positions of this layer's tokens in each sequence when they are not one
        # equal slice (context parallelism sets it; it takes precedence over seq_shard)
        self.token_positions: tuple[torch.Tensor, int] | None = None
        self.stats = MoEStats()
        # teacher-forced routing (`model/routing_tape.py`, verify's low-precision rows): records this layer's
        # decisions by token, or replays another run's; None routes by this run's own scores
        self.tape = None

    @property
    def top_k(self) -> int:
        return experts_per_token(self.cfg)

    def capacity(self) -> int:
        return capacity(self.cfg.group_tokens, self.n_experts, self.top_k, self.cfg.capacity_factor)

    # ---- layout-independent random streams
    def _rows_random(self, kind: str, rows: int, shape: tuple[int, ...], uniform: bool) -> torch.Tensor:
        """(rows, *shape) float64 draws, row r from the stream (seed, layer, kind, step, global row); `shape[0]`
        counts this layer's slice of the row's tokens (`seq_shard`)."""
        from scaletrain.model.init import name_seed

        seed, step, first = self.key
        index, parts = self.seq_shard
        whole = (shape[0] * parts, *shape[1:])
        if self.token_positions is not None:  # a row's draws per token, `per` numbers each, picked at its positions
            pos, total = self.token_positions
            per = shape[0] // len(pos)
            whole = (total * per, *shape[1:])
        out = []
        for r in range(first, first + rows):
            g = torch.Generator().manual_seed(name_seed(seed, f"moe/{self.layer}/{kind}/{step}/{r}"))
            draw = (torch.rand(whole, generator=g, dtype=torch.float64) if uniform
                    else torch.randn(whole, generator=g, dtype=torch.float64))
            if self.token_positions is not None:
                out.append(draw.view(total, per, *shape[1:])[pos.cpu()].reshape(shape))
            else:
                out.append(draw[index * shape[0]: (index + 1) * shape[0]])
        return torch.stack(out)

    def route(self, xg: torch.Tensor, rows: int) -> Routing:
        """Router in fp32 or wider (Switch's selective precision), whatever the model dtype."""
        c = self.cfg
        rdtype = torch.promote_types(xg.dtype, torch.float32)
        G, S, C = xg.shape
        x = xg.to(rdtype)
        noisy = self.training and c.router_noise > 0
        if noisy and c.router == "switch":  # multiplicative jitter on the router input
            u = self._rows_random("jitter", rows, (xg.numel() // rows,), True).view(G, S, C)
            x = x * (1 - c.router_noise + 2 * c.router_noise * u.to(x))
        logits = F.linear(x, self.router.weight.to(rdtype))  # (G, S, E)
        K = self.capacity()
        importance = (c.importance_loss_weight, c.load_loss_weight) if c.aux_loss == "importance" else None
        if c.groups > 1:
            decide = self._hierarchical_decider(x, logits, rows, K, noisy, importance)
        else:
            noise = uniform = std = None
            if noisy and c.router == "topk":
                eps = self._rows_random("noise", rows, (S * G // rows, self.n_experts), False).view(G, S, -1)
                std = F.softplus(F.linear(x, self.noise.weight.to(rdtype))) * c.router_noise
                noise = eps.to(x) * std
            if self.training and c.random_routing and c.router == "topk":
                uniform = self._rows_random("second", rows, (S * G // rows,), True).view(G, S).to(x)

            def decide(forced=None) -> Routing:
                if c.router == "switch":
                    return route_switch(logits, K, forced)
                if c.router == "expert_choice":
                    return route_expert_choice(logits, K, forced)
                return route_topk(logits, c.top_k, K, noise, uniform, std, importance, forced)

        r = decide()
        return r if self.tape is None or not self.training else self.tape.route(self, r, decide, rows)

    def _hierarchical_decider(self, x: torch.Tensor, primary: torch.Tensor, rows: int, K: int, noisy: bool,
                              importance: tuple[float, float] | None) -> Callable[..., Routing]:
        """The two-level gate: secondary logits of every group (one stacked linear), noise drawn per level;
        returns the routing as a function of teacher-forced choices (None: its own)."""
        c, (G, S, _) = self.cfg, x.shape
        a = c.groups
        secondary = F.linear(x, self.expert_router.weight.to(x.dtype)).view(G, S, a, -1)
        noise = std = None
        if noisy:
            std = (F.softplus(F.linear(x, self.noise.weight.to(x.dtype))) * c.router_noise,
                   F.softplus(F.linear(x, self.expert_noise.weight.to(x.dtype))).view(G, S, a, -1) * c.router_noise)
            eps_p = self._rows_random("noise", rows, (S * G // rows, a), False).view(G, S, a)
            eps_s = self._rows_random("noise2", rows, (S * G // rows, self.n_experts), False).view(G, S, a, -1)
            noise = (eps_p.to(x) * std[0], eps_s.to(x) * std[1])
        return lambda forced=None: route_hierarchical(primary, secondary, c.top_k, K, noise, std, importance, forced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        S, E = self.cfg.group_tokens, self.n_experts
        xg = x.reshape(-1, S, C)  # (G, S, C): groups of consecutive tokens of the batch
        G = xg.shape[0]
        r = self.route(xg, B)
        K = r.slot_token.shape[-1]
        self.experts.slot_ids = self._slot_ids(B, T, G, K, x.device)
        padded = torch.cat([xg, xg.new_zeros(G, 1, C)], 1)  # (G, S + 1, C): row S feeds the empty slots
        index = r.slot_token.view(G, E * K, 1).expand(G, E * K, C)
        dispatched = padded.gather(1, index).view(G, E, K, C).transpose(0, 1)  # (E, G, K, C)
        done = self.experts(dispatched).transpose(0, 1)  # (G, E, K, C)
        weighted = done * r.slot_weight.unsqueeze(-1).to(done.dtype)
        out = x.new_zeros(G, S + 1, C).scatter_add(1, index, weighted.reshape(G, E * K, C))[:, :S]
        out = out.reshape(B, T, C)
        if self.training:
            weight = 1.0 if self.cfg.aux_loss == "importance" else self.cfg.aux_loss_weight  # importance: weighted
            aux = weight * r.aux + self.cfg.z_loss_weight * r.z
            if aux.requires_grad:
                out = AttachAux.apply(out, aux, self.grad_scale)
            self._record(r, B)
        return self.dropout(out)

    def _slot_ids(self, B: int, T: int, G: int, K: int, device: torch.device) -> torch.Tensor | None:
        """Global ids (group of the step x K + slot) of this forward's (G, K) slots, for a layout-independent
        expert dropout: a group's global id is its first token's index in the step's (rows x sequence)."""
        drop = self.experts.dropout
        if not self.training or getattr(drop, "p", 0.0) == 0.0 or not hasattr(drop, "context"):
            return None
        index, parts = self.seq_shard
        first = torch.arange(G, device=device) * self.cfg.group_tokens  # local flat token of each group
        row, t = first // T + drop.context.row, first % T + index * T
        total = T * parts
        if self.token_positions is not None:  # the group's first token at its global position
            pos, total = self.token_positions
            t = pos.to(device)[first % T]
        gid = (row * total + t) // self.cfg.group_tokens
        return (gid.view(G, 1) * K + torch.arange(K, device=device)).view(-1)

    @torch.no_grad()
    def _record(self, r: Routing, rows: int) -> None:
        s = self.stats
        s.aux += float(r.aux.detach())
        s.z += float(r.z.detach())
        s.dropped += int(r.dropped)
        s.assignments += int(r.assignments)
        s.load = r.load.detach() if s.load is None else s.load + r.load
        seed, step, first = self.key
        self.key = (seed, step, first + rows)


def moe_modules(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def begin_step(module: nn.Module, seed: int, step: int, first_row: int) -> None:
    """Reset the statistics of every MoE layer of `module` and key its random streams: this rank's first
    row of the step is row `first_row` of the global batch (micro-batches follow in order)."""
    for m in moe_modules(module):
        m.stats = MoEStats()
        m.key = (seed, step, first_row)


def set_grad_scale(module: nn.Module, scale: float) -> None:
    """The factor the engine multiplies each token-summed loss by (1 / global tokens, times a loss scale)."""
    for m in moe_modules(module):
        m.grad_scale = scale
