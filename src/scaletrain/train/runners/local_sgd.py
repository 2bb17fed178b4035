"""Local SGD and DiLoCo: each worker takes H optimizer steps alone, then the workers synchronise.

Local SGD (Lin et al., "Don't use large mini-batches, use local SGD", arXiv 1808.07217; Stich, arXiv
1805.09767): worker w trains on its data-parallel slice of every global batch (ticket (s - 1) x dp + w of step
s, loss averaged over its own tokens) with its own optimizer and gradient clipping; every H steps
(`parallel.local_steps`) and at the last step the parameters are replaced by their average over the workers
(one all-reduce of the parameters instead of one of the gradients per step: 1/H of BSP's traffic). With
H = 1 and an optimizer whose update is linear in the gradient (SGD, with or without momentum, no clipping) the
average of the workers' steps is the single process's step: H = 1 is BSP. Adaptive optimizers (AdamW) are not
linear in the gradient, so there local SGD with H = 1 is not BSP.

DiLoCo (Douillard et al., "DiLoCo: distributed low-communication training of language models", arXiv
2311.08105), `parallel.outer=diloco`: the average change of a round, Δ = θ_outer - mean_w θ_w, is an outer
gradient for Nesterov SGD (`outer_lr`, `outer_momentum`) on the outer parameters, which every worker then
starts the next round from; the inner optimizers keep their state. With outer_lr 1 and momentum 0 the outer
step is θ_outer - Δ = the average: local SGD.

Each worker's state (its parameters, inner optimizer, the outer parameters and momentum, the losses of the
round not yet logged) is saved per rank, so a checkpoint at any step resumes exactly.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from scaletrain.config import Config
from scaletrain.distributed.comm import CommStats, all_reduce
from scaletrain.distributed.process_group import DistEnv, pick_device
from scaletrain.errors import CheckpointError
from scaletrain.optim import lr_multiplier
from scaletrain.parallel.async_dp.model import Ticket, WorkerModel
from scaletrain.parallel.async_dp.straggler import Straggler, wrap_engine
from scaletrain.train.runners import rank_checkpoint as ckpt
from scaletrain.train.runners.common import Metrics, async_signature, find_resume, observers
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import TrainResult


class LocalSGDRunner:
    def __init__(self, cfg: Config, out: Path | None, env: DistEnv | None, progress: bool = False):
        p = cfg.parallel
        self.cfg, self.out, self.progress = cfg, out, progress
        self.rank = env.rank if env else 0
        self.dp = p.dp
        self.group = dist.group.WORLD if p.dp > 1 else None
        self.device = pick_device(cfg.train.device, env.local_rank if env else 0)
        self.model = WorkerModel(cfg, self.device)
        self.n_params = self.model.engine.n_params
        wrap_engine(self.model.engine, Straggler.for_rank(p.slow_ranks, p.dp, self.rank))
        self.opt = self.model.engine.optimizer  # the replicated optimizer over a group of one: no communication
        self.comm = CommStats()
        self.lr_scale = lr_multiplier(cfg.optim)
        self.outer_param: nn.Parameter | None = None
        if p.outer == "diloco":
            self.outer_param = nn.Parameter(self.model.flat.detach().clone())
            self.outer_opt = torch.optim.SGD([self.outer_param], lr=p.outer_lr, momentum=p.outer_momentum,
                                             nesterov=p.outer_momentum > 0)
        self.round: list[tuple[int, float, float, float]] = []  # (step, local loss, grad norm, seconds) not logged
        self.val: dict[int, float] = {}
        self.step = 0
        self._resume()
        self.obs = observers(cfg, out, self.rank, self.device, p.dp, self.step)  # collective

    # ---- state

    def state_dict(self) -> dict[str, Any]:
        state = {"params": self.model.flat.detach().cpu().clone(), "inner": self.opt.state_dict(),
                 "round": torch.tensor(self.round, dtype=torch.float64).reshape(-1, 4), "step": self.step,
                 "val": torch.tensor(sorted(self.val.items()), dtype=torch.float64).reshape(-1, 2)}
        if self.outer_param is not None:
            state["outer"] = self.outer_param.detach().cpu().clone()
            state["outer_opt"] = self.outer_opt.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.model.flat.copy_(state["params"])
            if self.outer_param is not None:
                self.outer_param.copy_(state["outer"])
        self.opt.load_state_dict(state["inner"])
        if self.outer_param is not None:
            self.outer_opt.load_state_dict(state["outer_opt"])
        self.round = [(int(s), loss, norm, sec) for s, loss, norm, sec in state["round"].tolist()]
        self.val = {int(s): v for s, v in state["val"].tolist()}

    def _resume(self) -> None:
        found, meta = find_resume(self.out, self.cfg)
        if found is None:
            return
        try:
            self.load_state_dict(ckpt.load_rank(found, self.rank))
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {found} does not fit the model: {str(e).splitlines()[0]}") from None
        self.step = int(meta["step"])

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier()

    def save(self) -> None:
        ckpt.save(self.out / "checkpoints", self.step, self.rank, self.dp, self.state_dict(),
                  async_signature(self.cfg), self._barrier, self.cfg.train.keep_checkpoints)

    # ---- steps

    def _local_step(self, step: int) -> None:
        t0 = time.perf_counter()
        ticket = Ticket((step - 1) * self.dp + self.rank, self.dp)
        loss = self.model.gradient(ticket, self.dp / self.cfg.tokens_per_step)  # this worker's mean token loss
        norm = float(self.opt.clip_grad_norm(self.cfg.train.grad_clip))  # a 0-dim tensor or a float
        self.opt.step(lr_at(step, self.cfg.train) * self.lr_scale)
        self.opt.zero_grad()
        self.round.append((step, loss, norm, time.perf_counter() - t0))

    def _average(self, flat: torch.Tensor, stats: CommStats | None = None) -> None:
        """flat <- the mean of flat over the workers (in place)."""
        if self.group is not None:
            all_reduce(flat, self.group, stats=stats)
            flat.div_(self.dp)

    def _synchronise(self) -> None:
        with torch.no_grad():
            self._average(self.model.flat, self.comm)
            if self.outer_param is not None:  # DiLoCo: outer Nesterov step on Δ = θ_outer - mean θ_w
                self.outer_param.grad = self.outer_param.detach() - self.model.flat
                self.outer_opt.step()
                self.model.flat.copy_(self.outer_param)

    def _evaluate(self, synced: bool) -> float:
        """Validation loss of the workers' average parameters (the synchronised ones at a synchronisation)."""
        keep = None if synced else self.model.flat.detach().clone()
        if keep is not None:
            with torch.no_grad():
                self._average(self.model.flat)
        units = range(self.rank, self.model.eval_unit_count(), self.dp)  # slice `rank` of every eval batch
        total = torch.tensor([sum(self.model.eval_units(u, u + 1) for u in units)], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(total)
        if keep is not None:
            with torch.no_grad():
                self.model.flat.copy_(keep)
        return float(total) / (self.cfg.train.eval_batches * self.cfg.tokens_per_step)

    def _log_round(self, metrics: Metrics, result, sync_s: float) -> None:
        """At a synchronisation: the mean over workers of each step's loss and gradient norm, one row per step; the
        times are this rank's (its local steps and its wait at the synchronisation add up to the round's wall time)."""
        vals = torch.tensor([[loss, norm] for _, loss, norm, _ in self.round], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(vals)
        vals /= self.dp
        t = self.cfg.train
        for k, ((s, _, _, sec), (loss, norm)) in enumerate(zip(self.round, vals.tolist())):
            last = k == len(self.round) - 1
            dt = sec + (sync_s if last else 0.0)
            behind = (s - 1) % self.cfg.parallel.local_steps  # the other workers' steps this step's parameters lack
            row = {"step": s, "loss": loss, "lr": lr_at(s, t) * self.lr_scale, "grad_norm": norm,
                   "tokens_per_s": self.cfg.tokens_per_step / dt, "step_time_s": dt, "staleness_max": behind,
                   "staleness_mean": behind}
            if last:
                row.update({f"comm_{kind}_bytes": n for kind, n in sorted(self.comm.bytes.items())})
            if s in self.val:
                row["val_loss"] = result.val_losses[s] = self.val.pop(s)
            result.losses[s] = loss
            metrics.write(row)
        self.round = []
        self.comm.reset()

    def run(self, stop_after: int | None = None):
        t, p = self.cfg.train, self.cfg.parallel
        result = TrainResult(params=self.n_params, resumed_from=self.step)
        root = self.rank == 0
        metrics = Metrics(self.out if root else None, self.cfg, self.step, self.progress and root, self.obs)
        last = min(t.steps, stop_after) if stop_after is not None else t.steps
        t_start, tokens = time.perf_counter(), 0
        try:
            while self.step < last:
                self.step += 1
                s = self.step
                self._local_step(s)
                tokens += self.cfg.tokens_per_step
                synced = s % p.local_steps == 0 or s == t.steps
                sync_s = 0.0
                if synced:
                    t0 = time.perf_counter()
                    self._synchronise()
                    sync_s = time.perf_counter() - t0
                if t.eval_every and (s % t.eval_every == 0 or s == t.steps):
                    self.val[s] = self._evaluate(synced)
                if synced:
                    self._log_round(metrics, result, sync_s)
                if self.out is not None and ((t.checkpoint_every and s % t.checkpoint_every == 0) or s == t.steps):
                    metrics.sync()
                    self.save()
                    metrics.checkpoint(s)
        finally:
            metrics.close()
        self.rows = metrics.rows
        self.obs.finish()
        elapsed = time.perf_counter() - t_start
        result.final_step = self.step
        result.tokens_per_s = tokens / elapsed if elapsed else 0.0
        return result

    def full_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_with()
