"""`scaletrain verify`: prove that a parallel layout computes what the single-process run computes.

Runs the given config twice on the same model, data and seed — once as one process, once on the layout's
N local processes — in fp64 by default, and compares the loss of every step and every final parameter
(gathered from its shards): `scaletrain.verify.run`. With `--matrix` the layout matrix (`scaletrain.verify.matrix`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from scaletrain.config import Config, load_config, validate
from scaletrain.guards import nonneg_float
from scaletrain.verify.run import SMALL, layout_words, reference_config, report, run


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
    m = p.add_argument_group("layout matrix (scaletrain.verify.layouts; docs/verify.md)")
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


def cmd_verify(args) -> int:
    import torch

    from scaletrain.distributed.process_group import detect_env

    if args.matrix_batch is not None or args.matrix:
        from scaletrain.verify import matrix

        return matrix.run_batch(args) if args.matrix_batch is not None else matrix.cmd_matrix(args)

    cfg = _config(args)
    env = detect_env()
    if args.result is not None:  # one rank of the parallel run
        from scaletrain.distributed import process_group as distributed
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
        from scaletrain.verify.spanning import verify_in_job

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
            from scaletrain.distributed.launch import launch_local

            code = launch_local(cfg.world_size, argv, Path(tmp))
        if code != 0:
            return code
        par = torch.load(result, weights_only=True)
    return report(ref_losses, ref_state, par["losses"], par["state"], args.rtol, args.atol)


def build_args(argv: list[str]) -> argparse.Namespace:
    """`argv` (starting with "verify") parsed as the command line would parse it."""
    from scaletrain.commands.parser import Parser

    parser = Parser(prog="scaletrain")
    add_parser(parser.add_subparsers(dest="command", parser_class=Parser))
    return parser.parse_args(argv)
