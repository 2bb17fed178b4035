"""Budget to plan: a compute budget -> the compute-optimal model -> its best layout -> days of training.

`scaletrain plan --flops-budget C --gpus N --gpu TYPE [--law LAW]`:

1. N_opt(C) from the selected published law (`scaling/laws.py`: Hoffmann et al. arXiv 2203.15556,
   Besiroglu et al. arXiv 2404.10102, Kaplan et al. arXiv 2001.08361).
2. A model shape with that many parameters (`shape_for_params`): a GPT (learned positions, tied
   embeddings, as the planner's GPT-3 rows) whose width is about ASPECT times its depth, d_model/n_layers
   = 128 as in GPT-3's 6.7B-175B models (Brown et al. arXiv 2005.14165, Table 2.1; Kaplan et al. §3.1
   found the loss within a few percent over a wide range of aspect ratios at fixed N). Widths are
   multiples of 128 below 512, of 512 below 4096 (heads of 64) and of 1024 from 4096 (heads of 128), so
   from 512 on the head count is a multiple of 8 and tp up to 8 divides it; depths above 16 are
   multiples of 4 (so pipeline degrees 2 and 4 divide them). Among the shapes within 5 % of N_opt the
   one nearest the aspect ratio wins, else the nearest in N. N is counted as the law counts it: all
   parameters for the Chinchilla and Epoch laws, non-embedding parameters (Kaplan's N) for `kaplan`.
3. The global batch, unless `--global-batch` is given: Kaplan's critical batch size
   B_crit(L) = B* / L^(1/α_B) tokens with B* = 2e8 and α_B = 0.21 (Kaplan et al. §5.1), at the loss of
   Kaplan's compute frontier L(C) (both in WebText2 nats, so the two fit together), rounded to a power of
   two sequences. Training at about B_crit balances time against compute (McCandlish et al., arXiv
   1812.06162; measure your own run's noise scale with `train.log_noise_scale`).
4. The planner's layout search (`scaletrain.plan.search`) for that model on the cluster; the best
   layout is the fastest that fits.
5. days = C / (GPUs × achieved FLOP/s per GPU of the best layout) / 86400, where achieved FLOP/s are the
   planner's model FLOP/s (its model FLOPs per step / step time; they count attention, which 6N
   leaves out, so `days_by_tokens`, D / tokens per second, is a little longer).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from scaletrain.errors import UserError
from scaletrain.plan import hardware, report
from scaletrain.plan.analytic.estimate import Estimate
from scaletrain.plan.analytic.inputs import DEFAULT_ASSUMPTIONS, Assumptions, Training
from scaletrain.plan.analytic.params import param_counts, total_params
from scaletrain.plan.catalog import ModelSpec, check_model
from scaletrain.plan.search import dedupe, parse_layout, search
from scaletrain.scaling.laws import PF_DAY, Optimum, get_law, kaplan_loss_compute

ASPECT = 128.0
"""Target d_model / n_layers."""
PARAMS_TOLERANCE = 0.05
"""Shapes within this relative distance of N_opt compete on aspect ratio."""
DEFAULT_VOCAB = 32000  # Chinchilla's SentencePiece vocabulary (Hoffmann et al. §3, App. A)
DEFAULT_SEQ_LEN = 2048  # Chinchilla's and GPT-3's context
KAPLAN_B_STAR = 2e8
"""Kaplan et al. §5.1: B_crit(L) ≈ B* / L^(1/α_B), B* ≈ 2·10^8 tokens."""
KAPLAN_ALPHA_B = 0.21
SECONDS_PER_DAY = 86400.0


def counted_params(m: ModelSpec, law_name: str) -> int:
    """Parameters as the law counts them: non-embedding for Kaplan, all for the others."""
    if law_name == "kaplan":
        c = param_counts(m)
        return total_params(m) - c.embedding - c.position - c.head
    return total_params(m)


def _widths(limit: int = 131072) -> list[tuple[int, int]]:
    """(d_model, n_heads): multiples of 128 below 512 and of 512 below 4096 (heads of 64), then multiples of
    1024 (heads of 128); from 512 on the head count is a multiple of 8."""
    return ([(d, d // 64) for d in range(128, 512, 128)] + [(d, d // 64) for d in range(512, 4096, 512)]
            + [(d, d // 128) for d in range(4096, limit + 1, 1024)])


def _depths(limit: int = 512) -> list[int]:
    return list(range(1, 17)) + list(range(20, limit + 1, 4))


def shape_for_params(target: float, law_name: str = "chinchilla-3", vocab: int = DEFAULT_VOCAB,
                     seq_len: int = DEFAULT_SEQ_LEN, mlp: str = "gelu") -> ModelSpec:
    """A GPT shape with about `target` parameters (counted as `law_name` counts them); see the module doc."""
    best_near: tuple[float, float, ModelSpec] | None = None
    best_any: tuple[float, ModelSpec] | None = None
    for d, heads in _widths():
        for layers in _depths():
            aspect = d / layers
            if not ASPECT / 8 <= aspect <= ASPECT * 8:
                continue
            m = ModelSpec(f"budget-l{layers}-d{d}", layers, d, heads, vocab, seq_len, mlp=mlp,
                          source="scaletrain.scaling.budget aspect-ratio rule")
            miss = abs(math.log(counted_params(m, law_name) / target))
            off = abs(math.log(aspect / ASPECT))
            if miss <= math.log1p(PARAMS_TOLERANCE) and (best_near is None or (off, miss) < best_near[:2]):
                best_near = (off, miss, m)
            if best_any is None or miss < best_any[0]:
                best_any = (miss, m)
    assert best_any is not None
    return check_model(best_near[2] if best_near is not None else best_any[1])


def critical_batch_tokens(flops: float) -> float:
    """Kaplan's B_crit at the loss of Kaplan's compute frontier for this budget, in tokens."""
    loss = kaplan_loss_compute(flops)
    return KAPLAN_B_STAR / loss ** (1.0 / KAPLAN_ALPHA_B)


def default_global_batch(flops: float, seq_len: int) -> int:
    """B_crit / seq_len sequences, rounded to the nearest power of two (at least 1)."""
    seqs = critical_batch_tokens(flops) / seq_len
    return 2 ** max(0, round(math.log2(seqs)))


@dataclass
class BudgetPlan:
    optimum: Optimum
    """The law's compute-optimal point for the budget."""
    model: ModelSpec
    params: int
    """Parameters of `model` as the law counts them."""
    tokens: float
    """C / (6 · params): the tokens the budget buys for this model."""
    global_batch: int
    batch_rule: str
    cluster: hardware.Cluster
    train: Training
    candidates: list[Estimate]
    evaluated: int
    offload_needed: bool

    @property
    def best(self) -> Estimate:
        return self.candidates[0]

    @property
    def achieved_flops_per_gpu(self) -> float:
        return self.best.model_tflops_per_gpu * 1e12

    @property
    def days(self) -> float:
        """C / (GPUs × achieved FLOP/s per GPU), in days."""
        return self.optimum.flops / (self.cluster.n_gpus * self.achieved_flops_per_gpu) / SECONDS_PER_DAY

    @property
    def days_by_tokens(self) -> float:
        return self.tokens / self.best.tokens_per_s / SECONDS_PER_DAY

    @property
    def steps(self) -> float:
        return self.tokens / (self.global_batch * self.model.seq_len)

    def summary(self) -> dict:
        return {
            "law": self.optimum.law, "flops_budget": self.optimum.flops, "params_optimal": self.optimum.params,
            "tokens_optimal": self.optimum.tokens, "params": self.params,
            "params_total": total_params(self.model),
            "tokens": self.tokens, "steps": self.steps, "global_batch": self.global_batch,
            "batch_rule": self.batch_rule, "gpus": self.cluster.n_gpus, "gpu": self.cluster.gpu.name,
            "achieved_flops_per_gpu": self.achieved_flops_per_gpu, "mfu": self.best.mfu,
            "days": self.days, "days_by_tokens": self.days_by_tokens,
        }


def plan_budget(flops: float, n_gpus: int, gpu: hardware.GPU, law_name: str = "chinchilla-3",
                global_batch: int | None = None, vocab: int = DEFAULT_VOCAB, seq_len: int = DEFAULT_SEQ_LEN,
                mlp: str = "gelu", dtype: str = "bf16", attention: str = "flash", dp_overlap: bool = True,
                fixed: dict | None = None, assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                top: int = 5) -> BudgetPlan:
    """Law -> shape -> layout search -> days (see the module doc). UserError if nothing fits."""
    if not (math.isfinite(flops) and flops > 0):
        raise UserError(f"--flops-budget must be a positive finite number, got {flops}")
    if n_gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {n_gpus}")
    law = get_law(law_name)
    optimum = law.optimum(flops=flops)
    model = shape_for_params(optimum.params, law.name, vocab, seq_len, mlp)
    if global_batch is None:
        global_batch = default_global_batch(flops, seq_len)
        rule = (f"Kaplan critical batch at L(C) = {kaplan_loss_compute(flops):.3f}: "
                f"{critical_batch_tokens(flops):.3g} tokens, rounded to {global_batch} sequences")
    elif global_batch < 1:
        raise UserError(f"--global-batch must be >= 1, got {global_batch}")
    else:
        rule = "--global-batch"
    train = Training(global_batch, dtype, attention, dp_overlap)
    result = search(model, gpu, n_gpus, train, fixed or {}, assumptions)
    if not result.candidates or not result.candidates[0].fits:
        raise UserError(f"no layout of {n_gpus} x {gpu.name} fits the {total_params(model) / 1e9:.3g}B-parameter"
                        f" model that {law.name} chooses for {flops:.3g} FLOPs; give more --gpus")
    params = counted_params(model, law.name)
    return BudgetPlan(optimum, model, params, flops / (6.0 * params), global_batch, rule,
                      hardware.Cluster(gpu, n_gpus), train, dedupe(result.candidates, top), result.evaluated,
                      result.offload_needed)


# --------------------------------------------------------------------------- command line (from plan)


def _gpu(args: argparse.Namespace, dtype: str) -> tuple[hardware.GPU, Assumptions]:
    if args.calibrate:  # measured rates are achieved rates already
        from scaletrain.plan.calibrate import calibrate

        gpu = calibrate(dtype if dtype in ("fp32", "fp64") else "fp32", max(2, min(args.gpus or 2, 8)))
        return gpu, Assumptions(link_efficiency=1.0, hbm_efficiency=1.0, reserved_bytes=0.0)
    if args.cluster:
        gpu, n = hardware.load_cluster(args.cluster)
        if args.gpus is None and n is not None:
            args.gpus = n
        return gpu, DEFAULT_ASSUMPTIONS
    return hardware.get_gpu(args.gpu or "a100-80gb"), DEFAULT_ASSUMPTIONS


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def print_plan(p: BudgetPlan) -> None:
    o, m, b = p.optimum, p.model, p.best
    what = "non-embedding parameters" if o.law == "kaplan" else "parameters"
    miss = p.params / o.params - 1
    lines = (
        ("budget", f"{o.flops:.3e} FLOPs  ({o.flops / PF_DAY:,.4g} PF-days)"),
        ("law", f"{o.law}: N_opt = {o.params:.3e} {what}, D_opt = {o.tokens:.3e} tokens"),
        ("model", f"{m.n_layers} layers x d_model {m.d_model}, {m.n_heads} heads, vocab {m.vocab_size}, seq "
                  f"{m.seq_len}: {p.params:.3e} {what} ({miss:+.1%} from N_opt), "
                  f"{_si(total_params(m))} in all"),
        ("tokens", f"{p.tokens:.3e}  (C / 6N), {p.steps:,.0f} steps of {p.global_batch} x {m.seq_len} tokens"),
        ("global batch", p.batch_rule),
        ("best layout", f"{b.layout.short()}: {b.step_time_s:.3g} s/step, MFU {b.mfu:.1%}, "
                        f"{p.achieved_flops_per_gpu / 1e12:.1f} TFLOP/s per GPU"),
        ("days", f"{p.days:,.2f}  = C / ({p.cluster.n_gpus} x {p.achieved_flops_per_gpu:.3e} FLOP/s) / 86400"),
        ("", f"(D / tokens per second: {p.days_by_tokens:,.2f} days; the planner's FLOPs include attention)"),
    )
    for key, value in lines:
        print(f"{key:<13}{value}")
    if p.offload_needed:
        print("Nothing fits without offload; these layouts offload optimizer state or parameters.")
    from rich.console import Console

    con = Console(width=None if sys.stdout.isatty() else 160)
    con.print(report.table(p.candidates, p.cluster, f"{m.name} on {p.cluster.n_gpus} x {p.cluster.gpu.name} "
                                                    f"({p.evaluated} layouts evaluated)"))


def run_budget(args: argparse.Namespace) -> int:
    """`scaletrain plan --flops-budget C ...` (dispatched from scaletrain.commands.plan)."""
    from scaletrain.guards import parse_positive

    flops = parse_positive(args.flops_budget, "--flops-budget")
    model_flags = ("model", "config", "params", "layers", "hidden", "heads", "ffn", "kv_heads", "experts", "top_k")
    given = ["--" + k.replace("_", "-") for k in model_flags if getattr(args, k, None) is not None]
    if given:
        raise UserError(f"--flops-budget chooses the model from the law; do not also give {', '.join(given)}")
    gpu, assumptions = _gpu(args, args.dtype)
    if args.gpus is None:
        raise UserError("--gpus is required with --flops-budget (or a cluster file with gpus)")
    p = plan_budget(flops, args.gpus, gpu, args.law, args.global_batch, args.vocab or DEFAULT_VOCAB,
                    args.seq_len or DEFAULT_SEQ_LEN, args.mlp or "gelu", args.dtype, args.attention,
                    not args.no_dp_overlap, parse_layout(args.layout), assumptions, args.top)
    if args.png:
        report.memory_png(p.candidates, gpu.memory_bytes, args.png,
                          f"{p.model.name} on {p.cluster.n_gpus} x {gpu.name}: memory per GPU")
    if getattr(args, "html", None):
        from scaletrain.report.plan_page import write_plan_page

        write_plan_page({**report.to_json(p.model, p.cluster, p.train, p.candidates), "budget": p.summary()},
                        args.html)
    if args.json:
        doc = report.to_json(p.model, p.cluster, p.train, p.candidates)
        doc["budget"] = p.summary()
        json.dump(doc, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
    else:
        print_plan(p)
    return 0
