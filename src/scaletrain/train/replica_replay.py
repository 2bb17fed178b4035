"""`scaletrain replay --out RUN` for a fault-tolerant replica run (parallel.replicas > 1): recompute the committed
rounds of the membership log in one process and compare with the final parameters every finishing group saved
(docs/fault_tolerance.md). Each committed round is one step computed by exactly its members: their gradients
(each on its own rows, and with parallel.missing_rows=reassign on the rows the log's `rows` gave it,
train/runners/replicas.py) added in member order, divided by the number of groups whose rows were computed, clipped,
AdamW step. The run adds them in the same order (distributed/quorum.py `ordered_sum`), so equal means bit-equal
when both sides ran on the same kind of CPU; the command prints the largest difference either way."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from scaletrain.config import Config
from scaletrain.distributed.quorum import ordered_sum
from scaletrain.distributed.rows import divisor, rows_of
from scaletrain.errors import CheckpointError
from scaletrain.multinode.replicas import effective_rows
from scaletrain.multinode.replicas import summarize as summarize_log
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.replica_init import start_checkpoint
from scaletrain.train.runners.replicas import GroupModel

TOLERANCE = 1e-12
"""Largest absolute parameter difference the replay accepts (fp64) for groups of data-parallel ranks, whose
intra-group sums the replay recomputes in their order; measured: 0 (bit-identical) to 5.8e-15 on this CPU."""
TP_RTOL, TP_ATOL = 1e-9, 1e-11
"""Groups with tensor parallelism inside: the replay runs the model at whole width, the run adds half-width partial
products, so they differ by rounding (~1e-15 per step) as any tp layout differs from one process. The bound is
docs/verify.md's for fp64 layouts against one process, element-wise |run - replay| <= TP_ATOL + TP_RTOL |replay|
(set before measuring). Groups of pipeline stages use the same bound: the run adds the tied embedding's two
gradients once per step, one process once per micro-batch; groups of two expert-parallel ranks too (an expert's
weight gradient sums both ranks' slots in one matmul in the run, one rank's at a time in the replay)."""


def _split(cfg: Config) -> bool:
    """Groups whose matmuls or stages are split across ranks (tp or pp inside), or whose experts are (ep2 groups: an
    expert's weight gradient is one matmul over both ranks' slots in the run, one per rank in the replay): the
    replay's bound is TP_*."""
    return cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or cfg.parallel.ep > 1


def within(cfg: Config, mine: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether a replayed parameter equals the run's within the bound of its layout (above)."""
    if _split(cfg):
        return bool(((mine - saved).abs() <= TP_ATOL + TP_RTOL * mine.abs()).all())
    return float((mine - saved).abs().max()) <= TOLERANCE


def load_log(out: Path) -> list[dict]:
    path = out / "membership.jsonl"
    if not path.is_file():
        raise CheckpointError(f"{out}: no membership log (membership.jsonl); is it a parallel.replicas run?")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise CheckpointError(f"{path}: line {n} is not JSON") from None
    return rows


def replay_rounds(cfg: Config, rows: list[dict], out: Path | None = None) -> dict[str, torch.Tensor]:
    """The parameters after the committed rounds of `rows` (after a whole-job resume: those the resumed run went
    through, `effective_rows`), computed in this process. A run that started from a checkpoint of step N (`--reshard`
    from another layout's run: the log's first row has `resumed_from` N and no rounds of steps 1..N) is replayed from
    that checkpoint, `out/checkpoints/step_N`, read into the replay's one process by the reshard path; one started from
imported weights (`--init-from`: the first row has `start_checkpoint`) from the checkpoint of step 0 the launcher
wrote of them (train/replica_init.py)."""
    committed = effective_rows(rows)
    start = rows[0].get("resumed_from") if rows else None
    found = None
    if start and not any(r["step"] <= start for r in committed):
        found = _start_checkpoint(out, int(start))
    elif rows and rows[0].get("start_checkpoint"):  # a run started from imported weights (--init-from)
        found = _init_checkpoint(out, rows[0])
    model = GroupModel(cfg, replay=True)
    step = _load_start(model, found) if found is not None else 0
    for row in committed:
        if row["step"] != step + 1:
            raise CheckpointError(f"membership log: committed step {row['step']} follows step {step}")
        rows = row.get("rows")  # parallel.missing_rows=reassign: whose rows each member computed
        parts = [ordered_sum([model.group_grad(row["step"], g) for g in rows_of(rows, m)]) for m in row["members"]]
        model.apply(row["step"], ordered_sum(parts) / divisor(rows, row["members"]))
        step = row["step"]
    return model.trainer.full_state()


def _start_checkpoint(out: Path | None, step: int) -> Path:
    """The checkpoint of step `step` the run started from, in `out/checkpoints` (CheckpointError if it is gone)."""
    from scaletrain.train.checkpoint_dirs import step_dir

    found = step_dir(out / "checkpoints", step) if out is not None else None
    if found is None or not (found / ckpt.COMPLETE).exists():
        raise CheckpointError(f"membership log: the run started from the checkpoint of step {step}, which is not "
                              f"in {out}/checkpoints (keep it, train.keep_checkpoints, to replay the run)")
    return found


def _init_checkpoint(out: Path | None, row: dict) -> Path:
    """The start checkpoint of the imported weights the log's first row names (CheckpointError if it is gone)."""
    found = start_checkpoint(out) if out is not None else None
    if found is None or str(found.relative_to(out)) != row["start_checkpoint"]:
        raise CheckpointError(f"membership log: the run started from the weights of {row.get('init_from', '?')}, "
                              f"written as {row['start_checkpoint']}, which is not complete in {out}")
    return found


def _load_start(model: GroupModel, found: Path) -> int:
    """Read the checkpoint the run started from into the replay's engine (any layout's); its step."""
    from scaletrain.train import resume

    t = model.trainer
    resume.load_engine(t.engine, found, streams={t.rng_stream: t.rng})
    return int(ckpt.read_meta(found)["step"])


def summarize(cfg: Config, rows: list[dict]) -> dict:
    """Failures, steps and tokens lost, heals, whole-job resumes: what the membership log says happened."""
    return summarize_log(rows, cfg.parallel.replicas, cfg.tokens_per_step)


def cmd_replay_replicas(out: Path, cfg: Config, as_json: bool) -> int:
    rows = load_log(out)
    finals = sorted((out / "replicas").glob("final-group*.pt"))
    if not finals:
        raise CheckpointError(f"{out}: no group saved final parameters (replicas/final-group*.pt)")
    saved_runs = {f.stem: torch.load(f, weights_only=True) for f in finals}
    # the groups' thread count: a matmul splits its sums by thread, so the same count is what makes equal bit-equal
    threads = {int(s.get("threads", 0)) for s in saved_runs.values()} - {0}
    before = torch.get_num_threads()
    if len(threads) == 1:
        torch.set_num_threads(threads.pop())
    t0 = time.perf_counter()
    try:
        mine = replay_rounds(cfg, rows, out)
    finally:
        torch.set_num_threads(before)
    seconds = time.perf_counter() - t0
    diffs, ok = {}, True
    for stem, run in saved_runs.items():
        saved = run["params"]
        diffs[stem] = max(float((mine[k] - saved[k]).abs().max()) for k in saved)
        ok = ok and all(within(cfg, mine[k], saved[k]) for k in saved)
    worst = max(diffs.values())
    bound = f"rtol {TP_RTOL:g}, atol {TP_ATOL:g}" if _split(cfg) else f"tolerance {TOLERANCE:g}"
    summary = {"run": str(out), **summarize(cfg, rows), "max_abs_diff": diffs, "replay_s": seconds, "pass": ok}
    if as_json:
        json.dump(summary, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"replayed {summary['steps']} steps ({summary['rounds']} rounds, {summary['failed_rounds']} failed) of "
              f"{out} in {seconds:.1f} s; groups dropped: {summary['drops'] or 'none'}; heals: "
              f"{summary['heals'] or 'none'}; tokens lost {summary['tokens_lost']}"
              + (f"; rows reassigned: {summary['group_steps_reassigned']} group-steps "
                 f"({summary['tokens_reassigned']} tokens)" if summary["group_steps_reassigned"] else "")
              + "".join(f"; group {e['group']} excluded at step {e['step']} after {e['failed_heals']} failed heals"
                        for e in summary["excluded"]))
        print(f"largest parameter difference {worst:.3g} ({bound}): "
              + ("PASS" if summary["pass"] else "FAIL"))
    return 0 if summary["pass"] else 1
