"""Everything the run report shows, read from a run directory and nothing else.

Sources (all written by `scaletrain train`): `config.yaml` (the resolved config), `metrics.jsonl` (one row
per logged step), `run_info.json` and `memory_ranks.json` (`report/runinfo.py`), `pipeline_trace.json`
(pp > 1, `parallel/pipeline/trace.py`), `profile/*.json` (`train.profile_steps`) and `tb/`
(`train.tensorboard`). Derived numbers are computed here, in one place, so tests can check them:
tokens seen (step x global_batch x seq_len), MFU (model FLOPs per token from the planner x tokens/s over
ranks x peak FLOP/s per rank), and the planner's memory per pipeline stage.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scaletrain.config import Config, config_from_dict, validate
from scaletrain.config.run import HISTORY, current_config
from scaletrain.errors import ConfigError, UserError
from scaletrain.report.runinfo import MEMORY_RANKS, RUN_INFO

MEM_CATEGORIES = ("params", "grads", "optim", "activations")
PROFILE_DIR = "profile"
TB_DIR = "tb"


def read_metrics(path: Path) -> list[dict]:
    """The rows of metrics.jsonl up to the first unreadable line (a line cut by a kill ends the valid part)."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            break
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


@dataclass
class Peak:
    """Peak FLOP/s of one rank's device, and where the number comes from."""

    flops: float
    source: str


@dataclass
class RunData:
    out: Path
    cfg: Config
    rows: list[dict]
    info: dict = field(default_factory=dict)
    memory_ranks: list[dict] = field(default_factory=list)
    trace: Any = None  # parallel.pipeline.trace.PipelineTrace
    trace_error: str = ""
    profiles: list[Path] = field(default_factory=list)
    tb_dir: Path | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_step

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    def column(self, key: str) -> tuple[list[int], list[Any]]:
        """(steps, values) of the rows that have `key`."""
        rows = [r for r in self.rows if key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def tokens(self, steps: list[int]) -> list[int]:
        return [s * self.tokens_per_step for s in steps]

    def comm_kinds(self) -> list[str]:
        kinds: dict[str, None] = {}
        for r in self.rows:
            for k in r:
                if k.startswith("comm_") and k.endswith("_bytes"):
                    kinds[k] = None
        return list(kinds)

    def sessions(self) -> list[dict]:
        return list(self.info.get("sessions", []))

    def resumes(self) -> list[dict]:
        """The resumes recorded in `resumes.jsonl` (from_step, changed {key: [old, new]}), a cut line skipped."""
        path = self.out / HISTORY
        out = []
        for line in (path.read_text().splitlines() if path.is_file() else []):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("from_step"), int):
                out.append(rec)
        return out

    def device_types(self) -> set[str]:
        return {str(r.get("device", "cpu")).split(":")[0] for s in self.sessions() for r in s.get("ranks", [])}


def load_run(out: str | Path) -> RunData:
    """Read a run directory; UserError when it is not one."""
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"{out} is not a directory (give the --out of a scaletrain train run)")
    cfg_path = out / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"{out} is not a scaletrain run (no config.yaml)")
    try:  # config.yaml is the config the run started with; resumes.jsonl has what later invocations changed
        cfg = validate(config_from_dict(current_config(out)))
    except yaml.YAMLError as e:
        raise UserError(f"{cfg_path} is not valid YAML ({str(e).splitlines()[0]})") from None
    except ConfigError as e:
        raise UserError(f"{cfg_path}: {e}") from None
    run = RunData(out, cfg, read_metrics(out / "metrics.jsonl"))
    run.info = _read_json(out / RUN_INFO) or {}
    run.memory_ranks = list((_read_json(out / MEMORY_RANKS) or {}).get("ranks", []))
    trace_path = out / "pipeline_trace.json"
    if trace_path.exists():
        from scaletrain.parallel.pipeline import trace as tr

        try:
            run.trace = tr.load(trace_path)
        except (ValueError, KeyError, TypeError) as e:
            run.trace_error = f"{trace_path} could not be read ({e})"
    prof = out / PROFILE_DIR
    run.profiles = sorted(prof.glob("*.json")) if prof.is_dir() else []
    run.tb_dir = out / TB_DIR if (out / TB_DIR).is_dir() else None
    return run


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------- derived numbers


def model_flops_per_token(cfg: Config) -> float:
    """Model FLOPs of one trained token (forward + backward, no recomputation; routed experts only): the
    planner's `step_flops` for one token, the numerator of MFU (Chowdhery et al., arXiv 2204.02311)."""
    from scaletrain.plan import catalog
    from scaletrain.plan.analytic.flops import step_flops

    return step_flops(catalog.from_model_config(cfg.model), 1.0, "none")[0]


def mfu(tokens_per_s: float, flops_per_token: float, world: int, peak: Peak) -> float | None:
    """Achieved model FLOP/s over all ranks / (ranks x peak FLOP/s of one)."""
    if not (isinstance(tokens_per_s, (int, float)) and math.isfinite(tokens_per_s)):
        return None
    return tokens_per_s * flops_per_token / (world * peak.flops)


def catalog_gpu(device_name: str) -> str | None:
    """The planner's catalog entry for a CUDA device name (`NVIDIA H100 80GB HBM3` -> h100-80gb), or None."""
    n = device_name.lower()
    for key, name in (("b200", "b200"), ("h200", "h200"), ("h100", "h100-80gb"), ("v100", "v100-32gb")):
        if key in n:
            return name
    if "a100" in n:
        return "a100-40gb" if "40g" in n else "a100-80gb"
    return None


def resolve_peak(run: RunData, peak_flops: float | None = None, gpu: str | None = None,
                 calibrate: bool = False) -> Peak | None:
    """The peak FLOP/s per rank for MFU: given, from the catalog, measured here, or (CUDA runs) looked up by
    the device name recorded in run_info.json; None when nothing says (a CPU run without --calibrate)."""
    from scaletrain.plan import hardware

    if peak_flops is not None:
        if not (math.isfinite(peak_flops) and peak_flops > 0):
            raise UserError(f"--peak-flops must be a positive number of FLOP/s, got {peak_flops}")
        return Peak(peak_flops, "--peak-flops")
    if gpu is not None:
        g = hardware.get_gpu(gpu)
        return Peak(g.peak_flops, f"catalog entry {g.name} (--gpu): dense 16-bit peak")
    if calibrate:
        from scaletrain.plan.calibrate import matmul_flops

        dtype = run.cfg.train.dtype if run.cfg.train.dtype in ("fp32", "fp64") else "fp32"
        return Peak(matmul_flops(dtype), f"measured on this machine by --calibrate ({dtype} matmul, one process)")
    names = {r.get("device_name", "") for s in run.sessions()[-1:] for r in s.get("ranks", [])
             if str(r.get("device", "")).startswith("cuda")}
    found = {catalog_gpu(n) for n in names}
    if len(found) == 1 and None not in found:
        g = hardware.get_gpu(found.pop())
        return Peak(g.peak_flops, f"catalog entry {g.name} for {', '.join(sorted(names))}: dense 16-bit peak")
    return None


def median(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.median(vals) if vals else None


@dataclass
class PlannedMemory:
    """The planner's bytes per category for each pipeline stage (the fullest rank of the stage)."""

    stages: list[dict[str, int]]
    error: str = ""


def planned_memory(cfg: Config) -> PlannedMemory:
    """`plan.exact.run_memory` per stage: model states exact; activations where the planner models them."""
    from scaletrain.plan.exact import run_memory

    try:
        states = run_memory.model_state_bytes_per_stage(cfg)
        acts = run_memory.activation_bytes_per_stage(cfg) if run_memory.predicts_activations(cfg) else None
    except (ValueError, KeyError, ZeroDivisionError, RuntimeError) as e:
        return PlannedMemory([], f"the planner could not predict this run's memory ({e})")
    stages = []
    for i, s in enumerate(states):
        row = {"params": s["params"], "grads": s["grads"], "optim": s["optim"]}
        if acts is not None:
            row["activations"] = acts[i]
        stages.append(row)
    return PlannedMemory(stages)


def rank_stage(cfg: Config, rank: int) -> int:
    """The pipeline stage (pp coordinate) of a global rank: the grid is arange(world).view(pp, dp, cp, tp)."""
    return rank // (cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.tp)
