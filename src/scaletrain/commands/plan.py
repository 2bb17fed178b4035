"""`scaletrain plan`: predict memory, step time, MFU, bubble and communication of parallel layouts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from scaletrain.config.schema import MLPS, POSITIONS
from scaletrain.errors import UserError
from scaletrain.guards import MAX_GLOBAL_BATCH, MAX_GPUS, SIZE_LIMITS, positive_float, short
from scaletrain.optim import optimizer_spec
from scaletrain.plan import catalog, hardware
from scaletrain.plan.analytic.inputs import DTYPES, KERNELS, OPTIMIZERS, Assumptions, Layout, Training

EXAMPLES = """examples:
  scaletrain plan --model gpt3-175b --gpus 1024
      the best layouts of GPT-3 175B on 1,024 A100-80GB at its published batch (1,536 sequences)
  scaletrain plan --model llama2-70b --gpu h100-80gb --gpus 512 --global-batch 1024 --top 3
  scaletrain plan --model megatron-1t --gpus 3072 --layout "tp=8,pp=64" --json
      fix some layout fields, search the rest; machine-readable output
  scaletrain plan --layers 24 --hidden 2048 --heads 16 --vocab 50257 --seq-len 2048 --gpus 64 --global-batch 512
      a model of your own dimensions
  scaletrain plan --params 7.5e9 --gpus 64
      model-state memory only (ZeRO paper, Table 1)
  scaletrain plan --config run.yaml --calibrate
      the run `scaletrain train --config run.yaml` will do, with this machine's measured speeds (about a minute)

--model without --global-batch uses the batch its paper trained with, where the catalog has one; docs/planner.md
"""
"""`plan --help`'s examples: each parses with the real parser, and the --model / --layers / --params ones run
(tests/test_cli_help.py)."""

PUBLISHED_BATCH = {
    **{name: (512, "Radford et al. 2019, section 2.3") for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")},
    **{name: (batch, "Brown et al., arXiv 2005.14165, Table 2.1 (0.5M-3.2M tokens)") for name, batch in (
        ("gpt3-125m", 256), ("gpt3-350m", 256), ("gpt3-760m", 256), ("gpt3-1.3b", 512), ("gpt3-2.7b", 512),
        ("gpt3-6.7b", 1024), ("gpt3-13b", 1024), ("gpt3-175b", 1536))},
    **{name: (batch, "Narayanan et al., arXiv 2104.04473, Table 1") for name, batch in (
        ("megatron-1.7b", 512), ("megatron-3.6b", 512), ("megatron-7.5b", 512), ("megatron-18b", 1024),
        ("megatron-39b", 1536), ("megatron-76b", 1792), ("megatron-146b", 2304), ("megatron-310b", 2160),
        ("megatron-530b", 2520), ("megatron-1t", 3072))},
    "megatron-22b": (4, "Korthikanti et al., arXiv 2205.05198, Table 3"),
    **{name: (1024, "Touvron et al., arXiv 2307.09288, section 2.2 (4M tokens)")
       for name in ("llama2-7b", "llama2-13b", "llama2-70b")},
}
"""Global batch (sequences of the catalog's seq_len) each catalog model was trained with in its paper; `plan --model`
uses it when --global-batch is not given. Llama 3 (a batch that grows during training) and Mixtral (not published)
have none."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict memory and time of parallel layouts and find the best",
                              description=__doc__.splitlines()[0].split(": ", 1)[1], epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model (one of)")
    src.add_argument("--model", help=f"catalog name ({', '.join(catalog.MODELS)})")
    src.add_argument("--config", help="a scaletrain YAML config: predict that run")
    src.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="config override (with --config)")
    src.add_argument("--params", type=positive_float, help="bare parameter count: model-state memory only")
    dims = p.add_argument_group("custom dimensions")
    for flag, h in (("--layers", "transformer blocks"), ("--hidden", "d_model"),
                    ("--heads", "attention heads"), ("--vocab", "vocabulary size"),
                    ("--ffn", "MLP hidden size (default 4*hidden)"),
                    ("--kv-heads", "key/value heads (GQA)"), ("--experts", "MoE experts per layer"),
                    ("--top-k", "experts per token")):
        dims.add_argument(flag, type=int, help=h)
    dims.add_argument("--mlp", choices=MLPS, help="MLP kind (default gelu)")
    dims.add_argument("--capacity-factor", type=positive_float,
                      help="MoE expert slots per routed token-choice (default 1.25; 1.0 for catalog models)")
    dims.add_argument("--moe-every", type=int, help="every k-th block is MoE (default 1)")
    dims.add_argument("--position", choices=POSITIONS, help="position encoding (default learned)")
    dims.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                      help="output layer shares the embedding (default yes)")
    dims.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                      help="biases in linear layers and norms (default yes)")
    dims.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                      help="dropout masks kept for backward, as Korthikanti's 34sbh counts them (default no; yes "
                           "for the GPT-2/GPT-3/Megatron catalog entries). With --model these flags override the "
                           "entry; the plan prints every one of them")
    dims.add_argument("--reversible", action="store_true",
                      help="reversible blocks (RevNet/Reformer; our model.reversible): attention and MLP of width "
                           "hidden/2 on the two halves of the stream, nothing stored per layer")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    hw = p.add_argument_group("cluster")
    hw.add_argument("--gpu", help=f"catalog GPU ({', '.join(hardware.CATALOG)}); default a100-80gb")
    hw.add_argument("--cluster", help="cluster YAML file (gpu fields, optional gpus)")
    hw.add_argument("--gpus", type=int, help="number of GPUs")
    hw.add_argument("--calibrate", action="store_true",
                    help="measure this machine's matmul FLOP/s, memory and gloo bandwidth and use them")
    tr = p.add_argument_group("training")
    tr.add_argument("--global-batch", type=int,
                    help="sequences per optimizer step (default with --model: the model's published batch)")
    tr.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    tr.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                    help="optimizer state: adamw (K = 12 bytes/param in bf16/fp16), adafactor or sm3 (fp32 master "
                         "+ factored statistics)")
    tr.add_argument("--first-moment", action="store_true",
                    help="adafactor with beta1 / sm3 with momentum: one more state per parameter")
    tr.add_argument("--attention", choices=("flash", "standard"), default="flash")
    tr.add_argument("--no-dp-overlap", action="store_true", help="gradient reduction not overlapped")
    tr.add_argument("--zero3-style", choices=("prefetch", "per-tensor"), default="prefetch",
                    help="ZeRO-3 implementation: prefetch (per-layer gathers one layer ahead: FSDP, ours) or "
                         "per-tensor (DeepSpeed ZeRO-3 up to v0.4); see docs/planner.md")
    tr.add_argument("--zero3-bw", type=float, metavar="GB/S",
                    help="per-GPU bandwidth ZeRO-3's collectives reach across nodes (default: all NICs of a node)")
    tr.add_argument("--kernels", choices=KERNELS,
                    help="element-wise work of the blocks: fused (Megatron / TransformerEngine kernels, torch.compile; "
                         "default) or eager (PyTorch eager, one kernel per operation: about twice the memory-bound "
                         "time; plan --config takes it from train.compile)")
    tr.add_argument("--tp-overlap", action="store_true",
                    help="tensor-parallel all-gathers / reduce-scatters (with sequence parallelism) decomposed and "
                         "overlapped with their GEMMs, as Megatron's tp-comm-overlap or PyTorch's async TP (default: "
                         "fully exposed; the plan says which it assumed)")
    p.add_argument("--layout", default="",
                   help='fix fields, e.g. "dp=8,tp=8,pp=4,zero=1,recompute=full"; the rest is searched')
    p.add_argument("--baseline", metavar="LAYOUT",
                   help='your own layout, e.g. "dp=16,tp=8,pp=8,zero=1": shown beside the search\'s, and each one '
                        "the planner ranks above it says whether the difference is beyond the planner's held-out error")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=5, help="layouts to show")
    out.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    out.add_argument("--png", help="write a PNG of the memory breakdown of the top layouts")
    out.add_argument("--html", metavar="FILE", help="write a self-contained HTML page of the result (docs/report.md)")
    sy = p.add_argument_group("asynchronous data parallelism (docs/async.md)")
    sy.add_argument("--servers", type=int, help="compare, for the best layout, a parameter server with this many "
                                                "servers and local SGD / DiLoCo with the all-reduce")
    sy.add_argument("--local-steps", type=int, help="H of local SGD / DiLoCo in that comparison (default 8)")
    sy.add_argument("--server-bw", type=float, metavar="GB/S", help="one server's link (default: one NIC, inter_bw)")
    bud = p.add_argument_group("compute budget (scaletrain.scaling.budget)")
    bud.add_argument("--flops-budget", metavar="C",
                     help="training FLOPs: choose the compute-optimal model by --law, find its best layout and "
                          "print the expected training days")
    bud.add_argument("--law", default="chinchilla-3",
                     help="scaling law for --flops-budget (as `scaletrain scaling optimal`; default chinchilla-3)")
    p.set_defaults(func=run)


# ModelSpec fields a flag sets (field, flag, argparse dest): every modelling assumption of a catalog entry
MODEL_FLAGS = (("seq_len", "--seq-len", "seq_len"), ("d_ff", "--ffn", "ffn"), ("mlp", "--mlp", "mlp"),
               ("n_kv_heads", "--kv-heads", "kv_heads"), ("position", "--position", "position"),
               ("tie_embeddings", "--tie-embeddings", "tie_embeddings"), ("bias", "--bias", "bias"),
               ("dropout", "--dropout", "dropout"), ("n_experts", "--experts", "experts"),
               ("top_k", "--top-k", "top_k"), ("capacity_factor", "--capacity-factor", "capacity_factor"),
               ("moe_every", "--moe-every", "moe_every"))


def _model(args) -> catalog.ModelSpec:
    custom = [args.layers, args.hidden, args.heads, args.vocab]
    if args.model and any(x is not None for x in custom):
        raise UserError("give either --model or custom dimensions (--layers --hidden --heads --vocab)")
    given = {f: getattr(args, dest) for f, _, dest in MODEL_FLAGS if getattr(args, dest, None) is not None}
    if args.model:
        base = catalog.get_model(args.model)
        if given.get("seq_len") is not None:
            catalog.with_seq_len(base, given["seq_len"])  # checks the value
        if "n_experts" in given and "top_k" not in given and not base.n_experts:
            given["top_k"] = 2 if given["n_experts"] else 1
        return catalog.check_model(dataclasses.replace(base, **given, reversible=args.reversible))
    if all(x is not None for x in custom):
        if args.seq_len is None:
            raise UserError("custom dimensions need --seq-len")
        experts = given.get("n_experts", 0)
        defaults = {"top_k": 2, "capacity_factor": 1.25} if experts else {}  # our engine's MoE defaults
        return catalog.check_model(catalog.ModelSpec(
            "custom", args.layers, args.hidden, args.heads, args.vocab, **{**defaults, **given},
            reversible=args.reversible))
    if any(x is not None for x in custom):
        missing = [f for f, x in zip(("--layers", "--hidden", "--heads", "--vocab"), custom) if x is None]
        raise UserError(f"custom dimensions are missing {', '.join(missing)}")
    raise UserError("give a model: --model NAME, custom dimensions, --config FILE or --params N")


def model_flags(m: catalog.ModelSpec) -> str:
    """The model as the command-line flags that rebuild it from dimensions: every assumption the plan makes."""
    parts = [f"--layers {m.n_layers} --hidden {m.d_model} --heads {m.n_heads} --vocab {m.vocab_size}"]
    for field, flag, _ in MODEL_FLAGS:
        value = {"d_ff": m.ffn, "n_kv_heads": m.kv_heads}.get(field, getattr(m, field))
        if field in ("top_k", "capacity_factor", "moe_every") and not m.n_experts:
            continue
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        else:
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    if m.reversible:
        parts.append("--reversible")
    return " ".join(parts)


def _gpu(args, dtype: str) -> hardware.GPU:
    if args.calibrate:
        from scaletrain.plan.calibrate import calibrate

        world = max(2, min(args.gpus or 2, 8))
        benchmarking(f"this machine's matmul FLOP/s, memory bandwidth and gloo bandwidth among {world} local "
                     "processes")
        return calibrate(dtype if dtype in ("fp32", "fp64") else "fp32", world)
    if args.cluster:
        gpu, n = hardware.load_cluster(args.cluster)
        if args.gpus is None and n is not None:
            args.gpus = n
        return gpu
    return hardware.get_gpu(args.gpu or "a100-80gb")


def benchmarking(what: str) -> float:
    """Say on stderr, before it starts, that the plan measures the machine and how long that may take (every other
    plan answers at once); returns the start time for the line that says how long it took."""
    sys.stderr.write(f"plan: benchmarking {what}; this takes up to about a minute (--gpu NAME or --cluster FILE "
                     "plans without measuring) ...\n")
    sys.stderr.flush()
    return time.monotonic()


def _assumptions(args) -> Assumptions:
    style = getattr(args, "zero3_style", "prefetch")
    bw = getattr(args, "zero3_bw", None)
    if bw is not None and not bw > 0:
        raise UserError(f"--zero3-bw must be a positive bandwidth in GB/s, got {bw}")
    zero3 = {"zero3_style": style, "zero3_link_bw": bw * 1e9 if bw is not None else None,
             "tp_comm_overlap": getattr(args, "tp_overlap", False)}
    if args.calibrate:  # measured rates are achieved rates already
        return Assumptions(link_efficiency=1.0, hbm_efficiency=1.0, reserved_bytes=0.0, **zero3)
    return Assumptions(**zero3)


INT_LIMITS = {"layers": SIZE_LIMITS["model.n_layers"], "hidden": SIZE_LIMITS["model.d_model"],
              "heads": SIZE_LIMITS["model.n_heads"], "vocab": SIZE_LIMITS["model.vocab_size"],
              "ffn": SIZE_LIMITS["model.d_ff"], "kv_heads": SIZE_LIMITS["model.n_heads"],
              "experts": SIZE_LIMITS["model.moe.experts"], "top_k": SIZE_LIMITS["model.moe.top_k"],
              "moe_every": SIZE_LIMITS["model.n_layers"], "seq_len": SIZE_LIMITS["model.seq_len"], "gpus": MAX_GPUS,
              "global_batch": MAX_GLOBAL_BATCH, "servers": MAX_GPUS, "local_steps": 10**9, "top": 10**6}
"""Upper bounds of plan's integer flags, checked before any arithmetic (guards.py: a --gpus of 10^20 made the
search enumerate divisors for minutes)."""
CONFIG_IGNORES = ("model", "params", "layers", "hidden", "heads", "vocab", "gpus", "global_batch", "kernels",
                  *(dest for _, _, dest in MODEL_FLAGS))
"""Flags that `plan --config` would ignore (the config names the model, batch and layout): refused with it."""


def check_flags(args) -> None:
    """Integer flags within their limits; with --config, no flag it would ignore."""
    for dest, limit in INT_LIMITS.items():
        value = getattr(args, dest, None)
        if value is not None and value > limit:
            raise UserError(f"--{dest.replace('_', '-')} ({short(value, 30)}) is above the limit of {limit:,}")
    if args.config:
        given = [f"--{d.replace('_', '-')}" for d in CONFIG_IGNORES if getattr(args, d, None) is not None]
        given += ["--layout"] if args.layout else []
        if given:
            raise UserError(f"plan --config predicts the run its config describes; {', '.join(given)} would be "
                            "ignored: set the model, batch and layout in the config (or with --set)")


def run(args) -> int:
    from scaletrain.plan.search import dedupe, parse_layout, search

    check_flags(args)
    if args.top < 1:
        raise UserError(f"--top must be >= 1, got {args.top}")
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {args.gpus}")
    from scaletrain.guards import check_output_file  # outputs checked before the search, not after it

    if args.png is not None:
        check_output_file(args.png, "--png", (".png",))
    if args.html is not None:
        check_output_file(args.html, "--html")
    if args.flops_budget is not None:
        from scaletrain.scaling.budget import run_budget

        return run_budget(args)
    if args.config:
        return _run_config(args)
    if args.params is not None:
        return _run_params(args)
    model = _model(args)
    gpu = _gpu(args, args.dtype)
    if args.gpus is None:
        raise UserError("--gpus is required (or a cluster file with gpus)")
    if args.global_batch is None:
        args.global_batch = published_batch(args.model, model)
    if args.global_batch < 1:
        raise UserError(f"--global-batch must be >= 1, got {args.global_batch}")
    cluster = hardware.Cluster(gpu, args.gpus)
    train = Training(args.global_batch, args.dtype, args.attention, not args.no_dp_overlap,
                     optimizer=args.optimizer, first_moment=args.first_moment, kernels=args.kernels or "fused")
    fixed = parse_layout(args.layout)
    result = search(model, gpu, args.gpus, train, fixed, _assumptions(args))
    top = dedupe(result.candidates, args.top)
    extra = _sync_comm(args, model, gpu, train, top[0].layout) if top else None
    if args.baseline:
        extra = {**(extra or {}), "baseline": _baseline(args, model, gpu, train)}
    return _emit(args, model, cluster, train, top, result.evaluated, result.offload_needed, extra)


def published_batch(name: str | None, model: catalog.ModelSpec) -> int:
    """The catalog model's published global batch (PUBLISHED_BATCH), announced in one line on stderr; a UserError
    when there is none or --seq-len changed the sequences it counts."""
    entry = PUBLISHED_BATCH.get(model.name) if name else None
    if entry is None:
        what = f"{model.name} has no published batch in the catalog" if name else "custom dimensions"
        raise UserError(f"--global-batch is required ({what})")
    published_seq = catalog.MODELS[model.name].seq_len
    if model.seq_len != published_seq:
        raise UserError(f"--global-batch is required: {model.name}'s published batch ({entry[0]:,} sequences) is at "
                        f"seq_len {published_seq:,}, not --seq-len {model.seq_len:,}")
    sys.stderr.write(f"global batch {entry[0]:,} sequences x {published_seq:,} tokens: {model.name}'s published "
                     f"batch ({entry[1]}); set it with --global-batch\n")
    return entry[0]


def _baseline(args, model, gpu, train):
    """The user's own layout (`--baseline`), evaluated as given: every field it does not name takes its default."""
    from scaletrain.plan.analytic.estimate import estimate
    from scaletrain.plan.search import parse_layout

    fixed = parse_layout(args.baseline)
    missing = [k for k in ("dp", "tp", "pp") if k not in fixed]
    if missing:
        raise UserError(f"--baseline names a whole layout: it needs {', '.join(missing)} (e.g. \"dp=8,tp=8,pp=16\")")
    try:
        return estimate(model, gpu, train, Layout(**fixed), _assumptions(args), n_gpus=args.gpus)
    except UserError as e:
        raise UserError(f"--baseline: {e}") from None


def _emit(args, model, cluster, train, top, evaluated: int, offload_needed: bool = False,
          extra: dict | None = None) -> int:
    from scaletrain.plan import report
    from scaletrain.plan.analytic.params import total_params

    if args.png:
        report.memory_png(top, cluster.gpu.memory_bytes, args.png,
                          f"{model.name} on {cluster.n_gpus} x {cluster.gpu.name}: memory per GPU")
    if args.html:
        from scaletrain.report.plan_page import write_plan_page

        explanation = report.explain(top[0], top[1], model, cluster) if len(top) > 1 else ""
        write_plan_page({**report.to_json(model, cluster, train, top), **(extra or {})}, args.html, explanation)
        if not args.json:
            sys.stderr.write(f"wrote {args.html}\n")
    extra = dict(extra or {})
    base = extra.pop("baseline", None)
    if args.json:
        doc = report.to_json(model, cluster, train, top)
        doc.update(extra)
        if base is not None:
            doc["baseline"] = {**base.to_dict(), "faster": [
                {"rank": i, "beyond_held_out_error": report.trusted(c, base)}
                for i, c in enumerate(top, 1) if c.fits and c.step_time_s < base.step_time_s]}
        json.dump(doc, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console

    con = Console(width=None if sys.stdout.isatty() else 160)
    n = total_params(model)
    size = report.count(n)
    title = (f"{model.name}: {size} params on {cluster.n_gpus} x "
             f"{cluster.gpu.name}, global batch {train.global_batch} x {model.seq_len} tokens "
             f"({evaluated} layouts evaluated)")
    con.print(report.table(top + ([base] if base is not None else []), cluster, title, base))
    con.print(f"model assumptions: {model_flags(model)}", soft_wrap=True)
    if offload_needed:
        con.print("Nothing fits without offload; these layouts offload optimizer state or parameters.")
    shown = top + ([base] if base is not None else [])
    for note in dict.fromkeys(n for c in shown for n in (*c.notes, *report.coverage_notes(c))):  # each once
        con.print(f"note: {note}", soft_wrap=True)
    if top and not top[0].fits:
        con.print(f"Does not fit: the closest layout is {report.gib(top[0].over_by)} GiB over the "
                  f"{report.gib(cluster.gpu.memory_bytes)} GiB per GPU.")
    elif len(top) > 1:
        con.print(report.explain(top[0], top[1], model, cluster))
    if base is not None:
        con.print(_baseline_text(report, top, base), soft_wrap=True)
    if extra:
        for key, value in extra.get("run_prediction", {}).items():
            con.print(f"{key}: {value:,} bytes")
        if "fp8" in extra:
            con.print(extra["fp8"]["line"], soft_wrap=True)
        if "sync_comm" in extra:
            from scaletrain.plan.analytic import async_costs

            con.print(async_costs.table(extra["sync_comm"]))
    if args.png:
        con.print(f"memory breakdown: {args.png}")
    return 0


def _baseline_text(report, top: list, base) -> str:
    """What the search found against the user's layout, each gain said beyond or inside the planner's error."""
    faster = [c for c in top if c.fits and c.step_time_s < base.step_time_s]
    head = f"Your layout {base.label()}: {base.step_time_s:.3g} s per step" + ("" if base.fits else
                                                                            f", {report.gib(base.over_by)} GiB over")
    if not faster:
        return head + "; none of the layouts shown is predicted faster."
    sure = [c for c in faster if report.trusted(c, base)]
    text = f"{head}; the best shown is {report.verdict(faster[0], base)}."
    if len(faster) > 1:
        text += (f" {len(sure)} of the {len(faster)} shown faster than yours are beyond that error." if sure else
                 f" None of the {len(faster)} shown faster than yours is beyond that error.")
    return text


def config_layout(cfg) -> Layout:
    """The planner's description of the layout `scaletrain train` runs for this config."""
    par, t = cfg.parallel, cfg.train
    return Layout(dp=par.dp, tp=par.tp, pp=par.pp, ep=par.ep, zero=par.zero, micro_batch=t.micro_batch,
                  recompute=cfg.memory.recompute.strip().lower(), schedule=par.schedule,
                  virtual_stages=par.virtual_stages, vertical_sync=par.vertical_sync,
                  sequence_parallel=par.sequence_parallel and par.tp > 1, offload=par.offload,
                  tp_mode=par.tp_mode, tp_depth=par.tp_depth, cp=par.cp, cp_mode=par.cp_mode,
                  # `time` profiles the run's own blocks: predicted, as predict_run does, with the parameter balance
                  partition="params" if par.partition == "time" else par.partition.replace(" ", ""),
                  reshard_after_forward=getattr(par, "reshard_after_forward", None))


def config_training(cfg) -> Training:
    """The training settings of the run as the engine does them: its dtype, the CPU attention kernel
    (flash without dropout, the math kernel with it), fp32 gradient buffers under bf16/fp16 and the
    optimizer's state (AdamW: two moments, plus fp32 masters under bf16/fp16)."""
    t = cfg.train
    elem = DTYPES[t.dtype][0]
    low = t.dtype in ("bf16", "fp16")
    spec = optimizer_spec(cfg.optim.name)
    moments = 0 if spec.factored else spec.moments  # element-wise moments (factored statistics: not per element)
    k = moments * (4 if low else elem) + (4 if low else 0)
    attention = "standard" if cfg.model.dropout > 0 else "flash"
    kernels = "fused" if t.compile else "eager"  # torch.compile fuses the blocks' element-wise work
    if t.precision == "autocast-bf16":  # fp32 parameters, gradients and moments; bf16 matmuls and activations
        return Training(t.global_batch, "bf16", attention, True, optimizer_k=4 * moments, grad_bytes=4,
                        param_bytes=4, kernels=kernels)
    gather = fp8_gathered_fraction(cfg) if t.precision == "fp8" and t.fp8_all_gather else 0.0
    return Training(t.global_batch, t.dtype, attention, True, optimizer_k=k, grad_bytes=4 if low else elem,
                    fp8_gather=gather, kernels=kernels)


def fp8_gathered_fraction(cfg) -> float:
    """The fraction of the blocks' parameter elements that are FP8 layers' weights (memory/fp8_layers.py), which
    train.fp8_all_gather all-gathers as float8 (parallel/zero_fp8.py), counted on the model built on the meta
    device."""
    import torch

    from scaletrain.memory.fp8_layers import fp8_layer_names
    from scaletrain.model import build_gpt

    fp8 = {f"{name}.weight" for name in fp8_layer_names(cfg.model, cfg.train)}
    counts = [0, 0]
    for name, p in build_gpt(cfg.model, 0, "meta", torch.float32).named_parameters():
        if name.startswith("blocks."):
            counts[name in fp8] += p.numel()
    return counts[1] / max(sum(counts), 1)


def _run_config(args) -> int:
    from scaletrain.config import load_config, validate
    from scaletrain.plan.analytic.estimate import estimate

    cfg = validate(load_config(args.config, args.set))
    from scaletrain.plan.analytic.async_costs import as_bsp

    cfg, p = as_bsp(cfg), cfg.parallel  # compute, memory and time of one worker as in BSP; p: the run's sync
    model = catalog.from_model_config(cfg.model, name=args.config)
    lay, train = config_layout(cfg), config_training(cfg)
    args.gpus = cfg.world_size
    if cfg.parallel.tp_mode != "1d" and args.calibrate:
        raise UserError(f"--calibrate profiles 1d tensor-parallel blocks; a parallel.tp_mode={cfg.parallel.tp_mode} "
                        "run is predicted with --gpu or --cluster (memory exact, time from the analytic model)")
    if cfg.parallel.cp > 1 and args.calibrate:
        raise UserError(f"--calibrate profiles blocks without context parallelism; a parallel.cp ({cfg.parallel.cp}) "
                        "run is predicted with --gpu or --cluster (memory and cp bytes exact, time from the analytic "
                        "model)")
    if not (args.gpu or args.cluster or args.calibrate) and cfg.parallel.tp_mode == "1d" and cfg.parallel.cp == 1:
        args.calibrate = True
    from scaletrain.plan.exact.run_memory import predict_run

    pred = predict_run(cfg)
    if cfg.parallel.cp > 1:  # the bytes our engine's ring / all-to-alls send per step (plan/analytic/context.py)
        from scaletrain.plan.analytic.context import step_bytes

        pred = {**pred, **{f"plan_{k}": v for k, v in step_bytes(cfg).as_metrics().items()}}
    extra: dict = {"run_prediction": pred}
    if cfg.train.precision == "fp8":  # which layers the run computes in FP8 (memory/fp8_layers.py)
        from scaletrain.memory.fp8_layers import describe, fp8_layer_names

        names = fp8_layer_names(cfg.model, cfg.train)
        extra["fp8"] = {"recipe": cfg.train.fp8_recipe, "gemm": cfg.train.fp8_gemm, "layers": names,
                        "line": f"FP8 ({cfg.train.fp8_recipe}, train.fp8_gemm={cfg.train.fp8_gemm}): "
                                f"{describe(names, cfg.model)}; embeddings, output layer, norms and attention in "
                                "bf16/fp32"}
    if args.calibrate:  # this machine, profiled at the run's sizes (plan/exact/run_time.py)
        from scaletrain.plan.calibrate import machine
        from scaletrain.plan.exact.run_calibrate import calibrate_run
        from scaletrain.plan.exact.run_time import apply_to_estimate

        started = benchmarking(f"this machine at the run's sizes in {cfg.world_size} local process"
                               f"{'es' if cfg.world_size > 1 else ''} (9 timed repeats of each block)")
        step, link = calibrate_run(cfg)
        gpu = machine(train.dtype if train.dtype in ("fp32", "fp64") else "fp32", cfg.world_size, link)
        est = estimate(model, gpu, train, lay, _assumptions(args), n_gpus=cfg.world_size, memory_only=True)
        apply_to_estimate(est, cfg, step, gpu.peak_flops)
        extra["run_step_time_s"] = step.step_time_s
        sys.stderr.write(f"plan: benchmarked in {time.monotonic() - started:.0f} s\n")
    else:
        gpu = _gpu(args, train.dtype)
        est = estimate(model, gpu, train, lay, _assumptions(args), n_gpus=cfg.world_size)
    # memory per category exactly as the trainer will measure it (the buffers stay the estimate's)
    for key, name in (("params", "plan_mem_params"), ("grads", "plan_mem_grads"),
                      ("optimizer", "plan_mem_optim"), ("activations", "plan_mem_activations")):
        if name in pred:
            est.memory[key] = float(pred[name])
    if "plan_mem_stash" in pred:  # PipeDream's stashed weight copies, counted with the parameters (as the estimate)
        est.memory["params"] += float(pred["plan_mem_stash"])
    est.memory["total"] = sum(v for k, v in est.memory.items() if k != "total")
    if p.sync != "bsp":  # the run's own synchronisation next to the all-reduce (ps: servers, local: H)
        args.servers = args.servers or p.servers
        args.local_steps = args.local_steps or p.local_steps
    extra.update(_sync_comm(args, model, gpu, train, lay, p.outer) or {})
    if p.sync == "ps":
        extra["servers"] = p.servers
    return _emit(args, model, hardware.Cluster(gpu, cfg.world_size), train, [est], 1, extra=extra)


PARAMS_LAYOUT_KEYS = ("dp", "tp", "pp", "zero")


def params_rows(psi: float, gpus: int, fixed: dict, dtype: str, optimizer: str = "adamw",
                first_moment: bool = False, memory_bytes: float = float("inf")) -> list[dict]:
    """Model-state memory of each ZeRO stage `fixed` allows (arXiv 1910.02054 Sec. 5.1), best first.

    tp and pp split the parameters evenly (Ψ / (tp·pp) per rank), dp = gpus / (tp·pp) shards them by ZeRO. With no
    time model, "best" is: layouts that fit first; among them the least data-parallel traffic per step and GPU
    (ring volumes: 2Ψ' gradient bytes for ZeRO 0-2, plus Ψ' parameter bytes for ZeRO-3's extra all-gather; the
    ZeRO paper's 2Ψ and 3Ψ), then the least memory; then the layouts that do not fit, closest first."""
    from scaletrain.plan.analytic.memory import memory_model_states

    bad = sorted(set(fixed) - set(PARAMS_LAYOUT_KEYS))
    if bad:
        raise UserError(f"--params models model states only: --layout {', '.join(bad)} needs a model (--model NAME "
                        "or --layers/--hidden/--heads/--vocab)")
    tp, pp = fixed.get("tp", 1), fixed.get("pp", 1)
    if gpus % (tp * pp):
        raise UserError(f"--layout tp ({tp}) x pp ({pp}) = {tp * pp} does not divide --gpus ({gpus})")
    dp = fixed.get("dp", gpus // (tp * pp))
    if dp * tp * pp != gpus:
        raise UserError(f"--layout dp ({dp}) x tp ({tp}) x pp ({pp}) = {dp * tp * pp} does not match --gpus ({gpus})")
    if fixed.get("zero", 0) not in (0, 1, 2, 3):
        raise UserError(f"--layout: zero must be 0, 1, 2 or 3, got {fixed['zero']}")
    pb, gb, _, k = DTYPES[dtype]
    if optimizer_spec(optimizer).factored:  # master + optional first moment; factored statistics need the dims
        k = (4 if pb == 2 else 0) + (4 if pb == 2 else pb) * first_moment
    share = psi / (tp * pp)
    rows = []
    for zero in ([fixed["zero"]] if "zero" in fixed else [0, 1, 2, 3]):
        p, g, o = memory_model_states(share, dp, zero, pb, gb, k)
        total = p + g + o
        ring = (dp - 1) / dp
        comm = ring * share * (2 * gb + (pb if zero == 3 else 0))
        rows.append({"layout": {"dp": dp, "tp": tp, "pp": pp, "ep": 1, "zero": zero},
                     "fits": total <= memory_bytes,
                     "memory_bytes": {"params": int(p), "grads": int(g), "optimizer": int(o),
                                      "activations": 0, "buffers": 0, "total": int(total)},
                     "comm_bytes_per_step": {"dp": int(comm)}})
    rows.sort(key=lambda r: (not r["fits"], r["comm_bytes_per_step"]["dp"] if r["fits"] else 0,
                             r["memory_bytes"]["total"]))
    return rows


def _sync_comm(args, model, gpu, train, lay, outer: str = "avg") -> dict | None:
    """The synchronisation comparison (`plan/analytic/async_costs.py`) when --servers or --local-steps is given."""
    servers, h = getattr(args, "servers", None), getattr(args, "local_steps", None)
    bw = getattr(args, "server_bw", None)
    if servers is None and h is None:
        return None
    for flag, value in (("--servers", servers), ("--local-steps", h)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if bw is not None and not bw > 0:
        raise UserError(f"--server-bw must be a positive bandwidth in GB/s, got {bw}")
    from scaletrain.plan.analytic import async_costs

    return {"sync_comm": async_costs.for_layout(model, gpu, train, lay, servers or lay.dp, h or 8,
                                                bw * 1e9 if bw else None, outer, _assumptions(args))}


def _run_params(args) -> int:
    from scaletrain.plan import report
    from scaletrain.plan.search import parse_layout

    if args.params <= 0:
        raise UserError(f"--params must be positive, got {args.params}")
    if args.gpus is None:
        raise UserError("--gpus is required")
    if args.cluster:
        gpu = hardware.load_cluster(args.cluster)[0]
    else:
        gpu = hardware.get_gpu(args.gpu or "a100-80gb")
    psi = args.params
    fixed = parse_layout(args.layout)
    rows = params_rows(psi, args.gpus, fixed, args.dtype, args.optimizer, args.first_moment, gpu.memory_bytes)
    pb, _, _, k = DTYPES[args.dtype]
    if optimizer_spec(args.optimizer).factored:
        k = (4 if pb == 2 else 0) + (4 if pb == 2 else pb) * args.first_moment
    doc = {"model": {"params": int(psi)},
           "cluster": hardware.Cluster(gpu, args.gpus).to_dict(), "candidates": rows}
    if args.html:
        from scaletrain.report.plan_page import write_plan_page

        lay = rows[0]["layout"]
        stages = f"ZeRO-{fixed['zero']}" if "zero" in fixed else "each ZeRO stage"
        write_plan_page({**doc, "model": {"name": f"{psi:.4g} parameters", "params": int(psi)}}, args.html,
                        f"Model states of {psi:.4g} parameters over dp={lay['dp']}, tp={lay['tp']}, pp={lay['pp']} "
                        f"for {stages} ({args.dtype}, K={k} optimizer bytes per parameter).")
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    lay = rows[0]["layout"]
    split = f" / (tp={lay['tp']} x pp={lay['pp']})" if lay["tp"] * lay["pp"] > 1 else ""
    keys = ("params", "grads", "optimizer", "total")
    unit, size = report.memory_unit([r["memory_bytes"][k_] for r in rows for k_ in keys])
    tab = Table(title=f"model states of {report.count(psi)} params{split} over dp={lay['dp']} ({args.dtype}, "
                      f"{args.optimizer}, K={k}), best first",
                caption=f"{unit} per GPU (1 {unit} = {size:,.0f} bytes)")
    for col in ("#", "ZeRO", f"params {unit}", f"grads {unit}", f"optimizer {unit}", f"total {unit}",
                f"dp traffic {unit}/step", f"fits {gpu.name}"):
        tab.add_column(col, justify="right")
    for i, r in enumerate(rows, 1):
        mb = r["memory_bytes"]
        tab.add_row(str(i), str(r["layout"]["zero"]), *(report.in_unit(mb[k_], size) for k_ in keys),
                    report.in_unit(r["comm_bytes_per_step"]["dp"], size), "yes" if r["fits"] else "no")
    Console(width=None if sys.stdout.isatty() else 160).print(tab)
    return 0
