"""Fit scaling laws to real runs: the three estimation approaches of Hoffmann et al. 2022 (arXiv 2203.15556).

Input is a set of (params N, tokens D, flops C, loss L) points, read from a CSV or from a folder of
scaletrain run outputs, optionally grouped into training curves by a `run` label.

- Approach 1 (§3.1): the lower envelope of the training curves over compute. Each curve is a map
  C -> L (interpolated in log C; its first 10 % is dropped, see ENVELOPE_SKIP); at each of many
  log-spaced budgets the run with the lowest loss gives N_opt(C); a power law N_opt = k·C^a is fitted.
- Approach 2 (§3.2): IsoFLOP profiles. Final points are grouped by budget; a parabola in log N is fitted
  to each group's losses and its vertex is N_opt(C); a power law is fitted to the vertices.
- Approach 3 (§3.3, §D.2): the parametric loss L = E + A/N^α + B/D^β fitted to all final points by
  minimising Σ Huber_δ(LSE(a - α log N, b - β log D, e) - log L) with δ = 1e-3 and L-BFGS. The objective
  is summed, not averaged, and divided by δ² so that L-BFGS's stopping tests see a well-scaled number
  (Besiroglu et al., arXiv 2404.10102, trace the original fit's early stop to a badly scaled objective).
  Starts: the objective is evaluated on the paper's whole initialisation grid (4,500 points) and
  L-BFGS is run from the best few of them; the best converged fit wins.

Confidence intervals are bootstrapped as in the paper's Table 2: the fit is repeated on random 80 %
subsets of the data (runs for approach 1, final points otherwise) and the 10th and 90th percentiles of
the exponents are reported. Throughout, C = 6·N·D and N counts all parameters (embeddings included),
as in the Chinchilla paper (§F).
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from scaletrain.errors import UserError
from scaletrain.scaling.laws import FLOPS_PER_PARAM_TOKEN, ParametricLaw, PowerLawFrontier, fit_power_law

REQUIRED_COLUMNS = ("params", "tokens", "flops", "loss")
HUBER_DELTA = 1e-3
PERCENTILES = (10.0, 90.0)
# Hoffmann et al. §D.2 initialisation grid for (alpha, beta, e, a, b).
INIT_GRID = (
    np.arange(0.0, 2.01, 0.5),
    np.arange(0.0, 2.01, 0.5),
    np.arange(-1.0, 1.01, 0.5),
    np.arange(0.0, 25.1, 5.0),
    np.arange(0.0, 25.1, 5.0),
)


# --------------------------------------------------------------------------- data


@dataclass
class Points:
    """Observed (N, D, C, L) points; `run` labels group them into training curves (None: each its own run).

    `val_loss` (NaN where absent) is a held-out loss logged at some points; where a run's last point has
    one, the run's final point uses it instead of the training loss (see `final`).
    """

    params: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    loss: np.ndarray
    run: np.ndarray | None = None
    val_loss: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, idx: np.ndarray) -> Points:
        run = None if self.run is None else self.run[idx]
        val = None if self.val_loss is None else self.val_loss[idx]
        return Points(self.params[idx], self.tokens[idx], self.flops[idx], self.loss[idx], run, val)

    def run_indices(self) -> dict[str, np.ndarray]:
        """Indices of each run's points, sorted by compute."""
        if self.run is None:
            return {str(i): np.array([i]) for i in range(len(self))}
        out = {}
        for name in dict.fromkeys(self.run.tolist()):
            idx = np.flatnonzero(self.run == name)
            out[name] = idx[np.argsort(self.flops[idx], kind="stable")]
        return out

    def final(self) -> Points:
        """The last (largest-compute) point of every run: what approaches 2 and 3 fit. Its loss is the
        held-out `val_loss` where the run logged one there (the same held-out windows for every run, so
        runs compare with far less noise than one batch's training loss), else the training loss."""
        if self.run is None:
            return self
        final = self.subset(np.array([idx[-1] for idx in self.run_indices().values()]))
        if final.val_loss is not None:
            has_val = np.isfinite(final.val_loss)
            final.loss = np.where(has_val, final.val_loss, final.loss)
            final.val_loss = None
        return final


def _number(text: str, column: str, line: int, path: Path) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(f"{path}: line {line}: column '{column}' is not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{path}: line {line}: column '{column}' must be positive and finite, got {text!r}")
    return value


def read_csv(path: Path) -> Points:
    """Points from a CSV with columns params, tokens, flops, loss and optionally run."""
    from scaletrain.guards import read_input

    text = read_input(path, "RUNS", "CSV file")  # guards.py: FIFOs, not UTF-8, a spreadsheet's byte-order mark
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise UserError(
                f"{path}: missing column(s) {', '.join(missing)} (need {', '.join(REQUIRED_COLUMNS)};"
                f" found {', '.join(header) or 'no header'})"
            )
        rows = [{k.strip(): v for k, v in row.items() if k is not None} for row in reader]
    except csv.Error as e:
        raise UserError(f"{path}: not a CSV file ({e})") from None
    values = {c: [] for c in REQUIRED_COLUMNS}
    runs = []
    for line, row in enumerate(rows, start=2):
        for c in REQUIRED_COLUMNS:
            values[c].append(_number((row.get(c) or "").strip(), c, line, path))
        runs.append((row.get("run") or "").strip())
    if not rows:
        raise UserError(f"{path}: no data rows")
    run = np.array(runs, dtype=object) if "run" in header else None
    return Points(*(np.array(values[c], dtype=float) for c in REQUIRED_COLUMNS), run=run)


def model_params(model_cfg) -> int:
    """Parameters of scaletrain's GPT for a model config, counted on the meta device (no memory used)."""
    from scaletrain.model.gpt import count_params, gpt_on_meta

    return count_params(gpt_on_meta(model_cfg))


def _smooth(loss: np.ndarray, window: int) -> np.ndarray:
    """Gaussian smoothing over about `window` logged steps (Hoffmann et al. §D.1 use a 10-step window)."""
    if window <= 1 or len(loss) < 3:
        return loss
    from scipy.ndimage import gaussian_filter1d

    return gaussian_filter1d(loss, sigma=window / 4.0, mode="nearest", truncate=2.0)


def read_run_dir(run_dir: Path, smooth: int = 10) -> Points:
    """Points of one scaletrain run: tokens = step · train.global_batch · model.seq_len, C = 6·N·D."""
    from scaletrain.config import load_config

    cfg = load_config(run_dir / "config.yaml")
    n = float(model_params(cfg.model))
    steps, losses, vals = [], [], []
    with open(run_dir / "metrics.jsonl") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{run_dir / 'metrics.jsonl'}: line {line_no} is not JSON") from None
            if "loss" in rec and "step" in rec and rec["step"] > 0 and math.isfinite(rec["loss"]):
                steps.append(float(rec["step"]))
                losses.append(float(rec["loss"]))
                vals.append(float(rec.get("val_loss", math.nan)))
    if not steps:
        raise UserError(f"{run_dir / 'metrics.jsonl'}: no lines with a positive 'step' and a 'loss'")
    order = np.argsort(steps, kind="stable")
    step = np.array(steps)[order]
    tokens = step * cfg.train.global_batch * cfg.model.seq_len
    loss = _smooth(np.array(losses)[order], smooth)
    return Points(np.full(len(step), n), tokens, FLOPS_PER_PARAM_TOKEN * n * tokens, loss,
                  np.full(len(step), run_dir.name, dtype=object), np.array(vals)[order])


def read_run_dirs(root: Path, smooth: int = 10) -> Points:
    """Points of every run under `root` (each a folder with config.yaml and metrics.jsonl)."""
    dirs = sorted({p.parent for p in root.rglob("metrics.jsonl") if (p.parent / "config.yaml").is_file()})
    if not dirs:
        raise UserError(f"{root}: no run folders (a folder with config.yaml and metrics.jsonl) found")
    parts = [read_run_dir(d, smooth) for d in dirs]
    names = [str(d.relative_to(root)) if d != root else d.name for d in dirs]
    for part, name in zip(parts, names):
        part.run[:] = name
    fields = ("params", "tokens", "flops", "loss", "run", "val_loss")
    return Points(*(np.concatenate([getattr(p, f) for p in parts]) for f in fields))


def load_points(path: str | Path) -> Points:
    """A CSV file or a folder of run outputs."""
    from scaletrain.guards import check_path

    p = check_path(path, "RUNS")
    if p.is_dir():
        return read_run_dirs(p)
    if not p.exists():
        raise UserError(f"runs not found: {p} (give a CSV file or a folder of scaletrain runs)")
    return read_csv(p)


# --------------------------------------------------------------------------- results


@dataclass
class FrontierFit:
    """N_opt = k·C^a and D_opt = kd·C^b fitted to frontier points (approaches 1 and 2)."""

    approach: int
    a: float
    k: float
    b: float
    kd: float
    compute: np.ndarray
    n_opt: np.ndarray
    d_opt: np.ndarray
    a_ci: tuple[float, float] | None = None
    b_ci: tuple[float, float] | None = None
    notes: list[str] = field(default_factory=list)

    def law(self) -> PowerLawFrontier:
        return PowerLawFrontier(f"fit-approach-{self.approach}", self.a, self.k)

    def to_dict(self) -> dict:
        return {"a": self.a, "k": self.k, "b": self.b, "kd": self.kd, "a_ci": self.a_ci, "b_ci": self.b_ci,
                "frontier_points": len(self.compute), "notes": self.notes}


@dataclass
class IsoFlopCurve:
    """One IsoFLOP group of approach 2: its parabola L = p[0]·x² + p[1]·x + p[2] in x = ln N."""

    flops: float
    params: np.ndarray
    loss: np.ndarray
    coef: np.ndarray
    n_opt: float | None  # None: no valley inside the sampled sizes


@dataclass
class ParametricFit:
    """Approach 3: L(N, D) = E + A/N^α + B/D^β."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    n_points: int
    starts: int
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def a(self) -> float:
        return self.law().a

    @property
    def b(self) -> float:
        return self.law().b

    def law(self) -> ParametricLaw:
        return ParametricLaw("fit-approach-3", self.E, self.A, self.B, self.alpha, self.beta)

    def to_dict(self) -> dict:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta,
                "a": self.a, "b": self.b, "ci": self.ci, "points": self.n_points, "objective": self.objective}


@dataclass
class FitReport:
    points: int
    runs: int
    final_points: int
    approach1: FrontierFit | None = None
    approach2: FrontierFit | None = None
    approach3: ParametricFit | None = None
    isoflop: list[IsoFlopCurve] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        def d(x):
            return None if x is None else x.to_dict()

        return {"points": self.points, "runs": self.runs, "final_points": self.final_points,
                "approach1": d(self.approach1), "approach2": d(self.approach2),
                "approach3": d(self.approach3), "skipped": self.skipped}


class ApproachSkipped(Exception):
    """This approach cannot run on these data (reported, or a UserError when it was asked for)."""


def _ci(samples: list[float]) -> tuple[float, float] | None:
    if len(samples) < 10:
        return None
    lo, hi = np.percentile(samples, PERCENTILES)
    return float(lo), float(hi)


def _frontier(approach: int, compute: np.ndarray, n_opt: np.ndarray) -> FrontierFit:
    d_opt = compute / (FLOPS_PER_PARAM_TOKEN * n_opt)
    a, k = fit_power_law(compute, n_opt)
    b, kd = fit_power_law(compute, d_opt)
    return FrontierFit(approach, a, k, b, kd, compute, n_opt, d_opt)


# --------------------------------------------------------------------------- approach 1


ENVELOPE_SKIP = 0.1
"""Approach 1 ignores the first 10 % of every curve (by compute): warm-up and the initial plateau, which
in small runs would otherwise make the envelope at low compute."""


def envelope(points: Points, grid_size: int = 300,
             skip: float = ENVELOPE_SKIP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lower envelope of the training curves: (C, N of the best run, its loss) at log-spaced budgets
    covered by at least two curves."""
    curves = []
    for i in points.run_indices().values():
        i = i[points.flops[i] >= skip * points.flops[i[-1]]]
        if len(i) >= 2:
            curves.append((np.log(points.flops[i]), points.loss[i], points.params[i[0]]))
    if len(curves) < 2:
        raise ApproachSkipped(
            "approach 1 needs at least two training curves (a 'run' column with several points each)")
    lo = min(c[0][0] for c in curves)
    hi = max(c[0][-1] for c in curves)
    grid = np.linspace(lo, hi, grid_size)
    loss = np.full((len(curves), grid_size), np.inf)
    for j, (logc, curve, _) in enumerate(curves):
        inside = (grid >= logc[0]) & (grid <= logc[-1])
        loss[j, inside] = np.interp(grid[inside], logc, curve)
    keep = np.isfinite(loss).sum(axis=0) >= 2  # budgets where at least two curves compete
    best = np.argmin(loss, axis=0)
    n = np.array([curves[j][2] for j in best])
    if keep.sum() < 2 or len(np.unique(n[keep])) < 2:
        raise ApproachSkipped("approach 1: the lower envelope of the training curves is a single model size")
    return np.exp(grid[keep]), n[keep], loss[best[keep], np.flatnonzero(keep)]


def fit_approach1(points: Points) -> FrontierFit:
    c, n, _ = envelope(points)
    return _frontier(1, c, n)


# --------------------------------------------------------------------------- approach 2


def isoflop_groups(flops: np.ndarray, rel_tol: float = 0.1) -> list[np.ndarray]:
    """Indices of points whose budgets agree within `rel_tol`, clustered in log C."""
    order = np.argsort(flops, kind="stable")
    logc = np.log(flops[order])
    breaks = np.flatnonzero(np.diff(logc) > math.log1p(rel_tol)) + 1
    return list(np.split(order, breaks))


def isoflop_curves(final: Points) -> list[IsoFlopCurve]:
    curves = []
    for g in isoflop_groups(final.flops):
        x = np.log(final.params[g])
        if len(np.unique(x)) < 3:
            continue
        coef = np.polyfit(x, final.loss[g], 2)
        n_opt = None
        if coef[0] > 0:
            vertex = -coef[1] / (2 * coef[0])
            if x.min() <= vertex <= x.max():
                n_opt = float(math.exp(vertex))
        order = np.argsort(x)
        curves.append(IsoFlopCurve(float(np.exp(np.mean(np.log(final.flops[g])))), final.params[g][order],
                                   final.loss[g][order], coef, n_opt))
    return curves


def fit_approach2(final: Points) -> tuple[FrontierFit, list[IsoFlopCurve]]:
    curves = isoflop_curves(final)
    valleys = [c for c in curves if c.n_opt is not None]
    if len(valleys) < 2:
        raise ApproachSkipped(
            f"approach 2 needs at least 2 IsoFLOP budgets with 3+ model sizes and a loss valley inside the"
            f" sampled sizes; found {len(curves)} budget(s) with 3+ sizes, {len(valleys)} with a valley"
        )
    fit = _frontier(2, np.array([c.flops for c in valleys]), np.array([c.n_opt for c in valleys]))
    dropped = len(curves) - len(valleys)
    if dropped:
        fit.notes.append(f"{dropped} IsoFLOP budget(s) without a valley inside the sampled sizes left out")
    return fit, curves


# --------------------------------------------------------------------------- approach 3


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run OpenBLAS on one thread inside the block, then restore its thread count.

    scipy's L-BFGS-B calls BLAS on 5-element vectors; on a machine whose cores are busy, OpenBLAS's
    thread hand-offs made each fit 10-40 times slower in our measurements. Linux with OpenBLAS only
    (the loaded libraries are found in /proc/self/maps); elsewhere this does nothing.
    """
    restore = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        paths = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""),
                               ("openblas", "64_"), ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                restore.append((put, get()))
                put(1)
                break
    try:
        yield
    finally:
        for put, n in restore:
            put(n)



def _huber_objective(theta: np.ndarray, logn: np.ndarray, logd: np.ndarray, logl: np.ndarray,
                     delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Σ Huber_δ(LSE(a - α ln N, b - β ln D, e) - ln L) / δ² and its gradient; theta (..., 5) =
    (a, b, e, alpha, beta), broadcast over leading dimensions."""
    a, b, e, alpha, beta = (theta[..., i, None] for i in range(5))
    t = np.stack(np.broadcast_arrays(a - alpha * logn, b - beta * logd, e + 0 * logn))  # (3, ..., n)
    m = t.max(axis=0)
    w = np.exp(t - m)
    s = w.sum(axis=0)
    r = m + np.log(s) - logl
    w = w / s  # softmax weights: d LSE / d t_i
    absr = np.abs(r)
    h = np.where(absr <= delta, 0.5 * r * r, delta * (absr - 0.5 * delta)).sum(axis=-1)
    dh = np.clip(r, -delta, delta)
    grad = np.stack([(dh * w[0]).sum(-1), (dh * w[1]).sum(-1), (dh * w[2]).sum(-1),
                     -(dh * w[0] * logn).sum(-1), -(dh * w[1] * logd).sum(-1)], axis=-1)
    return h / delta**2, grad / delta**2


def _grid_starts(logn, logd, logl, delta, n_starts: int) -> np.ndarray:
    alpha, beta, e, a, b = np.meshgrid(*INIT_GRID, indexing="ij")
    grid = np.stack([a.ravel(), b.ravel(), e.ravel(), alpha.ravel(), beta.ravel()], axis=-1)
    values = np.concatenate([_huber_objective(chunk, logn, logd, logl, delta)[0]
                             for chunk in np.array_split(grid, max(1, len(grid) * len(logn) // 200_000))])
    return grid[np.argsort(values, kind="stable")[:n_starts]]


def _lbfgs(starts: np.ndarray, logn, logd, logl, delta) -> tuple[np.ndarray, float, int]:
    """Best converged L-BFGS solution over `starts`: (theta, objective, number converged)."""
    best, best_value, converged = None, math.inf, 0
    for x0 in starts:
        res = minimize(_huber_objective, x0, args=(logn, logd, logl, delta), jac=True, method="L-BFGS-B",
                       options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-9})
        ok = np.all(np.isfinite(res.x)) and (res.success or np.max(np.abs(res.jac)) < 1e-5 * len(logl))
        if ok:
            converged += 1
            if res.fun < best_value:
                best, best_value = res.x, float(res.fun)
    return best, best_value, converged


def fit_approach3(final: Points, n_starts: int = 16, delta: float = HUBER_DELTA,
                  bootstrap: int = 0, seed: int = 0) -> ParametricFit:
    """Fit L = E + A/N^α + B/D^β to the final points (Hoffmann et al. eq. 3 and §D.2)."""
    n = len(final)
    if n <= 5:
        raise UserError(f"approach 3 fits 5 parameters (E, A, B, alpha, beta) and needs more than 5 final"
                        f" points (runs); got {n}")
    for what, values, exponent in (("model sizes", final.params, "alpha"), ("token counts", final.tokens, "beta")):
        distinct = np.unique(values)
        if len(distinct) < 3:  # E + A/N^alpha has 3 unknowns along N: two sizes fit any alpha exactly
            raise UserError(f"approach 3 cannot identify {exponent}: the runs have {len(distinct)} distinct "
                            f"{what} ({', '.join(f'{v:.3g}' for v in distinct)}); add runs of at least 3")
    logn, logd, logl = np.log(final.params), np.log(final.tokens), np.log(final.loss)
    starts = _grid_starts(logn, logd, logl, delta, n_starts)
    with one_blas_thread():
        theta, value, converged = _lbfgs(starts, logn, logd, logl, delta)
    if theta is None:
        raise UserError(f"approach 3 fit did not converge from any of {len(starts)} starting points")
    a, b, e, alpha, beta = (float(v) for v in theta)
    if alpha <= 0 or beta <= 0:
        raise UserError(
            f"approach 3 fit is degenerate: alpha={alpha:.3g}, beta={beta:.3g} (the losses do not fall as"
            f" a power law in both model size and tokens); add runs spanning more sizes and budgets"
        )
    fit = ParametricFit(math.exp(e), math.exp(a), math.exp(b), alpha, beta, value, n, converged)
    if bootstrap:
        with one_blas_thread():
            fit.ci = _bootstrap3(final, theta, starts[:3], delta, bootstrap, seed)
    return fit


def _bootstrap3(final: Points, theta: np.ndarray, starts: np.ndarray, delta: float, rounds: int,
                seed: int) -> dict[str, tuple[float, float]]:
    rng = np.random.default_rng(seed)
    n = len(final)
    size = int(round(0.8 * n))
    if size <= 5:
        return {}
    samples: dict[str, list[float]] = {k: [] for k in ("alpha", "beta", "a", "b", "E")}
    x0 = np.vstack([theta, starts])
    for _ in range(rounds):
        idx = rng.choice(n, size=size, replace=False)
        sub = final.subset(idx)
        t, _, _ = _lbfgs(x0, np.log(sub.params), np.log(sub.tokens), np.log(sub.loss), delta)
        if t is None or t[3] <= 0 or t[4] <= 0:
            continue
        samples["alpha"].append(t[3])
        samples["beta"].append(t[4])
        samples["a"].append(t[4] / (t[3] + t[4]))
        samples["b"].append(t[3] / (t[3] + t[4]))
        samples["E"].append(math.exp(t[2]))
    return {k: ci for k, v in samples.items() if (ci := _ci(v)) is not None}


# --------------------------------------------------------------------------- all approaches


def _bootstrap_frontier(fit: FrontierFit, points: Points, by_run: bool, refit, rounds: int,
                        seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = list(points.run_indices().values()) if by_run else [np.array([i]) for i in range(len(points))]
    size = max(1, int(round(0.8 * len(groups))))
    a_s, b_s = [], []
    for _ in range(rounds):
        pick = rng.choice(len(groups), size=size, replace=False)
        try:
            f = refit(points.subset(np.concatenate([groups[i] for i in pick])))
        except (ApproachSkipped, UserError, np.linalg.LinAlgError):
            continue
        a_s.append(f.a)
        b_s.append(f.b)
    fit.a_ci, fit.b_ci = _ci(a_s), _ci(b_s)


def fit_all(points: Points, approaches: tuple[int, ...] = (1, 2, 3), bootstrap: int = 100,
            seed: int = 0, required: tuple[int, ...] = (3,), progress=None) -> FitReport:
    """Run the requested approaches. An approach in `required` that cannot run is a UserError; the
    others are reported in `skipped` with the reason. `progress(text)`, if given, hears each approach start."""
    with one_blas_thread():
        return _fit_all(points, approaches, bootstrap, seed, required, progress or (lambda text: None))


def _fit_all(points: Points, approaches: tuple[int, ...], bootstrap: int, seed: int,
             required: tuple[int, ...], progress) -> FitReport:
    final = points.final()
    report = FitReport(len(points), len(points.run_indices()), len(final))

    def attempt(k: int, fn) -> None:
        if k not in approaches:
            return
        progress(f"approach {k}" + (f" (+ {bootstrap} bootstrap refits)" if bootstrap else ""))
        try:
            fn()
        except ApproachSkipped as e:
            if k in required:
                raise UserError(str(e)) from None
            report.skipped[f"approach{k}"] = str(e)

    def one() -> None:
        report.approach1 = fit_approach1(points)
        if bootstrap:
            _bootstrap_frontier(report.approach1, points, True, fit_approach1, bootstrap, seed)

    def two() -> None:
        report.isoflop = isoflop_curves(final)  # plotted even when approach 2 cannot use them
        report.approach2, report.isoflop = fit_approach2(final)
        if bootstrap:
            _bootstrap_frontier(report.approach2, final, False, lambda p: fit_approach2(p)[0], bootstrap,
                                seed)

    def three() -> None:
        report.approach3 = fit_approach3(final, bootstrap=bootstrap, seed=seed)

    attempt(3, three)
    attempt(2, two)
    attempt(1, one)
    return report


def _fmt_ci(ci) -> str:
    return "" if not ci else f"  [{ci[0]:.3f}, {ci[1]:.3f}]"


def print_fit_report(report) -> None:
    """The fits of `scaling fit` (and `scaling sweep`) as text."""
    print(f"points {report.points}  runs {report.runs}  final points {report.final_points}")
    p = report.approach3
    if p is not None:
        print(f"approach 3 (parametric, Huber delta=1e-3, L-BFGS; {p.starts} converged starts)")
        print(f"  L(N, D) = {p.E:.4g} + {p.A:.4g}/N^{p.alpha:.4f} + {p.B:.4g}/D^{p.beta:.4f}")
        print(f"  N_opt ~ C^{p.a:.3f}{_fmt_ci(p.ci.get('a'))}   D_opt ~ C^{p.b:.3f}{_fmt_ci(p.ci.get('b'))}")
        for k in ("alpha", "beta", "E"):
            if k in p.ci:
                print(f"  {k} 10-90%{_fmt_ci(p.ci[k])}")
    frontiers = ((2, report.approach2, "IsoFLOP parabolas"), (1, report.approach1, "training-curve envelope"))
    for k, fit, what in frontiers:
        if fit is None:
            continue
        print(f"approach {k} ({what}, {len(fit.compute)} frontier points)")
        print(f"  N_opt = {fit.k:.4g} * C^{fit.a:.3f}{_fmt_ci(fit.a_ci)}")
        print(f"  D_opt = {fit.kd:.4g} * C^{fit.b:.3f}{_fmt_ci(fit.b_ci)}")
        for note in fit.notes:
            print(f"  note: {note}")
    for k, reason in report.skipped.items():
        print(f"{k.replace('approach', 'approach ')} skipped: {reason}")
