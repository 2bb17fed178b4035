"""Presentation of planner results: a rich table of the top layouts, a one-paragraph explanation of why
the best beats the runner-up, the `--json` document, and a PNG of the memory breakdown.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.plan.analytic.comm import group_link
from scaletrain.plan.analytic.estimate import Estimate
from scaletrain.plan.analytic.inputs import DEFAULT_ASSUMPTIONS as _A
from scaletrain.plan.analytic.inputs import Training
from scaletrain.plan.analytic.memory import optimizer_bytes
from scaletrain.plan.analytic.params import active_params, param_counts, total_params
from scaletrain.plan.catalog import ModelSpec
from scaletrain.plan.hardware import Cluster
from scaletrain.plan.trust import TRUST, VALIDATED_ZERO3_DP, coverage_notes, trusted  # noqa: F401 (re-exported)

GiB = float(1 << 30)
MEM_KEYS = ("params", "grads", "optimizer", "activations", "buffers")
TIME_LABELS = {
    "compute": "compute", "recompute": "recomputation", "tp_comm": "tensor-parallel communication",
    "ep_comm": "expert all-to-all", "cp_comm": "context-parallel communication",
    "pp_comm": "pipeline sends", "bubble": "pipeline bubble",
    "dp_comm": "data-parallel communication", "optimizer": "optimizer step", "offload": "offload transfers",
    "loader": "data loading", "sync": "step synchronisation", "stragglers": "waiting for the slowest GPU",
}


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


MEM_LEGEND = "p/g/o/a/b = parameters / gradients / optimizer states / activations / buffers, per GPU"


def verdict(best: Estimate, other: Estimate) -> str:
    """The sentence on whether a predicted speed-up of `best` over `other` is beyond the planner's error."""
    gain = other.step_time_s / best.step_time_s - 1
    if trusted(best, other):
        return f"{gain:.0%} faster, beyond the planner's held-out error of ±{TRUST:.0%}"
    return (f"{gain:.0%} faster, inside the planner's held-out error of ±{TRUST:.0%}: the planner cannot tell"
            " them apart (choose by memory, simplicity or a measurement)")


def sig(x: float, digits: int = 3) -> str:
    """`x` with `digits` significant digits, trailing zeros kept (16.0, 14.9, 0.250, 1,230): one format for a
    column of step times."""
    import math

    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return f"{0:.{digits - 1}f}"
    r = float(f"{x:.{digits}g}")  # rounded first: 9.996 -> 10.0, not 10.00
    decimals = digits - 1 - math.floor(math.log10(abs(r)))
    return f"{r:,.{decimals}f}" if decimals > 0 else f"{round(r, decimals):,.0f}"


def layout_legend(layouts: list, uneven_stages: bool = False) -> str:
    """The legend of the layout notation (`Layout.short`, e.g. `dp4 tp2 pp2 z1 mb2 full interleavedx2 sp
    off:optimizer`) for the abbreviations these layouts use, in the order they appear in a label."""
    parts = ["dpN tpN ppN = data-, tensor- and pipeline-parallel degrees"]
    if any(x.tp_mode != "1d" for x in layouts):
        parts.append("tpN(2d|2.5d|3d dK) = tensor parallelism over a 2-D/2.5-D/3-D grid of depth K")
    if any(x.ep > 1 for x in layouts):
        parts.append("epN = expert-parallel degree")
    parts.append("zN = ZeRO stage N (z0: none)")
    if any(x.zero == 3 and x.pp == 1 and not x.reshards for x in layouts):
        parts.append("-keep = ZeRO-3 keeps gathered parameters from forward to backward")
    parts.append("mbN = micro-batch of N sequences per GPU")
    used = sorted({x.recompute for x in layouts})
    parts.append(f"{'/'.join(used)} after mbN = activation recomputation (none: every activation stored)")
    if any(x.pp > 1 for x in layouts):
        names = sorted({x.schedule for x in layouts if x.pp > 1})
        parts.append(f"{'/'.join(names)} = pipeline schedule"
                     + (", xN = N virtual stages (model chunks) per GPU" if any(x.pp > 1 and x.virtual_stages > 1
                                                                                for x in layouts) else ""))
        if any(x.pp > 1 and x.partition != "uniform" for x in layouts):
            parts.append("params/time/ends = how blocks are split among stages")
    if uneven_stages:
        parts.append("[a,bxN,c] = transformer blocks per pipeline stage (b repeated N times)")
    if any(x.sequence_parallel for x in layouts):
        parts.append("sp = sequence parallelism")
    if any(x.offload != "none" for x in layouts):
        parts.append("off:X = X kept in host memory (offloaded)")
    return "layout: " + "; ".join(parts)


def legend_of(cands: list[Estimate]) -> str:
    """`layout_legend` of the candidates of a table."""
    return layout_legend([c.layout for c in cands], any(len(set(c.stage_blocks)) > 1 for c in cands))


def memory_unit(values: list[float]) -> tuple[str, float]:
    """(name, bytes) of the binary unit that shows the smallest non-zero value with a digit before the point
    rounded to 0.1: GiB for billion-parameter models, MiB or KiB for small ones (never "0.0" for non-zero)."""
    small = min((v for v in values if v > 0), default=GiB)
    for name, size in (("GiB", GiB), ("MiB", float(1 << 20))):
        if small >= 0.1 * size:
            return name, size
    return "KiB", 1024.0


def count(n: float) -> str:
    """A parameter count for people: 124.44M, 1.3B, 12,345."""
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M" if n >= 1e6 else f"{n:,.0f}"


def in_unit(x: float, size: float) -> str:
    v = x / size
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def table(cands: list[Estimate], cluster: Cluster, title: str, baseline: Estimate | None = None):
    from rich.table import Table

    unit, size = memory_unit([c.memory[k] for c in cands for k in MEM_KEYS])
    t = Table(title=title, show_lines=False, caption=f"{MEM_LEGEND}\n{legend_of(cands)}",
              caption_justify="left")
    for col in ("#", "layout", "fits", f"mem {unit} (p/g/o/a/b)", f"total {unit}", f"step s (±{TRUST:.0%})",
                "tokens/s", "MFU", "bubble", "dominant"):
        t.add_column(col, justify="right" if col not in ("layout", "dominant") else "left")
    for i, c in enumerate(cands, 1):
        mem = "/".join(in_unit(c.memory[k], size) for k in MEM_KEYS)
        fits = "yes" if c.fits else f"no (+{gib(c.over_by)} GiB)"
        mark = "yours" if baseline is not None and c is baseline else str(i)
        t.add_row(mark, c.label(), fits, mem, in_unit(c.memory["total"], size), sig(c.step_time_s),
                  f"{c.tokens_per_s:,.0f}", f"{c.mfu:.1%}", f"{c.bubble_fraction:.1%}",
                  TIME_LABELS.get(c.dominant, c.dominant))
    return t


def explain(best: Estimate, other: Estimate, m: ModelSpec, cluster: Cluster) -> str:
    """Why `best` beats `other`: the time components that differ most, in plain words."""
    if not other.fits and best.fits:
        return (f"{best.label()} is the fastest layout that fits; {other.label()} would need "
                f"{gib(other.over_by)} GiB more than the {gib(cluster.gpu.memory_bytes)} GiB per GPU.")
    ratio = other.step_time_s / best.step_time_s
    if ratio < 1.005:
        saved = other.memory["total"] - best.memory["total"]
        return (f"{best.label()} and the runner-up {other.label()} take the same time per step "
                f"({best.step_time_s:.3g} s, ±{TRUST:.0%})" + (f"; the best needs {gib(saved)} GiB less memory per GPU."
                                                                if saved > 0 else "."))
    diffs = sorted(((other.time_breakdown.get(k, 0) - best.time_breakdown.get(k, 0), k)
                    for k in set(best.time_breakdown) | set(other.time_breakdown)), reverse=True)
    parts = []
    for delta, key in diffs[:2]:
        if delta <= 0.01 * best.step_time_s:
            continue
        o, b = other.time_breakdown[key], best.time_breakdown[key]
        parts.append(f"{TIME_LABELS[key]} {b:.3g} s vs {o:.3g} s")  # best first, as in the headline
    text = (f"{best.label()} is {ratio:.2f}x faster than the runner-up {other.label()}"
            f" ({best.step_time_s:.3g} s vs {other.step_time_s:.3g} s per step)")
    text += ": " + "; ".join(parts) + "." if parts else "."
    bl, ol = best.layout, other.layout
    notes = []
    if bl.zero != ol.zero and (bl.dp > 1 or ol.dp > 1):
        bb, ob = best.comm_bytes.get("dp", 0), other.comm_bytes.get("dp", 0)
        if bb > 0 and ob > 0:
            crosses = group_link(cluster.gpu, ol.dp, ol.tp, _A)[1] == cluster.gpu.inter_latency
            notes.append(f"ZeRO-{ol.zero} moves {ob / bb:.2g}x the bytes of ZeRO-{bl.zero}"
                         + (" and its collectives cross nodes" if crosses else ""))
    if bl.pp != ol.pp or bl.schedule != ol.schedule or bl.virtual_stages != ol.virtual_stages:
        notes.append(f"pipeline bubble {best.bubble_fraction:.1%} vs {other.bubble_fraction:.1%}")
    if bl.tp != ol.tp:
        gpn = cluster.gpu.gpus_per_node
        notes.append(f"tp {bl.tp} vs {ol.tp}" + (" (tp beyond one node crosses InfiniBand)"
                                                 if max(bl.tp, ol.tp) > gpn else ""))
    if bl.recompute != ol.recompute:
        notes.append(f"recompute {bl.recompute} vs {ol.recompute}")
    if notes:
        text += " " + "; ".join(notes) + "."
    if not trusted(best, other):
        text += f" The difference is inside the planner's held-out error of ±{TRUST:.0%}: it cannot tell them apart."
    return text


def to_json(m: ModelSpec, cluster: Cluster, train: Training, cands: list[Estimate]) -> dict:
    model = m.to_dict()
    model["params"] = total_params(m)
    model["param_tensors"] = param_counts(m).tensors
    if m.n_experts:
        model["active_params"] = active_params(m)
    return {
        "model": model,
        "cluster": cluster.to_dict(),
        "training": {"global_batch": train.global_batch, "seq_len": m.seq_len, "dtype": train.dtype,
                     "attention": train.attention, "kernels": train.kernels, "optimizer": train.optimizer,
                     "optimizer_bytes_per_param": sum(optimizer_bytes(m, train))},
        "candidates": [c.to_dict() for c in cands],
        "held_out_error": TRUST,
    }


def memory_png(cands: list[Estimate], capacity: float, path: str | Path, title: str) -> Path:
    """Stacked bars of the memory categories of each layout, with the GPU's capacity as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cands) + 2), 4.5))
    labels = [f"#{i}\n" + c.label().replace(" ", "\n", 3) for i, c in enumerate(cands, 1)]
    bottom = [0.0] * len(cands)
    for key in MEM_KEYS:
        vals = [c.memory[key] / GiB for c in cands]
        ax.bar(range(len(cands)), vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(capacity / GiB, color="black", linestyle="--", linewidth=1, label="GPU memory")
    ax.set_xticks(range(len(cands)), labels, fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

