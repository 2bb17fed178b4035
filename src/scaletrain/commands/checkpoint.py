"""Subcommands `checkpoint inspect`, `checkpoint convert` and `export` (docs/checkpoints.md).

    scaletrain checkpoint inspect runs/r2                     # newest checkpoint: step, layout, tensors, checksums
    scaletrain checkpoint convert runs/r2 --to runs/r2-single  # the same state as a single-process run
    scaletrain checkpoint convert runs/r2 --to runs/r2-tp --layout "tp=2,sequence_parallel=true"
    scaletrain export runs/r2 --format hf --to hf/r2           # Hugging Face GPT-2 / Llama / Qwen2 directory

A DIR argument may be a checkpoint directory, a run directory (its newest complete checkpoint) or a folder of
runs (the run with the newest checkpoint, e.g. `runs/demo`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from scaletrain.errors import CheckpointError, UserError
from scaletrain.guards import check_not_managed, check_path


def add_parser(sub) -> None:
    c = sub.add_parser("checkpoint", help="inspect or convert checkpoints (any layout)")
    csub = c.add_subparsers(dest="checkpoint_command", metavar="ACTION", parser_class=type(c))
    i = csub.add_parser("inspect", help="step, layout, tensors, bytes; verify every checksum")
    i.add_argument("dir", help="a checkpoint, a run (its newest checkpoint) or a folder of runs")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=cmd_inspect)
    v = csub.add_parser("convert", help="rewrite a checkpoint as another layout would write it (offline)")
    v.add_argument("dir", help="a checkpoint, a run (its newest checkpoint) or a folder of runs")
    v.add_argument("--to", required=True, help="the new run directory (must not exist, or be empty)")
    v.add_argument("--layout", default="", help='target layout, e.g. "dp=2,zero=3" or "tp=2,sp=true" '
                                                '(default: a single process)')
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="other layout keys (parallel.*, train.micro_batch, memory.*)")
    v.set_defaults(func=cmd_convert)

    e = sub.add_parser("export", help="export a checkpoint of any layout (Hugging Face GPT-2 / Llama / Qwen2)")
    e.add_argument("dir", help="a checkpoint, a run (its newest checkpoint) or a folder of runs")
    e.add_argument("--format", choices=["hf"], default="hf", help="hf: config.json + model.safetensors")
    e.add_argument("--to", required=True, help="output directory (must not exist, or be empty)")
    e.set_defaults(func=cmd_export)


def find_checkpoint(path, note: bool = True) -> Path:
    """`train.checkpoint.find_checkpoint`, imported when a command runs (`scaletrain --help` starts without torch)."""
    from scaletrain.train.checkpoint import find_checkpoint as find

    return find(path, note)


@contextlib.contextmanager
def _removed_when_full(out: Path, what: str):
    """A write into the new output folder `out` (empty before) that runs out of space: its partial files are removed
    and the failure is one line (DiskFull, exit 1)."""
    from scaletrain.errors import DiskFull, disk_full, disk_full_error

    try:
        yield
    except Exception as e:
        if not (isinstance(e, DiskFull) or (disk_full(e) and not isinstance(e, UserError))):
            raise
        for p in sorted(out.iterdir(), reverse=True) if out.is_dir() else []:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise disk_full_error(what, out, f"; the partial {what.removeprefix('the ')} was removed ({out} is empty)") \
            from None


def _new_output(to: str, what: str) -> Path:
    """An output directory that does not exist or is empty (created); never one with files in it."""
    if str(to).strip() == "":
        raise UserError(f"--to must name a directory for the {what}")
    out = check_path(to, "--to")  # guards.py: long parts, link loops, dangling links
    check_not_managed(out, "--to")  # never inside a run's checkpoints/ or logs/: its clean-up would delete it
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--to {out} exists and is not an empty directory; choose a new one (nothing was written)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--to {out} cannot be written ({e.strerror or e.__class__.__name__})") from None
    return out


# --------------------------------------------------------------------------- inspect


def cmd_inspect(args) -> int:
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train import ckpt_index

    directory = find_checkpoint(args.dir)
    meta = ckpt.read_meta(directory)
    index = ckpt_index.read_index(directory)
    report = ckpt.verify(directory, index)
    kinds: dict[str, int] = {}
    params = 0
    for name, t in index["tensors"].items():
        kinds[name.split("/")[0]] = kinds.get(name.split("/")[0], 0) + 1
        if name.startswith("model/"):
            n = 1
            for s in t["shape"]:
                n *= s
            params += n
    files = sorted({c["file"] for t in index["tensors"].values() for c in t["chunks"]})
    out = {"checkpoint": str(directory), "step": meta["step"], "layout": meta["layout"],
           "world_size": meta["world_size"], "tensors": report.tensors, "by_kind": kinds, "chunks": report.chunks,
           "files": len(files), "bytes": report.bytes, "parameters": params, "checksums_ok": not report.bad,
           "errors": report.bad[:5]}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        kinds_s = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        print(f"checkpoint  {directory}\nstep        {meta['step']}\nlayout      {meta['layout']}\n"
              f"tensors     {report.tensors} ({kinds_s}) in {report.chunks} chunks, {len(files)} files\n"
              f"bytes       {report.bytes:,}\nparameters  {params:,}\n"
              f"checksums   {'ok' if not report.bad else 'FAILED'} ({report.chunks} chunks read)")
    if report.bad:
        raise CheckpointError(report.bad[0])
    return 0


# --------------------------------------------------------------------------- convert


def parse_layout(text: str) -> list[str]:
    """`"dp=2,zero=3,sp=true,mb=2"` -> config overrides (`parallel.dp=2`, ...); UserError for unknown keys."""
    from dataclasses import fields

    from scaletrain.config import MemoryConfig, ParallelConfig

    par, mem = {f.name for f in fields(ParallelConfig)}, {f.name for f in fields(MemoryConfig)}
    alias = {"sp": "sequence_parallel", "v": "virtual_stages", "mb": "micro_batch"}
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if "=" not in item:
            raise UserError(f"--layout expects key=value pairs, got {item!r}")
        key, value = (x.strip() for x in item.split("=", 1))
        key = alias.get(key, key)
        if key in par:
            out.append(f"parallel.{key}={value}")
        elif key in mem:
            out.append(f"memory.{key}={value}")
        elif key == "micro_batch":
            out.append(f"train.micro_batch={value}")
        else:
            raise UserError(f"--layout: unknown key {key!r} (parallel.*, memory.* or micro_batch)")
    return out


def target_config(meta: dict, layout: str, sets: list[str]):
    """The checkpoint's config with the target layout: parallel/memory keys at their defaults unless given."""
    from scaletrain.config import Config, config_from_dict, set_value
    from scaletrain.train.resume import kind

    cfg = config_from_dict(meta["config"])
    default = Config()
    cfg.parallel, cfg.memory = default.parallel, default.memory
    cfg.parallel.timeout_s = config_from_dict(meta["config"]).parallel.timeout_s
    for item in parse_layout(layout) + list(sets):
        if "=" not in item:
            raise UserError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        if kind(key.strip()) != "layout":
            raise UserError(f"--set {key.strip()}: convert changes only the layout (parallel.*, train.micro_batch, "
                            "memory.*)")
        set_value(cfg, key.strip(), raw.strip())
    return cfg


def cmd_convert(args) -> int:
    from scaletrain.config import validate
    from scaletrain.distributed.process_group import detect_env
    from scaletrain.train import checkpoint as ckpt

    env = detect_env()
    source = find_checkpoint(args.dir, note=env is None or env.rank == 0)
    meta = ckpt.read_meta(source)
    cfg = target_config(meta, args.layout, args.set)
    if env is not None:
        validate(cfg, env.world_size)
        return convert_worker(cfg, source, meta, Path(args.to), env)
    validate(cfg, cfg.world_size)
    out = _new_output(args.to, "converted run")
    if cfg.world_size == 1:
        with _removed_when_full(out, "the converted run"):
            return convert_worker(cfg, source, meta, out, None)
    argv = ["checkpoint", "convert", str(source), "--to", str(out), "--layout", args.layout]
    for item in args.set:
        argv += ["--set", item]
    return _convert_job(cfg.world_size, argv, out)


def _convert_job(nproc: int, argv: list[str], out: Path) -> int:
    """A conversion on `nproc` local ranks. The job's logs and the ranks' error records go to a folder of their own
    beside the output, not into it: on a full disk they would not fit there, and the failure would name no cause.
    When a rank ran out of space, the partial output is removed and the line is the single-process one; the logs
    folder is removed after a success and named by the failure's line otherwise."""
    import io
    import sys
    import tempfile

    from scaletrain.distributed.launch import launch_local
    from scaletrain.errors import disk_full_error

    job = Path(tempfile.mkdtemp(prefix="scaletrain-convert-"))
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = launch_local(nproc, argv, job)
    if code == 0:
        shutil.rmtree(job, ignore_errors=True)
        return 0
    if "the disk is full" in said.getvalue():
        shutil.rmtree(job, ignore_errors=True)
        for p in sorted(out.iterdir(), reverse=True) if out.is_dir() else []:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise disk_full_error("the converted run", out, f"; the partial converted run was removed ({out} is empty)")
    sys.stderr.write(said.getvalue())
    return code


def convert_worker(cfg, source: Path, meta: dict, out: Path, env) -> int:
    """One rank of a conversion: build the target engine, read the checkpoint into it, write it under `out`."""
    import torch
    import torch.distributed as dist

    from scaletrain.distributed import process_group as distributed
    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.model.init import name_seed
    from scaletrain.parallel.parallelize import build_engine
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.train import resume
    from scaletrain.train.trainer import DTYPES, _seeded_rng_state

    rank = env.rank if env else 0
    device = torch.device("cpu")
    owns_group = env is not None and not dist.is_initialized()  # else the caller's group (tests, a job's runner)
    if owns_group:
        distributed.init(env, cfg.parallel.timeout_s, device)
    try:
        p = cfg.parallel
        mesh = Mesh.build(ParallelDims(pp=p.pp, dp=p.dp, tp=p.tp, ep=p.ep), p.timeout_s)
        engine = build_engine(cfg, mesh, device, DTYPES[cfg.train.dtype], CommStats())
        stream = f"dropout/dp{mesh.local_rank('dp')}/pp{mesh.local_rank('pp')}"
        rng = _seeded_rng_state(name_seed(cfg.train.seed, stream), device)
        resume.load_engine(engine, source, streams={stream: rng})
        saver = ckpt.Saver(out / "checkpoints", rank, keep=1)
        entries = resume.save_entries(engine, {stream: rng})
        saver.save(int(meta["step"]), entries,
                   resume.checkpoint_meta(cfg, mesh.world_size, meta.get("trainer") or {}))
        if rank == 0:
            (out / "config.yaml").write_text(cfg.to_yaml())
            layout = resume.describe_layout(cfg.to_dict(), mesh.world_size)
            print(f"{source} (step {meta['step']}, {meta['layout']}) -> {out} ({layout}); train with --out {out} and "
                  "that layout to continue")
    except BaseException:
        if owns_group:
            distributed.shutdown(clean=False)
        raise
    if owns_group:
        distributed.shutdown()
    return 0


# --------------------------------------------------------------------------- export


def cmd_export(args) -> int:
    from scaletrain.config import config_from_dict
    from scaletrain.interop.hf import export_hf
    from scaletrain.interop.hf_config import hf_family
    from scaletrain.train import checkpoint as ckpt

    directory = find_checkpoint(args.dir)
    meta = ckpt.read_meta(directory)
    cfg = config_from_dict(meta["config"])
    hf_family(cfg.model)  # refuses models without a Hugging Face equivalent before anything is written
    out = _new_output(args.to, "export")
    state = ckpt.read_tensors(directory, "model/")
    from scaletrain.data.tokenizer import run_tokenizer

    with _removed_when_full(out, "the export"):
        arch = export_hf(cfg.model, state, out)
        tokenizer = run_tokenizer(cfg.data.tokenizer, cfg.data.eot_token, directory).save(out)  # AutoTokenizer reads
    files = "".join(f" + {p.name}" for p in tokenizer)
    print(f"{directory} (step {meta['step']}) -> {out}: {arch}, config.json + model.safetensors (fp32){files}")
    return 0
