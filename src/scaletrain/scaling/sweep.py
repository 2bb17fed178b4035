"""`scaletrain scaling sweep`: train a grid of tiny GPTs on the embedded corpus on CPU, then fit scaling laws.

The grid follows the IsoFLOP design of Hoffmann et al. 2022 (arXiv 2203.15556, §3.2): a few compute levels
C_k, three times apart, and at each level several model sizes N from a fixed ladder of GPT shapes, each
trained on D = C_k / (6N) tokens with a cosine schedule whose length matches the run (their Appendix B:
a cosine cycle longer than the run spoils the result). The sizes at a level are centred on the model that
would get 100 tokens per parameter (for byte-level tokens; Chinchilla's 20 is for BPE tokens), so the
loss valley of each IsoFLOP curve is inside the grid unless the optimum is more than about 3x away.
No run reads more tokens than one epoch of the corpus's training split (random windows, so some text
repeats before that; Muennighoff et al., arXiv 2305.16264, find a few epochs cost little), and none has
fewer than MIN_STEPS optimizer steps; sizes outside these limits are left out of a level.

The scale is set by the time budget: the sweep first times a few steps of every ladder size with the real
trainer, then picks the smallest budget C_0 whose predicted total training time fills about 85 % of
`--minutes`. Every run is a normal `scaletrain.train.trainer.Trainer` run in `OUT/runs/NAME/` (config.yaml,
metrics.jsonl); completed runs of the same plan (`OUT/plan.json`) are kept when the sweep is run again.
Final points feed approaches 2 and 3; whole curves feed approach 1 (with the caveat of the paper: a point
inside a cosine run is not an optimally trained run of that length).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from scaletrain.errors import UserError

# (n_layers, d_model, n_heads): one shape family, 2 layers of growing width (head size 16 where it
# divides), about 1.5-2x more parameters per rung (vocab 256, seq_len 64, tied embeddings). Mixing depths
# made the IsoFLOP curves bumpy: at these sizes a 1-layer model beat 2-layer ones of similar compute.
LADDER = (
    (2, 8, 1), (2, 12, 1), (2, 16, 1), (2, 24, 1), (2, 32, 2), (2, 48, 3), (2, 64, 4), (2, 96, 6),
    (2, 128, 8), (2, 160, 10), (2, 192, 12), (2, 256, 16),
)
SEQ_LEN = 64
GLOBAL_BATCH = 16
TOKENS_PER_STEP = SEQ_LEN * GLOBAL_BATCH
LEVEL_RATIO = 3.0
MIN_STEPS = 150  # shorter runs spend too much of themselves in the warm-up plateau
# Centre of each level: a byte token is a fraction of a BPE token (those average 3-4 bytes of English or
# code), and our sweeps put the IsoFLOP valleys at 100-150 tokens per parameter; centred on Chinchilla's
# 20, the valleys of the lower levels fell below the smallest size.
TOKENS_PER_PARAM_GUESS = 100.0
RUN_OVERHEAD_S = 0.5  # build, first step, final checkpoint
TIME_FRACTION = 0.85  # of --minutes spent training; the rest is calibration, fitting and plots


@dataclass(frozen=True)
class PlannedRun:
    name: str
    level: int
    n_layers: int
    d_model: int
    n_heads: int
    params: int
    steps: int
    predicted_s: float

    @property
    def tokens(self) -> int:
        return self.steps * TOKENS_PER_STEP

    @property
    def flops(self) -> float:
        return 6.0 * self.params * self.tokens


def run_config(run: PlannedRun, seed: int = 1234):
    """The training config of one sweep run (validated)."""
    from scaletrain.config import Config, validate

    cfg = Config()
    m, t = cfg.model, cfg.train
    m.n_layers, m.d_model, m.n_heads, m.seq_len = run.n_layers, run.d_model, run.n_heads, SEQ_LEN
    t.steps, t.global_batch, t.micro_batch, t.seed = run.steps, GLOBAL_BATCH, GLOBAL_BATCH, seed
    t.lr, t.min_lr = 2e-3, 2e-4  # 10x cosine decay, as in Hoffmann et al. §D.1
    t.warmup_steps = max(1, min(20, run.steps // 10))
    # about 100 metrics lines per run: enough for the curves of approach 1, and logging every step of a
    # tiny model costs as much as training it
    t.checkpoint_every, t.keep_checkpoints = 0, 1
    t.log_every = max(1, run.steps // 100)
    # one held-out evaluation at the last step, on the same 16 x 16 windows for every run: the final
    # points of the fit use it (a single batch's training loss is too noisy to rank neighbouring sizes)
    t.eval_every, t.eval_batches = run.steps, 16
    t.device, t.dtype = "cpu", "fp32"
    t.report = False  # the sweep's own page (OUT/report.html) shows every run; a page per run would cost more
    return validate(cfg, 1)


def calibrate(ladder=LADDER, seed: int = 1234) -> dict[int, tuple[int, float]]:
    """{rung: (params, tokens per second)} of each ladder shape.

    Each shape's step time is the fastest of four steps after a warm-up step; then a line
    t(N) = t0 + k·N is fitted through all shapes by the Theil-Sen estimator (median of pairwise
    slopes), so a shape timed while other processes held the CPU does not distort the plan.
    """
    import numpy as np

    from scaletrain.train.trainer import Trainer

    params, times = [], []
    for n_layers, d_model, n_heads in ladder:
        probe = PlannedRun("probe", 0, n_layers, d_model, n_heads, 0, 100, 0.0)
        trainer = Trainer(run_config(probe, seed), None)
        trainer.train_step(1)  # the first step pays one-off costs
        times.append(min(trainer.train_step(step)["step_time_s"] for step in range(2, 6)))
        params.append(trainer.n_params)
    n, t = np.array(params, float), np.array(times)
    i, j = np.triu_indices(len(n), 1)
    k = max(float(np.median((t[j] - t[i]) / (n[j] - n[i]))), 1e-12)
    t0 = max(float(np.median(t - k * n)), 1e-4)
    return {r: (params[r], TOKENS_PER_STEP / (t0 + k * n[r])) for r in range(len(ladder))}


def corpus_tokens() -> int:
    """Tokens in the training split of the embedded corpus (what one epoch is)."""
    from scaletrain.config import Config
    from scaletrain.data import load_tokens

    cfg = Config()
    n = len(load_tokens(cfg.data.source, cfg.data.cache_dir))
    return n - int(n * cfg.data.val_fraction)


def ladder_params(ladder=LADDER) -> dict[int, tuple[int, float]]:
    """{rung: (params, NaN tokens per second)}: the sizes without timing (for a sweep with a fixed budget)."""
    from scaletrain.config import ModelConfig
    from scaletrain.scaling.fit import model_params

    return {i: (model_params(ModelConfig(n_layers=layers, d_model=d, n_heads=heads, seq_len=SEQ_LEN)), math.nan)
            for i, (layers, d, heads) in enumerate(ladder)}


def plan(c0: float, speed: dict[int, tuple[int, float]], levels: int, sizes: int, max_tokens: float = math.inf,
         min_steps: int = MIN_STEPS, ladder=LADDER) -> list[PlannedRun]:
    """The runs of a sweep whose smallest budget is c0 FLOPs: at each level the `sizes` ladder shapes
    nearest the TOKENS_PER_PARAM_GUESS size that get at least `min_steps` steps and at most `max_tokens`."""
    runs = []
    for k in range(levels):
        c = c0 * LEVEL_RATIO**k
        feasible = [i for i in range(len(ladder))
                    if min_steps <= c / (6 * speed[i][0] * TOKENS_PER_STEP) <= max_tokens / TOKENS_PER_STEP]
        if not feasible:
            continue
        guess = math.sqrt(c / (6 * TOKENS_PER_PARAM_GUESS))
        centre = min(feasible, key=lambda i: abs(math.log(speed[i][0] / guess)))
        pos = feasible.index(centre)
        lo = max(0, min(pos - sizes // 2, len(feasible) - sizes))
        for i in feasible[lo:lo + sizes]:
            n, tps = speed[i]
            steps = round(c / (6 * n * TOKENS_PER_STEP))
            layers, d, heads = ladder[i]
            runs.append(PlannedRun(f"c{k + 1}-l{layers}d{d}", k + 1, layers, d, heads, n, steps,
                                   float(steps * TOKENS_PER_STEP / tps + RUN_OVERHEAD_S)))
    return runs


def choose_budget(seconds: float, speed, levels: int, sizes: int, max_tokens: float = math.inf,
                  min_steps: int = MIN_STEPS) -> tuple[float, list[PlannedRun]]:
    """Largest c0 (bisection in log c0) whose predicted total time fits in `seconds`."""
    def total(c0: float) -> float:
        return sum(r.predicted_s for r in plan(c0, speed, levels, sizes, max_tokens, min_steps))

    lo, hi = math.log(1e6), math.log(1e17)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if total(math.exp(mid)) <= seconds else (lo, mid)
    runs = plan(math.exp(lo), speed, levels, sizes, max_tokens, min_steps)
    if len({r.level for r in runs}) < 2 or len(runs) < 6:
        raise UserError(f"a {seconds / 60 / TIME_FRACTION:.2g}-minute budget is too small for a sweep on this"
                        f" machine (planned {len(runs)} runs); give more --minutes")
    return math.exp(lo), runs


def _completed(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    try:
        return bool(lines) and json.loads(lines[-1]).get("step") == steps
    except ValueError:
        return False


def train_run(run: PlannedRun, run_dir: Path, seed: int) -> float:
    """Train one run with the project's trainer; returns its final training loss."""
    from scaletrain.train.trainer import Trainer

    trainer = Trainer(run_config(run, seed), run_dir)
    result = trainer.run()
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the fit needs metrics only
    return result.losses[run.steps] if run.steps in result.losses else math.nan


def _log(message: str) -> None:
    print(message, flush=True)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Tiny models gain little from intra-op threads, and on a machine whose cores are busy torch's
    threads wait for each other: we measured 15 ms a step on one thread against 15-460 ms on two."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_plan(minutes: float, levels: int, sizes: int, seed: int, flops: float | None,
              min_steps: int, log) -> tuple[float, list[PlannedRun]]:
    """A new plan: from a time budget (timing the ladder first), or from a fixed smallest budget."""
    if flops is not None:
        runs = plan(flops, ladder_params(), levels, sizes, corpus_tokens(), min_steps)
        if len({r.level for r in runs}) < 2 or len(runs) < 6:
            raise UserError(f"--flops {flops:.3g} leaves {len(runs)} runs with at least {min_steps} steps each;"
                            " a sweep needs 6 or more over 2 levels: give a larger --flops")
        return flops, runs
    log("timing the model sizes ...")
    return choose_budget(minutes * 60 * TIME_FRACTION, calibrate(seed=seed), levels, sizes, corpus_tokens(),
                         min_steps)


SWEEP_MARKER = ".scaletrain-sweep"
"""File that marks a folder as a scaling sweep (written before its plan)."""


def _saved_plan(path: Path) -> dict | None:
    """The sweep's saved plan, None if there is none; a plan.json that is not one is refused (not overwritten)."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("runs"), list):
            raise ValueError("no list of runs")
        return saved
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e).split(":")[0]
        raise UserError(f"{path} is not a sweep plan ({reason}); move it away to plan the sweep again") from None


def run_sweep(out: Path, minutes: float = 10.0, levels: int = 3, sizes: int = 5, seed: int = 1234,
              flops: float | None = None, min_steps: int = MIN_STEPS, log=_log) -> dict:
    """Plan (or reuse the plan in OUT/plan.json), train every run, fit; returns the summary written to
    OUT/sweep.json. `flops` fixes the smallest budget instead of deriving it from `minutes`."""
    from scaletrain.scaling.fit import fit_all, load_points
    from scaletrain.scaling.plots import plot_report

    if not (minutes > 0 and math.isfinite(minutes)):
        raise UserError(f"--minutes must be positive, got {minutes}")
    if levels < 2 or sizes < 3:
        raise UserError(f"--levels must be >= 2 and --sizes >= 3 (got {levels}, {sizes})")
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    key = {"minutes": minutes, "levels": levels, "sizes": sizes, "seed": seed, "flops": flops,
           "min_steps": min_steps}
    saved = _saved_plan(plan_path)
    (out / SWEEP_MARKER).write_text("this folder is a scaletrain scaling sweep (scaling sweep --out continues it)\n")
    if saved is not None and saved.get("key") == key:
        runs = [PlannedRun(**r) for r in saved["runs"]]
        c0 = saved["c0"]
        log(f"reusing the plan in {plan_path}")
    else:
        c0, runs = make_plan(minutes, levels, sizes, seed, flops, min_steps, log)
        plan_path.write_text(json.dumps({"key": key, "c0": c0, "runs": [asdict(r) for r in runs]}, indent=1))
    predicted = sum(r.predicted_s for r in runs)
    when = f"predicted {predicted / 60:.1f} min of training" if math.isfinite(predicted) else "not timed"
    log(f"{len(runs)} runs at {levels} compute levels from {c0:.3g} FLOPs (x{LEVEL_RATIO:g} apart), {when}")
    start = time.perf_counter()
    for i, r in enumerate(runs, 1):
        run_dir = out / "runs" / r.name
        if _completed(run_dir, r.steps):
            log(f"[{i}/{len(runs)}] {r.name}: already done")
            continue
        t0 = time.perf_counter()
        loss = train_run(r, run_dir, seed)
        log(f"[{i}/{len(runs)}] {r.name}: N={r.params:,} D={r.tokens:,} C={r.flops:.3g} "
            f"steps={r.steps} loss={loss:.4f} ({time.perf_counter() - t0:.0f} s)")
    summary = {"c0": c0, "runs": [asdict(r) for r in runs], "train_seconds": time.perf_counter() - start}
    points = load_points(out / "runs")
    try:
        report = fit_all(points, bootstrap=50)
    except UserError as e:  # the runs are fine; the data do not support a fit
        summary["fit_error"] = str(e)
        log(f"fit failed: {e}")
    else:
        summary["fit"] = report.to_dict()
        summary["plots"] = [str(p) for p in plot_report(points, report, out / "plots")]
        from scaletrain.scaling.page import write_scaling_page

        page_runs = [{**asdict(r), "tokens": r.tokens, "flops": r.flops} for r in runs]
        summary["report"] = str(write_scaling_page(points, report, out / "report.html",
                                                   f"scaletrain scaling sweep: {out}", page_runs))
        from scaletrain.scaling.fit import print_fit_report

        print_fit_report(report)
        log(f"plots in {out / 'plots'}, page {out / 'report.html'}")
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    return summary


def run_sweep_command(args: argparse.Namespace) -> int:
    from scaletrain.guards import check_own_dir, parse_positive

    # a folder that cannot be written fails here, not after the first run; a user's folder is never overwritten
    check_own_dir(args.out, "--out", SWEEP_MARKER, "scaling sweep", legacy=("plan.json", "runs"))
    flops = parse_positive(args.flops, "--flops") if args.flops is not None else None
    with _torch_threads(1):
        summary = run_sweep(Path(args.out), args.minutes, args.levels, args.sizes, args.seed, flops)
    print(f"summary: {Path(args.out) / 'sweep.json'}")
    return 0 if "fit" in summary else 1
