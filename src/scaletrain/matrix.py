"""`scaletrain verify --matrix`: run many layouts of the enumerated space (`scaletrain.layouts`) and compare each
with the single-process run of the same model, data, seed and dtype.

Each layout trains `layouts.STEPS` steps; the comparison covers the loss and the gradient norm of every step and
every final parameter (gathered from its shards):

- fp64: losses and parameters element-wise within rtol 1e-9, atol 1e-11 (verify's defaults; the layouts differ
  from one process only in summation order, ~1e-15);
- fp32, bf16, fp16: the relative loss and gradient-norm differences per step and the relative L2 distance of all
  parameters within `TOLERANCE`, derived from measured rounding noise (docs/verify.md): 3x the largest difference
  seen over the covering set's layouts of that dtype and over single-process runs with another micro-batch split.

Layouts of one world size run in one job (`torchrun`, or a set of local processes in tests), one after the
other; `--jobs J` runs J such jobs at once. Results print as a table and are written as JSON.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from scaletrain.layouts import STEPS, Layout, config, reference_config

RTOL_FP64, ATOL_FP64 = 1e-9, 1e-11


@dataclass(frozen=True)
class Tolerance:
    loss: float  # max over steps of |loss - ref| / ref
    grad_norm: float  # max over steps of |norm - ref| / ref
    params: float  # ||params - ref||_2 / ||ref||_2 over all parameters


TOLERANCE = {  # docs/verify.md: 3x the measured rounding noise
    "fp32": Tolerance(3e-6, 3e-5, 3e-5),
    "bf16": Tolerance(3.3e-4, 4.5e-3, 1.2e-2),
    "fp16": Tolerance(1.0e-4, 5.0e-4, 1.8e-3),
}


@dataclass
class Outcome:
    layout: str
    world: int
    dtype: str
    ok: bool
    loss: float  # the largest relative loss difference over the steps
    grad_norm: float
    params: float  # relative L2 distance of all parameters (fp64: the largest element-wise excess over rtol)
    worst: str  # the parameter with the largest element-wise difference
    error: str = ""


def train(cfg, env=None, stale: bool = False) -> tuple[dict, dict, dict[str, torch.Tensor] | None]:
    """(losses, gradient norms) of every step and the full final parameters (on rank 0) of one run; `stale`
    trains one process by PipeDream-2BW's rule (`stale_weights`)."""
    from scaletrain.train.trainer import Trainer

    t = Trainer(cfg, None, env)
    step = stale_weights(t) if stale else t.train_step
    losses, norms = {}, {}
    while t.step < cfg.train.steps:
        t.step += 1
        row = step(t.step)
        losses[t.step], norms[t.step] = row["loss"], row["grad_norm"]
    state = t.full_state()
    return losses, norms, ({k: v.double() for k, v in state.items()} if env is None or env.rank == 0 else None)


def stale_weights(trainer):
    """PipeDream-2BW's update rule (Narayanan et al., arXiv 2006.09503) on one process, around the real trainer:
    step t computes the loss and gradient at W(t-1) (W(0) = W(1)) and the optimizer applies them to W(t). Returns
    the step function; the optimizer's own state (moments, fp32 masters) is the trainer's."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    older = [p.detach().clone() for p in params]
    opt = trainer.engine.optimizer
    update = opt.step
    current: list[torch.Tensor] = []

    def step_at_current(lr=None):
        with torch.no_grad():
            for p, w in zip(params, current):
                p.copy_(w)  # the update applies to W(t)
        update(lr)

    opt.step = step_at_current

    def train_step(step: int):
        nonlocal older
        current[:] = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, older):
                p.copy_(w)  # forward and backward at W(t-1)
        older = [w.clone() for w in current]
        return trainer.train_step(step)

    return train_step


def run_layout(layout: Layout, env=None):
    from scaletrain.config import validate

    return train(validate(config(layout), layout.world), env)


def run_reference(layout: Layout):
    """The single-process run the layout is compared with; for PipeDream-2BW the single-process run of its
    update rule (`stale_weights`)."""
    from scaletrain.config import validate

    return train(validate(reference_config(layout), 1), stale=layout["schedule"] == "2bw")


def compare(layout: Layout, ref, got) -> Outcome:
    dtype = layout["dtype"]
    rl, rn, rs = ref
    gl, gn, gs = got
    loss = max(abs(gl[s] - rl[s]) / abs(rl[s]) for s in rl)
    norm = max(abs(gn[s] - rn[s]) / max(abs(rn[s]), 1e-300) for s in rn)
    num = sum(float((gs[k] - rs[k]).square().sum()) for k in rs)
    den = sum(float(rs[k].square().sum()) for k in rs)
    worst_name, worst = "", -math.inf
    for k, r in rs.items():
        excess = float(((gs[k] - r).abs() - RTOL_FP64 * r.abs()).max())
        if excess > worst:
            worst_name, worst = k, excess
    if dtype == "fp64":
        ok = all(abs(gl[s] - rl[s]) <= ATOL_FP64 + RTOL_FP64 * abs(rl[s]) for s in rl) and \
            all(torch.allclose(gs[k], rs[k], rtol=RTOL_FP64, atol=ATOL_FP64) for k in rs)
        return Outcome(layout.name, layout.world, dtype, ok, loss, norm, max(worst, 0.0), worst_name)
    tol = TOLERANCE[dtype]
    rel = math.sqrt(num / den)
    ok = loss <= tol.loss and norm <= tol.grad_norm and rel <= tol.params
    return Outcome(layout.name, layout.world, dtype, ok, loss, norm, rel, worst_name)


def table(outcomes: list[Outcome]) -> str:
    lines = [f"{'layout':<72} {'world':>5} {'loss':>9} {'gnorm':>9} {'params':>9}  result"]
    for o in outcomes:
        result = "PASS" if o.ok else ("ERROR " + o.error if o.error else "FAIL")
        lines.append(f"{o.layout[:72]:<72} {o.world:>5} {o.loss:>9.2e} {o.grad_norm:>9.2e} {o.params:>9.2e}  {result}")
    passed = sum(o.ok for o in outcomes)
    lines.append(f"{passed} of {len(outcomes)} layouts PASS")
    return "\n".join(lines)


def to_json(outcomes: list[Outcome], meta: dict[str, Any]) -> str:
    return json.dumps({**meta, "layouts": [asdict(o) for o in outcomes],
                       "passed": sum(o.ok for o in outcomes), "total": len(outcomes)}, indent=1)


# --------------------------------------------------------------------------- selection


def parse_filter(expr: str | None) -> dict[str, tuple[bool, set[str]]]:
    """`dim=a|b,dim!=c` -> {dim: (wanted, values as strings)}; unknown dimensions and values are user errors."""
    from scaletrain.errors import UserError
    from scaletrain.layouts import DIMENSIONS

    out: dict[str, tuple[bool, set[str]]] = {}
    for term in [t.strip() for t in (expr or "").split(",") if t.strip()]:
        neg = "!=" in term
        key, sep, raw = term.partition("!=" if neg else "=")
        key = key.strip()
        if not sep or not raw.strip():
            raise UserError(f"--filter term {term!r} is not dim=value or dim!=value (values separated by |)")
        if key not in DIMENSIONS:
            raise UserError(f"--filter: unknown dimension {key!r} (known: {', '.join(DIMENSIONS)})")
        allowed = {_text(v) for v in DIMENSIONS[key]}
        values = {v.strip().lower() for v in raw.split("|")}
        bad = sorted(values - allowed)
        if bad:
            raise UserError(f"--filter: {key} has no value {', '.join(bad)} (values: {', '.join(sorted(allowed))})")
        out[key] = (not neg, values)
    return out


def _text(value: Any) -> str:
    return str(value).lower()


def matches(layout: Layout, flt: dict[str, tuple[bool, set[str]]]) -> bool:
    return all((_text(layout[d]) in values) == wanted for d, (wanted, values) in flt.items())


def select(world: int, flt: dict, exhaustive: bool, limit: int) -> list[Layout]:
    """The layouts to run: the covering set of up to `world` processes, or every accepted layout, filtered."""
    from scaletrain.errors import UserError
    from scaletrain.layouts import DIMENSIONS, WORLD_SIZES, accepted, covering, stored_covering

    if not exhaustive:
        layouts = stored_covering() if world == 4 else covering(world)
        return [lay for lay in layouts if lay.world <= world and matches(lay, flt)]
    space = {d: [v for v in vals if d not in flt or (_text(v) in flt[d][1]) == flt[d][0]]
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
    from scaletrain.errors import UserError
    from scaletrain.layouts import WORLD_SIZES

    if args.world not in WORLD_SIZES:
        raise UserError(f"--world must be one of {', '.join(map(str, WORLD_SIZES))}, got {args.world}")
    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    if args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")


def run_batch(args) -> int:
    """One rank of a matrix job: run the layouts of `args.matrix_batch` in order; rank 0 saves the results."""
    from scaletrain import distributed
    from scaletrain.distributed import detect_env

    env = detect_env()
    layouts = [Layout.of(**d) for d in json.loads(open(args.matrix_batch).read())]
    device = distributed.pick_device("auto", env.local_rank if env else 0)
    if env is not None:
        distributed.init(env, 300.0, device)
    try:
        results = []
        for lay in layouts:
            try:
                results.append(run_layout(lay, env))
            except Exception as e:  # noqa: BLE001 - a layout that crashes is a FAIL of that layout, not of the job
                if env is not None and env.world_size > 1:
                    raise  # the other ranks are inside collectives: the whole job has to stop
                results.append(("error", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
        if env is None or env.rank == 0:
            torch.save(results, args.result)
    except BaseException:
        distributed.shutdown(clean=False)
        raise
    distributed.shutdown()
    return 0


def _launch(layouts: list[Layout], tmp: str, index: int):
    """Start one job (a subprocess) running `layouts` (all of one world size); returns (process, result path)."""
    import subprocess
    import sys
    from pathlib import Path

    from scaletrain.launch import torchrun_command

    batch = Path(tmp) / f"batch{index}.json"
    batch.write_text(json.dumps([lay.as_dict() for lay in layouts]))
    result = Path(tmp) / f"result{index}.pt"
    argv = ["verify", "--matrix-batch", str(batch), "--result", str(result)]
    world = layouts[0].world
    cmd = [sys.executable, "-m", "scaletrain", *argv] if world == 1 else torchrun_command(world, argv)
    log = open(Path(tmp) / f"job{index}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), result, log


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
    print(f"verify --matrix: {len(layouts)} layouts ({what}, world <= {args.world}), {args.jobs} job(s) at a time;"
          f" each trains {STEPS} steps and is compared with one process of the same dtype", flush=True)
    t0 = time.time()
    chunks: list[list[Layout]] = []
    for world in sorted({lay.world for lay in layouts}):
        group = [lay for lay in layouts if lay.world == world]
        n = max(1, min(args.jobs, len(group)))
        chunks += [group[i::n] for i in range(n)]
    got: dict[Layout, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(enumerate(chunks))
        running: list = []
        while pending or running:
            while pending and len(running) < args.jobs:
                i, chunk = pending.pop(0)
                running.append((chunk, *_launch(chunk, tmp, i)))
            time.sleep(0.2)
            for item in list(running):
                chunk, proc, result, log = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                log.close()
                if proc.returncode == 0 and Path(result).exists():
                    got.update(zip(chunk, torch.load(result, weights_only=False)))
                else:
                    tail = Path(log.name).read_text().strip().splitlines()[-1:] or ["(no output)"]
                    got.update({lay: ("error", f"job exited {proc.returncode}: {tail[0][:200]}") for lay in chunk})
    refs: dict[str, Any] = {}
    outcomes = []
    for lay in layouts:
        res = got[lay]
        if isinstance(res, tuple) and res and res[0] == "error":
            outcomes.append(Outcome(lay.name, lay.world, lay["dtype"], False, math.nan, math.nan, math.nan, "", res[1]))
            continue
        key = reference_config(lay).to_yaml()
        if key not in refs:
            refs[key] = run_reference(lay)
        outcomes.append(compare(lay, refs[key], res))
    print(table(outcomes))
    Path(args.json).write_text(to_json(outcomes, {"world": args.world, "filter": args.filter or "",
                                                  "exhaustive": args.exhaustive, "seconds": time.time() - t0}))
    print(f"results written to {args.json} ({time.time() - t0:.0f} s)")
    sys.stdout.flush()
    return 0 if all(o.ok for o in outcomes) else 1
