"""One asynchronous worker's model: the single-process engine, parameters in one flat buffer, and the data of a
ticket.

Every asynchronous mode hands out work as *tickets*: ticket n is the data-parallel slice n mod dp of the global
batch of step n // dp + 1, exactly the slice data-parallel rank n mod dp trains on in step n // dp + 1 of a
synchronous run. Whichever worker gets a ticket computes the same gradient from the same parameters, so a
single process can recompute any gradient of an asynchronous run from (ticket, parameter version) alone
(`replay.py`). The model is built by the same passes as a single-process run (`build_engine` with a mesh of
size one: no process group, no communication); its parameters are views into one flat buffer so that a pull or
a shared-memory copy is one tensor copy.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from scaletrain.config import Config
from scaletrain.data import BatchLoader, load_corpus
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.errors import TrainingDiverged
from scaletrain.model.init import name_seed
from scaletrain.parallel.norms import squared_norm
from scaletrain.parallel.parallelize import build_engine

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class Ticket:
    """Unit of work n: the slice `slice` of the global batch of `step` (1-based)."""

    n: int
    dp: int

    @property
    def step(self) -> int:
        return self.n // self.dp + 1

    @property
    def slice(self) -> int:
        return self.n % self.dp


class WorkerModel:
    """The whole model of one worker with its parameters in `flat` (model order) and gradients in `grads`."""

    def __init__(self, cfg: Config, device: torch.device, loader: BatchLoader | None = None):
        self.cfg, self.device = cfg, device
        self.dtype = DTYPES[cfg.train.dtype]
        self.engine = build_engine(cfg, Mesh.build(ParallelDims()), device, self.dtype, CommStats())
        self.module = self.engine.module
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.numels = [p.numel() for p in self.params]
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        with torch.no_grad():  # parameters become views of the flat buffer (same objects: optimizer state keys)
            for p, v in zip(self.params, self.views(self.flat)):
                p.data = v
        self.grads = self.engine.optimizer.grads  # the gradient of each parameter (bucket views), model order
        self._loader = loader

    @property
    def loader(self) -> BatchLoader:
        if self._loader is None:  # servers build the model for its initial weights only: no data needed
            cfg = self.cfg
            self._loader = BatchLoader(load_corpus(cfg.data), cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed,
                                       cfg.data.val_fraction, cfg.model.vocab_size)
        return self._loader

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (model order, parameter shapes) of a flat tensor laid out like `self.flat`."""
        out, off = [], 0
        for p, n in zip(self.params, self.numels):
            out.append(flat[off: off + n].view(p.shape))
            off += n
        return out

    def state_with(self, flat: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The module's full state dict (every key of a single-process run's), with parameters `flat` if given."""
        if flat is not None:
            with torch.no_grad():
                self.flat.copy_(flat)
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def grads_into(self, flat: torch.Tensor) -> None:
        """Copy the current gradients into a flat tensor laid out like `self.flat`."""
        torch._foreach_copy_(self.views(flat), self.grads)

    @contextmanager
    def _dropout_stream(self, ticket: Ticket):
        """torch dropout (model.dropout_impl=torch): a generator seeded by the ticket, so that whoever computes a
        ticket draws the same masks; global dropout needs no stream (its masks hash (seed, step, row))."""
        if self.cfg.model.dropout <= 0 or self.cfg.model.dropout_impl != "torch":
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(name_seed(self.cfg.train.seed, f"dropout/step{ticket.step}/slice{ticket.slice}"))
            yield

    def gradient(self, ticket: Ticket, scale: float) -> float:
        """Forward and backward of the ticket's slice with the loss scaled by `scale` (1 / tokens of the global
        batch for a share of the global gradient, dp / tokens for the slice's own mean); returns the scaled loss.
        The gradients are left in `self.grads` (zeroed first)."""
        cfg = self.cfg
        self.engine.optimizer.zero_grad()
        micro = self.loader.micro_batches(ticket.step, ticket.slice, ticket.dp, cfg.train.micro_batch,
                                          device=self.device)
        if self.engine.dropout is not None:
            d = self.engine.dropout
            d.seed, d.step, d.base_row = cfg.train.seed, ticket.step, ticket.slice * (cfg.train.global_batch //
                                                                                       ticket.dp)
        with self._dropout_stream(ticket):
            total = self.engine.forward_backward(micro, scale)
        loss = float(total)
        if not loss == loss or loss in (float("inf"), float("-inf")):
            raise TrainingDiverged(f"loss is {loss} at step {ticket.step} (ticket {ticket.n}, data-parallel slice "
                                   f"{ticket.slice})")
        return loss

    def eval_units(self, start: int, end: int) -> float:
        """Sum of token losses of validation units [start, end): unit u is slice u mod dp of eval batch u // dp."""
        dp, total = self.cfg.parallel.dp, 0.0
        for u in range(start, end):
            micro = self.loader.micro_batches(u // dp, u % dp, dp, self.cfg.train.micro_batch, self.loader.val,
                                              self.device)
            total += self.engine.eval_loss(micro)
        return total

    def eval_unit_count(self) -> int:
        return self.cfg.train.eval_batches * self.cfg.parallel.dp


def clip_coefficient(total_sq: torch.Tensor, max_norm: float) -> tuple[float, float | None]:
    """(global gradient norm, the factor to scale the gradients by or None): the trainer's clipping rule."""
    norm = float(total_sq.sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            return norm, coef
    return norm, None


def sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared norm of a list of gradients, computed as the trainer computes it."""
    return squared_norm(grads, grads[0].device)


def clip_(grads: list[torch.Tensor], max_norm: float) -> float:
    """Clip a list of gradients in place by their global norm (the trainer's rule); returns the norm."""
    norm, coef = clip_coefficient(sq_norm(grads), max_norm)
    if coef is not None:
        torch._foreach_mul_(grads, coef)
    return norm
