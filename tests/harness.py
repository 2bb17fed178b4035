"""Multi-process test harness: run a function on N ranks (spawned processes, gloo on a FileStore).

`run_ranks(fn, world_size, *args)` starts `world_size` processes, initialises a gloo process group with a
timeout in each, calls `fn(rank, world_size, *args)` and returns the list of results (passed back through
`torch.save`, so tensors are fine). If a rank raises, the others are killed and the failing rank's
traceback is raised in the test; if the ranks do not finish within `timeout` seconds, all are killed.

`train_reference(overrides)` and `train_parallel(overrides, world)` run the real Trainer on the same config
single-process and on N ranks; `assert_same_run` compares their per-step losses and final parameters.
"""

from __future__ import annotations

import copy
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _child(fn, rank, world, store_path, timeout, threads, args, q):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, threads: int | None = None) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
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


def train_reference_rules(overrides: dict, rules: tuple[str, ...]) -> tuple[dict, dict]:
    """One process, step t computing its gradient at the current weights (`sync`) or, PipeDream-2BW's rule
    (`2bw`, arXiv 2006.09503), at the version before the last update (W(0) = W(1); entering 2BW from a synchronous
    step likewise starts with the older version equal to the current one). Clipping by the global norm, AdamW.
    Written independently of the engine: (losses by step, final parameters)."""
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.model import build_gpt, loss_sum
    from scaletrain.train.schedule import lr_at

    cfg = make_config({k: v for k, v in overrides.items() if not k.startswith(("parallel.", "_"))})
    t, o = cfg.train, cfg.optim
    current = build_gpt(cfg.model, t.seed, "cpu", torch.float64)
    params = list(current.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), cfg.model.seq_len, t.global_batch,
                         t.seed, cfg.data.val_fraction, cfg.model.vocab_size)
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
        norm = torch.sqrt(sum(p.grad.square().sum() for p in params)).item()
        if t.grad_clip > 0 and t.grad_clip / (norm + 1e-6) < 1:
            for p in params:
                p.grad.mul_(t.grad_clip / (norm + 1e-6))
        before = copy.deepcopy(current.state_dict())
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
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
