"""The layout matrix in CI (scaletrain.verify.layouts, scaletrain.verify.matrix; docs/verify.md).

- The stored all-pairs covering set of up to 4 processes: every layout, run in persistent ranks per world size (one
  process start-up per world), equals the single-process run of the same model, data, seed and dtype. fp64: the
  whole run, losses and gradient norms of every step and every final parameter at rtol 1e-9. fp32/bf16/fp16: step
  by step, one process computing each step from the layout's checkpoint of the step before and on its MoE routes
  (verify/stepwise.py), within bounds derived from the dtype's unit roundoff (`tolerances.stepwise_bound`).
- The comparison can fail: one layout of each dtype with a dropped micro-batch gradient (tests/faults.py), and in
  fp64 with a clip threshold ten times too small, FAILs.
- The stored sets (2, 4 and 8 processes) are accepted by `validate()` and miss no pair of values that an accepted
  layout contains; the check fails when the set loses a layout or `validate()` starts accepting a new pair.
- docs/verify.md's refusal and tolerance tables are the generated ones.
- `verify --matrix` runs end to end; bad input is one line and exit 2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import inject
from harness import run_ranks

from scaletrain.cli import main
from scaletrain.verify.layouts import (
    DIMENSIONS,
    Layout,
    accepted,
    pairs_of,
    refusal_table,
    stored_covering,
    uncovered_accepted,
)
from scaletrain.verify.matrix import check, compare, run_layout, table
from scaletrain.verify.tolerances import TOLERANCE

DOCS = Path(__file__).parent.parent / "docs" / "verify.md"
COVERING = stored_covering(4)
# grad_clip / 10 in fp64 only: with AdamW, rescaling every step's gradient by one factor barely changes the first
# steps, so in low precision its effect is not claimed (docs/verify.md, "The matrix can fail")
FAULTS = {"fp64": ("drop a micro-batch", "grad_clip / 10"), "fp32": ("drop a micro-batch",),
          "bf16": ("drop a micro-batch",), "fp16": ("drop a micro-batch",)}


def _mutants() -> list[tuple[Layout, str]]:
    """For each dtype, a layout of the set without pipeline parallelism (its loss goes through engine.loss_fn, where
    the fault is injected) with more than one process: the fewest micro-batches per step but at least two (a dropped
    one is then a large part of the step's gradient), then the fewest processes; with each fault. The clip fault
    in an AdamW layout (SM3 is invariant to scaling every step's gradient by the same factor, which is what a
    clipped run's wrong clip does)."""
    out = []

    def micro_batches(x: Layout) -> int:
        return x["dp"] * x["accumulation"]

    for dtype in DIMENSIONS["dtype"]:
        for fault in FAULTS[dtype]:
            lay = min((x for x in COVERING if x["dtype"] == dtype and x["precision"] == "dtype" and x["pp"] == 1
                       and x.world > 1
                       and (fault != "grad_clip / 10" or x["optimizer"] == "adamw")),
                      key=lambda x: (micro_batches(x) < 2, micro_batches(x), x.world))
            out.append((lay, fault))
    return out


MUTANTS = _mutants()


def _faulty_run(lay: Layout, name: str, env, root: str):
    """The layout's run with a fault: a clip threshold ten times too small in its config (a wrong world-size factor;
    x10 changes nothing while the gradient norms stay below the clip), or a fault of tests/faults.py."""
    from scaletrain.verify.matrix import layout_config, train

    if name == "grad_clip / 10":
        cfg = layout_config(lay)
        cfg.train.grad_clip /= 10
        return train(cfg, env)
    return run_layout(lay, env, prepare=lambda trainer: inject(trainer, name), root=root)


def _world(rank, world, layouts, mutants, roots):
    """Every layout of one world size, then its faulty runs, in one set of processes."""
    from scaletrain.distributed.process_group import DistEnv

    torch.set_num_threads(1)
    env = DistEnv(rank, world, 0, "test")
    runs = [run_layout(lay, env, root=roots[lay]) for lay in layouts]
    bad = [_faulty_run(lay, fault, env, roots[(lay, fault)]) for lay, fault in mutants]
    return runs, bad


def _threads_after_layouts(rank, world, layouts):
    """The rank's thread count after each layout, one after the other in this process."""
    import gc

    from scaletrain.distributed.process_group import DistEnv

    env, counts = DistEnv(rank, world, 0, "test"), []
    for lay in layouts:
        run_layout(lay, env)
        gc.collect()  # the finished trainer's objects (reference cycles hold a group until collected)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def test_a_rank_running_layout_after_layout_keeps_no_process_groups_of_the_finished_ones():
    """The matrix's persistent ranks run dozens of layouts; each layout's gloo groups (threads that keep waking
    up) are destroyed when it ends, so the thread count does not grow with the number of layouts run."""
    lays = [Layout.of(dp=2, zero=3), Layout.of(tp=2), Layout.of(pp=2)]
    counts = run_ranks(_threads_after_layouts, 2, lays)[0]
    assert counts == [counts[0]] * len(counts), counts


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory):
    """{layout: Run}, {mutant: Run} and the checkpoint folder of each (low-precision runs: verify/stepwise.py)."""
    top = tmp_path_factory.mktemp("matrix")
    roots = {key: str(top / f"run{i}") for i, key in enumerate([*COVERING, *MUTANTS])}
    runs, bad = {}, {}
    for world in sorted({lay.world for lay in COVERING}):
        layouts = [lay for lay in COVERING if lay.world == world]
        mutants = [m for m in MUTANTS if m[0].world == world]
        if world == 1:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            got = [run_layout(lay, root=roots[lay]) for lay in layouts], []
            torch.set_num_threads(before)
        else:
            mine = {k: roots[k] for k in [*layouts, *mutants]}
            got = run_ranks(_world, world, layouts, mutants, mine, timeout=1500)[0]
        runs.update(zip(layouts, got[0]))
        bad.update(zip(mutants, got[1]))
    return runs, bad, roots


@pytest.fixture(scope="module")
def references():
    return {}  # the fp64 single-process runs, shared by layouts with the same reference (matrix.check)


@pytest.mark.parametrize("layout", COVERING, ids=[lay.name.replace(" ", ",") for lay in COVERING])
def test_covering_layout_matches_single_process(matrix_runs, references, layout):
    runs, _, roots = matrix_runs
    outcome = check(layout, runs[layout], roots[layout], references=references)
    assert outcome.ok, "\n" + table([outcome], width=200)
    print(table([outcome], width=160))  # the measured differences, shown with pytest -rP


@pytest.mark.parametrize("mutant", MUTANTS,
                         ids=[f"{lay['dtype']}-{f.replace(' ', '').replace('/', 'div')}" for lay, f in MUTANTS])
def test_an_injected_fault_makes_the_matrix_fail(matrix_runs, references, mutant):
    _, bad, roots = matrix_runs
    outcome = check(mutant[0], bad[mutant], roots[mutant], references=references)
    assert not outcome.ok, "\n" + table([outcome], width=200)
    print(f"{mutant[1]}:\n{table([outcome], width=120)}")  # shown with pytest -rP (docs/verify.md)


def test_a_step_skipped_for_overflow_counts_only_when_both_runs_skip():
    """Low precision, step by step: a step skipped for fp16 overflow on both sides is no difference; a skip on one
    side only is a FAIL, naming it."""
    from scaletrain.verify.stepwise import StepDiff, Stepwise
    from scaletrain.verify.stepwise import compare as stepwise_compare

    lay = Layout.of(dp=2, dtype="fp16")
    fine = {1: StepDiff(1e-6, 1e-5, 1e-3), 3: StepDiff(1e-6, 1e-5, 1e-3)}
    assert stepwise_compare(lay, Stepwise({**fine, 2: StepDiff(0.0, 0.0, 0.0, (True, True))}, None)).ok
    one_side = stepwise_compare(lay, Stepwise({**fine, 2: StepDiff(0.0, 0.3, 0.0, (True, False))}, None))
    assert not one_side.ok and "overflow" in one_side.error
    assert not stepwise_compare(lay, Stepwise({**fine, 2: StepDiff(math.nan, 0.0, 0.0)}, None)).ok
    assert not stepwise_compare(lay, Stepwise(fine, (30, 100))).ok  # its own router disagrees on 30% of tokens
    assert stepwise_compare(lay, Stepwise(fine, (3, 100))).ok


@pytest.mark.parametrize("dtype", ["fp64"])
def test_an_overflow_skip_counts_only_when_both_runs_skip(dtype):
    """fp64, whole runs: a step whose gradient norm is not finite on both sides is no difference, a skip on one side
    only (or a NaN loss) is a FAIL."""
    from scaletrain.verify.matrix import Run

    state = {"w": torch.ones(3, dtype=torch.float64)}
    lay = Layout.of(dp=2, dtype=dtype)
    ref = Run({1: 5.0, 2: 4.0}, {1: math.inf, 2: 1.0}, state)
    same = compare(lay, ref, Run({1: 5.0, 2: 4.0}, {1: math.inf, 2: 1.0}, state))
    assert same.ok and same.grad_norm == 0.0
    both_nan = Run({1: 5.0, 2: 4.0}, {1: math.nan, 2: 1.0}, state)  # what an overflowed fp16 step reports
    assert compare(lay, both_nan, both_nan).ok
    assert not compare(lay, both_nan, Run({1: 5.0, 2: 4.0}, {1: 3.0, 2: 1.0}, state)).ok
    assert not compare(lay, ref, Run({1: 5.0, 2: 4.0}, {1: 3.0, 2: 1.0}, state)).ok
    assert not compare(lay, Run({1: 5.0, 2: 4.0}, {1: 3.0, 2: 1.0}, state),
                       Run({1: 5.0, 2: 4.0}, {1: math.inf, 2: 1.0}, state)).ok
    assert not compare(lay, ref, Run({1: 5.0, 2: math.nan}, {1: math.inf, 2: 1.0}, state)).ok


# --------------------------------------------------------------------------- the covering sets


def test_stored_covering_sets_are_accepted_and_miss_no_accepted_pair():
    for world in (2, 4, 8):
        cov = stored_covering(world)
        assert all(lay.world <= world and accepted(lay) for lay in cov), world
        assert uncovered_accepted(cov, world) == [], world


def test_coverage_check_fails_when_a_layout_goes_or_validate_accepts_a_new_pair(monkeypatch):
    import copy

    import scaletrain.verify.layouts as layouts

    for i in (0, len(COVERING) - 1):  # without layout i, exactly the pairs only it covers are reported missing
        rest = COVERING[:i] + COVERING[i + 1:]
        only_here = pairs_of(COVERING[i]) - set().union(*map(pairs_of, rest))
        assert set(uncovered_accepted(rest, 4)) == only_here
        assert only_here or i == 0  # the last layout the greedy construction chose covers pairs nobody else does
    real = layouts.validate

    def lenient(cfg, world=None):  # validate() as if ZeRO-3 with PipeDream-2BW were implemented
        if cfg.parallel.schedule == "2bw" and cfg.parallel.zero == 3:
            other = copy.deepcopy(cfg)
            other.parallel.zero, other.parallel.offload = 2, "none"
            real(other, world)
            return cfg
        return real(cfg, world)

    # lenient() is validate() itself on every layout but ZeRO-3 with 2BW: those verdicts, memoised for validate()
    # (layouts.broken_constraints) by the searches above, are lenient()'s too; only the 2BW + ZeRO-3 layouts are asked
    monkeypatch.setattr(layouts, "_BROKEN", dict(layouts._BROKEN))
    for (fn, lay), broken in list(layouts._BROKEN.items()):
        if fn is real and not (lay["schedule"] == "2bw" and lay["zero"] == 3):
            layouts._BROKEN[(lenient, lay)] = broken
    monkeypatch.setattr(layouts, "validate", lenient)
    assert (("zero", 3), ("schedule", "2bw")) in uncovered_accepted(COVERING, 4)


def _section(name: str) -> str:
    text = DOCS.read_text()
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"docs/verify.md has no {name} section"
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_docs_tables_are_the_generated_ones():
    """Regenerate with `python -m scaletrain.verify.layouts --docs docs/verify.md`."""
    from scaletrain.verify.layouts import dimension_table
    from scaletrain.verify.tolerances import tolerance_table

    assert _section("refusals") == refusal_table(8)
    assert _section("tolerances") == tolerance_table()
    assert _section("dimensions") == dimension_table()
    assert set(TOLERANCE) == {"fp32", "bf16", "fp16", "fp8"}


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("argv,message", [
    (["--filter", "colour=red"], "--filter: unknown dimension 'colour'"),
    (["--filter", "pp=3"], "--filter: pp has no value 3"),
    (["--filter", "pp"], "is not dim=value"),
    (["--world", "3"], "--world must be one of 1, 2, 4, 8, got 3"),
    (["--world", "16"], "--world must be one of 1, 2, 4, 8, got 16"),
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["--limit", "0"], "--limit must be >= 1, got 0"),
    (["--dtype", "fp8"], "--dtype must be one of"),
    (["--set", "parallel.dp=2"], "--config, --set and --small apply to a single verify"),
    (["--exhaustive", "--filter", "dtype=fp64"], "--exhaustive with this --filter leaves up to"),
])
def test_matrix_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    out = tmp_path / "m.json"
    code = main(["verify", "--matrix", "--json", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_matrix_command_runs_a_filtered_set_and_writes_json(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, "-m", "scaletrain", "verify", "--matrix", "--world", "2", "--filter",
                        "dtype=fp64,tp=1,pp=1", "--json", str(out)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["total"] == doc["passed"] >= 1 and f"{doc['total']} of {doc['total']} layouts PASS" in p.stdout
    assert all(r["values"]["dtype"] == "fp64" and r["values"]["pp"] == 1 for r in doc["layouts"])


@pytest.mark.parametrize("kv_heads", [0, 1])
def test_key_bias_gradient_is_rounding_noise_and_only_scale_free_optimizers_leave_it_out(kv_heads):
    """verify/matrix.key_bias_slices: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift of a
    whole row), so in fp64 it is rounding noise: below 1e-6 of the value bias's (measured 7e-10 to 2e-9: the
    rounding of the row sums, while a real gradient entry is of the value bias's order); the slices name exactly the
    key entries, and only for Adafactor and SM3 (AdamW runs keep every entry in the comparison)."""
    from scaletrain.config import Config
    from scaletrain.model import build_gpt
    from scaletrain.verify.layouts import Layout, reference_config
    from scaletrain.verify.matrix import key_bias_slices

    torch.set_default_dtype(torch.float64)
    try:
        m = Config().model
        m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len = 2, 32, 4, 64, 16
        m.n_kv_heads, m.qkv_bias, m.bias = kv_heads, True, False
        model = build_gpt(m, 0)
        x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1)).backward()
    finally:
        torch.set_default_dtype(torch.float32)
    kv = kv_heads or m.n_heads
    hs = m.d_model // m.n_heads
    for name, p in model.named_parameters():
        if name.endswith(("attn.qkv.bias", "attn.kv.bias")):
            g = p.grad
            k = g[m.d_model:2 * m.d_model] if kv_heads == 0 else g[:kv * hs]
            v = g[2 * m.d_model:] if kv_heads == 0 else g[kv * hs:]
            assert float(k.abs().max()) < 1e-6 * float(v.abs().max()), name
    for opt, masked in (("adamw", False), ("adafactor", True), ("sm3", True)):
        lay = Layout.of(optimizer=opt, qkv_bias=True, kv_heads=kv_heads)
        got = key_bias_slices(lay)
        assert bool(got) is masked, opt
        if masked:
            rm = reference_config(lay).model
            hs = rm.d_model // rm.n_heads
            assert set(got) == {f"blocks.{i}.attn.{'qkv' if kv_heads == 0 else 'kv'}.bias" for i in range(rm.n_layers)}
            first = 0 if kv_heads else rm.d_model  # q, k, v fused: the middle third; k then v: the first half
            assert {(s.start, s.stop) for s in got.values()} == {(first, first + (kv_heads or rm.n_heads) * hs)}
