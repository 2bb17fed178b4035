"""Multi-process test harness: run a function on N ranks (spawned processes, gloo on a FileStore).

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` on `world_size` spawned processes, each
with a gloo process group with a timeout, and returns the list of results (passed back through `torch.save`, so
tensors are fine). The processes are kept for the next call of the same world size (see `run_ranks`). If a rank
raises, the others are killed and the failing rank's traceback is raised in the test; if the ranks do not finish
within `timeout` seconds, all are killed.

`train_reference(overrides)` and `train_parallel(overrides, world)` run the real Trainer on the same config
single-process and on N ranks; `assert_same_run` compares their per-step losses and final parameters.
"""

from __future__ import annotations

import copy
import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout


def _run_one(fn, rank, world, store_path, timeout, threads, args) -> tuple[str, bytes | str]:
    """One rank's part: a gloo group on the FileStore, fn, the group destroyed; ("ok", result bytes) or
    ("error", traceback)."""
    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=min(timeout, INIT_TIMEOUT_S)))
    except RuntimeError:
        return "init", traceback.format_exc()
    _set_pg_timeout(timedelta(seconds=timeout))  # the run's own collectives get the run's timeout
    try:
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        return "ok", buf.getvalue()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        return "error", traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _child(fn, rank, world, store_path, timeout, threads, args, q):
    """A fresh process for one run (tests that kill or hold ranks use it directly)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    status, payload = _run_one(fn, rank, world, store_path, timeout, threads, args)
    q.put((rank, status, payload))


# Modules whose functions a run must not leave replaced in a pooled rank (with every loaded scaletrain module): a
# fake left behind (torch.cuda.is_available answering True, a recording dist.init_process_group bound to an old
# run's store) would be what the next run in that process calls.
_WATCHED = ("torch", "torch.cuda", "torch.distributed", "torch.distributed.distributed_c10d", "torch.nn.functional",
            "torch.autograd")


def _module_functions() -> dict[tuple[str, str], object]:
    """{(module, name): object} of every function (not class: torch binds some classes lazily) of the watched and
    the loaded scaletrain modules."""
    names = [*_WATCHED, *(m for m in list(sys.modules) if m == "scaletrain" or m.startswith("scaletrain."))]
    out = {}
    for name in names:
        mod = sys.modules.get(name)
        for key, value in list(vars(mod).items()) if mod is not None else ():
            if callable(value) and not isinstance(value, type):
                out[(name, key)] = value
    return out


def _wraps(new: object, old: object) -> bool:
    """Whether `new` is `old` or a functools.wraps wrapper of it (importing torch._dynamo wraps torch.manual_seed
    once per process: the same function, not a fake)."""
    for _ in range(8):
        if new is old:
            return True
        new = getattr(new, "__wrapped__", None)
        if new is None:
            return False
    return False


def replaced_since(before: dict[tuple[str, str], object]) -> list[str]:
    """The `module.name`s of `before` (`_module_functions`) now bound to another object."""
    missing = object()
    return sorted(f"{m}.{k}" for (m, k), v in before.items()
                  if not _wraps(getattr(sys.modules.get(m), k, missing), v))


def _pool_worker(rank, world, tasks, q):
    """A rank that stays alive between runs: each task brings the parent's environment and working directory
    (a test may have changed them since the pool started), runs like `_child` and restores torch's defaults
    that a run may change, so the next run starts as a fresh process would (docstring of `run_ranks`). A run that
    leaves a function of torch or scaletrain replaced (a fake it installed) fails, naming it: the parent then
    closes the pool, so no later run calls the fake."""
    while True:
        task = tasks.get()
        if task is None:
            return
        job, fn, store_path, timeout, threads, args, env, cwd = task
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        before = _module_functions()
        status, payload = _run_one(fn, rank, world, store_path, timeout, threads, args)
        leaked = replaced_since(before)
        if leaked and status == "ok":
            status, payload = "error", (f"the run left {', '.join(leaked)} replaced in this reused rank: the next "
                                        "run in this process would call the replacement; restore what the run "
                                        "patches (or run it with fresh=True)")
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        q.put((job, rank, status, payload))


class _Pool:
    """`world` spawned ranks reused by consecutive `run_ranks` calls of that world size."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.jobs = world, 0
        self.q = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world, self.tasks[r], self.q), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for p, t in zip(self.procs, self.tasks):
            if p.is_alive() and not kill:
                t.put(None)
        for p in self.procs:
            p.join(timeout=0.1 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, _Pool] = {}
_KEEP_POOLS = 2  # world sizes whose ranks stay alive (each rank holds torch: ~0.3 GB)


def _pool(world: int) -> _Pool:
    pool = _POOLS.pop(world, None)
    if pool is not None and not pool.alive():
        pool.close(kill=True)
        pool = None
    if pool is None:
        pool = _Pool(world)
    _POOLS[world] = pool  # most recently used last
    while len(_POOLS) > _KEEP_POOLS:
        _POOLS.pop(next(iter(_POOLS))).close()
    return pool


def close_pools() -> None:
    for world in list(_POOLS):
        _POOLS.pop(world).close()


def _fresh_processes() -> bool:
    return os.environ.get("SCALETRAIN_TEST_FRESH_RANKS") == "1"


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, threads: int | None = None,
              fresh: bool = False) -> list:
    """fn(rank, world_size, *args) on `world_size` ranks with a gloo group; the ranks' results in rank order.

    The ranks are spawned processes kept alive between calls of the same world size (starting a rank imports torch:
    about 2-3 s of CPU per rank, which most runs would otherwise pay again). Each run gets a new process group on a
    new FileStore, the parent's environment and working directory, and torch's default dtype and grad mode reset
    after it; the trainer seeds everything it draws from (seed, name, step), so a run's result does not depend on
    what the process ran before (tests/test_harness.py checks a pooled run equals a fresh one bit for bit). A rank
    that raises or a run that times out kills the pool (the next call starts new ranks). `fresh=True`, or
    SCALETRAIN_TEST_FRESH_RANKS=1 for the whole session, starts new processes for the run instead.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    for attempt in range(1, INIT_ATTEMPTS + 1):
        try:
            if fresh or _fresh_processes():
                return _run_fresh(fn, world_size, args, timeout, threads)
            return _run_pooled(fn, world_size, args, timeout, threads)
        except _InitFailed as e:
            if attempt == INIT_ATTEMPTS:
                raise RuntimeError(f"the gloo group did not start in {INIT_ATTEMPTS} attempts:\n{e}") from None
    raise AssertionError("unreachable")


class _InitFailed(RuntimeError):
    """A rank's gloo group did not start (on a loaded machine gloo's connection mesh sometimes fails with
    "Connection closed by peer" before any of the test's code ran): the run is started again in new processes."""


INIT_ATTEMPTS = 3
# A gloo group starts in well under a second; a start that fails part-way ("Connection closed by peer" under load)
# can leave the other ranks waiting for the whole run timeout. Starting is given a minute (spawned ranks import torch
# before they arrive), then the run is started again.
INIT_TIMEOUT_S = 60.0


def _run_pooled(fn, world_size: int, args: tuple, timeout: float, threads: int) -> list:
    pool = _pool(world_size)
    pool.jobs += 1
    job = pool.jobs
    results: dict[int, object] = {}
    ok = False
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env, cwd = dict(os.environ), os.getcwd()
        for r in range(world_size):
            pool.tasks[r].put((job, fn, store, timeout, threads, args, env, cwd))
        deadline = time.monotonic() + timeout + 30
        try:
            while len(results) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout + 30:.0f} s")
                try:
                    got_job, rank, status, payload = pool.q.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(pool.procs) if not p.is_alive() and r not in results]
                    if dead:
                        raise RuntimeError(f"rank {dead[0]} died with exit code {pool.procs[dead[0]].exitcode}") \
                            from None
                    continue
                if got_job != job:  # a late answer of an earlier run that failed (its pool would be closed)
                    continue
                if status == "init":
                    raise _InitFailed(f"rank {rank}: {payload}")
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}{_other_errors(pool.q, job, rank)}")
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            ok = True
        finally:
            if not ok:
                _POOLS.pop(world_size, None)
                pool.close(kill=True)
    return [results[r] for r in range(world_size)]


def _other_errors(q, job: int, failed: int, wait: float = 3.0) -> str:
    """The other ranks' errors of the same run that arrive within `wait` seconds (a rank's failure often makes its
    peers fail too; the first one to arrive is not always the cause)."""
    out, deadline = [], time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            got_job, rank, status, payload = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if got_job == job and status == "error" and rank != failed:
            out.append(f"\n(also) rank {rank} failed:\n{payload}")
    return "".join(out)


def _run_fresh(fn, world_size: int, args: tuple, timeout: float, threads: int) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store, timeout, threads, args, q), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout + 30
        try:
            while len(results) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout + 30:.0f} s")
                try:
                    rank, status, payload = q.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                    if dead:
                        raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                    continue
                if status == "init":
                    raise _InitFailed(f"rank {rank}: {payload}")
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=5 if len(results) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world_size)]


# ----------------------------------------------------------------------------- training runs


def make_config(overrides: dict):
    from scaletrain.config import load_config, validate

    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    return validate(cfg)


TINY = {
    "model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.seq_len": 32,
    "train.steps": 4, "train.global_batch": 8, "train.micro_batch": 2, "train.warmup_steps": 2,
    "train.eval_every": 0, "train.dtype": "fp64", "train.lr": 3e-3,
}


def train_reference(overrides: dict) -> tuple[dict, dict]:
    """(losses by step, full final parameters) of the single-process run."""
    from scaletrain.train.trainer import Trainer

    cfg = make_config({**TINY, **overrides, "parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1,
                       "parallel.zero": 0, "parallel.ep": 1})
    t = Trainer(cfg)
    result = t.run()
    return result.losses, t.full_state()


def plain_setup(overrides: dict):
    """The plain loops' (cfg, fp64 model, AdamW with decay on matrices, BatchLoader) for `overrides` with every
    parallel setting at its default: what the independent references below train."""
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.model import build_gpt

    cfg = make_config({k: v for k, v in overrides.items() if not k.startswith(("parallel.", "_"))})
    t, o = cfg.train, cfg.optim
    model = build_gpt(cfg.model, t.seed, "cpu", torch.float64)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), cfg.model.seq_len, t.global_batch,
                         t.seed, cfg.data.val_fraction, cfg.model.vocab_size)
    return cfg, model, opt, loader


def clip_and_step(params: list, opt, step: int, train) -> None:
    """Clip the gradients by their global norm (train.grad_clip, eps 1e-6), set step's learning rate, step AdamW."""
    from scaletrain.train.schedule import lr_at

    norm = torch.sqrt(sum(p.grad.square().sum() for p in params)).item()
    if train.grad_clip > 0 and train.grad_clip / (norm + 1e-6) < 1:
        for p in params:
            p.grad.mul_(train.grad_clip / (norm + 1e-6))
    for g in opt.param_groups:
        g["lr"] = lr_at(step, train)
    opt.step()


def train_reference_rules(overrides: dict, rules: tuple[str, ...]) -> tuple[dict, dict]:
    """One process, step t computing its gradient at the current weights (`sync`) or, PipeDream-2BW's rule
    (`2bw`, arXiv 2006.09503), at the version before the last update (W(0) = W(1); entering 2BW from a synchronous
    step likewise starts with the older version equal to the current one). Clipping by the global norm, AdamW.
    Written independently of the engine: (losses by step, final parameters)."""
    from scaletrain.model import loss_sum

    cfg, current, opt, loader = plain_setup(overrides)
    params = list(current.parameters())
    losses, older = {}, None
    for step, rule in enumerate(rules, start=1):
        if rule == "2bw" and older is None:
            older = copy.deepcopy(current)
        at = older if rule == "2bw" else current
        x, y = loader.global_batch_at(step)
        at.zero_grad(set_to_none=True)
        loss = loss_sum(at(x), y) / cfg.tokens_per_step
        loss.backward()
        losses[step] = loss.item()
        if at is not current:
            for p, q in zip(current.parameters(), at.parameters()):
                p.grad = q.grad.clone()
        before = copy.deepcopy(current.state_dict())
        clip_and_step(params, opt, step, cfg.train)
        if rule == "2bw":
            older.load_state_dict(before)  # W(t): what the next 2BW step computes at
        else:
            older = None
    return losses, {k: v.detach().clone() for k, v in current.state_dict().items()}


def _train_rank(rank, world, overrides):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    cfg = make_config({**TINY, **overrides})
    t = Trainer(cfg, None, DistEnv(rank, world, 0, "test"))
    result = t.run()
    state = t.full_state()
    return result.losses, state if rank == 0 else None


def train_parallel(overrides: dict, world_size: int, timeout: float = 180.0) -> tuple[dict, dict]:
    outs = run_ranks(_train_rank, world_size, overrides, timeout=timeout)
    return outs[0]


def _train_many(rank, world, overrides_list):
    return [_train_rank(rank, world, o) for o in overrides_list]


def train_parallel_many(overrides_list: list[dict], world_size: int, timeout: float = 300.0) -> list:
    """Several parallel runs in one set of processes (saves the process start-up per configuration)."""
    return run_ranks(_train_many, world_size, overrides_list, timeout=timeout)[0]


def assert_same_run(ref: tuple[dict, dict], par: tuple[dict, dict], rtol: float, atol: float) -> None:
    ref_losses, ref_state = ref
    par_losses, par_state = par
    assert ref_losses.keys() == par_losses.keys()
    for step in ref_losses:
        assert abs(ref_losses[step] - par_losses[step]) <= atol + rtol * abs(ref_losses[step]), (
            f"step {step}: loss {par_losses[step]!r} vs single-process {ref_losses[step]!r}")
    assert ref_state.keys() == par_state.keys()
    for name in ref_state:
        torch.testing.assert_close(par_state[name], ref_state[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------- planned vs measured memory

MEMORY_KEYS = ("params", "grads", "optim", "activations")


def measured_and_planned(trainer) -> dict:
    """{category: (measured bytes, planned bytes)} as the trainer logged them after its first step."""
    return {k: (trainer.mem[f"mem_{k}"], trainer.mem.get(f"plan_mem_{k}")) for k in MEMORY_KEYS}


def _measure_layouts(rank, world, base, layouts):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for overrides in layouts:
        trainer = Trainer(make_config({**base, **overrides}), None, DistEnv(rank, world, 0, "test"))
        trainer.run()
        out.append(measured_and_planned(trainer))
    return out


def measure_layouts(base: dict, layouts: list[dict], world: int = 2, timeout: float = 240.0) -> list[dict]:
    """Train each layout (base + overrides) on `world` ranks; rank 0's measured_and_planned per layout."""
    return run_ranks(_measure_layouts, world, base, layouts, timeout=timeout)[0]
