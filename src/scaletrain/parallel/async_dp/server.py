"""The parameter server's state and update: a shard of whole tensors, its optimizer, and one update from the
gradients of several pushes.

Placement (Li et al., "Scaling distributed machine learning with the parameter server", OSDI 2014; BytePS,
Jiang et al., OSDI 2020): the model's tensors are spread over the S servers, largest first onto the least
loaded, so each server's link carries about 1/S of every push and pull. Tensors are kept whole (BytePS also
cuts large tensors into pieces) so that Adafactor's and SM3's row and column statistics see whole matrices and
any of our optimizers runs unchanged on a server.

An update sums its pushes' gradients in ticket order (deterministic, whatever the arrival order), clips by the
global norm over all servers (the partial squared norms are gathered and added in server order, so the result
does not depend on the collective's reduction order), and steps the shard's optimizer. `replay.py` runs the
same `ServerShard` code in one process, which is why a replay is bit-identical.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from scaletrain.config import Config
from scaletrain.optim import build_optimizer, config_hyper, decay_groups
from scaletrain.parallel.async_dp.model import clip_coefficient, sq_norm


def assign_tensors(numels: list[int], servers: int) -> list[list[int]]:
    """Indices of the tensors each server holds: largest first onto the least loaded server (ties: lowest
    index), each server's list in model order."""
    load = [0] * servers
    owned: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owned[s].append(i)
        load[s] += numels[i]
    return [sorted(o) for o in owned]


class ShardLayout:
    """Where each server's tensors sit in a worker's flat parameter buffer (model order) and in the server's own
    flat buffer (its tensors in model order)."""

    def __init__(self, numels: list[int], servers: int):
        self.numels = numels
        self.owned = assign_tensors(numels, servers)
        starts = [0]
        for n in numels:
            starts.append(starts[-1] + n)
        self.starts = starts
        self.sizes = [sum(numels[i] for i in o) for o in self.owned]

    def gather(self, flat: torch.Tensor, server: int, out: torch.Tensor) -> None:
        """Copy server `server`'s tensors from a model-order flat buffer into its flat buffer `out`."""
        off = 0
        for i in self.owned[server]:
            n = self.numels[i]
            out[off: off + n].copy_(flat[self.starts[i]: self.starts[i] + n])
            off += n

    def scatter(self, shard: torch.Tensor, server: int, flat: torch.Tensor) -> None:
        """Copy a server's flat buffer into its tensors' places in a model-order flat buffer."""
        off = 0
        for i in self.owned[server]:
            n = self.numels[i]
            flat[self.starts[i]: self.starts[i] + n].copy_(shard[off: off + n])
            off += n


class ServerShard:
    """One server's tensors (leaf parameters viewing one flat buffer), their summed gradient and optimizer."""

    def __init__(self, cfg: Config, values: list[torch.Tensor]):
        self.cfg = cfg
        self.flat = torch.cat([v.detach().reshape(-1).to("cpu") for v in values]).clone()
        self.params: list[nn.Parameter] = []
        self.grad = torch.zeros_like(self.flat)
        off = 0
        for v in values:
            n = v.numel()
            p = nn.Parameter(self.flat[off: off + n].view(v.shape))
            p.grad = self.grad[off: off + n].view(v.shape)
            self.params.append(p)
            off += n
        self.grad_views = [p.grad for p in self.params]
        self.opt = build_optimizer(cfg.optim.name, decay_groups(self.params, cfg.optim.weight_decay),
                                   **config_hyper(cfg.optim, cfg.train.lr))

    def sum_grads(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum the pushes' flat gradients in the given order into the shard's gradient; its squared norm."""
        self.grad.copy_(grads[0])
        for g in grads[1:]:
            self.grad.add_(g)
        return sq_norm(self.grad_views)

    def step(self, total_sq: torch.Tensor, lr: float) -> float:
        """Clip by the global norm (from the servers' squared norms, added in server order) and step."""
        norm, coef = clip_coefficient(total_sq, self.cfg.train.grad_clip)
        if coef is not None:
            torch._foreach_mul_(self.grad_views, coef)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {"params": self.flat.clone(), "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["params"].shape != self.flat.shape:
            raise ValueError(f"server shard has {state['params'].numel()} parameters, this run {self.flat.numel()}")
        with torch.no_grad():
            self.flat.copy_(state["params"])
        self.opt.load_state_dict(state["optimizer"])


def add_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The global squared norm from the servers' parts, added in server order."""
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]
