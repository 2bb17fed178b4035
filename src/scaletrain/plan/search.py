"""Enumerate the parallel layouts of a model on a cluster and rank them by predicted step time.

The search space: tp over the divisors of the GPU count up to one node (heads divisible) for Megatron's 1D, and
the 2D / 2.5D / 3D grids of any size that divide it (`tp_mode`, plan/analytic/tp_nd.py; pp only with 2D), pp over
divisors that split the layers, dp the rest, ep over divisors of dp and the expert count (MoE only),
micro-batch sizes dividing the per-rank batch, ZeRO 0-3 (under pipeline parallelism ZeRO-3 keeps a stage
gathered for the whole step, as FSDP does with pipelining), recompute none / selective / full, sequence parallelism when
tp > 1, and the synchronous schedules 1F1B, interleaved (virtual stages 2, 4, 8 that divide the layers)
and ZB-H1 (recompute `selective` only with standard attention). GPipe (1F1B's time with more memory)
and 2BW (asynchronous, a different update rule) are evaluated only when asked for with --layout.
Offload is tried only when nothing fits without it.

Speed: memory is checked first with the cheap memory-only model and time is computed only for layouts
that fit, so a 1T-parameter model on 3,072 GPUs is searched in well under 2 s (tests/test_plan_search.py).
The pipeline bubble uses the closed forms of `analytic.pipeline.pipeline_time`, which agree with the schedule
simulator (`scaletrain.parallel.pipeline.simulate`) for every schedule and small p, m, v (tested).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from scaletrain.config.schema import CP_MODES, CP_UNSUPPORTED_RECOMPUTE, TP_MODES
from scaletrain.distributed.grid import grid_shape
from scaletrain.errors import UserError
from scaletrain.guards import MAX_GPUS, short
from scaletrain.plan.analytic.estimate import Estimate, estimate
from scaletrain.plan.analytic.inputs import (
    DEFAULT_ASSUMPTIONS,
    OFFLOAD,
    SCHEDULES,
    Assumptions,
    Layout,
    Training,
    recompute_policy,
)
from scaletrain.plan.analytic.stages import PARTITIONS
from scaletrain.plan.analytic.tp_nd import grid
from scaletrain.plan.catalog import ModelSpec
from scaletrain.plan.hardware import GPU
from scaletrain.plan.trust import rank_key

LAYOUT_FIELDS = {f.name: f.type for f in fields(Layout)}
SEARCHED_RECOMPUTE = ("none", "full", "ops:matmul+attention")
"""The checkpointing policies the search tries; `attn-core` too with standard attention (with flash attention the
kernel already recomputes the core: it would save nothing). every:k and nth:k are evaluated when asked for."""


def parse_layout(text: str) -> dict:
    """`"dp=8,tp=8,recompute=selective,sequence_parallel=true"` -> {field: value}; UserError if bad. Block counts
    of `partition` continue over the commas: `"pp=4,partition=7,8,8,7"`."""
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item and item.isdigit() and str(out.get("partition", "x")).replace(",", "").isdigit():
            out["partition"] += f",{item}"
            continue
        if "=" not in item:
            raise UserError(f"--layout expects key=value pairs, got {item!r}")
        key, raw = (x.strip() for x in item.split("=", 1))
        key = {"mb": "micro_batch", "sp": "sequence_parallel", "v": "virtual_stages",
               "reshard": "reshard_after_forward"}.get(key, key)
        if key not in LAYOUT_FIELDS:
            raise UserError(f"--layout: unknown field {key!r} (known: {', '.join(LAYOUT_FIELDS)})")
        if key in out:  # tp=8,tp=4 kept the last one silently
            raise UserError(f"--layout names {key} twice ({key}={out[key]} and {key}={raw}); give it once")
        if key in ("tp_mode", "cp_mode"):
            allowed = TP_MODES if key == "tp_mode" else CP_MODES
            if raw not in allowed:
                raise UserError(f"--layout: {key} must be one of {', '.join(allowed)}, got {raw!r}")
            out[key] = raw
            continue
        if key in ("sequence_parallel", "reshard_after_forward"):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise UserError(f"--layout: {key} must be true or false, got {raw!r}")
            out[key] = raw.lower() in ("true", "1", "yes")
        elif key == "recompute":
            try:
                out[key] = recompute_policy(raw).spec
            except UserError as e:
                raise UserError(f"--layout: {e}") from None
        elif key == "partition":
            if raw not in PARTITIONS and not raw.isdigit():
                raise UserError(f"--layout: partition must be one of {', '.join(PARTITIONS)} or block counts like"
                                f" 7,8,8,7; got {raw!r}")
            out[key] = raw
        elif key in ("schedule", "offload"):
            allowed = {"schedule": SCHEDULES, "offload": OFFLOAD}[key]
            if raw not in allowed:
                raise UserError(f"--layout: {key} must be one of {', '.join(allowed)}, got {raw!r}")
            out[key] = raw
        else:
            try:
                out[key] = int(raw)
            except ValueError:
                raise UserError(f"--layout: {key} must be an integer, got {raw!r}") from None
            if out[key] < (0 if key == "zero" else 1):
                raise UserError(f"--layout: {key} must be >= {0 if key == 'zero' else 1}, got {raw}")
            if out[key] > MAX_GPUS:
                raise UserError(f"--layout: {key} ({short(out[key], 30)}) is above the limit of {MAX_GPUS:,}")
    return out


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class SearchResult:
    candidates: list[Estimate]
    """Every evaluated layout, best first: fitting ones by step time, then the rest by overshoot."""
    evaluated: int
    offload_needed: bool = False


def _options(fixed: dict, key: str, default: list) -> list:
    return [fixed[key]] if key in fixed else default


def enumerate_layouts(m: ModelSpec, gpu: GPU, n_gpus: int, train: Training, fixed: dict,
                      offload: tuple[str, ...] = ("none",)) -> list[Layout]:
    cp_fixed = fixed.get("cp", 1)
    if {"dp", "tp", "pp"} <= fixed.keys() and fixed["dp"] * fixed["tp"] * fixed["pp"] * cp_fixed != n_gpus:
        cp = f" x cp ({cp_fixed})" if "cp" in fixed else ""
        raise UserError(f"layout dp ({fixed['dp']}) x tp ({fixed['tp']}) x pp ({fixed['pp']}){cp} ="
                        f" {fixed['dp'] * fixed['tp'] * fixed['pp'] * cp_fixed} does not match --gpus ({n_gpus})")
    for key in ("dp", "tp", "pp", "cp"):
        if key in fixed and n_gpus % fixed[key]:
            raise UserError(f"layout {key} ({fixed[key]}) does not divide --gpus ({n_gpus})")
    out: list[Layout] = []
    for mode, tp, depth, rows, cp, cp_mode in _tp_cp_choices(m, gpu, n_gpus, fixed):
        grid_mode = mode != "1d"
        for pp in _options(fixed, "pp", divisors(n_gpus // (tp * cp)) if n_gpus % (tp * cp) == 0 else []):
            if n_gpus % (tp * pp * cp) or m.n_layers < pp or (pp > 1 and mode in ("2.5d", "3d")):
                continue
            dp = n_gpus // (tp * pp * cp)
            if "dp" in fixed and fixed["dp"] != dp:
                continue
            if train.global_batch % dp:
                continue
            per_rank = train.global_batch // dp
            mbs = _options(fixed, "micro_batch", [d for d in divisors(per_rank) if d <= max(16, 4 * rows)
                                                  and d % rows == 0])
            eps = _options(fixed, "ep", [e for e in divisors(dp) if m.n_experts and m.n_experts % e == 0]
                           if m.n_experts else [1])
            zeros = _options(fixed, "zero", [0, 1] if grid_mode else [0, 1, 2, 3])
            sps = _options(fixed, "sequence_parallel", [True, False] if tp > 1 and not grid_mode else [False])
            scheds: list[tuple[str, int, str]] = []
            if pp == 1:
                scheds = [(fixed.get("schedule", "1f1b"), fixed.get("virtual_stages", 1), "uniform")]
            else:
                names = _options(fixed, "schedule", ["1f1b", "interleaved"] + ([] if grid_mode else ["zb-h1"]))
                for name in names:
                    if name == "interleaved":  # chunks of equal size, or ends' (Megatron's)
                        vs = _options(fixed, "virtual_stages", [v for v in (2, 4, 8) if _partitions(
                            m, {}, pp * v, grid_mode, balance=False)])
                    elif name in ("zb-v", "dualpipev"):  # two chunks in a V; priced only when --layout names it
                        vs = [2] if fixed.get("virtual_stages", 2) == 2 else []
                    else:
                        vs = [1] if fixed.get("virtual_stages", 1) == 1 else []
                    scheds += [(name, v, part) for v in vs
                               for part in _partitions(m, fixed, pp * v, grid_mode, balance=name != "interleaved")]
            recs = _options(fixed, "recompute", SEARCHED_RECOMPUTE + (("attn-core",) if train.attention == "standard"
                                                                      else ()))
            offs = _options(fixed, "offload", list(offload))
            for ep, mb, zero, sp, (sched, v, part), rec, off in itertools.product(
                    eps, mbs, zeros, sps, scheds, recs, offs):
                if off in ("params", "nvme") and zero != 3:
                    continue
                if sched == "interleaved" and (per_rank // mb) % pp:
                    continue
                if cp > 1 and (rec.split(":")[0] in CP_UNSUPPORTED_RECOMPUTE or sched == "zb-h1" and rec.split(
                        ":")[0] in ("full", "every")):
                    continue  # refused by validate() (parallel/context/rules.py): W recomputes the ring per group
                # ZeRO-3 without pipelining: also the units kept gathered from forward to backward (FSDP's option)
                reshards = _options(fixed, "reshard_after_forward", [None, False] if zero == 3 and pp == 1 and
                                    off != "nvme" else [None])
                out += [Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, micro_batch=mb, recompute=rec, schedule=sched,
                               virtual_stages=v, sequence_parallel=sp, offload=off, tp_mode=mode, tp_depth=depth,
                               cp=cp, cp_mode=cp_mode, partition=part, reshard_after_forward=keep)
                        for keep in reshards]
    return out


MIN_CP_CHUNK = 1024
"""Context parallelism is searched for degrees whose sequence chunks keep at least this many tokens (a ring
attention block of fewer tokens is too small to hide its transfer); --layout cp=N asks for any degree."""


def _tp_cp_choices(m: ModelSpec, gpu: GPU, n_gpus: int, fixed: dict) -> list[tuple]:
    """`_tp_choices` with the context-parallel degree and mode of each (plan/analytic/context.py): cp = 1, and for
    1D tensor parallelism the powers of two dividing the remaining GPUs whose chunks keep `MIN_CP_CHUNK` tokens, ring
    and (heads and kv heads per tp rank divisible by cp) Ulysses."""
    out = []
    for mode, tp, depth, rows in _tp_choices(m, gpu, n_gpus, fixed):
        rest = n_gpus // tp if n_gpus % tp == 0 else 0
        if "cp" in fixed:
            cps = [fixed["cp"]] if rest and rest % fixed["cp"] == 0 else []
        else:
            cps = [c for c in (1, 2, 4, 8, 16, 32, 64) if rest and rest % c == 0
                   and (c == 1 or m.seq_len // (2 * c) >= MIN_CP_CHUNK)]
        for cp in cps:
            if cp > 1 and mode != "1d":
                continue
            modes = _options(fixed, "cp_mode", ["ring", "ulysses"]) if cp > 1 else [fixed.get("cp_mode", "ring")]
            for cp_mode in modes:
                heads_ok = all(max(n // tp, 1) % cp == 0 for n in (m.n_heads, m.kv_heads)) if n_gpus else True
                if cp > 1 and cp_mode == "ulysses" and not heads_ok and "cp_mode" not in fixed:
                    continue
                out.append((mode, tp, depth, rows, cp, cp_mode))
    return out


def _partitions(m: ModelSpec, fixed: dict, n_stages: int, grid_mode: bool, balance: bool = True) -> list[str]:
    """The partitions to try for `n_stages` stages: `uniform` when the layers divide; `ends` when layers + 2 divide
    (Megatron's stages that count the embedding and the loss as a layer; also tried beside `uniform`; with layers + 2
    stages, Llama 3's one-block chunks whose end ones hold only the embedding and the head); otherwise
    `params` (PipeDream's balance over parameter counts, the engine's) when `balance`."""
    if "partition" in fixed:
        return [fixed["partition"]]
    L = m.n_layers
    if L + 2 == n_stages and not grid_mode:  # one-block chunks, the end ones only the embedding and the head (Llama 3)
        return ["ends"]
    if L < n_stages or (grid_mode and L % n_stages):
        return []
    if grid_mode or n_stages == 1:
        return ["uniform"]
    out = ["uniform"] if L % n_stages == 0 else []
    if (L + 2) % n_stages == 0 and L + 2 >= 2 * n_stages:  # >= 1 block on the first and the last stage
        out.append("ends")
    return out or (["params"] if balance else [])


def _tp_choices(m: ModelSpec, gpu: GPU, n_gpus: int, fixed: dict) -> list[tuple[str, int, int, int]]:
    """(tp_mode, tp, tp_depth, sequence blocks of a micro-batch) to search: 1D over the divisors of the GPU count
    up to a node (heads divisible); 2D / 2.5D / 3D over the q^2, d q^2 (2 <= d <= q) and q^3 grids dividing it
    (any size: their groups are q wide; heads divisible by q, widths by q^2; dense, non-reversible models only)."""
    out = []
    for mode in _options(fixed, "tp_mode", list(TP_MODES)):
        if mode == "1d":
            for tp in _options(fixed, "tp", [d for d in divisors(n_gpus) if d <= gpu.gpus_per_node]):
                if not (m.n_heads % tp or (m.kv_heads % tp and tp % m.kv_heads)):
                    out.append(("1d", tp, 1, 1))
            continue
        for tp in _options(fixed, "tp", divisors(n_gpus)):
            for depth in _options(fixed, "tp_depth", divisors(tp) if mode == "2.5d" else [1]):
                if "tp" in fixed and "tp_mode" in fixed:  # asked for: say why it is not a grid
                    grid(mode, tp, depth)
                s = grid_shape(mode, tp, depth)
                if s is None or s.q < 2 or (mode == "2.5d" and not 2 <= depth <= s.q) or m.n_experts or m.reversible:
                    continue
                if m.n_heads % s.q or m.kv_heads % s.q or m.d_model % (s.q * s.q) or m.ffn % (s.q * s.q):
                    continue
                out.append((mode, tp, depth, s.row_blocks))
    return out


def search(m: ModelSpec, gpu: GPU, n_gpus: int, train: Training, fixed: dict | None = None,
           a: Assumptions = DEFAULT_ASSUMPTIONS, keep_unfit: int = 20) -> SearchResult:
    """Evaluate every layout allowed by `fixed` (fields from --layout); best first."""
    fixed = fixed or {}
    result = _run(m, gpu, n_gpus, train, fixed, a, keep_unfit, ("none",))
    if not any(c.fits for c in result.candidates) and "offload" not in fixed:
        for offload in (("optimizer", "params"), ("nvme",)):  # host memory first, then NVMe (ZeRO-Infinity)
            try:
                more = _run(m, gpu, n_gpus, train, fixed, a, keep_unfit, offload)
            except UserError:  # e.g. a fixed zero < 3 leaves no parameter or NVMe offload to try: the misses stand
                continue
            if any(c.fits for c in more.candidates):
                more.offload_needed = True
                more.evaluated += result.evaluated
                return more
    return result


def _run(m, gpu, n_gpus, train, fixed, a, keep_unfit, offload) -> SearchResult:
    layouts = enumerate_layouts(m, gpu, n_gpus, train, fixed, offload)
    if not layouts:
        raise UserError(_no_layout_reason(m, n_gpus, train, fixed))
    fit: list[Estimate] = []
    unfit: list[Estimate] = []
    errors: list[str] = []
    for lay in layouts:
        try:
            est = estimate(m, gpu, train, lay, a, memory_only=True)
        except UserError as e:
            errors.append(str(e))
            continue
        if est.fits:
            fit.append(estimate(m, gpu, train, lay, a))
        else:
            unfit.append(est)
    if not fit and not unfit:
        raise UserError(errors[0])
    fit.sort(key=rank_key)
    unfit.sort(key=lambda e: e.over_by)
    for est in unfit[:keep_unfit]:  # time for the closest misses, so the table can show it
        full = estimate(m, gpu, train, est.layout, a)
        est.__dict__.update(full.__dict__)
    return SearchResult(fit + unfit[:keep_unfit], len(layouts))


def _no_layout_reason(m: ModelSpec, n_gpus: int, train: Training, fixed: dict) -> str:
    if "tp" in fixed and m.n_heads % fixed["tp"]:
        return f"heads ({m.n_heads}) is not divisible by tp ({fixed['tp']})"
    if "pp" in fixed and m.n_layers < fixed["pp"]:
        return f"layers ({m.n_layers}) are fewer than pp ({fixed['pp']})"
    if "dp" in fixed and train.global_batch % fixed["dp"]:
        return f"global batch ({train.global_batch}) is not divisible by dp ({fixed['dp']})"
    return (f"no layout of {n_gpus} GPUs fits the constraints (layers {m.n_layers}, heads {m.n_heads},"
            f" global batch {train.global_batch}, fixed {fixed or 'nothing'})")


def dedupe(cands: list[Estimate], k: int) -> list[Estimate]:
    """The first k candidates, skipping ones whose numbers equal an earlier one's (e.g. ZeRO-0 vs ZeRO-1
    when both fit and cost the same) so the table shows distinct choices."""
    out: list[Estimate] = []
    seen = set()
    for c in cands:
        key = (round(c.step_time_s, 6), round(c.memory["total"] / 2**20))
        if key in seen:
            continue
        seen.add(key)
        out.append(c)
        if len(out) == k:
            break
    return out
