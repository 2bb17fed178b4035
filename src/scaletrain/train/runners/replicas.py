"""Training one fault-tolerant replica group (parallel.replicas > 1; docs/fault_tolerance.md): HSDP across groups
with a per-step quorum, as torchft does (github.com/pytorch/torchft), on torch.distributed (distributed/quorum.py).

Each step: join the round's quorum (the lighthouse, multinode/lighthouse.py); if this group is behind (restarted),
receive parameters, optimizer state and step from a live member, checksummed (distributed/heal.py), and join at
this step boundary; compute this group's gradient on its own rows of the global batch (group g of R takes rows
g*B/R .. (g+1)*B/R, as data-parallel rank g of dp = R would), normalised by its own tokens; sum the gradients (and
losses) over the quorum and divide by the quorum's size; commit through the lighthouse; clip and step.

The missing group's share (parallel.missing_rows): `skip` (the default): a step with Q of R groups is the mean
gradient over the Q groups' rows (the batch actually computed) at the step's usual learning rate; the rows of a dead
group are not recomputed by the others, so a failure costs (R - Q) x B/R sequences of that step and no stop.
`reassign`: the lighthouse gives each missing group's rows to a live member, round-robin (distributed/rows.py); a
member adds its shares' gradients (its own first), the sum over members is divided by R, so the step is the mean over
the whole global batch at the usual learning rate, and the live groups compute more. The membership log records
which groups computed each step and whose rows each computed; `scaletrain replay` recomputes exactly that.

Groups of two processes (parallel.dp = 2 x replicas, parallel.zero = 2): each group is ZeRO-2 over its own two
ranks (rank I of group g takes the rows of data-parallel rank g*2+I of dp = 2R, and after each micro-batch's
backward the group reduce-scatters its gradients, so rank I holds shard I of the group's gradient). The quorum is
joined once per group (its local rank 0) and handed to the other rank; rank I of every member forms the cross-group
gloo group of local rank I and adds the members' shard I in member order; the lighthouse commits only when every
rank of every member reported ok; then each group clips by the norm over its two shards, steps its shards and
all-gathers the parameters. A restarted group heals rank by rank: rank I receives rank I's ZeRO shard (its slice of
the parameters, its optimizer state) from rank I of the source group, and the group all-gathers its parameters.
The replay recomputes a group's gradient as its engine does: per micro-batch, the two ranks' gradients added (a sum
of two is the same in either order), accumulated over the micro-batches.
ZeRO-3 groups (parallel.zero = 3) reduce-scatter per unit and micro-batch as ZeRO-2 does (the same replay), keep
their parameters as shards gathered per unit (nothing to all-gather after the step or a heal: a heal sends rank I's
parameter shard); plain dp and ZeRO-1 groups reduce once after the last micro-batch (the replay adds each rank's
accumulated gradient) and a heal sends rank I's whole state (plain dp) or its ZeRO-1 shard.

Groups of two tensor-parallel ranks (parallel.tp = 2, parallel.dp = replicas): both ranks read the group's rows;
rank I of every member adds its own tp slice's gradients (and its copy of the replicated parameters') in member
order over local rank I's cross-group group, each group clips by the whole model's norm (the engine's clip, reduced
over its tp ranks), and a restarted group heals rank by rank (rank I receives rank I's training state: its slice).
The replay computes each group's gradient at whole width: equal to the run within docs/verify.md's fp64 bound.
Groups of two 1F1B pipeline stages (parallel.pp = 2, parallel.dp = replicas) work the same way stage by stage:
the engine's schedule runs the micro-batches of the group's rows, adds the last stage's tied-embedding gradient on
stage 0 (across the pipeline first) and broadcasts the loss to stage 0; then stage I of every member sums over local
rank I's cross-group group, the clip's norm is reduced over the two stages, and a heal sends stage I's state to
stage I. The replay runs all stages in one process, within the same bound as tp groups.
A run may start from a checkpoint of another layout (`--reshard`): every rank reads it through train/resume.py, and
the replay starts from the same checkpoint (train/replica_replay.py).

Checkpoints (train.checkpoint_every, and the last step): the committed state is the same in every member after a
round, so the lowest-numbered member of the step's quorum writes it alone, through train/checkpoint.py (the plain
portable format, COMPLETE marker, in the background with train.checkpoint_async), as the checkpoint of the whole run
(its config and world size). A whole-job launch resumes every group from the newest complete checkpoint; a group
restarted inside a run never reads one: it heals from a live group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.distributed.comm import all_gather_single
from scaletrain.distributed.heal import Link, load_training_state, recv_state, send_state, training_state
from scaletrain.distributed.quorum import LIGHTHOUSE_ENV, REPLICA_ENV, Quorum, QuorumClient, ordered_sum
from scaletrain.distributed.rows import divisor, rows_of
from scaletrain.errors import CheckpointError
from scaletrain.model.moe import begin_step as begin_moe_step
from scaletrain.model.moe import moe_modules
from scaletrain.parallel.experts import ExpertParallelOptimizer
from scaletrain.parallel.zero import ZeroOptimizer
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import resume
from scaletrain.train.replica_init import start_checkpoint, start_record
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import Trainer, TrainResult

FAULT_ENV = "SCALETRAIN_FT_FAULT"
"""Fault drills (tests, benchmarks): `kill:G:S` or `stop:G:S` sends SIGKILL / SIGSTOP to replica group G's
process when it has joined the quorum of step S, on its first attempt only (a restarted group is not hit again);
`hold:G:S` makes it write `OUT/replicas/held-group{G}` there and sleep while its heartbeat goes on (the run stalls
until it is killed: a whole-job kill at a known step); `corrupt:G:0` makes group G, when it sends a heal, corrupt
the first chunk once (the receiver must detect it); `corrupt:G:all` makes it corrupt every chunk of every heal it
sends on every resend (each heal fails: the lighthouse excludes the receiver after parallel.heal_attempts rounds)."""
PACE_ENV = "SCALETRAIN_FT_PACE_S"
"""Fault drills: each committed step with fewer than all groups takes at least this many seconds (so the restart of
a tiny model's group finds the run still going); not once every missing group was excluded by the lighthouse."""


def ranks_per_group(cfg: Config) -> int:
    """Processes per replica group: its data-parallel ranks times its tensor-parallel ranks."""
    return cfg.world_size // cfg.parallel.replicas


def dp_per_group(cfg: Config) -> int:
    """Data-parallel ranks per replica group (each reads its own rows of the group's share of the batch)."""
    return cfg.parallel.dp // cfg.parallel.replicas


def group_config(cfg: Config, replay: bool = False) -> Config:
    """The config one group's trainer runs: its share of the data-parallel dimension, its tensor or pipeline
    parallelism (a pipeline scheduling the micro-batches of the group's rows), no replicas (`replay`: the one
    process of `scaletrain replay`, which computes every rank's gradient itself, at whole width, all stages)."""
    p = cfg.parallel
    if replay:
        return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=1, tp=1, pp=1, ep=1, replicas=1, zero=0,
                                                                     microbatches=0))
    # a pipeline's schedule runs the micro-batches of the group's rows (those of one dp rank of the whole run)
    micro = (p.microbatches or cfg.grad_accum) if p.pp > 1 else p.microbatches
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp_per_group(cfg), replicas=1,
                                                                 microbatches=micro))


def _grads(opt) -> list[torch.Tensor]:
    """The gradients this rank reduces across groups: the whole gradients, or its ZeRO shard's; under expert
    parallelism (ep2 groups) the dense parameters' (all-reduced over the group) then this rank's experts'."""
    if isinstance(opt, ExpertParallelOptimizer):
        return [g for part in opt.parts for g in _grads(part)]
    return [g.shard_grad for g in opt.groups] if isinstance(opt, ZeroOptimizer) else opt.grads


class GroupModel:
    """The model, optimizer and data of one replica group's rank (a `Trainer` without an output folder), and its
    gradient of one step. Shared by the runner and the replay (`replay`: one process computing whole groups)."""

    def __init__(self, cfg: Config, replay: bool = False):
        self.cfg, self.ranks, self.dps = cfg, ranks_per_group(cfg), dp_per_group(cfg)
        self.trainer = Trainer(group_config(cfg, replay), None, None)
        self.opt = self.trainer.engine.optimizer  # replicated (dp, tp, the replay) or ZeRO-1/2 over the group's dp
        self.tokens = cfg.tokens_per_step // cfg.parallel.replicas  # one group's tokens of a step
        self.local_rank = dist.get_rank() if not replay and self.ranks > 1 else 0
        self.dp_rank = self.trainer.dp_rank  # the rows it reads: tp ranks of one dp rank read the same ones

    def _micro(self, step: int, group: int, rank: int):
        """Data-parallel rank `rank` of group `group`'s micro-batches: those of rank group x dps + rank of dp."""
        t = self.trainer
        return t.loader.micro_batches(step, group * self.dps + rank, self.cfg.parallel.dp, self.cfg.train.micro_batch,
                                      device=t.device)

    def _flat(self, loss: torch.Tensor) -> torch.Tensor:
        grads = _grads(self.opt)
        loss = loss.reshape(1).to(grads[0].dtype) + self._aux_loss()
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss])
        self.opt.zero_grad()
        return flat

    def _aux_loss(self) -> float:
        """This rank's share of the weighted MoE auxiliary and z-losses of the forward just run (0 without MoE), per
        token of the group: added to the logged loss as the Trainer adds them (they are already in the gradient)."""
        w = self.cfg.model.moe
        if not w.experts:
            return 0.0
        aux_weight = 1.0 if w.aux_loss == "importance" else w.aux_loss_weight  # importance's aux is weighted
        return sum(aux_weight * m.stats.aux + w.z_loss_weight * m.stats.z
                   for m in moe_modules(self.trainer.model)) / self.tokens

    def local_grad(self, step: int, group: int) -> torch.Tensor:
        """This rank's part of its group's gradient of the mean token loss over the group's rows, flattened, with
        this rank's part of that loss appended: the whole gradient (a group of one process) or its ZeRO shard."""
        return self._rank_grad(step, group, self.dp_rank)

    def _first_row(self, group: int, rank: int) -> int:
        """The global batch row of data-parallel rank `rank` of group `group`'s first row of a step."""
        cfg = self.cfg
        return (group * self.dps + rank) * (cfg.train.global_batch // cfg.parallel.dp)

    def _begin(self, step: int, first_row: int) -> None:
        """The per-step state of the model's random streams, as the Trainer sets it (train/trainer.py): MoE routers'
        noise and random routing (model/moe.py) and layout-independent dropout (model/dropout.py) are keyed by
        (seed, step, global row of the rank's first row), so a group, a healed group and the replay draw the same
        numbers for the same rows; the MoE layers' statistics are reset."""
        t, cfg = self.trainer, self.cfg
        if cfg.model.moe.experts:
            begin_moe_step(t.model, cfg.train.seed, step, first_row)
        if t.engine.dropout is not None:
            d = t.engine.dropout
            d.seed, d.step, d.base_row = cfg.train.seed, step, first_row

    def _rank_grad(self, step: int, group: int, rank: int) -> torch.Tensor:
        t = self.trainer
        self._begin(step, self._first_row(group, rank))
        with t.own_rng():
            loss = t.engine.forward_backward(self._micro(step, group, rank), 1.0 / self.tokens)
        return self._flat(loss)

    def group_grad(self, step: int, group: int) -> torch.Tensor:
        """The replay: group `group`'s whole gradient (and loss) as its engine computes it. One data-parallel rank
        (one process, or tp ranks: their slices at whole width): its local_grad. Two with ZeRO-2 or -3: per micro-batch
        the ranks' gradients added in rank order (the reduce-scatter), accumulated over the micro-batches into a
        zero buffer (the shard accumulator). Two with plain dp or ZeRO-1: each rank's gradient accumulated over
        its micro-batches, then the ranks' added in rank order (the one reduction after the last micro-batch)."""
        if self.dps == 1:
            return self.local_grad(step, group)
        if self.cfg.parallel.zero not in (2, 3):
            return ordered_sum([self._rank_grad(step, group, i) for i in range(self.dps)])
        t = self.trainer
        micro = [self._micro(step, group, i) for i in range(self.dps)]
        total = None
        for m in range(len(micro[0])):
            parts = []
            for i in range(self.dps):
                self._begin(step, self._first_row(group, i) + m * self.cfg.train.micro_batch)
                with t.own_rng():
                    parts.append(self._flat(t.engine.forward_backward([micro[i][m]], 1.0 / self.tokens)))
            reduced = ordered_sum(parts)
            total = torch.zeros_like(reduced) + reduced if total is None else total + reduced
        return total

    def apply(self, step: int, mean: torch.Tensor) -> torch.Tensor:
        """Set the gradients to `mean` (without its loss entry), clip, update; the step's grad norm."""
        offset = 0
        for g in _grads(self.opt):
            g.copy_(mean[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        for part in self.opt.parts:  # plain dp over several ranks drops .grad in zero_grad
            if not isinstance(part, ZeroOptimizer):
                for p, g in zip(part.params, part.grads):
                    p.grad = g
        norm = self.opt.clip_grad_norm(self.cfg.train.grad_clip)
        self.opt.step(lr_at(step, self.cfg.train) * self.trainer.lr_scale)
        self.opt.zero_grad()
        return norm


class ReplicaRunner:
    """One replica group's process: the `make_trainer` interface (`step`, `n_params`, `run()`, `full_state()`)."""

    def __init__(self, cfg: Config, out: Path | None, reshard: bool = False, init_from: str | Path | None = None):
        self.cfg, self.out = cfg, out
        self.group = int(os.environ[REPLICA_ENV])
        self.model = GroupModel(cfg)
        self.n_params = self.model.trainer.n_params
        self.step = 0
        p = cfg.parallel
        self.rank = self.model.local_rank  # this process's rank in its group
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.client = QuorumClient(os.environ[LIGHTHOUSE_ENV], self.group, p.heartbeat_s, 2 * p.heartbeat_s,
                                   local_rank=self.rank, attempt=attempt)
        self.fault = _fault(self.group, self.rank, self.model.ranks)
        self.pace = float(os.environ.get(PACE_ENV, "0"))
        self.saver: ckpt.Saver | None = None
        if out is not None:  # the launcher stops a group still alive after the run (a frozen one) by this pid
            (out / "replicas").mkdir(parents=True, exist_ok=True)
            pid = f"group{self.group}.pid" if self.rank == 0 else f"group{self.group}.rank{self.rank}.pid"
            (out / "replicas" / pid).write_text(str(os.getpid()))
            t = cfg.train  # the group's ranks write the checkpoint together (each its ZeRO shard)
            self.saver = ckpt.Saver(out / "checkpoints", self.rank, t.keep_checkpoints, t.checkpoint_async, p.timeout_s)
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:  # a restarted group heals instead
                self._resume(reshard, init_from is not None)

    def _resume(self, reshard: bool, init: bool = False) -> None:
        """A whole-job launch: load the newest complete checkpoint (any group's; they are one state), or with
        `reshard` a checkpoint of another layout's run (train/resume.py reads it into this group's layout)."""
        assert self.out is not None
        found, _ = ckpt.usable_latest(self.out / "checkpoints")
        if found is None:
            if init:  # --init-from: the imported weights, as the launcher wrote them
                self._start_from_init()
            return
        t = self.model.trainer
        meta = ckpt.read_meta(found)
        diffs = resume.check_compatible(found, meta, self.cfg, self.cfg.world_size, reshard=reshard)
        resume.load_engine(t.engine, found, streams={t.rng_stream: t.rng})
        self.step = int(meta["step"])
        if self.group == 0 and self.rank == 0:  # resumes.jsonl: whole-job resumes only (heals: the membership log)
            extra = {}
            if any(resume.kind(k) == "layout" for k in diffs) or meta["world_size"] != self.cfg.world_size:
                extra["layout"] = {"from": meta["layout"], "to": resume.describe_layout(self.cfg.to_dict(),
                                                                                        self.cfg.world_size)}
            resume.record_resume(self.out, self.step, diffs, checkpoint=found.name, **extra)
            start = {"checkpoint": found.name, **({"from_layout": extra["layout"]["from"]} if extra else {})}
            self.client.store.set("start", json.dumps(start))  # the lighthouse's first row records it
            resume.trim_metrics(self.out, self.step)  # the steps after the checkpoint are computed again

    def _start_from_init(self) -> None:
        """A fresh launch with `--init-from`: read the start checkpoint the launcher wrote of the imported weights
        (train/replica_init.py) into this rank's layout; group 0 names it to the lighthouse for the log's first row."""
        assert self.out is not None
        found = start_checkpoint(self.out)
        if found is None:
            raise CheckpointError(f"{self.out}: no start checkpoint of the imported weights (the launcher writes it)")
        t = self.model.trainer
        resume.load_engine(t.engine, found, streams={t.rng_stream: t.rng})
        if self.group == 0 and self.rank == 0:
            self.client.store.set("start", json.dumps(start_record(self.out, found)))

    def _save(self, q: Quorum) -> None:
        """Write the checkpoint of the step just committed (this group is the quorum's lowest member)."""
        assert self.saver is not None
        t = self.model.trainer
        entries = resume.save_entries(t.engine, {t.rng_stream: t.rng})
        meta = resume.checkpoint_meta(self.cfg, self.cfg.world_size, resume.trainer_meta(t))
        meta["replicas"] = {"writer": self.group, "members": q.members, "round": q.round}
        self.saver.save(self.step, entries, meta)

    def full_state(self) -> dict[str, torch.Tensor]:
        return self.model.trainer.full_state()

    def _heal(self, q: Quorum) -> tuple[dict, dict] | None:
        """Bring members that are behind to the source's state (the others wait until it is done, so the step's
        collective does not time out on a long transfer). A receiver gets (its verified state, its receive stats),
        loaded only once every rank of its group has its own (`_phase`); None for the others."""
        link = Link(self.client.process_group(q))  # the cross-group group of this local rank
        src = q.members.index(q.source)
        if self.group == q.source:
            kind = self.fault[0] if self.fault is not None else None
            tamper = {"corrupt": _flip_first_chunk, "corrupt-all": _flip_every_chunk}.get(kind)
            try:
                for g in q.behind:
                    send_state(self._heal_state(), q.members.index(g), link, tamper=tamper)
            finally:  # sent or failed: the others stop waiting (a failed heal fails the round through its receiver)
                self.client.store.set(f"healed/{q.round}/{self.rank}", "1")
        elif self.group in q.behind:
            state, stats = recv_state(src, link)
            self._check_slice(state)
            return state, {"seconds": stats.seconds, "retries": stats.retries, "bytes": stats.bytes}
        else:
            self.client.wait(f"healed/{q.round}/{self.rank}", self.cfg.parallel.timeout_s)
        return None

    def _check_slice(self, state: dict) -> None:
        """A verified heal payload of an ep2 group holds the sender's experts: refused (the round fails, nothing is
        loaded) unless they are this rank's (both ranks' expert weights have the same names and shapes)."""
        if "ep_rank" in state and state["ep_rank"] != self.model.trainer.mesh.local_rank("ep"):
            raise RuntimeError(f"replica group {self.group}: the heal sent ep rank {state['ep_rank']}'s experts to "
                               f"ep rank {self.model.trainer.mesh.local_rank('ep')}")

    def _phase(self, q: Quorum) -> dict | None:
        """The round's heal phase, agreed by the group's ranks: the heal's stats (None if not behind); RuntimeError
        when any rank of this group failed it. The ranks go on to the step's collectives inside the group (ZeRO-2's
        reduce-scatter, the healed parameters' all-gather) together or not at all."""
        try:
            got = self._heal(q) if q.behind else None
            ok = True
        except RuntimeError as e:  # a peer died during the transfer, or a chunk stayed corrupt: not joined
            got, ok = None, False
            if self.group in q.behind:  # the lighthouse excludes a group whose heals keep failing
                self.client.heal_failed(q, str(e) or type(e).__name__)
        if not self.client.agree(q, ok, self.model.ranks, self.cfg.parallel.timeout_s):
            raise RuntimeError(f"replica group {self.group}: the heal of round {q.round} failed on a rank")
        if got is None:
            return None
        try:
            self.step = self._load_heal(got[0])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # a verified state this rank cannot load
            self.client.heal_failed(q, f"the received state does not load: {e}")
            raise RuntimeError(f"replica group {self.group}: the healed state does not load") from e
        return got[1]

    def _heal_state(self) -> dict:
        """What this rank sends to the same local rank of a group that is behind: the whole training state (a group
        of one process, plain dp), or its ZeRO shard: its slice of the parameters (ZeRO-3: its persistent parameter
        shard) and masters, its optimizer state."""
        t = self.model.trainer
        z = t.engine.optimizer
        if isinstance(z, ExpertParallelOptimizer):  # ep2 groups: its experts' slice and the dense copy, both parts'
            return {"model": t.model.state_dict(), "optimizer": [o.state_dict() for o in z.parts],  # AdamW state
                    "ep_rank": t.mesh.local_rank("ep"), "step": self.step}
        if not isinstance(z, ZeroOptimizer):
            return training_state(t.model, z, self.step)
        return {"shards": [_param_shard(z, g).clone() for g in z.groups],
                "masters": [g.master.clone() for g in z.groups] if z.main_grads else [],
                "optimizer": z.opt.state_dict(), "step": self.step}

    def _load_heal(self, state: dict) -> int:
        """Load a verified heal payload; a ZeRO-1/2 group then all-gathers its parameters (both ranks heal at once)."""
        t = self.model.trainer
        z = t.engine.optimizer
        if isinstance(z, ExpertParallelOptimizer):
            t.model.load_state_dict(state["model"])
            for part, part_state in zip(z.parts, state["optimizer"]):
                part.load_state_dict(part_state)
            return int(state["step"])
        if not isinstance(z, ZeroOptimizer):
            return load_training_state(t.model, z, state)
        with torch.no_grad():
            for g, shard in zip(z.groups, state["shards"]):
                _param_shard(z, g).copy_(shard)
            for g, master in zip(z.groups, state["masters"]):
                g.master.copy_(master)
            z.opt.load_state_dict(state["optimizer"])
            if z.stage != 3:  # ZeRO-3 gathers each unit's parameters from the shards when it runs
                for g in z.groups:
                    all_gather_single(g.full, g.own(g.full).clone(), group=z.group)
        return int(state["step"])

    def run(self) -> TrainResult:
        result = TrainResult(params=self.n_params, resumed_from=self.step)
        log = open(self.out / "replicas" / f"group{self.group}.jsonl", "a") if self.out is not None else None
        local: tuple[int, dict[int, torch.Tensor]] = (-1, {})  # (step, group -> its rows' gradient) kept across
        # failed rounds; with parallel.missing_rows=reassign a member also computes missing groups' rows
        try:
            while True:
                q = self.client.join(self.step)
                if q is None:
                    break
                if self.fault is not None and self.fault[1] == q.step and not self.fault[0].startswith("corrupt"):
                    self._drill()
                t0 = time.perf_counter()
                try:
                    heal = self._phase(q)
                except RuntimeError:  # a peer died during the transfer, or a chunk stayed corrupt: not joined
                    self.client.commit(q, False)
                    continue
                if local[0] != q.step:
                    local = (q.step, {})
                mine = rows_of(q.rows, self.group)  # this group's rows, then those of missing groups it computes
                for g in mine:
                    if g not in local[1]:
                        local[1][g] = self.model.local_grad(q.step, g)
                total = self.client.gather_sum(q, ordered_sum([local[1][g] for g in mine]))
                if not self.client.commit(q, total is not None, heal):
                    continue
                mean = total / divisor(q.rows, q.members)  # Q groups' rows (skip) or all R (reassign)
                norm = self.model.apply(q.step, mean)
                loss = mean[-1].clone()
                if self.model.dps > 1:  # the group's loss: its data-parallel ranks' parts (tp ranks: the whole)
                    dist.all_reduce(loss, group=self.model.trainer.dp_group)
                if self.pace and not self._all_missing_excluded(q):
                    time.sleep(max(0.0, self.pace - (time.perf_counter() - t0)))
                self.step = q.step
                row = {"step": q.step, "loss": float(loss), "grad_norm": float(norm), "members": q.members,
                       "round": q.round, "step_time_s": time.perf_counter() - t0,
                       "groups_computed": divisor(q.rows, q.members)}
                if len(mine) > 1:  # the extra compute of reassigned rows
                    row["rows"] = mine
                if heal is not None:
                    row["heal"] = heal
                result.losses[q.step] = row["loss"]
                if log is not None and self.rank == 0:
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                if self.out is not None and self.group == q.members[0] and self.rank == 0:  # the lowest member
                    self._metrics(row, lr_at(q.step, self.cfg.train) * self.model.trainer.lr_scale)
                every, last = self.cfg.train.checkpoint_every, self.cfg.train.steps
                if self.saver is not None and self.group == q.members[0] and (
                        (every and self.step % every == 0) or self.step == last):
                    self._save(q)
                if self.step >= last:  # the last step is committed: the lighthouse's store may close any moment
                    break
        finally:
            self.client.close()
            if log is not None:
                log.close()
        if self.saver is not None:
            self.saver.wait()
        result.final_step = self.step
        if self.out is not None and self.step >= self.cfg.train.steps:
            params = self.full_state()  # every rank: tp slices are gathered
            if self.rank != 0:
                return result
            path = self.out / "replicas" / f"final-group{self.group}.pt"
            torch.save({"step": self.step, "params": params, "threads": torch.get_num_threads()},
                       path.with_suffix(".part"))
            os.replace(path.with_suffix(".part"), path)  # whole or absent: the launcher stops groups once it sees it
        return result


    def _metrics(self, row: dict, lr: float) -> None:
        """The step's row of `OUT/metrics.jsonl` (every train.log_every steps and the last), for the report: loss
        and gradient norm of the quorum's mean, lr, step time, tokens/s of the rows actually computed."""
        t = self.cfg.train
        if self.step % t.log_every and self.step != t.steps:
            return
        tokens = row["groups_computed"] * self.model.tokens  # reassigned rows included
        line = {"step": self.step, "loss": row["loss"], "grad_norm": row["grad_norm"], "lr": lr,
                "step_time_s": row["step_time_s"], "tokens_per_s": tokens / row["step_time_s"],
                "replica_groups": len(row["members"])}
        with open(self.out / "metrics.jsonl", "a") as f:  # one short line, appended: whole or absent
            f.write(json.dumps(line) + "\n")

    def _all_missing_excluded(self, q: Quorum) -> bool:
        """Whether every group missing from q was excluded by the lighthouse (the fault drills' pace then stops)."""
        missing = set(range(self.cfg.parallel.replicas)) - set(q.members)
        return all(self.client.store.check([f"excluded/{g}"]) for g in missing)

    def _drill(self) -> None:
        assert self.fault is not None
        if self.fault[0] == "hold":
            if self.out is not None:
                (self.out / "replicas" / f"held-group{self.group}").touch()
            while True:
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL if self.fault[0] == "kill" else signal.SIGSTOP)


def _param_shard(z: ZeroOptimizer, g) -> torch.Tensor:
    """This rank's slice of a flat group's parameters: ZeRO-3's persistent shard (its flat buffer is released between
    uses), or the owned slice of ZeRO-1/2's full buffer."""
    return g.param_shard if z.stage == 3 else g.own(g.full)


def _fault(group: int, rank: int = 0, ranks: int = 1) -> tuple[str, int] | None:
    """This process's drill from FAULT_ENV (a comma list of `kill:G:S`, `stop:G:S`, or `corrupt:G:0`: as the heal
    source, group G corrupts the first chunk it sends once; `corrupt:G:all`: every chunk, every time), on the first
    attempt only. In a group of several
    processes `kill` and `stop` hit its last rank only (its agent then stops the others, or the group's heartbeat
    names it dead); `hold` and `corrupt` every rank."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    for item in spec.split(","):
        kind, g, step = item.split(":")
        if kind == "corrupt" and step == "all":
            kind, step = "corrupt-all", "0"
        if int(g) == group and (kind not in ("kill", "stop") or rank == ranks - 1):
            return kind, int(step)
    return None


def _flip_every_chunk(index: int, attempt: int, chunk: torch.Tensor) -> torch.Tensor:
    chunk[0] ^= 0xFF
    return chunk


def _flip_first_chunk(index: int, attempt: int, chunk: torch.Tensor) -> torch.Tensor:
    if index == 0 and attempt == 0:
        chunk[0] ^= 0xFF
    return chunk
