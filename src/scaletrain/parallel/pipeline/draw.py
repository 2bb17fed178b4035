"""Pipeline timelines: a PNG Gantt chart and a Chrome/Perfetto trace of per-rank compute events.

Both accept a `SimResult` from `simulate.py` or any list of events, so the executor can pass what it
measured. An event is a `simulate.Event`, any object with the attributes `rank, name, start_s, end_s,
microbatch, chunk`, a mapping with those keys, or a tuple in that order (microbatch and chunk
optional). Names "F", "B", "I", "W" (forward, backward, backward-input, backward-weight) get fixed
colours; other names get colours of their own. Gaps between boxes are the pipeline bubble.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from scaletrain.parallel.pipeline.simulate import Event, SimResult

OP_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
OP_LABELS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}
_EXTRA_COLOURS = ["#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd"]


def as_events(events: SimResult | Iterable[Any]) -> list[Event]:
    """Normalise a SimResult or a generic event list to `Event`s (see module docstring)."""
    if isinstance(events, SimResult):
        return list(events.events)
    out = []
    for e in events:
        if isinstance(e, Event):
            out.append(e)
        elif isinstance(e, Mapping):
            out.append(Event(int(e["rank"]), str(e["name"]), float(e["start_s"]), float(e["end_s"]),
                             int(e.get("microbatch", -1)), int(e.get("chunk", 0))))
        elif isinstance(e, (tuple, list)):
            rank, name, start, end, *rest = e
            mb = int(rest[0]) if len(rest) > 0 else -1
            chunk = int(rest[1]) if len(rest) > 1 else 0
            out.append(Event(int(rank), str(name), float(start), float(end), mb, chunk))
        else:
            out.append(Event(int(e.rank), str(e.name), float(e.start_s), float(e.end_s),
                             int(getattr(e, "microbatch", -1)), int(getattr(e, "chunk", 0))))
    return out


def to_chrome_trace(events: SimResult | Iterable[Any]) -> dict:
    """Chrome / Perfetto trace JSON (load in chrome://tracing or ui.perfetto.dev): one track per rank.

    Complete events (ph "X") with ts and dur in microseconds; pid and tid are the rank.
    """
    evs = as_events(events)
    trace: list[dict] = []
    for rank in sorted({e.rank for e in evs}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": rank,
                      "args": {"name": f"rank {rank}"}})
    for e in evs:
        label = OP_LABELS.get(e.name, e.name)
        trace.append({
            "name": f"{e.name}{e.microbatch}" if e.microbatch >= 0 else e.name,
            "cat": label,
            "ph": "X",
            "ts": e.start_s * 1e6,
            "dur": (e.end_s - e.start_s) * 1e6,
            "pid": e.rank,
            "tid": e.rank,
            "args": {"op": e.name, "microbatch": e.microbatch, "chunk": e.chunk},
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def legend_notes(multi_chunk: bool) -> list[str]:
    """What the box labels and shading mean (in the legend beside the op colours)."""
    if multi_chunk:
        return ["label m.c = microbatch m, model chunk c", "lighter = later chunk"]
    return ["label = microbatch"]


def draw_timeline(
    sim_result_or_events: SimResult | Iterable[Any],
    path: str | os.PathLike,
    title: str = "pipeline timeline",
    time_unit: str = "",
) -> str:
    """Write a PNG Gantt chart: one row per rank (rank 0 on top), boxes coloured by op and labelled by
    microbatch (`mb.chunk` when there are several chunks). Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = as_events(sim_result_or_events)
    ranks = sorted({e.rank for e in evs}) or [0]
    n_rows = max(ranks) + 1
    multi_chunk = any(e.chunk > 0 for e in evs)
    colours = dict(OP_COLOURS)
    for name in sorted({e.name for e in evs} - set(colours)):
        colours[name] = _EXTRA_COLOURS[len(colours) % len(_EXTRA_COLOURS)]
    t0 = min((e.start_s for e in evs), default=0.0)
    t1 = max((e.end_s for e in evs), default=1.0)
    span = max(t1 - t0, 1e-12)

    narrowest = min((e.end_s - e.start_s for e in evs if e.end_s > e.start_s), default=span)
    # Wide enough that the narrowest box holds a 3-character label at 8 points (up to 30 inches).
    fig_w = min(max(4 + len(evs) / (2.5 * n_rows), 0.32 * span / narrowest), 30)
    fig, ax = plt.subplots(figsize=(fig_w, 0.6 * n_rows + 1.6))
    top_chunk = max((x.chunk for x in evs), default=0)
    for e in evs:
        width = e.end_s - e.start_s
        # Later chunks are drawn lighter so the interleaving is visible.
        alpha = 1.0 - 0.45 * (e.chunk / max(1, top_chunk)) if multi_chunk else 1.0
        ax.barh(e.rank, width, left=e.start_s - t0, height=0.8, color=colours[e.name], alpha=alpha,
                edgecolor="black", linewidth=0.4)
        label = f"{e.microbatch}.{e.chunk}" if multi_chunk else str(e.microbatch)
        # 8-point text needs about 0.07 inch per character: label only the boxes it fits in (readable or none).
        if e.microbatch >= 0 and width / span * 0.8 * fig_w > 0.07 * len(label) + 0.04:
            ax.text(e.start_s - t0 + width / 2, e.rank, label, ha="center", va="center", fontsize=8,
                    color="white", clip_on=True)
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels([f"rank {r}" for r in range(n_rows)])
    ax.set_ylim(n_rows - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time{f' ({time_unit})' if time_unit else ''}")
    ax.set_title(title)
    used = [n for n in colours if any(e.name == n for e in evs)]
    handles = [Patch(color=colours[n], label=OP_LABELS.get(n, n)) for n in used]
    for text in legend_notes(multi_chunk):
        handles.append(Patch(color="none", label=text))
    fig.legend(handles=handles, loc="lower center", ncol=max(1, len(handles)), fontsize=8, frameon=False)
    legend_height = 0.3 / (0.6 * n_rows + 1.6)  # about 0.3 inch, as a fraction of the figure
    fig.tight_layout(rect=(0, legend_height, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
