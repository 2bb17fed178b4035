"""`scaletrain verify`: prove that a parallel layout computes what the single-process run computes.

Runs the given config twice on the same model, data and seed — once as one process, once on the layout's
N local processes — in fp64 by default, and compares the loss of every step and every final parameter
(gathered from its shards). Prints the largest differences and PASS/FAIL against the tolerance; exit 1
on FAIL. The parallel run is started through the same launcher as `scaletrain train`; run under torchrun
(or srun) the parallel side is the whole job, on every node (`multinode/spanning.py`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.config import Config, load_config, validate
from scaletrain.errors import UserError
from scaletrain.guards import nonneg_float

if TYPE_CHECKING:  # torch is imported where it is used: `scaletrain --help` must not pay for it
    import torch

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=64", "train.steps=4",
         "train.eval_every=0", "train.warmup_steps=2", "train.checkpoint_every=0"]


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a parallel layout against the single-process run (fp64)")
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--dtype", default=None,
                   help="dtype of both runs (default fp64, for tight tolerances); with --matrix every layout runs in "
                        "this dtype instead of its own")
    p.add_argument("--rtol", type=nonneg_float, default=1e-9, help="relative tolerance (>= 0, default 1e-9)")
    p.add_argument("--atol", type=nonneg_float, default=1e-11, help="absolute tolerance (>= 0, default 1e-11)")
    p.add_argument("--small", action="store_true", help="use a small model (2 layers, d_model 64) and 4 steps")
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: worker output file
    m = p.add_argument_group("layout matrix (scaletrain.layouts; docs/verify.md)")
    m.add_argument("--matrix", action="store_true",
                   help="run the all-pairs covering set of the layout space (or --exhaustive: every accepted layout), "
                        "each against one process, and print a PASS/FAIL table with the worst differences")
    m.add_argument("--world", type=int, default=4, help="largest number of processes of a layout (1, 2, 4 or 8)")
    m.add_argument("--filter", default=None, metavar="EXPR",
                   help="keep layouts matching every term, e.g. 'pp=2,dtype=bf16|fp16,optimizer!=sm3'")
    m.add_argument("--jobs", type=int, default=1, help="jobs (sets of processes) running at once")
    m.add_argument("--exhaustive", action="store_true",
                   help="every accepted layout matching --filter instead of the all-pairs covering set")
    m.add_argument("--limit", type=int, default=200, help="--exhaustive refuses to run more layouts than this")
    m.add_argument("--json", default="verify_matrix.json", help="where the results are written")
    m.add_argument("--matrix-batch", default=None, help=argparse.SUPPRESS)  # internal: a job's layouts
    p.set_defaults(func=cmd_verify)


def _config(args) -> Config:
    sets = (SMALL if args.small else []) + list(args.set) + [f"train.dtype={args.dtype or 'fp64'}"]
    return load_config(args.config, sets)


def run(cfg: Config, env=None) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    from scaletrain.parallel.async_dp import make_trainer

    t = make_trainer(cfg, None, env)  # the Trainer, or an asynchronous mode's runner (parallel.sync)
    return t.run().losses, t.full_state()


def cmd_verify(args) -> int:
    import torch

    from scaletrain.distributed import detect_env

    if args.matrix_batch is not None or args.matrix:
        from scaletrain import matrix

        return matrix.run_batch(args) if args.matrix_batch is not None else matrix.cmd_matrix(args)

    cfg = _config(args)
    env = detect_env()
    if args.result is not None:  # one rank of the parallel run
        from scaletrain import distributed
        from scaletrain.multinode.job import supervise

        validate(cfg, env.world_size if env else 1)
        device = distributed.pick_device(cfg.train.device, env.local_rank if env else 0)
        try:
            with supervise(cfg, None, env, device):
                losses, state = run(cfg, env)
                if env is None or env.rank == 0:
                    torch.save({"losses": losses, "state": state}, args.result)
        except BaseException:
            distributed.shutdown(clean=False)
            raise
        distributed.shutdown()
        return 0
    if env is not None and env.world_size > 1:  # inside a torchrun/SLURM job: the parallel side is the whole job
        from scaletrain.multinode.spanning import verify_in_job

        return verify_in_job(cfg, args, env)
    validate(cfg, cfg.world_size)
    ref_cfg = reference_config(cfg)
    layout = layout_words(cfg)
    procs = f"{cfg.world_size} process{'es' if cfg.world_size > 1 else ''}"
    print(f"verify: {layout} ({procs}) against 1 process, {cfg.train.steps} steps, {cfg.train.dtype}")
    ref_losses, ref_state = run(ref_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "parallel.pt"
        argv = ["verify", "--result", str(result), "--dtype", cfg.train.dtype]
        if args.config:
            argv += ["--config", args.config]
        for item in (SMALL if args.small else []) + list(args.set):
            argv += ["--set", item]
        if cfg.world_size == 1:
            code = cmd_verify(build_args(argv))
        else:
            from scaletrain.launch import launch_local

            code = launch_local(cfg.world_size, argv, Path(tmp))
        if code != 0:
            return code
        par = torch.load(result, weights_only=True)
    return report(ref_losses, ref_state, par["losses"], par["state"], args.rtol, args.atol)


def layout_words(cfg: Config) -> str:
    """The layout as verify's header names it, e.g. 'dp=2 tp=2 pp=1 zero=1 tp_mode=2.5d tp_depth=2'."""
    p = cfg.parallel
    words = f"dp={p.dp} tp={p.tp} pp={p.pp} zero={p.zero}"
    if p.tp_mode != "1d":  # 2d / 2.5d / 3d tensor parallelism (docs/tensor_parallel.md)
        words += f" tp_mode={p.tp_mode}" + (f" tp_depth={p.tp_depth}" if p.tp_mode == "2.5d" else "")
    return words


def reference_config(cfg: Config) -> Config:
    """The single-process run of `cfg`'s model, data, recipe and seed (refusing what cannot match it)."""
    m = cfg.model
    if cfg.world_size > 1 and m.dropout_impl == "torch" and (m.dropout > 0 or m.moe.expert_dropout > 0):
        raise UserError("model.dropout_impl=torch draws dropout masks from per-rank random streams, so a parallel "
                        "layout drops other elements than one process and cannot match it; use "
                        "model.dropout_impl=global (the default) to verify a layout with dropout")
    ref_cfg = load_config(None, [])
    ref_cfg.model, ref_cfg.train, ref_cfg.optim, ref_cfg.data, ref_cfg.memory = (
        cfg.model, cfg.train, cfg.optim, cfg.data, cfg.memory)
    return validate(ref_cfg, 1)


def build_args(argv: list[str]) -> argparse.Namespace:
    from scaletrain.cli import build_parser

    return build_parser().parse_args(argv)


def report(ref_losses, ref_state, losses, state, rtol: float, atol: float) -> int:
    import torch

    ok = True
    print(f"{'step':>5} {'single-process':>18} {'parallel':>18} {'|diff|':>10}")
    for step in sorted(ref_losses):
        diff = abs(losses[step] - ref_losses[step])
        ok &= diff <= atol + rtol * abs(ref_losses[step])
        print(f"{step:>5} {ref_losses[step]:>18.12f} {losses[step]:>18.12f} {diff:>10.2e}")
    big_name, big = "", 0.0
    for name, ref in ref_state.items():
        got = state[name].to(ref.dtype)
        diff = float((got - ref).abs().max()) if ref.numel() else 0.0
        if diff > big or not big_name:
            big_name, big = name, diff
        ok &= bool(torch.allclose(got, ref, rtol=rtol, atol=atol))
    print(f"parameters: {len(ref_state)} tensors, largest parameter difference {big:.2e} ({big_name or '-'}); "
          "each must be within atol + rtol x |single-process value|")
    print(f"{'PASS' if ok else 'FAIL'} (rtol {rtol:g}, atol {atol:g})")
    sys.stdout.flush()
    return 0 if ok else 1
