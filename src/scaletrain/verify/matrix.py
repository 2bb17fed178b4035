"""`scaletrain verify --matrix`: run layouts of the enumerated space (`scaletrain.verify.layouts`) and compare each with
the single-process run of the same model, data, seed and dtype (docs/verify.md).

Each layout trains `layouts.STEPS` steps. Compared: the loss and the gradient norm of every step and the
parameters (gathered from their shards):

- fp64: the whole run against one process: losses and final parameters element-wise within rtol 1e-9, atol 1e-11
  (verify's defaults), gradient norms within rtol 1e-9; the layouts differ from one process only in summation
  order (~1e-15);
- fp32, bf16, fp16: step by step, one process computing each step from the layout's checkpoint of the step before
  and on the layout's MoE routes, within bounds derived from the dtype's unit roundoff (`verify/stepwise.py`,
  `tolerances.stepwise_bound`): whole low-precision runs drift apart chaotically, by amounts that depend on the
  CPU's kernels.

PipeDream-2BW (`schedule=2bw`) is compared with one process running 2BW's own update rule (`StaleWeights`); in
fp64 its steps overlap as in `scaletrain train` (the pipeline drains only after the last step).

Layouts of one world size run in one job, one after the other in the same processes (`torchrun`, or a set of
local processes in tests), so process start-up is paid once per job; `--jobs J` runs J jobs at once. A job that
dies marks the layout it was running as ERROR and the rest of its layouts run in a new job. Results print as a
table and are written as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from scaletrain.verify.layouts import STEPS, Layout, reference_config
from scaletrain.verify.runs import Outcome, Run, StaleWeights, fp8_keeps_dtype, layout_config, train
from scaletrain.verify.tolerances import ATOL_FP64, RTOL_FP64, TOLERANCE

__all__ = ["Outcome", "Run", "StaleWeights", "check", "compare", "layout_config", "run_layout", "run_reference",
           "table", "train"]


# --------------------------------------------------------------------------- running


def stepwise(layout: Layout, dtype: str | None = None) -> bool:
    """Whether the layout is compared step by step from the same state (fp32, bf16, fp16 and every FP8 layout, which
    keeps its fp32 or bf16: `verify/stepwise.py`) rather than over the whole run (fp64)."""
    return (fp8_keeps_dtype(layout, dtype) or dtype or layout["dtype"]) != "fp64"


def run_layout(layout: Layout, env=None, dtype: str | None = None, prepare: Callable | None = None,
               root: str | None = None) -> Run:
    """One rank's part of the layout's run (all ranks of the layout call it together). A low-precision layout
    writes its checkpoints into `root` (`verify/stepwise.py`)."""
    if stepwise(layout, dtype):
        from scaletrain.verify import stepwise as sw

        if root is None:
            raise ValueError(f"layout {layout.name} in {dtype or layout['dtype']} is compared step by step: "
                             "run_layout needs a folder for its checkpoints (root)")
        return sw.run_layout(layout, root, env, dtype, prepare)
    return train(layout_config(layout, dtype), env, prepare=prepare)


def run_reference(layout: Layout, dtype: str | None = None) -> Run:
    """The single-process run an fp64 layout is compared with; for PipeDream-2BW the single-process run of its
    update rule (`StaleWeights`)."""
    from scaletrain.config import validate

    cfg = reference_config(layout)
    if dtype and fp8_keeps_dtype(layout, dtype) is None:
        cfg.train.dtype = dtype
    return train(validate(cfg, 1), stale=layout["schedule"] == "2bw")


def check(layout: Layout, got: Run, root: str | None = None, dtype: str | None = None,
          references: dict | None = None) -> Outcome:
    """The layout's run against one process: the whole run (fp64; references shared through `references`, keyed
    by `reference_key`) or step by step from the layout's checkpoints in `root` (fp32, bf16, fp16)."""
    if stepwise(layout, dtype):
        from scaletrain.model.routing_tape import MissingDecision
        from scaletrain.verify import stepwise as sw

        try:
            return sw.compare(layout, sw.reference(layout, root, got, dtype, key_bias_slices(layout)), dtype)
        except MissingDecision as e:  # the layout routed other tokens than one process does: not the same run
            return Outcome(layout.name, layout.world, dtype or layout["dtype"], False, math.nan, math.nan, math.nan,
                           "", str(e), math.nan)
    references = {} if references is None else references
    key = reference_key(layout, dtype)
    if key not in references:
        references[key] = run_reference(layout, dtype)
    return compare(layout, references[key], got, dtype)


def reference_key(layout: Layout, dtype: str | None = None) -> str:
    """Layouts with equal keys share one reference run."""
    return reference_config(layout).to_yaml() + f"{dtype}{layout['schedule'] == '2bw'}"


# --------------------------------------------------------------------------- comparing


SCALE_FREE_OPTIMIZERS = ("adafactor", "sm3")
"""Optimizers whose step divides each gradient entry by its own running magnitude (no ε of consequence: Adafactor's
ε1 = 1e-30, SM3's 0)."""


def key_bias_slices(layout: Layout) -> dict[str, slice]:
    """The entries of the attention biases that are key biases, by parameter name, when the layout's optimizer is
    scale-free. A key bias adds q·b to every logit of a query's row, and softmax ignores a shift shared by the whole
    row: its gradient is zero in exact arithmetic and rounding noise (~1e-11 relative in fp64) in practice. AdamW and
    SGD leave such a parameter still; Adafactor and SM3 scale the noise to full-size steps that depend on the order of
    the sums, so its final value differs between layouts while the model's function does not. These entries are left
    out of the parameter comparison for those optimizers (docs/verify.md); every other entry, the losses and the
    gradient norms are compared as usual."""
    if layout["optimizer"] not in SCALE_FREE_OPTIMIZERS:
        return {}
    m = reference_config(layout).model
    if not (m.bias or m.qkv_bias):
        return {}
    from scaletrain.config.sizes import kv_heads

    width = m.d_model // 2 if m.reversible else m.d_model  # RevNet blocks: F and G are half width
    hs, kv = width // m.n_heads, kv_heads(m)
    if kv == m.n_heads:  # fused q, k, v
        return {f"blocks.{i}.attn.qkv.bias": slice(width, 2 * width) for i in range(m.n_layers)}
    return {f"blocks.{i}.attn.kv.bias": slice(0, kv * hs) for i in range(m.n_layers)}  # k then v


def compare(layout: Layout, ref: Run, got: Run, dtype: str | None = None) -> Outcome:
    """An fp64 layout's whole run against its reference: every step's loss and gradient norm and every final
    parameter element-wise (an overflow-skipped step counts when both runs skipped it)."""
    import torch

    dtype = fp8_keeps_dtype(layout, dtype) or dtype or layout["dtype"]
    rl, rn, rs = ref.losses, ref.grad_norms, ref.state
    gl, gn, gs = got.losses, got.grad_norms, got.state
    masked = key_bias_slices(layout)
    if masked and rs.keys() == gs.keys():
        gs = dict(gs)
        for name, part in masked.items():
            if name in gs:
                gs[name] = gs[name].clone()
                gs[name][part] = rs[name][part]
    if rl.keys() != gl.keys() or rs.keys() != gs.keys():
        return Outcome(layout.name, layout.world, dtype, False, math.nan, math.nan, math.nan, "",
                       "steps or parameter names differ from the single-process run")
    loss = max(abs(gl[s] - rl[s]) / abs(rl[s]) for s in rl)
    # an fp16 step skipped for overflow has a non-finite gradient norm (inf or NaN): a skip on both sides is no
    # difference (the losses and parameters still have to agree)
    skipped = {s for s in rn if not math.isfinite(rn[s]) and not math.isfinite(gn[s])}
    norm = max((abs(gn[s] - rn[s]) / max(abs(rn[s]), 1e-300) for s in rn if s not in skipped), default=0.0)
    worst_name, worst = "", -math.inf
    for k, r in rs.items():
        excess = float(((gs[k] - r).abs() - RTOL_FP64 * r.abs()).max())
        if excess > worst:
            worst_name, worst = k, excess
    finite = all(math.isfinite(x) for x in (*gl.values(), *rl.values())) and \
        all(math.isfinite(gn[s]) and math.isfinite(rn[s]) for s in rn if s not in skipped)
    if dtype == "fp64":  # (the only dtype compared over whole runs)
        ok = finite and all(abs(gl[s] - rl[s]) <= ATOL_FP64 + RTOL_FP64 * abs(rl[s]) for s in rl) and \
            all(abs(gn[s] - rn[s]) <= ATOL_FP64 + RTOL_FP64 * abs(rn[s]) for s in rn if s not in skipped) and \
            all(torch.allclose(gs[k], rs[k], rtol=RTOL_FP64, atol=ATOL_FP64) for k in rs)
        return Outcome(layout.name, layout.world, dtype, ok, loss, norm, max(worst, 0.0), worst_name)
    raise ValueError(f"a {dtype} layout is compared step by step (verify/stepwise.py), not over the whole run")


def table(outcomes: list[Outcome], width: int = 72) -> str:
    lines = [f"{'layout':<{width}} {'world':>5} {'dtype':>5} {'loss':>9} {'gnorm':>9} {'params':>9} {'routing':>7}"
             "  result"]
    for o in outcomes:
        name = o.layout if len(o.layout) <= width else o.layout[:width - 3] + "..."
        routing = "-" if math.isnan(o.routing) else f"{o.routing:.1%}"
        lines.append(f"{name:<{width}} {o.world:>5} {o.dtype:>5} {o.loss:>9.2e} {o.grad_norm:>9.2e} "
                     f"{o.params:>9.2e} {routing:>7}  {o.result}")
    lines.append(f"{sum(o.ok for o in outcomes)} of {len(outcomes)} layouts PASS")
    return "\n".join(lines)


def to_json(outcomes: list[Outcome], layouts: list[Layout], meta: dict[str, Any]) -> str:
    rows = [{**asdict(o), "values": lay.as_dict()} for o, lay in zip(outcomes, layouts)]
    return json.dumps({**meta, "tolerance": {k: asdict(v) for k, v in TOLERANCE.items()},
                       "fp64": {"rtol": RTOL_FP64, "atol": ATOL_FP64}, "layouts": rows,
                       "passed": sum(o.ok for o in outcomes), "total": len(outcomes)}, indent=1)


# --------------------------------------------------------------------------- selection


def parse_filter(expr: str | None) -> dict[str, tuple[bool, set[str]]]:
    """`dim=a|b,dim!=c` -> {dim: (wanted, values as text)}; unknown dimensions and values are user errors."""
    from scaletrain.errors import UserError
    from scaletrain.verify.layouts import DIMENSIONS, text

    out: dict[str, tuple[bool, set[str]]] = {}
    for term in [t.strip() for t in (expr or "").split(",") if t.strip()]:
        neg = "!=" in term
        key, sep, raw = term.partition("!=" if neg else "=")
        key = key.strip()
        if not sep or not raw.strip():
            raise UserError(f"--filter term {term!r} is not dim=value or dim!=value (values separated by |)")
        if key not in DIMENSIONS:
            raise UserError(f"--filter: unknown dimension {key!r} (known: {', '.join(DIMENSIONS)})")
        if key in out:
            raise UserError(f"--filter: dimension {key!r} appears twice")
        allowed = {text(v) for v in DIMENSIONS[key]}
        values = {v.strip().lower() for v in raw.split("|")}
        bad = sorted(values - allowed)
        if bad:
            raise UserError(f"--filter: {key} has no value {', '.join(bad)} (values: {', '.join(sorted(allowed))})")
        out[key] = (not neg, values)
    return out


def matches(layout: Layout, flt: dict[str, tuple[bool, set[str]]]) -> bool:
    from scaletrain.verify.layouts import text

    return all((text(layout[d]) in values) == wanted for d, (wanted, values) in flt.items())


def select(world: int, flt: dict, exhaustive: bool, limit: int) -> list[Layout]:
    """The layouts to run: the stored covering set of up to `world` processes, or every accepted layout, filtered."""
    import itertools

    from scaletrain.errors import UserError
    from scaletrain.verify.layouts import DIMENSIONS, WORLD_SIZES, accepted, stored_covering, text

    if not exhaustive:
        return [lay for lay in stored_covering(world) if matches(lay, flt)]
    space = {d: [v for v in vals if d not in flt or (text(v) in flt[d][1]) == flt[d][0]]
             for d, vals in DIMENSIONS.items()}
    upper = math.prod(len(v) for v in space.values())
    if upper > 10**6:
        raise UserError(f"--exhaustive with this --filter leaves up to {upper:,} combinations to check; fix more "
                        "dimensions (e.g. dtype, optimizer, moe, recompute)")
    out = []
    for combo in itertools.product(*space.values()):
        lay = Layout.of(**dict(zip(space, combo)))
        if lay.world in WORLD_SIZES and lay.world <= world and accepted(lay):
            out.append(lay)
            if len(out) > limit:
                raise UserError(f"more than --limit ({limit}) accepted layouts match; narrow --filter or raise --limit")
    return out


# --------------------------------------------------------------------------- the command


def check_args(args) -> None:
    """Bad input before anything runs: one line, exit 2."""
    from scaletrain.config import DTYPES
    from scaletrain.errors import UserError
    from scaletrain.verify.layouts import WORLD_SIZES

    if args.world not in WORLD_SIZES:
        raise UserError(f"--world must be one of {', '.join(map(str, WORLD_SIZES))}, got {args.world}")
    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    if args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.set or args.config or args.small:
        raise UserError("--matrix runs the layouts of scaletrain.verify.layouts on its own small model; "
                        "--config, --set and --small apply to a single verify")


def run_batch(args) -> int:
    """One rank of a matrix job: run the layouts of `args.matrix_batch` in order. Rank 0 saves the results after
    each layout (so a job that dies still reports what it finished)."""
    import os

    import torch

    from scaletrain.distributed import process_group as distributed
    from scaletrain.distributed.process_group import detect_env

    env = detect_env()
    with open(args.matrix_batch) as f:
        batch = json.load(f)
    layouts, dtype, roots = [Layout.of(**d) for d in batch["layouts"]], batch["dtype"], batch["roots"]
    device = distributed.pick_device("auto", env.local_rank if env else 0)
    if env is not None:
        distributed.init(env, 300.0, device)
    try:
        results = []
        for lay, root in zip(layouts, roots):
            results.append(asdict(run_layout(lay, env, dtype, root=root)))
            if env is None or env.rank == 0:
                torch.save(results, args.result + ".part")
                os.replace(args.result + ".part", args.result)  # a job killed while saving keeps the last file
    except BaseException:
        distributed.shutdown(clean=False)
        raise
    distributed.shutdown()
    return 0


def root_of(tmp: str, layouts: list[Layout], layout: Layout) -> str:
    """The folder of a layout's checkpoints in a matrix run (low-precision layouts, `verify/stepwise.py`)."""
    from pathlib import Path

    return str(Path(tmp) / f"layout{layouts.index(layout)}")


def _launch(layouts: list[Layout], dtype: str | None, tmp: str, index: int, devices: str | None, roots: list[str]):
    """Start one job (a subprocess) running `layouts` (all of one world size), with their checkpoint folders."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from scaletrain.distributed.launch import torchrun_command

    batch = Path(tmp) / f"batch{index}.json"
    batch.write_text(json.dumps({"layouts": [lay.as_dict() for lay in layouts], "dtype": dtype, "roots": roots}))
    result = Path(tmp) / f"result{index}.pt"
    argv = ["verify", "--matrix-batch", str(batch), "--result", str(result)]
    world = layouts[0].world
    cmd = [sys.executable, "-m", "scaletrain", *argv] if world == 1 else torchrun_command(world, argv)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    log = open(Path(tmp) / f"job{index}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, result, log


def _device_slices(jobs: int, world: int) -> list[str | None]:
    """CUDA devices of each of `jobs` concurrent jobs of `world` ranks (None on CPU)."""
    import torch

    from scaletrain.errors import UserError

    if not torch.cuda.is_available():
        return [None] * jobs
    n = torch.cuda.device_count()
    if jobs * world > n:
        raise UserError(f"--jobs {jobs} x {world} processes needs {jobs * world} GPUs, this machine has {n}")
    return [",".join(str(i * world + r) for r in range(world)) for i in range(jobs)]


def run_all(layouts: list[Layout], jobs: int, dtype: str | None, tmpdir: str,
            echo: Callable[[str], None] = print) -> dict[Layout, Any]:
    """Run every layout (jobs of one world size each, `jobs` at a time); returns {layout: Run or error text}.
    Jobs write their files (and low-precision layouts their checkpoints, `root_of`) under `tmpdir`."""
    import time
    from pathlib import Path

    import torch

    queue: list[list[Layout]] = []
    for world in sorted({lay.world for lay in layouts}):
        group = [lay for lay in layouts if lay.world == world]
        n = max(1, min(jobs, len(group)))
        queue += [group[i::n] for i in range(n)]
    got: dict[Layout, Any] = {}
    total = len(layouts)
    running: list = []
    free = {w: _device_slices(min(jobs, sum(lay.world == w for lay in layouts)), w)
            for w in {lay.world for lay in layouts}}
    index = 0
    while queue or running:
        # one world size at a time (its jobs share the devices), `jobs` jobs at once
        while queue and len(running) < jobs and free[queue[0][0].world] and \
                all(item[0][0].world == queue[0][0].world for item in running):
            chunk = queue.pop(0)
            devices = free[chunk[0].world].pop()
            roots = [root_of(tmpdir, layouts, lay) for lay in chunk]
            running.append((chunk, devices, *_launch(chunk, dtype, tmpdir, index, devices, roots)))
            index += 1
        time.sleep(0.2)
        for item in list(running):
            chunk, devices, proc, result, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            free[chunk[0].world].append(devices)
            done = torch.load(result, weights_only=True) if Path(result).exists() else []
            for lay, res in zip(chunk, done):
                got[lay] = Run(**res)
                echo(f"[{len(got)}/{total}] {lay.name} (world {lay.world}): ran")
            if len(done) < len(chunk):  # the job died in chunk[len(done)]; the rest run in a new job
                tail = Path(log.name).read_text().strip().splitlines()[-1:] or ["(no output)"]
                bad = chunk[len(done)]
                got[bad] = f"job exited {proc.returncode} in this layout: {tail[0][:200]}"
                echo(f"[{len(got)}/{total}] {bad.name} (world {bad.world}): ERROR")
                if chunk[len(done) + 1:]:
                    queue.insert(0, chunk[len(done) + 1:])
    return got


def cmd_matrix(args) -> int:
    import sys
    import tempfile
    import time
    from pathlib import Path

    check_args(args)
    flt = parse_filter(args.filter)
    layouts = select(args.world, flt, args.exhaustive, args.limit)
    if not layouts:
        print("no layout matches the filter")
        return 0
    what = "every accepted layout" if args.exhaustive else "the all-pairs covering set"
    dtype = f" in {args.dtype}" if args.dtype else ""
    print(f"verify --matrix: {len(layouts)} layouts ({what}, world <= {args.world}){dtype}, {args.jobs} job(s) at a "
          f"time; each trains {STEPS} steps and is compared with one process of the same dtype", flush=True)
    t0 = time.time()
    refs: dict[str, Run] = {}
    outcomes = []
    with tempfile.TemporaryDirectory() as tmpdir:
        got = run_all(layouts, args.jobs, args.dtype, tmpdir, echo=lambda line: print(line, flush=True))
        for lay in layouts:
            res, dt = got[lay], args.dtype or lay["dtype"]
            if isinstance(res, str):
                outcomes.append(Outcome(lay.name, lay.world, dt, False, math.nan, math.nan, math.nan, "", res))
                continue
            try:
                outcomes.append(check(lay, res, root_of(tmpdir, layouts, lay), args.dtype, refs))
            except Exception as e:  # noqa: BLE001 - a reference that cannot run is this layout's ERROR
                text = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                outcomes.append(Outcome(lay.name, lay.world, dt, False, math.nan, math.nan, math.nan, "", text))
    seconds = time.time() - t0
    print(table(outcomes))
    Path(args.json).write_text(to_json(outcomes, layouts, {
        "world": args.world, "filter": args.filter or "", "exhaustive": args.exhaustive, "dtype": args.dtype,
        "steps": STEPS, "seconds": seconds}) + "\n")
    print(f"results written to {args.json} ({seconds:.0f} s)")
    sys.stdout.flush()
    return 0 if all(o.ok for o in outcomes) else 1
