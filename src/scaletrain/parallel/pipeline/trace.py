"""The measured timeline of one pipeline step: per-rank compute events, bubble, and the prediction.

The executor records the start and end of every compute action it runs (F, B, I, W) on every pipeline
rank; on the traced step the ranks start together after a barrier and their events are gathered on
pipeline rank 0 into a `PipelineTrace`. From it:

- the measured bubble per rank, 1 - busy / makespan (busy: summed compute time of the rank; makespan:
  the last end over all ranks), the quantity GPipe (arXiv 1811.06965) and Megatron (arXiv 2104.04473)
  give in closed form as (p-1)/(m+p-1);
- the prediction of `simulate.simulate` for the same action lists with the measured median F, B (or
  I and W) times of each (rank, chunk), so model and measurement can be compared rank by rank;
- a Chrome/Perfetto trace JSON (`draw.to_chrome_trace`, schedule and bubbles under "otherData") and a
  PNG Gantt chart (`draw.draw_timeline`), written next to a run's metrics as `pipeline_trace.json` and
  `pipeline_timeline.png`. `load` reads the JSON back (`scaletrain report timeline --run DIR`).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from scaletrain.parallel.pipeline.draw import as_events, draw_timeline, to_chrome_trace
from scaletrain.parallel.pipeline.schedules import (
    batches,
    build_schedule,
    rank_chunk_to_stage,
    stage_to_rank_chunk,
    unfold,
)
from scaletrain.parallel.pipeline.simulate import Event, SimResult, _finish_batch, _result, simulate

TRACE_JSON = "pipeline_trace.json"
TRACE_PNG = "pipeline_timeline.png"


@dataclass
class PipelineTrace:
    """Measured compute events of one step on all ranks of one pipeline (seconds from a common start)."""

    schedule: str
    p: int
    m: int
    v: int
    events: list[Event]

    @property
    def makespan(self) -> float:
        return max((e.end_s for e in self.events), default=0.0) - self.start

    @property
    def start(self) -> float:
        return min((e.start_s for e in self.events), default=0.0)

    def busy(self) -> list[float]:
        out = [0.0] * self.p
        for e in self.events:
            out[e.rank] += e.end_s - e.start_s
        return out

    def bubble_per_rank(self) -> list[float]:
        span = self.makespan
        return [1.0 - b / span if span > 0 else 0.0 for b in self.busy()]

    @property
    def bubble(self) -> float:
        per = self.bubble_per_rank()
        return sum(per) / len(per) if per else 0.0

    def op_times(self) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
        """Median measured (t_f, t_b, t_w) per [rank][chunk]; an unsplit B counts as t_b with t_w = 0. Where a chunk
        runs both (DualPipeV splits only its cool-down's backwards), t_b is the split input passes' median."""
        durations: dict[tuple[str, int, int], list[float]] = defaultdict(list)
        for e in self.events:
            durations[(e.name, e.rank, e.chunk)].append(e.end_s - e.start_s)

        def table(*names: str) -> list[list[float]]:
            rows = []
            for r in range(self.p):
                row = []
                for c in range(self.v):
                    xs = next((durations[(n, r, c)] for n in names if durations.get((n, r, c))), [])
                    row.append(statistics.median(xs) if xs else 0.0)
                rows.append(row)
            return rows

        return table("F"), table("I", "B"), table("W")

    def message_latency(self) -> float:
        """Median time from the end of the compute that produced a message to the start of the compute
        that consumed it, over consumers that were waiting for it: transfer plus wake-up latency."""
        by_key = {(e.rank, e.name, e.microbatch, e.chunk): e for e in self.events}
        prev_end: dict[tuple[int, int], float] = {}
        order = sorted(self.events, key=lambda e: (e.rank, e.start_s))
        for a, b in zip(order, order[1:]):
            if a.rank == b.rank:
                prev_end[(b.rank, id(b))] = a.end_s
        last = self.p * self.v - 1
        gaps = []
        for e in self.events:
            s = rank_chunk_to_stage(e.rank, e.chunk, self.p, self.schedule)
            if e.name == "F" and s > 0:
                src, names = s - 1, ("F",)
            elif e.name in ("B", "I") and s < last:
                src, names = s + 1, ("B", "I")
            else:
                continue
            r, c = stage_to_rank_chunk(src, self.p, self.schedule)
            producer = next((by_key[k] for n in names if (k := (r, n, e.microbatch, c)) in by_key), None)
            if producer is None:
                continue
            ready = prev_end.get((e.rank, id(e)), self.start)
            if producer.end_s > ready:  # the consumer was waiting for this message
                gaps.append(e.start_s - producer.end_s)
        return statistics.median(gaps) if gaps else 0.0

    def predicted(self, t_comm: float = 0.0) -> SimResult:
        """What the simulator predicts for this schedule with the measured per-op times."""
        t_f, t_b, t_w = self.op_times()
        return simulate(build_schedule(self.schedule, self.p, self.m, self.v), t_f, t_b, t_w, t_comm)

    def replay(self, t_comm: float = 0.0) -> SimResult:
        """The simulator's model run with every action's own measured duration (not per-op medians).

        What is left between this and the measurement is what the model leaves out: message latency
        beyond `t_comm`, and time a rank is late to start its next action after a message arrived.
        """
        actions = [unfold(acts) for acts in build_schedule(self.schedule, self.p, self.m, self.v)]
        took = {(e.rank, e.name, e.microbatch, e.chunk): e.end_s - e.start_s for e in self.events}
        steps = [batches(acts) for acts in actions]
        pos, clock = [0] * self.p, [0.0] * self.p
        posted: dict = {}
        events: list[Event] = []
        while any(pos[r] < len(steps[r]) for r in range(self.p)):
            progress = False
            for r in range(self.p):
                while pos[r] < len(steps[r]):
                    step = steps[r][pos[r]]
                    a = step[0]
                    if a.op.is_compute:
                        end = clock[r] + took.get((r, a.op.value, a.microbatch, a.chunk), 0.0)
                        events.append(Event(r, a.op.value, clock[r], end, a.microbatch, a.chunk))
                        clock[r] = end
                    else:
                        done = _finish_batch(r, step, clock[r], posted, self.p, t_comm, False)
                        if done is None:
                            break
                        clock[r] = done
                    pos[r] += 1
                    progress = True
            if not progress:
                raise ValueError("replay cannot progress: the trace does not match its schedule")
        return _result(actions, events, clock, self.v)

    # ------------------------------------------------------------------ files

    def to_json(self) -> dict:
        trace = to_chrome_trace(self.shifted())
        pred = self.predicted()
        trace["otherData"] = {
            "schedule": self.schedule, "pp": self.p, "microbatches": self.m, "virtual_stages": self.v,
            "makespan_s": self.makespan,
            "bubble_per_rank": self.bubble_per_rank(),
            "predicted_bubble_per_rank": pred.bubble_per_rank,
            "predicted_makespan_s": pred.makespan,
        }
        return trace

    def shifted(self) -> list[Event]:
        """Events with the first start at time 0."""
        t0 = self.start
        return [Event(e.rank, e.name, e.start_s - t0, e.end_s - t0, e.microbatch, e.chunk) for e in self.events]

    def save(self, out_dir: str | Path) -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        js, png = out / TRACE_JSON, out / TRACE_PNG
        js.write_text(json.dumps(self.to_json()))
        self.draw(png)
        return [js, png]

    def draw(self, png: str | Path) -> Path:
        bubbles = ", ".join(f"{b:.2f}" for b in self.bubble_per_rank())
        title = (f"measured {self.schedule}: pp={self.p}, microbatches={self.m}"
                 f"{f', virtual stages={self.v}' if self.v > 1 else ''}; bubble per rank {bubbles}")
        return Path(draw_timeline(self.shifted(), png, title=title, time_unit="s"))


def load(path: str | Path) -> PipelineTrace:
    """Read a trace written by `PipelineTrace.save` (the JSON file, or the run directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / TRACE_JSON
    data = json.loads(path.read_text())
    meta = data.get("otherData", {})
    rows = []
    for ev in data.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        args = ev.get("args", {})
        start = float(ev["ts"]) / 1e6
        rows.append(Event(int(ev["pid"]), str(args.get("op", ev["name"])), start, start + float(ev["dur"]) / 1e6,
                          int(args.get("microbatch", -1)), int(args.get("chunk", 0))))
    return PipelineTrace(str(meta["schedule"]), int(meta["pp"]), int(meta["microbatches"]),
                         int(meta.get("virtual_stages", 1)), as_events(rows))
