"""Adafactor and SM3 under ZeRO: factored optimizer states over flat parameter shards.

Adafactor (Shazeer & Stern, arXiv 1804.04235) and SM3 (Anil et al., arXiv 1901.11150) keep statistics per
row and per column (per dimension) of a matrix, but under ZeRO a rank owns a contiguous flat slice of each
parameter, which cuts rows. Each step every rank computes the partial statistics of its own elements,
the ranks combine them with all-reduces, and every rank then updates only its own elements:

- Adafactor: row and column means of G² + ε1 (SUM), and the sums of X² (for RMS(X), relative step) and of
  U² (update clipping) — two all-reduces per step for all parameters together. The factored states R and C
  are replicated on every rank: they hold n + m numbers per matrix, tiny next to the n·m they replace.
  The unfactored second moment of vectors and the optional first moment are element-wise and sharded like
  the parameter.
- SM3: per dimension, the max of ν over each cover set (MAX) — one all-reduce per step; the accumulators of
  every dimension are replicated (sum of dims numbers per parameter), momentum is sharded.

The arithmetic per element is that of `scaletrain.optim.Adafactor` / `SM3` on the whole parameter (tested
against them in fp64).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

DEFAULTS = {"adafactor": {"eps1": 1e-30, "eps2": 1e-3}, "sm3": {"eps": 0.0}}  # the optimizers' own defaults


def tp_placement(p: torch.Tensor, tp_group: Any) -> tuple[tuple[int, ...], torch.Tensor | None, bool]:
    """Where a rank's copy of `p` sits in the plain model's parameter: (whole shape, flat index of each local
    element or None when the copy is the whole parameter, whether this rank's statistics count). A parameter
    split over tensor parallelism carries `_st_tp_shard` (set by `parallel.tp_plan.apply_tp_plan`), a stack of
    experts split over expert parallelism `_st_ep_shard` (`parallel.experts.apply_ep`); a parameter replicated
    over tp counts on tp rank 0 only, a copied piece (`_st_tp_copy`) on the first rank holding it."""
    shard = getattr(p, "_st_tp_shard", None) or getattr(p, "_st_ep_shard", None)
    replica = getattr(p, "_st_tp_replicated", False) and tp_group is not None and dist.get_rank(tp_group) > 0
    replica = replica or getattr(p, "_st_tp_copy", False)  # a copied key/value head (tp > n_kv_heads)
    if shard is not None:
        spec, rank, n = shard
        idx = spec.global_index(tuple(p.shape), rank, n).to(p.device)
        return spec.global_shape(tuple(p.shape), n), idx, not replica
    return tuple(p.shape), None, not replica


def tp_pieces(params: list[torch.Tensor], targets: list[torch.Tensor], grads: list[torch.Tensor],
              tp_group: Any) -> list[dict]:
    """`ShardedFactored` pieces for the whole local tensors of tensor-parallel parameters (no ZeRO): `targets`
    (the parameters, or their fp32 masters) are updated from `grads`, with statistics combined over tp."""
    out = []
    for p, x, g in zip(params, targets, grads):
        shape, idx, mine = tp_placement(p, tp_group)
        piece = {"shape": shape, "a": 0, "b": x.numel(), "x": x.view(-1), "grad": g.view(-1), "dtype": x.dtype,
                 "device": x.device, "contribute": mine}
        if idx is not None:
            piece["idx"] = idx
        out.append(piece)
    return out


def state_sizes(name: str, shape: tuple[int, ...], piece_numel: int, beta1: bool = False,
                momentum: bool = False) -> dict[str, int]:
    """Elements of each state tensor a rank holds for one parameter of `shape` of which it owns
    `piece_numel` elements (maybe 0): the replicated factored statistics plus the sharded element-wise
    ones. The planner counts `mem_optim` under ZeRO from this (`parallel.zero.predict_bytes`)."""
    sizes: dict[str, int] = {}
    if name == "adafactor":
        if len(shape) >= 2:
            sizes["row"] = math.prod(shape[:-1])
            sizes["col"] = math.prod(shape[:-2]) * shape[-1]
        else:
            sizes["v"] = piece_numel
        if beta1:
            sizes["m"] = piece_numel
    else:
        for d, size in enumerate(shape if len(shape) else (1,)):
            sizes[f"acc{d}"] = size
        if momentum:
            sizes["m"] = piece_numel
    return sizes


class ShardedFactored:
    """`name` in {adafactor, sm3} over `pieces`, each a dict: `shape` (the whole parameter's), the flat range
    [`a`, `b`) of it this rank holds — or `idx`, the flat index of each held element in the whole parameter (-1
    for padding that belongs to no element) —, `x` and `grad` (flat views of this rank's master and gradient),
    `dtype`, `device`, and `contribute` (False where another rank of the reduction holds the same elements: a
    tensor-parallel replica; its statistics then count once). The statistics are all-reduced over `group`, or
    over each group of a list in turn (ZeRO's dp group, then the tensor-parallel group)."""

    def __init__(self, name: str, params: list[dict], group: Any, hyper: dict[str, Any], weight_decay: float):
        self.name, self.params = name, params
        self.groups = [g for g in (group if isinstance(group, (list, tuple)) else [group]) if g is not None]
        self.hyper = dict(hyper)
        self.param_groups = [{"lr": self.hyper.get("lr", 1e-3)}]  # the trainer sets the lr here
        self.weight_decay = weight_decay
        self.t = 0
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(params):
            sizes = state_sizes(name, p["shape"], p["b"] - p["a"], beta1=self.hyper.get("beta1") is not None,
                                momentum=self.hyper.get("momentum", 0.0) > 0)
            st = {k: torch.zeros(n, dtype=p["dtype"], device=p["device"]) for k, n in sizes.items()}
            self.state[i] = st

    # ------------------------------------------------------------------ helpers

    def _reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        from scaletrain.distributed.comm import collective_device

        for group in self.groups:
            if dist.get_world_size(group) > 1:
                dev = collective_device(group)  # offloaded statistics live on the host; NCCL reduces on the GPU
                work = t if t.device == dev else t.to(dev)
                dist.all_reduce(work, op=op, group=group)
                if work is not t:
                    t.copy_(work)
        return t

    @staticmethod
    def _coords(p: dict) -> torch.Tensor:
        """Flat indices of the held elements in the whole parameter (padding clamped to 0; see `_weight`)."""
        if "idx" in p:
            return p["idx"].clamp(min=0)
        return torch.arange(p["a"], p["b"], device=p["device"])

    @staticmethod
    def _weight(p: dict) -> torch.Tensor | float:
        """What this rank's elements count in the SUM statistics: 0 for a replica or padding, else 1."""
        if not p.get("contribute", True):
            return 0.0
        return (p["idx"] >= 0).to(p["dtype"]) if "idx" in p and bool((p["idx"] < 0).any()) else 1.0

    @staticmethod
    def _valid(p: dict) -> torch.Tensor | float:
        """1 for this rank's real elements, 0 for padding (a replica's elements are real: it updates them too)."""
        return (p["idx"] >= 0).to(p["dtype"]) if "idx" in p and bool((p["idx"] < 0).any()) else 1.0

    def _decay(self, p: dict) -> float:
        return self.weight_decay if len(p["shape"]) >= 2 else 0.0

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        lr = self.param_groups[0]["lr"]
        if self.name == "adafactor":
            self._adafactor(lr)
        else:
            self._sm3(lr)

    def _adafactor(self, lr: float) -> None:
        h, t = self.hyper, self.t
        one_minus_beta2 = t ** (-h["decay_rate"])
        rho = min(lr, 1.0 / math.sqrt(t)) if h["relative_step"] else lr
        # 1) partial statistics of this rank's elements, all parameters in one buffer
        parts, layout = [], []
        for p in self.params:
            shape, idx, w = p["shape"], self._coords(p), self._weight(p)
            g2 = p["grad"].square().add_(h["eps1"]).mul_(w)
            x2 = (p["x"].square() * w).sum().reshape(1)
            if len(shape) >= 2:
                n, m = shape[-2], shape[-1]
                rows = torch.zeros(math.prod(shape[:-1]), dtype=g2.dtype, device=g2.device)
                rows.index_add_(0, idx // m, g2)
                cols = torch.zeros(math.prod(shape[:-2]) * m, dtype=g2.dtype, device=g2.device)
                cols.index_add_(0, (idx // (n * m)) * m + idx % m, g2)
                parts += [rows / m, cols / n, x2]
                layout.append((rows.numel(), cols.numel()))
            else:
                parts.append(x2)
                layout.append(None)
        flat = self._reduce(torch.cat(parts)) if parts else torch.zeros(0)
        # 2) states and unclipped updates; partial sums of U²
        updates, u2, off = [], [], 0
        for i, (p, lay) in enumerate(zip(self.params, layout)):
            st, shape, idx, g = self.state[i], p["shape"], self._coords(p), p["grad"]
            if lay is not None:
                nr, nc = lay
                n, m = shape[-2], shape[-1]
                r, c = st["row"], st["col"]
                r.lerp_(flat[off: off + nr], one_minus_beta2)
                c.lerp_(flat[off + nr: off + nr + nc], one_minus_beta2)
                x2 = flat[off + nr + nc]
                off += nr + nc + 1
                row_factor = (r.view(-1, n) / r.view(-1, n).mean(dim=-1, keepdim=True)).rsqrt_().reshape(-1)
                u = g * row_factor[idx // m] * c.rsqrt()[(idx // (n * m)) * m + idx % m]
            else:
                x2 = flat[off]
                off += 1
                v = st["v"]
                v.lerp_(g.square().add_(h["eps1"]), one_minus_beta2)
                u = g * v.rsqrt()
            # padding elements get no update; a tensor-parallel replica updates its copy like the owner does
            u = u * self._valid(p) if "idx" in p else u
            updates.append((u, x2))
            u2.append((u.square() * self._weight(p)).sum().reshape(1))
        usum = self._reduce(torch.cat(u2)) if u2 else torch.zeros(0)
        # 3) clip, scale, step — each rank on its own elements
        for i, (p, (u, x2)) in enumerate(zip(self.params, updates)):
            numel = math.prod(p["shape"]) if p["shape"] else 1
            rms_u = math.sqrt(float(usum[i]) / numel)
            rms_x = math.sqrt(float(x2) / numel)
            alpha = max(h["eps2"], rms_x) * rho if h["scale_parameter"] else rho
            u.div_(max(1.0, rms_u / h["clip_threshold"])).mul_(alpha)
            self._apply(i, p, u, lr, h["beta1"], step=1.0)  # Adafactor's u already carries its step size

    def _sm3(self, lr: float) -> None:
        h = self.hyper
        nus, parts, coords = [], [], []
        for i, p in enumerate(self.params):
            st, shape = self.state[i], p["shape"] or (1,)
            idx = self._coords(p)
            cs = torch.unravel_index(idx, tuple(shape)) if len(shape) > 1 else (idx,)
            accs = [st[f"acc{d}"] for d in range(len(shape))]
            nu = accs[0][cs[0]]
            for acc, c in zip(accs[1:], cs[1:]):
                nu = torch.minimum(nu, acc[c])
            nu = nu + p["grad"].square()
            counted = nu * self._weight(p)  # padding and replicas add nothing (ν >= 0: 0 is the identity of max)
            for acc, c in zip(accs, cs):  # partial max of ν per cover set
                part = torch.zeros_like(acc)
                parts.append(part.scatter_reduce_(0, c, counted, reduce="amax", include_self=True))
            nus.append(nu)
            coords.append(cs)
        flat = self._reduce(torch.cat(parts), dist.ReduceOp.MAX) if parts else torch.zeros(0)
        off = 0
        for i, (p, nu) in enumerate(zip(self.params, nus)):
            for d in range(len(p["shape"] or (1,))):
                acc = self.state[i][f"acc{d}"]
                acc.copy_(flat[off: off + acc.numel()])
                off += acc.numel()
            g = p["grad"]
            denom = nu.add_(h.get("eps", 0.0)).sqrt_()
            u = torch.where(denom > 0, g / denom, torch.zeros((), dtype=g.dtype, device=g.device))
            self._apply(i, p, u, lr, h.get("momentum"), step=lr)

    def _apply(self, i: int, p: dict, u: torch.Tensor, lr: float, momentum: float | None, step: float) -> None:
        """First moment (if kept), decoupled weight decay X(1 - lr λ), then X -= step · u."""
        if "m" in self.state[i]:
            m = self.state[i]["m"]
            m.lerp_(u, 1.0 - momentum)
            u = m
        x = p["x"]
        if self._decay(p):
            x.mul_(1.0 - lr * self._decay(p))
        x.add_(u, alpha=-step)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "state": self.state, "lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = int(state["t"])
        for i, st in state["state"].items():
            for k, v in st.items():
                self.state[int(i)][k].copy_(v)
