"""Subcommands `train`, `demo`, `sample` and `config show`."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from importlib import resources
from pathlib import Path

from scaletrain.config import Config, load_config, validate
from scaletrain.config.load import load_config_keys
from scaletrain.config.sizes import moe_layers
from scaletrain.errors import UserError
from scaletrain.guards import (
    MAX_GPUS,
    MAX_INT,
    MAX_SAMPLE_TOKENS,
    bounded_int,
    check_out_dir,
    check_path,
    lock_run,
    mark_run,
    nonneg_float,
    shown,
)
from scaletrain.multinode import launcher as multinode_launcher


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (N local processes with --nproc, or inside torchrun/SLURM)",
                       description="Train a model: one process, N local processes (--nproc), several machines "
                                   "(--nnodes), or one rank of a torchrun / SLURM job.",
                       epilog=TRAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _config_args(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start on this machine (default: the layout's size / --nnodes)")
    p.add_argument("--out", default=None,
                   help=f"output directory; an existing run there is resumed (default: a new folder "
                        f"{DEFAULT_TRAIN_ROOT}/<YYYYmmdd-HHMMSS>, printed at the start; required under torchrun/SLURM "
                        "and with --nnodes > 1)")
    p.add_argument("--reshard", action="store_true",
                   help="resume the run in --out under a different layout or number of processes")
    p.add_argument("--init-from", default=None, metavar="HF_DIR",
                   help="start a new run from a Hugging Face GPT-2 / Llama / Mistral / Qwen2 directory (config.json + "
                        "safetensors); the model keys come from its config.json")
    multinode_launcher.add_arguments(p)
    p.set_defaults(func=cmd_train)

    d = sub.add_parser("demo", help="the main job: train a small GPT on the embedded corpus (~2-3 min on CPU)")
    d.add_argument("--out", default=None, help="output directory (default runs/demo/<time>)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    d.add_argument("--no-prove", action="store_true", help="skip the layout-equivalence checks after training")
    d.add_argument("--steps", type=bounded_int(1, DEMO_MAX_STEPS), default=None,
                   help="train this many steps instead of the demo's 400 (a quick look; the warm-up, evaluation and "
                        "checkpoint intervals scale with it)")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("sample", help="generate text from a run's newest checkpoint (any layout)",
                       epilog=SAMPLE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--run", "--out", dest="run", required=True, metavar="DIR",
                   help="the run's output directory (or a folder of runs: the newest); --out is the older spelling")
    s.add_argument("--prompt", default="def ", help="text to continue")
    s.add_argument("--tokens", type=bounded_int(1, MAX_SAMPLE_TOKENS), default=200,
                   help=f"tokens to generate (1 to {MAX_SAMPLE_TOKENS:,})")
    s.add_argument("--temperature", type=nonneg_float, default=0.8,
                   help="softmax temperature (>= 0; 0 = greedy: the most likely token)")
    s.add_argument("--top-k", type=bounded_int(1), default=50, help="sample among the k likeliest tokens (>= 1)")
    s.add_argument("--seed", type=bounded_int(0, MAX_INT), default=0, help="sampling seed (0 to 2^63-1)")
    s.set_defaults(func=cmd_sample)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION", parser_class=type(p))
    show = csub.add_parser("show", help="print the resolved config (defaults < YAML < --set)")
    _config_args(show)
    show.add_argument("--doc", action="store_true", help="print each key's documentation")
    show.set_defaults(func=cmd_config_show)


DEFAULT_TRAIN_ROOT = "runs/train"
TRAIN_EXAMPLES = """examples:
  scaletrain train --set train.steps=50
      one process, the default small GPT on the embedded corpus; output in a new runs/train/<time> folder
  scaletrain train --nproc 2 --set parallel.dp=2 --set parallel.zero=3 --set train.steps=30 --out runs/zero3
      2 processes, data parallel with ZeRO-3; run it again with the same --out to resume
  scaletrain train --nproc 2 --set parallel.tp=2 --set parallel.sequence_parallel=true --set train.steps=60 \\
      --out runs/zero3 --reshard
      continue runs/zero3 to step 60 under another layout (tensor + sequence parallel)
  scaletrain train --set model.preset=gpt2 --set model.n_layers=2 --set train.steps=50 --out runs/gpt2-2l
      a catalog model's shape (scaletrain plan --help lists them), made smaller
  scaletrain train --set data.source=notes.txt --out runs/notes
      your own text file (or .jsonl, .parquet, a token .bin), one token per byte; `scaletrain data --help`
  scaletrain train --init-from hf/gpt2 --set train.steps=100 --out runs/ft
      start from a Hugging Face GPT-2 / Llama / Mistral / Qwen2 folder such as hf/gpt2 (config.json + safetensors)

see every key with `scaletrain config show --doc`; docs/training.md
"""
"""`train --help`'s examples: each `scaletrain train` line parses with the real parser and its config validates
(tests/test_cli_help.py)."""
SAMPLE_EXAMPLES = """examples:
  scaletrain sample --run runs/zero3
  scaletrain sample --run runs/train --prompt "import os" --tokens 50 --temperature 0
      runs/train is a folder of runs: the newest one is sampled
"""


def fresh_out(root: str, now: float | None = None) -> str:
    """A run folder under `root` named by the local time (YYYYmmdd-HHMMSS) that does not exist yet: a second run in
    the same second gets `-2`, `-3`, ... so a run started without --out never resumes or overwrites another."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    name, n = f"{root}/{stamp}", 1
    while Path(name).exists():
        n += 1
        name = f"{root}/{stamp}-{n}"
    return name


def _default_out(args) -> None:
    """`train` without --out: a fresh folder under runs/train (fresh_out), announced in _launch. Every rank of a
    torchrun/SLURM job and every node of --nnodes must name one folder, which separate clocks cannot promise."""
    from scaletrain.distributed.process_group import detect_env

    args.out_defaulted = args.out is None
    if args.out is not None:
        return
    if detect_env() is not None or args.nnodes > 1 or args.rdzv_endpoint:
        raise UserError("--out is required under torchrun/SLURM and with --nnodes/--rdzv-endpoint: every rank and "
                        "node must name the same run folder")
    args.out = fresh_out(DEFAULT_TRAIN_ROOT)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.n_layers=8 (repeatable)")


def cmd_config_show(args) -> int:
    cfg = validate(load_config(args.config, args.set))
    if not args.doc:
        sys.stdout.write(cfg.to_yaml())
        return 0
    from scaletrain.config.doc import doc_text

    sys.stdout.write(doc_text(cfg))
    return 0


def cmd_train(args) -> int:
    import os

    _default_out(args)  # no --out: a new runs/train/<time> folder
    check_path(args.out, "--out")  # before torch is imported: a path no file system takes costs no start-up

    from scaletrain.data.tokenizer import folder_tokenizer
    from scaletrain.distributed.launch import LOG_DIR_ENV
    from scaletrain.distributed.process_group import detect_env
    from scaletrain.plan.budget import check_before_launch, local_world_size

    cfg, explicit = load_config_keys(args.config, args.set, base=folder_tokenizer(args.init_from))  # DIR's tokenizer
    if cfg.parallel.sync != "bsp":  # what the asynchronous runners cannot do, said before any data or DIR is read
        from scaletrain.train.runners.common import refuse_reshard

        refuse_reshard(cfg, args.reshard, args.init_from)
    if args.init_from is not None:  # the model is DIR/config.json's; a bad directory fails here, before anything
        from scaletrain.interop.hf_config import apply_hf_model

        apply_hf_model(cfg, explicit, Path(args.init_from))
    env = detect_env()
    resume_args = {"reshard": args.reshard, "init_from": args.init_from}
    replica_group = os.environ.get("SCALETRAIN_REPLICA") is not None and cfg.parallel.replicas > 1
    if env is not None and replica_group:  # one fault-tolerant replica group (multinode/replicas.py launched it)
        validate(cfg, env.world_size * cfg.parallel.replicas)
        return run_worker(cfg, Path(args.out), env, **resume_args)
    if env is not None:
        validate(cfg, env.world_size)
        if LOG_DIR_ENV not in os.environ:  # under torchrun / SLURM (our own launcher checked before starting us)
            check_before_launch(cfg, Path(args.out), local_world_size(env.world_size))
        lock = None
        if env.rank == 0:
            from scaletrain.data.run import keep_tokenizer

            lock = lock_run(Path(args.out))  # under torchrun/SLURM or several nodes: rank 0 holds it for the job
            mark_run(Path(args.out))  # under torchrun too, so a later `train --out` knows the folder is a run
            keep_tokenizer(cfg, Path(args.out))
        try:
            return run_worker(cfg, Path(args.out), env, **resume_args)
        finally:
            if lock is not None:
                lock.release()
    from scaletrain.report.runinfo import set_user_command

    set_user_command(args)  # the command as the user gave it, for the run report
    multinode_launcher.check_arguments(args)
    if cfg.parallel.replicas > 1:
        check_replica_run(args, Path(args.out), cfg)
    if cfg.parallel.sync != "bsp" and (args.rdzv_endpoint or args.restarts):
        raise UserError(f"--nnodes/--rdzv-endpoint and --restarts are for parallel.sync=bsp runs; parallel.sync="
                        f"{cfg.parallel.sync} supervises its own ranks on one machine (docs/async.md)")
    nproc = args.nproc if args.nproc is not None else max(1, cfg.world_size // args.nnodes)
    if not 1 <= nproc <= MAX_GPUS:
        raise UserError(f"--nproc must be >= 1 (and at most {MAX_GPUS:,}), got {nproc}")
    validate(cfg, nproc * args.nnodes)
    from scaletrain.memory.fp8 import check_fp8_device

    check_fp8_device(cfg)  # no FP8 tensor cores: one line, before data, processes or the run folder
    out = check_out_dir(args.out)  # guards.py: not empty, not a file, writable, an existing folder only if a run
    from scaletrain.distributed.launch import LauncherLines

    with LauncherLines() as said:  # what this command prints before the ranks start: OUT/logs/launcher.log
        # several nodes share --out: the job's rank 0 takes the lock, not every node's launcher (replica groups: the
        # launcher of the lighthouse's host)
        if args.rdzv_endpoint and not (cfg.parallel.replicas > 1 and _runs_lighthouse(args)):
            return _launch(args, cfg, out, nproc, resume_args, said)
        with lock_run(out) or contextlib.nullcontext():  # one run per folder (guards.py), until the ranks have stopped
            return _launch(args, cfg, out, nproc, resume_args, said)


def _launch(args, cfg: Config, out: Path, nproc: int, resume_args: dict, said) -> int:
    """Everything after the folder is ours: data, checks against its checkpoints, the memory plan, then the run."""
    from scaletrain.data.run import keep_tokenizer, prepare
    from scaletrain.plan.budget import check_before_launch
    from scaletrain.train.announce import first_line, status

    first_line(cfg, nproc, out)  # the run in one line as soon as the config is valid (train/announce.py)
    if getattr(args, "out_defaulted", False):
        print(f"  no --out given: a new run folder {shown(out)} (resume it with --out {shown(out)})", flush=True)
    from scaletrain.train.runner import check_run

    # what the folder, the config and the memory plan refuse is said before the data is read or tokenized
    check_run(out, cfg, nproc * args.nnodes, args.reshard, args.init_from)  # a checkpoint of another run or layout
    if (done := complete_step(out, cfg)) is not None:  # said before the data is read or any process starts
        print(f"already complete at step {done}: nothing to do" + (
            f" (train.steps is {cfg.train.steps})" if done > cfg.train.steps else ""), flush=True)
        return 0
    if args.init_from is not None:  # weights whose shapes disagree with config.json fail here, before any process
        from scaletrain.interop.hf import check_hf_weights

        check_hf_weights(Path(args.init_from), cfg.model)
    check_before_launch(cfg, out, nproc)  # memory.budget_gb and the offload folder (plan/budget.py)
    refuse_if_too_big(cfg, nproc)
    status(f"loading data ({cfg.data.source if not cfg.data.mix else f'a mix of {len(cfg.data.mix)} sources'})")
    print(f"  {prepare(cfg)}", flush=True)  # tokens counted, ids checked: bad data fails here, before any process
    mark_run(out)  # guards.py: the folder is a run from now on (resumable with the same --out)
    keep_tokenizer(cfg, out)  # OUT/tokenizer/: what sample and export decode with (data/run.py)
    status("building the model" if nproc == 1 else f"starting {nproc} processes")
    if nproc == 1 and not args.restarts and not args.rdzv_endpoint:  # logs written once the checkpoint is read
        return run_single(cfg, out, **resume_args, launcher_lines=said.text())
    host = __import__("socket").gethostname()
    said.save(out / "logs" / (f"launcher-{host}.log" if args.rdzv_endpoint else "launcher.log"))
    from scaletrain.distributed.launch import launch_local

    argv = ["train", "--out", str(out)] + (["--reshard"] if args.reshard else [])
    argv += ["--init-from", str(args.init_from)] if args.init_from is not None else []
    if args.config:
        argv += ["--config", args.config]
    for item in args.set:
        argv += ["--set", item]
    if cfg.parallel.replicas > 1:  # fault-tolerant replica groups (docs/fault_tolerance.md)
        from scaletrain.multinode.replicas import launch_replicas
        from scaletrain.train.checkpoint_dirs import latest

        found = latest(out / "checkpoints")  # a whole-job resume: every group loads it (train/runners/replicas.py)
        if found is not None and int(found.name.split("_")[-1]) >= cfg.train.steps:
            print(f"run in {out} is already complete ({cfg.train.steps} steps); nothing to do", flush=True)
            return 0
        if found is None and _runs_lighthouse(args):
            (out / "config.yaml").write_text(cfg.to_yaml())  # what `scaletrain replay` rebuilds the groups from
            if args.init_from is not None:  # the imported weights, once: every group and the replay start from them
                from scaletrain.train.replica_init import write_start
                from scaletrain.train.runners.replicas import GroupModel

                write_start(GroupModel(cfg, replay=True).trainer, Path(args.init_from), out)
        p = cfg.parallel
        code = launch_replicas(p.replicas, argv, out, args.restarts, cfg.train.steps, p.heartbeat_s,
                               ranks=cfg.world_size // p.replicas, nnodes=args.nnodes, endpoint=args.rdzv_endpoint,
                               heal_attempts=p.heal_attempts,
                               missing_rows=p.missing_rows)
        if cfg.train.report and _runs_lighthouse(args):  # the groups have no output folder: the launcher writes it
            from scaletrain.report.observers import safely
            from scaletrain.report.run_page import write_report

            safely(f"writing the run report {out / 'report.html'}", lambda: write_report(out))
        return code
    if cfg.parallel.sync == "ps":  # supervised ranks: a worker's death may be tolerated (docs/async.md)
        from scaletrain.train.runners.launch import launch_ps

        return launch_ps(nproc, argv, out, cfg)
    if args.rdzv_endpoint:
        return multinode_launcher.launch_nodes(args.nnodes, nproc, args.rdzv_endpoint, argv, out, args.restarts)
    return launch_local(nproc, argv, out, args.restarts)


def _runs_lighthouse(args) -> bool:
    """Whether this launcher runs the replica run's lighthouse (one machine, or the rendezvous host of several):
    it writes the run's config.yaml and report."""
    if not args.rdzv_endpoint:
        return True
    from scaletrain.multinode import network

    return network.is_this_host(network.split_endpoint(args.rdzv_endpoint)[0])


def complete_step(out: Path, cfg: Config) -> int | None:
    """The step of `out`'s newest complete checkpoint when it is at or past train.steps (the run has nothing left to
    do), else None. check_run has already checked that checkpoint against the config."""
    from scaletrain.train import checkpoint as ckpt

    if not (out / "checkpoints").is_dir():
        return None
    found, _ = ckpt.usable_latest(out / "checkpoints")
    if found is None:
        return None
    step = int(ckpt.read_meta(found).get("step", 0))
    return step if step >= cfg.train.steps else None


def check_replica_run(args, out: Path, cfg: Config) -> None:
    """What a parallel.replicas > 1 run cannot do yet: one line, exit 2, before anything starts."""
    m = cfg.model
    if args.init_from is not None and (cfg.world_size > cfg.parallel.replicas or args.nnodes != 1 or m.dropout
                                       or m.moe.experts):
        per = cfg.world_size // cfg.parallel.replicas
        raise UserError(f"--init-from with parallel.replicas ({cfg.parallel.replicas}) needs dense groups of one "
                        f"process on one machine without dropout (got {per} processes per group, --nnodes "
                        f"{args.nnodes}, model.dropout={m.dropout}, model.moe.experts={m.moe.experts}): other replica "
                        "runs from imported weights have no test yet")
    check_replica_nodes(args, cfg.parallel.replicas)
    from scaletrain.train.checkpoint_dirs import latest

    if args.reshard and (out / "membership.jsonl").exists():
        raise UserError(f"{out} holds a replica run (membership.jsonl): --reshard starts replica groups from a "
                        "checkpoint of another layout's run, and a replica run's own folder is resumed without it "
                        "(its replay would span two layouts)")

    if (out / "membership.jsonl").exists() and latest(out / "checkpoints") is None:
        raise UserError(f"{out} holds a replica run (membership.jsonl) without a complete checkpoint to resume from "
                        "(set train.checkpoint_every): use a new --out")


def check_replica_nodes(args, replicas: int) -> None:
    """Replica groups on several machines (multinode/replicas.py): each node runs a whole number of groups, and the
    rendezvous host is named as the other nodes reach it (its launcher runs the lighthouse there)."""
    if args.nnodes == 1 and not args.rdzv_endpoint:
        return
    if replicas % args.nnodes:
        raise UserError(f"parallel.replicas ({replicas}) must be a multiple of --nnodes ({args.nnodes}): each node "
                        "runs the same number of whole replica groups")
    from scaletrain.multinode import network

    host, _ = network.split_endpoint(args.rdzv_endpoint)
    if args.nnodes > 1 and (host == "localhost" or network.is_loopback(host)):
        raise UserError(f"--rdzv-endpoint {args.rdzv_endpoint} is a loopback address: with parallel.replicas > 1 "
                        "name the host that runs the lighthouse as the other nodes reach it (its name or address)")


def refuse_if_too_big(cfg: Config, nproc: int) -> None:
    """Before launch: refuse when the planner says a rank's memory will not fit the device (or its share of the host's
    RAM), as memory.budget_gb does: allocating until the machine swaps or the kernel kills a rank helps nobody."""
    import os

    import torch

    from scaletrain.train.trainer import plan_memory

    plan = plan_memory(cfg)
    if not plan:
        return
    need = sum(plan.values())
    if torch.cuda.is_available() and cfg.train.device != "cpu":
        have, where = torch.cuda.get_device_properties(0).total_memory, "GPU memory"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // nproc, "host memory per process"
    if need > have:
        gib = {k.removeprefix("plan_mem_"): f"{v / 2**30:.2f}" for k, v in plan.items()}
        parts = ", ".join(f"{k} {v}" for k, v in gib.items())
        raise UserError(f"the plan needs {need / 2**30:,.2f} GiB per rank ({parts} GiB) but {where} is "
                        f"{have / 2**30:.2f} GiB; `scaletrain plan --config` shows layouts that fit (nothing was "
                        "started)")


def run_single(cfg: Config, out: Path, reshard: bool = False, init_from: str | None = None,
               launcher_lines: str | None = None) -> int:
    """The single-process run; a diverged loss is one line on stderr (exit 1), as on N processes."""
    from scaletrain.errors import TrainingDiverged

    try:
        return run_worker(cfg, out, None, reshard, init_from, launcher_lines)
    except TrainingDiverged as e:
        sys.stderr.write(f"scaletrain: error: training diverged: {e}\n")
        return 1


def run_worker(cfg: Config, out: Path, env, reshard: bool = False, init_from: str | None = None,
               launcher_lines: str | None = None) -> int:
    """One rank of a run (or the single process): train, then print the summary on rank 0."""
    from scaletrain.distributed import process_group as distributed
    from scaletrain.distributed.launch import WorkerContext
    from scaletrain.multinode.job import supervise
    from scaletrain.train.runner import make_trainer

    rank = env.rank if env else 0
    supervised = cfg.parallel.sync == "bsp" and cfg.parallel.replicas == 1  # replica groups: the lighthouse's quorum
    with WorkerContext(rank, out / "logs" if env is None else None, launcher_lines) as logs:  # logs/rankN.log
        device = distributed.pick_device(cfg.train.device, env.local_rank if env else 0)
        if env is not None and not supervised:
            store = None
            if cfg.parallel.replicas > 1 and env.world_size > 1:  # a replica group's ranks (docs/fault_tolerance.md)
                from scaletrain.distributed.quorum import group_store

                store = group_store(env.rank, cfg.parallel.timeout_s)
            distributed.init(env, cfg.parallel.timeout_s, device, store=store)
        try:
            # the asynchronous modes supervise their own ranks (docs/async.md); bsp runs get docs/multinode.md's
            with supervise(cfg, out, env, device) if supervised else contextlib.nullcontext() as job:
                start = time.time()
                trainer = make_trainer(cfg, out, env, progress=True, reshard=reshard,  # a bar or log lines
                                       init_from=init_from)  # bsp: the Trainer (train/resume.py)
                logs.commit()  # one process: its logs are written from here (the checkpoint was read)
                if job is not None:
                    job.attach(trainer)
                if trainer.step >= cfg.train.steps and rank == 0:
                    print(f"already complete at step {trainer.step}: nothing to do")
                result = trainer.run()
                if rank == 0:
                    summary(out, trainer.n_params, result, time.time() - start, moe_layers(cfg.model),
                            cfg.tokens_per_step)
        except BaseException:
            distributed.shutdown(clean=False)
            raise
        distributed.shutdown()
    return 0


def throughput_line(rows: list[dict], steps: int, tokens_per_step: int, seconds: float) -> str:
    """Both statistics, named: the median over the run's logged steps (report.html's), then this invocation's
    `steps` over its wall time (start-up, evaluation and checkpoints included)."""
    from scaletrain.report.run_data import median

    med = median([r.get("tokens_per_s") for r in rows])
    done = f"{steps} step{'s' if steps != 1 else ''}"
    wall = (f"{steps * tokens_per_step / seconds:,.0f} tokens/s over this invocation's {seconds:.0f} s wall time "
            f"({done}, start-up included)") if seconds > 0 else f"{done} in {seconds:.0f} s wall"
    head = (f"{med:,.0f} tokens/s over {rows[-1]['step']} steps (median of the logged steps, as in report.html); "
            if med else "")
    return f"throughput      {head}{wall}"


def summary(out: Path, n_params: int, result, seconds: float, moe_blocks: list[int] | None = None,
            tokens_per_step: int = 0) -> None:
    from scaletrain.report.plots import plot_expert_load, plot_loss, read_metrics

    metrics = out / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.exists() else []
    if not rows:
        return
    png = plot_loss(metrics, out / "loss.png", title=shown(out))  # printable: a name need not be UTF-8
    load_png = plot_expert_load(metrics, out / "expert_load.png", moe_blocks)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    lines = [
        f"parameters      {n_params:,}",
        f"loss            {rows[0]['loss']:.4f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.4f} "
        f"(step {rows[-1]['step']})",
        f"validation loss {val[-1]:.4f}" if val else "",
        throughput_line(rows, len(result.losses), tokens_per_step, seconds)
        + (f", resumed from step {result.resumed_from}" if result.resumed_from else ""),
        f"outputs         {out}/metrics.jsonl, {out}/checkpoints/, loss curve {png}"
        + (f", expert load {load_png}" if load_png else "")
        + (f", report {out / 'report.html'}" if (out / "report.html").is_file() else ""),
        _memory_line(rows[-1]),
    ]
    print("\n".join(x for x in lines if x))


def _memory_line(row: dict) -> str:
    """Measured bytes per category beside the planner's prediction (MiB, max over ranks)."""
    parts = []
    for cat in ("params", "grads", "optim", "activations"):
        if f"mem_{cat}" in row:
            planned = row.get(f"plan_mem_{cat}")
            plan = f" (plan {planned / 2**20:.2f})" if planned is not None else ""
            parts.append(f"{cat} {row[f'mem_{cat}'] / 2**20:.2f}{plan}")
    return "memory MiB/rank " + ", ".join(parts) if parts else ""


DEMO_PROOFS = (  # layouts the demo proves equal to one process (small fp64 model, a few steps)
    ("data parallel 2 x ZeRO-3", ["parallel.dp=2", "parallel.zero=3"]),
    ("tensor parallel 2 + sequence parallel", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
)


DEMO_MAX_STEPS = 100_000


def demo_steps(steps: int | None) -> list[str]:
    """`demo --steps N`: N steps, and the demo's warm-up (10%), evaluation (every quarter) and checkpoint (every
    half) intervals scaled to them."""
    if steps is None:
        return []
    return [f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 10)}",
            f"train.eval_every={max(1, steps // 4)}", f"train.checkpoint_every={max(1, steps // 2)}"]


def cmd_demo(args) -> int:
    text = resources.files("scaletrain").joinpath("configs/demo.yaml")
    with resources.as_file(text) as path:
        cfg = load_config(path, demo_steps(args.steps) + list(args.set))
    validate(cfg, 1)
    out = check_out_dir(args.out if args.out is not None else fresh_out("runs/demo"))
    with lock_run(out) or contextlib.nullcontext():
        return _demo(args, cfg, out)


def _demo(args, cfg: Config, out: Path) -> int:
    mark_run(out)
    print(f"scaletrain demo: {cfg.model.n_layers}-layer GPT (d_model {cfg.model.d_model}) on the embedded corpus "
          f"(Python standard library sources), {cfg.train.steps} steps -> {out}")
    code = run_single(cfg, out)
    if code or args.no_prove:
        return code
    from scaletrain.commands.verify import build_args, cmd_verify

    print("\nprove: each layout below trains the same small model in fp64 on 2 processes and is compared, "
          "step by step and parameter by parameter, with the single-process run")
    for title, sets in DEMO_PROOFS:
        print(f"\n== {title}")
        argv = ["verify", "--small", "--set", "train.steps=3", "--set", "train.device=cpu"]  # gloo: any machine
        for item in sets:
            argv += ["--set", item]
        code = cmd_verify(build_args(argv)) or code
    return code


def cmd_sample(args) -> int:
    import math

    import torch

    from scaletrain.data.tokenizer import run_tokenizer
    from scaletrain.train.checkpoint import find_checkpoint
    from scaletrain.train.sample import generate, load_model

    if args.tokens < 1 or not math.isfinite(args.temperature) or args.temperature < 0 or args.top_k < 1:
        raise UserError(f"--tokens ({args.tokens}) and --top-k ({args.top_k}) must be positive and --temperature "
                        f"({args.temperature}) finite and >= 0")
    if not args.prompt:
        raise UserError("--prompt must not be empty")
    directory = find_checkpoint(args.run)
    cfg, model = load_model(directory)
    tok = run_tokenizer(cfg.data.tokenizer, cfg.data.eot_token, directory)  # the run's own (data/tokenizer.py)
    idx = torch.tensor([tok.encode(args.prompt)], dtype=torch.int64)
    if idx.numel() == 0:
        raise UserError(f"--prompt {args.prompt!r} encodes to no tokens with {tok.name}")
    if int(idx.max()) >= cfg.model.vocab_size:
        raise UserError(f"--prompt has token id {int(idx.max())} beyond model.vocab_size ({cfg.model.vocab_size})")
    g = torch.Generator().manual_seed(args.seed)
    out = generate(model, idx, args.tokens, cfg, args.temperature, args.top_k, g)
    sys.stdout.write(tok.decode(out[0].tolist()) + "\n")
    return 0
