"""ZeRO-Infinity: ZeRO-3 whose parameter, master, optimizer-state and gradient shards live in files.

Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning",
arXiv 2104.07857. What we take from it, on top of our ZeRO-3 (`parallel/zero.py`, arXiv 1910.02054):

- Infinity offload engine (Sec. 5.1): each rank's shards of every ZeRO-3 unit are kept in files under
  `parallel.offload_dir` (`nvme_io.ShardFiles`): the parameters (compute dtype), the fp32 masters (bf16/fp16
  only; in fp32/fp64 the parameter shard is the master), AdamW's exp_avg and exp_avg_sq, and (by default,
  `parallel.nvme_grads`) the gradients.
- Bandwidth-centric partitioning (Sec. 6.1): a rank reads only its 1/N shard of a unit from its own files and the
  all-gather ZeRO-3 already does assembles the unit, so N ranks read with N disks' bandwidth in parallel.
- Overlap-centric design (Sec. 6.2): parameter shards are read ahead `parallel.nvme_prefetch` units in the order
  the forward and backward will gather them (`ReadAhead`), gradient shards are written behind the reduce-scatter
  (accumulated in the file with micro-batches), and the optimizer step streams each shard in chunks of
  `STEP_CHUNK` elements through a pool of prefetch + 1 staging sets: chunk j + 1 is read while chunk j is
  updated and chunk j - 1 written.
- Memory-centric tiling / init (Sec. 5.1.3, 7.3): the model is built on the meta device and each unit is
  materialised and initialised by (seed, name) on its own, written to the files and released, so the full
  model is never resident, not even at start-up.

What stays resident is bounded by the unit and chunk sizes, not by the model: two gathered units (current and
prefetch, as in-memory ZeRO-3), prefetch + 1 parameter staging buffers of the largest shard, prefetch + 1
gradient staging buffers (nvme_grads) and prefetch + 1 optimizer staging sets of STEP_CHUNK elements
(`plan.analytic.offload_costs.resident_bytes`, which the planner uses and the trainer measures; the planner's I/O and
step-time formulas are there too).

The optimizer arithmetic is torch's own AdamW (`torch.optim.adamw.adamw`, single-tensor path) applied to the
same pieces as in-memory ZeRO-3: elementwise, so chunking does not change a bit. `state_dict()` gives this rank's
whole state in in-memory ZeRO-3's form (AdamW state per piece, a flat parameter shard per unit, masters under mixed
precision), which the checkpoint code (`train/state.py`) maps to the layout-independent names, so a checkpoint
written with nvme offload resumes in memory and the other way round; the offload files are scratch.

This module builds on `zero.py`'s public interface (`ZeroOptimizer`, `FlatGroup`, `make_group`, `unit_list`,
`unit_params`, `preserve_version`, `in_backward`).
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.adamw import adamw as adamw_fn

from scaletrain.config import ModelConfig, OptimConfig, ParallelConfig
from scaletrain.config.sizes import NVME_STEP_CHUNK as STEP_CHUNK
from scaletrain.distributed.comm import CommStats, all_gather_single
from scaletrain.distributed.mesh import Mesh
from scaletrain.memory.nvme_io import ReadAhead, ShardFiles
from scaletrain.optim import config_hyper, optimizer_spec
from scaletrain.parallel.engine import weak_grad_hook
from scaletrain.parallel.norms import is_norm_owner
from scaletrain.parallel.zero import (
    FlatGroup,
    ZeroOptimizer,
    in_backward,
    make_group,
    preserve_version,
    unit_list,
    unit_params,
)


def meta_gpt(model_cfg, dtype: torch.dtype) -> nn.Module:
    """The plain GPT on the meta device, tied and cast like `model.init.build_gpt`, not materialised."""
    from scaletrain.model.gpt import gpt_on_meta

    model = gpt_on_meta(model_cfg)
    if model_cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    return model.to(dtype)


def gpt_init(model_cfg, seed: int) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """(name, shape) -> the float64 initial value `build_gpt` gives that parameter."""
    from scaletrain.model.init import gpt_rules, init_value

    rules = gpt_rules(model_cfg.n_layers, model_cfg.moe.switch_init_scale)
    return lambda name, shape: init_value(name, shape, seed, rules)


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class NvmeZeroOptimizer(ZeroOptimizer):
    """ZeRO-3 with every shard in files under `directory` (one sub-folder per rank, deleted by `close()`)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, *, device: torch.device,
                 directory: str | os.PathLike, init: Callable | None = None, prefetch: int = 2,
                 nvme_grads: bool = True, **kw: Any):
        if kw.get("reduce", "sum") != "sum" or not optimizer_spec(kw.get("optimizer", "adamw")).streamed:
            raise ValueError("NvmeZeroOptimizer sums gradients and steps AdamW")
        if kw.get("gather", "unit") != "unit":
            raise ValueError("NvmeZeroOptimizer gathers per unit")
        self._dev, self._init, self.depth, self.nvme_grads = torch.device(device), init, prefetch, nvme_grads
        self._root = Path(directory)
        self._grad_futures: dict[int, Any] = {}
        self._grad_writes: deque = deque()
        self._grad_written: set[int] = set()
        self._grad_sq: dict[int, float] = {}
        self._grad_muls: list[float] = []
        self._held: dict[int, torch.Tensor] = {}
        self.t = 0  # AdamW steps taken
        self._io_mark = (0, 0)
        super().__init__(module, 3, group, offload="nvme", **kw)
        self.device = self._dev

    @classmethod
    def from_config(cls, module: nn.Module, model: ModelConfig, optim: OptimConfig, par: ParallelConfig, seed: int,
                    lr: float, mesh: Mesh, comm: CommStats, device: torch.device) -> NvmeZeroOptimizer:
        """The run's ZeRO-Infinity optimizer over the dp group (`build_engine` with parallel.offload=nvme) in
        `par.offload_dir` (resolved, `resolve_offload_dir`); `module` is on meta (`meta_gpt`) and is materialised
        unit by unit here, each parameter initialised by (seed, name) as `build_gpt` does it."""
        import weakref

        root = Path(par.offload_dir)
        root.mkdir(parents=True, exist_ok=True)  # the default under --out; a user's folder was checked before launch
        opt = cls(module, mesh.group("dp_cp"), device=device, directory=root, init=gpt_init(model, seed),
                  prefetch=par.nvme_prefetch, nvme_grads=par.nvme_grads, weight_decay=optim.weight_decay,
                  bucket_mb=par.bucket_mb, comm=comm, optimizer=optim.name, hyper=config_hyper(optim, lr))
        weakref.finalize(opt, opt.files.close)  # scratch: deleted when the run ends (or the process exits)
        return opt

    # ------------------------------------------------------------------ layout and streamed initialisation

    def _setup_stage3(self, module: nn.Module, params: list[nn.Parameter], units) -> None:
        self.units = units = unit_list(module, units)
        owned = [(u, own) for u, own in zip(units, unit_params(units, params)) if own]
        self.groups, self._group_of, self._unit_group, self._index = [], {}, {}, {}
        low = params[0].dtype in (torch.bfloat16, torch.float16)
        dtype = params[0].dtype
        shards = [max(1, math.ceil(sum(p.numel() for p in own) / self.n)) for _, own in owned]
        self.shards = shards
        layout = {"params": (dtype, shards), "exp_avg": (self.grad_dtype, shards),
                  "exp_avg_sq": (self.grad_dtype, shards)}
        if low:
            layout["masters"] = (torch.float32, shards)
        if self.nvme_grads:
            layout["grads"] = (self.grad_dtype, shards)
        tag = f"scaletrain-nvme-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{self.rank:05d}"
        self.files = ShardFiles(self._root / tag, layout, threads=self.depth + 1)
        self.master_cat = "masters" if low else "params"
        names = {id(p): n for n, p in module.named_parameters()}
        for k, (u, own) in enumerate(owned):
            g = make_group(own, self.n, self.rank, self._dev)
            with torch.no_grad():
                for p, off in zip(g.params, g.offsets):
                    view = g.full[off: off + p.numel()].view_as(p)
                    if p.device.type == "meta":  # materialise this unit only, by (seed, name)
                        view.copy_(self._init(names[id(p)], tuple(p.shape)).to(p.dtype))
                        # a real (empty) tensor in place of the meta one, keeping the Parameter object (hooks,
                        # ties); then `.data` as in-memory ZeRO-3: its own version counter, not the flat buffer's
                        torch.utils.swap_tensors(p, nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad))
                    else:
                        view.copy_(p)
                    p.data = view
                shard = g.own(g.full).detach().to("cpu", copy=True)  # (numpy views pin a storage)
                self.files.write("params", k, shard)
                if low:
                    self.files.write("masters", k, shard.float())
            g.param_shard = None
            g.shard_grad = None if self.nvme_grads else torch.zeros(g.shard, dtype=self.grad_dtype, device=self._dev)
            self._release(g)
            self.groups.append(g)
            self._unit_group[id(u)] = g
            self._index[id(g)] = k
            for p in g.params:
                self._group_of[id(p)] = g
                p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad_ready))
        self.order = [u for u, _ in owned]
        for i, u in enumerate(self.order):
            u.register_forward_pre_hook(self._make_pre_forward(i))
            u.register_forward_hook(self._make_post_forward(i))
        pin = self._dev.type == "cuda"
        self.ahead = ReadAhead(self.files, "params", shards, self.depth + 1, max(shards), pin)
        U = len(self.groups)  # gathers of one micro-batch: forward 0..U-1, backward root, U-1, ..., 1
        self.sequence = list(range(U)) + ([0] + list(range(U - 1, 0, -1)) if U > 1 else [0])
        self._cursor, self._micro, self._micros = 0, 0, 1
        self.grad_pool = [torch.empty(max(shards), dtype=self.grad_dtype, pin_memory=pin)
                          for _ in range(self.depth + 1)] if self.nvme_grads else []
        self._grad_free = list(self.grad_pool)
        chunk = min(STEP_CHUNK, max(shards))
        self.step_sets = [self._staging_set(chunk, low, pin) for _ in range(self.depth + 1)]

    def _staging_set(self, chunk: int, low: bool, pin: bool) -> dict[str, torch.Tensor]:
        s = {"master": torch.empty(chunk, dtype=torch.float32 if low else self.groups[0].full.dtype, pin_memory=pin),
             "exp_avg": torch.empty(chunk, dtype=self.grad_dtype, pin_memory=pin),
             "exp_avg_sq": torch.empty(chunk, dtype=self.grad_dtype, pin_memory=pin),
             "grad": torch.empty(chunk, dtype=self.grad_dtype, pin_memory=pin)}
        if low:
            s["param"] = torch.empty(chunk, dtype=self.groups[0].full.dtype, pin_memory=pin)
        return s

    def _setup_masters(self) -> None:
        """No resident masters: the AdamW built by the base class runs over meta pieces and only gives the
        state-dict form (param groups, piece order); the arithmetic is `_step_chunk`'s."""
        for g in self.groups:
            g.master = None
            g.piece_params = []
            for pc in g.pieces:
                t = nn.Parameter(torch.empty(pc.hi - pc.lo, device="meta", dtype=self.grad_dtype))
                t.ndim_orig = pc.param.ndim
                g.piece_params.append(t)

    # ------------------------------------------------------------------ parameters: read ahead, gather

    def _k(self, g: FlatGroup) -> int:
        return self._index[id(g)]

    def _read_ahead_after(self, k: int) -> None:
        """Unit k is being gathered: read ahead the next `depth` units of the gather sequence (into the next
        micro-batch's forward while one remains)."""
        seq, n = self.sequence, len(self.sequence)
        for j in range(self._cursor, n):
            if seq[j] == k:
                self._cursor = j + 1
                left = n - j - 1 + (n if self._micro + 1 < self._micros else 0)
                for d in range(1, min(self.depth, left) + 1):
                    self.ahead.want(seq[(j + d) % n])
                return

    def _gather(self, g: FlatGroup, async_op: bool) -> None:
        if g.full.untyped_storage().nbytes() > 0 or g.pending is not None:
            return
        k = self._k(g)
        self._read_ahead_after(k)
        buf = self.ahead.take(k)
        g.full.untyped_storage().resize_(g.full.numel() * g.full.element_size())
        src = buf.to(self.device)  # the same tensor on CPU; a synchronous copy from pinned memory on CUDA
        if self.n == 1:
            with preserve_version(g.full):
                g.full.copy_(src)
            self.ahead.give(buf)
            return
        self.comm.add("all_gather", (self.n - 1) / self.n * g.full.numel() * g.full.element_size())
        with preserve_version(g.full):
            work = all_gather_single(g.full, src, group=self.group, async_op=async_op)
        if async_op:
            g.pending = (work, src)
            self._held[id(g)] = buf
        else:
            self.ahead.give(buf)

    def _make_pre_forward(self, i: int) -> Callable:
        """In-memory ZeRO-3's hook, except that a recomputation inside backward (activation checkpointing) only
        waits for its own unit: prefetching the next unit in forward order there would read a unit the backward
        does not need next."""
        forward_hook = super()._make_pre_forward(i)

        def hook(module, args):
            if in_backward():
                self._wait_gather(self._unit_group[id(module)])
                return None
            return forward_hook(module, args)
        return hook

    def _wait_gather(self, g: FlatGroup) -> None:
        super()._wait_gather(g)
        buf = self._held.pop(id(g), None)
        if buf is not None:
            self.ahead.give(buf)

    def begin_micro(self, index: int, count: int) -> None:
        super().begin_micro(index, count)
        self._cursor, self._micro, self._micros = 0, index, count
        if index == 0:  # a step begins: count its I/O from here, and start reading its first units
            self._io_mark = (self.files.read_bytes, self.files.write_bytes)
            for k in self.sequence[: self.depth]:
                self.ahead.want(k)

    def finish_backward(self) -> None:
        for g in self.groups:  # prefetches nobody used: finish them and return their buffers
            if g.pending is not None:
                self._wait_gather(g)
        super().finish_backward()

    # ------------------------------------------------------------------ gradients: written behind

    def _complete(self, g: FlatGroup, flat: torch.Tensor, out: torch.Tensor | None) -> None:
        shard = g.own(flat) if out is None else out
        if not self.nvme_grads:
            g.shard_grad += shard
            return
        k = self._k(g)
        prev = self._grad_futures.pop(k, None)
        if prev is not None:
            prev.result()
        while not self._grad_free:  # bounded write-behind: wait for the oldest write
            self._grad_writes.popleft().result()
        buf = self._grad_free.pop()[: g.shard]
        buf.copy_(shard)
        first = k not in self._grad_written
        self._grad_written.add(k)
        fut = self.files.submit(self._accumulate, g, k, buf, first)
        self._grad_futures[k] = fut
        self._grad_writes.append(fut)

    def _accumulate(self, g: FlatGroup, k: int, buf: torch.Tensor, first: bool) -> None:
        """Worker thread: add the file's gradient (after the step's first micro-batch), write, and keep the squared
        norm of the pieces this rank owns for clipping."""
        try:
            if not first:
                part = torch.empty(min(STEP_CHUNK, g.shard), dtype=buf.dtype)
                for lo in range(0, g.shard, STEP_CHUNK):
                    hi = min(lo + STEP_CHUNK, g.shard)
                    self.files.read("grads", k, part[: hi - lo], lo)
                    buf[lo:hi] += part[: hi - lo]
            self.files.write("grads", k, buf)
            self._grad_sq[k] = [buf[pc.lo: pc.hi].double().square().sum()
                                for pc in g.pieces if is_norm_owner(pc.param)]
        finally:
            self._grad_free.append(self.grad_pool[[b.data_ptr() for b in self.grad_pool].index(buf.data_ptr())])

    def _wait_grads(self) -> None:
        while self._grad_writes:
            self._grad_writes.popleft().result()
        self._grad_futures.clear()

    def local_grad_sq(self) -> torch.Tensor:
        if not self.nvme_grads:
            return super().local_grad_sq()
        self._wait_grads()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in self.groups:  # the pieces' sums in in-memory ZeRO-3's order: the same bits
            for part in self._grad_sq.get(self._k(g), []):
                sq += part
        return sq

    def scale_grads_(self, coef: float) -> None:
        if not self.nvme_grads:
            return super().scale_grads_(coef)
        self._wait_grads()
        self._grad_muls.append(coef)  # applied chunk by chunk in the step, in this order (as in memory)
        self._grad_sq = {k: [v * (coef * coef) for v in parts] for k, parts in self._grad_sq.items()}

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        """As ZeroOptimizer.unscale_ (a bool tensor on the run's device, stacked with the loss's flag), from the
        squared norms the gradient writer kept."""
        if not self.nvme_grads:
            return super().unscale_(inv_scale)
        if inv_scale != 1.0:
            self.scale_grads_(inv_scale)
        self._wait_grads()
        sq = torch.zeros((), dtype=torch.float64)
        for parts in self._grad_sq.values():
            for part in parts:
                sq += part
        return (~torch.isfinite(sq)).to(self.device)

    def zero_grad(self) -> None:
        if not self.nvme_grads:
            return super().zero_grad()
        self._wait_grads()
        self._grad_written.clear()  # the next step's first micro-batch overwrites the gradient files
        self._grad_sq.clear()
        self._grad_muls = []

    # ------------------------------------------------------------------ the streamed optimizer step

    def step(self, lr: float | None = None) -> None:
        """AdamW over the shard files, chunk by chunk: read chunk j + depth while chunk j is updated, write
        behind; at most depth + 1 staging sets in use."""
        if lr is not None:
            for pg in self.opt.param_groups:
                pg["lr"] = lr
        self._wait_grads()
        self.ahead.drop()  # read-aheads of the parameters this step replaces
        self.t += 1
        pg = self.opt.param_groups[0]
        wd = {True: self.opt.param_groups[0]["weight_decay"], False: self.opt.param_groups[1]["weight_decay"]}
        jobs = [(k, lo, min(lo + STEP_CHUNK, g.shard)) for k, g in enumerate(self.groups)
                for lo in range(0, g.shard, STEP_CHUNK)]
        free, reading, writing = list(self.step_sets), deque(), deque()
        nxt = 0
        for j, (k, lo, hi) in enumerate(jobs):
            while nxt < len(jobs) and nxt <= j + self.depth:  # read ahead
                if not free:
                    free.append(writing.popleft().result())  # the oldest write-behind gives its set back
                s = free.pop()
                reading.append((s, self.files.submit(self._read_chunk, s, *jobs[nxt])))
                nxt += 1
            s, fut = reading.popleft()
            fut.result()
            self._step_chunk(self.groups[k], s, lo, hi, wd, pg)
            writing.append(self.files.submit(self._write_chunk, s, k, lo, hi))
        for fut in writing:
            fut.result()
        self._grad_muls = []

    def _read_chunk(self, s: dict, k: int, lo: int, hi: int) -> None:
        n = hi - lo
        self.files.read(self.master_cat, k, s["master"][:n], lo)
        self.files.read("exp_avg", k, s["exp_avg"][:n], lo)
        self.files.read("exp_avg_sq", k, s["exp_avg_sq"][:n], lo)
        if self.nvme_grads:
            self.files.read("grads", k, s["grad"][:n], lo)
        else:
            s["grad"][:n].copy_(self.groups[k].shard_grad[lo:hi])

    def _write_chunk(self, s: dict, k: int, lo: int, hi: int) -> dict:
        n = hi - lo
        self.files.write(self.master_cat, k, s["master"][:n], lo)
        self.files.write("exp_avg", k, s["exp_avg"][:n], lo)
        self.files.write("exp_avg_sq", k, s["exp_avg_sq"][:n], lo)
        if "param" in s:
            self.files.write("params", k, s["param"][:n], lo)
        return s

    def _step_chunk(self, g: FlatGroup, s: dict, lo: int, hi: int, wd: dict, pg: dict) -> None:
        """AdamW on the pieces of unit g that lie in shard elements [lo, hi), as in-memory ZeRO-3 does it."""
        n = hi - lo
        grad = s["grad"][:n]
        for c in self._grad_muls:
            grad.mul_(c)
        step_value = float(self.t - 1)
        for pc in g.pieces:
            a, b = max(pc.lo, lo), min(pc.hi, hi)
            if a >= b:
                continue
            x, gr = s["master"][a - lo: b - lo], grad[a - lo: b - lo]
            m, v = s["exp_avg"][a - lo: b - lo], s["exp_avg_sq"][a - lo: b - lo]
            adamw_fn([x], [gr], [m], [v], [], [torch.tensor(step_value, dtype=_scalar_dtype())], foreach=False,
                     amsgrad=False, beta1=pg["betas"][0], beta2=pg["betas"][1], lr=pg["lr"],
                     weight_decay=wd[pc.param.ndim >= 2], eps=pg["eps"], maximize=False)
        if "param" in s:
            s["param"][:n].copy_(s["master"][:n])

    # ------------------------------------------------------------------ state, memory, I/O report

    def _pieces_in_order(self) -> list[tuple[int, Any]]:
        """(unit index, piece) in the order of the AdamW param groups (the in-memory optimizer's indices)."""
        where = {id(t): (k, pc) for k, g in enumerate(self.groups) for t, pc in zip(g.piece_params, g.pieces)}
        return [where[id(t)] for pg in self.opt.param_groups for t in pg["params"]]

    def _read_shard(self, cat: str, k: int) -> torch.Tensor:
        out = torch.empty(self.groups[k].shard, dtype=self.files.dtype[cat])
        self.files.read(cat, k, out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The form of in-memory ZeRO-3's `state_dict()` (read from the files; this rank's whole state)."""
        self._wait_grads()
        groups = self.opt.state_dict()["param_groups"]
        state: dict[int, dict[str, torch.Tensor]] = {}
        if self.t:
            moments = {}
            for i, (k, pc) in enumerate(self._pieces_in_order()):
                if k not in moments:
                    moments = {k: (self._read_shard("exp_avg", k), self._read_shard("exp_avg_sq", k))}
                m, v = moments[k]
                state[i] = {"step": torch.tensor(float(self.t), dtype=_scalar_dtype()),
                            "exp_avg": m[pc.lo: pc.hi].clone(), "exp_avg_sq": v[pc.lo: pc.hi].clone()}
        out: dict[str, Any] = {"adam": {"state": state, "param_groups": groups}, "stage": 3, "dp": self.n,
                               "param_shards": [self._read_shard("params", k).to(self.device)
                                                for k in range(len(self.groups))]}
        if self.master_cat == "masters":
            out["masters"] = [self._read_shard("masters", k) for k in range(len(self.groups))]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Write a ZeRO-3 state (in-memory or nvme, same dp) into the files."""
        if state.get("stage") != 3 or state.get("dp") != self.n:
            raise ValueError(f"optimizer state is for ZeRO-{state.get('stage')} on dp={state.get('dp')}, "
                             f"this run is ZeRO-3 on dp={self.n}")
        self._wait_grads()
        self.ahead.drop()
        adam = state["adam"]
        for mine, theirs in zip(self.opt.param_groups, adam["param_groups"]):
            for key in ("lr", "betas", "eps", "weight_decay"):
                mine[key] = theirs[key]
        pieces = self._pieces_in_order()
        if len(adam["param_groups"]) != len(self.opt.param_groups) or \
                sum(len(pg["params"]) for pg in adam["param_groups"]) != len(pieces):
            raise ValueError("optimizer state has another set of shard pieces")
        steps = {float(s["step"]) for s in adam["state"].values()}
        if len(steps) > 1:
            raise ValueError(f"optimizer pieces are at different steps {sorted(steps)}")
        self.t = int(steps.pop()) if steps else 0
        keys = ["param_shards"] + (["masters"] if self.master_cat == "masters" else [])
        for key in keys:
            if len(state.get(key, [])) != len(self.groups):
                raise ValueError(f"optimizer state has {len(state.get(key, []))} {key}, this run {len(self.groups)}")
        with torch.no_grad():
            for k, g in enumerate(self.groups):
                for key, cat in zip(keys, ("params", "masters")):
                    t = state[key][k]
                    if tuple(t.shape) != (g.shard,):
                        raise ValueError(f"{key} shape {tuple(t.shape)} != {(g.shard,)}")
                    self.files.write(cat, k, t.detach().to("cpu", self.files.dtype[cat]).contiguous())
            flat = {k: (torch.zeros(g.shard, dtype=self.grad_dtype), torch.zeros(g.shard, dtype=self.grad_dtype))
                    for k, g in enumerate(self.groups)}
            for i, (k, pc) in enumerate(pieces):
                s = adam["state"].get(i, adam["state"].get(str(i)))
                if s is not None:
                    flat[k][0][pc.lo: pc.hi].copy_(s["exp_avg"])
                    flat[k][1][pc.lo: pc.hi].copy_(s["exp_avg_sq"])
            for k, (m, v) in flat.items():
                self.files.write("exp_avg", k, m)
                self.files.write("exp_avg_sq", k, v)

    @property
    def separate_masters(self) -> bool:
        return self.master_cat == "masters"

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What is resident: gathered units and parameter staging, gradient staging (or the in-memory gradient
        shards), optimizer staging sets; the shards themselves are in the files (`file_bytes`)."""
        grads = self.grad_pool if self.nvme_grads else [g.shard_grad for g in self.groups]
        return {"params": [g.full for g in self.groups] + self.ahead.buffers, "grads": grads,
                "optim": [t for s in self.step_sets for t in s.values()]}

    def file_bytes(self) -> dict[str, int]:
        """Bytes of this rank's shard files per category (what offload moved out of memory)."""
        f = self.files.sizes
        return {"nvme_params": f["params"], "nvme_grads": f.get("grads", 0),
                "nvme_optim": f["exp_avg"] + f["exp_avg_sq"] + f.get("masters", 0)}

    def step_report(self) -> dict[str, int]:
        """Bytes this rank read and wrote in this step (the planner's `offload_costs.io_per_step` goes beside them)."""
        return {"nvme_read_bytes": self.files.read_bytes - self._io_mark[0],
                "nvme_write_bytes": self.files.write_bytes - self._io_mark[1]}

    def close(self) -> None:
        self._wait_grads()
        self.ahead.drop()
        self.files.close()


def resolve_offload_dir(cfg, out: str | os.PathLike | None):
    """The config with `parallel.offload_dir` resolved for offload=nvme: the user's folder, else OUT/offload,
    else (no output folder: tests, the API) the system's temporary folder. Other configs are returned as they are."""
    import copy
    import tempfile

    p = cfg.parallel
    if p.offload != "nvme" or p.offload_dir:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.parallel.offload_dir = str(Path(out) / "offload") if out is not None else tempfile.gettempdir()
    return cfg
