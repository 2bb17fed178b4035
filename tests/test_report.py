"""The HTML run report, TensorBoard events and profiler traces (scaletrain.report), end to end.

Three real runs are trained once per module and shared by the tests: a dense single-process run (stopped
after step 4 past its step-3 checkpoint and resumed, with TensorBoard and a profiler window), a 2-stage
pipeline run and a 2-rank MoE run with expert parallelism (both on 2 gloo processes, the pp run profiled).
The tests read the numbers the page carries to the browser (`page.figures_of`) and compare them with the
run's own files: metrics.jsonl, memory_ranks.json, pipeline_trace.json. The browser tests at the end load
the pages in Debian's headless chromium through Playwright, and skip (saying why) where either is missing.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
from harness import make_config, run_ranks

from scaletrain.cli import main
from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError
from scaletrain.report import page as pg
from scaletrain.report.run_data import read_metrics
from scaletrain.report.tensorboard import flatten

pytestmark = pytest.mark.usefixtures("one_thread")

MiB = float(1 << 20)
BASE = {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 2, "model.seq_len": 32, "train.warmup_steps": 2,
        "train.eval_batches": 1, "train.device": "cpu", "train.lr": 3e-3}
NO_EVAL = {k: v for k, v in BASE.items() if k != "train.eval_batches"}  # validate() refuses it without evaluation
DENSE = {**BASE, "train.steps": 6, "train.global_batch": 4, "train.micro_batch": 2, "train.eval_every": 3,
         "train.checkpoint_every": 3, "train.tensorboard": "true", "train.profile_steps": "2:3"}
PP = {**BASE, "parallel.pp": 2, "train.global_batch": 4, "train.micro_batch": 1, "train.steps": 4,
      "train.eval_every": 2, "train.checkpoint_every": 2, "train.profile_steps": "2:2"}
MOE = {**BASE, "parallel.dp": 2, "parallel.ep": 2, "model.moe.experts": 4, "model.moe.group_tokens": 32,
       "train.global_batch": 4, "train.micro_batch": 2, "train.steps": 4, "train.eval_every": 2}
SECTIONS = ("summary", "loss", "optimizer", "throughput", "memory", "communication", "pipeline", "moe", "profile",
            "run")


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    from scaletrain.train.trainer import Trainer

    out = tmp_path_factory.mktemp("dense")
    cfg = make_config(DENSE)
    Trainer(cfg, out).run(stop_after=4)  # checkpoint at 3, step 4 logged: as if killed after it
    Trainer(cfg, out).run()  # resumes from 3: metrics trimmed to 3, step 4 done again
    return out


def _train_runs(rank, world, jobs):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    for overrides, out in jobs:
        Trainer(make_config(overrides), Path(out), DistEnv(rank, world, 0, "test")).run()


@pytest.fixture(scope="module")
def pp_moe(tmp_path_factory) -> tuple[Path, Path]:
    pp, moe = tmp_path_factory.mktemp("pp"), tmp_path_factory.mktemp("moe")
    run_ranks(_train_runs, 2, [(PP, str(pp)), (MOE, str(moe))], timeout=240)
    return pp, moe


def _page(out: Path, name: str = "report.html") -> tuple[str, dict]:
    text = (out / name).read_text()
    return text, pg.figures_of(text)


def _trace(fig: dict, name: str) -> dict:
    return next(t for t in fig["data"] if t["name"] == name)


def _same(xs, ys, rel: float = 1e-12) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        if y is None or (isinstance(y, float) and not math.isfinite(y)):
            assert x is None
        else:
            assert x == pytest.approx(y, rel=rel, abs=0)


# --------------------------------------------------------------------------- numbers on the page


def test_dense_report_shows_the_numbers_of_metrics_jsonl(dense):
    rows = read_metrics(dense / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the redone step 4 once
    text, figs = _page(dense)
    steps = [r["step"] for r in rows]
    tokens_per_step = DENSE["train.global_batch"] * BASE["model.seq_len"]
    train = _trace(figs["loss-step"], "train")
    assert train["x"] == steps
    _same(train["y"], [r["loss"] for r in rows])
    val = _trace(figs["loss-step"], "validation")
    assert val["x"] == [3, 6]
    _same(val["y"], [r["val_loss"] for r in rows if "val_loss" in r])
    assert _trace(figs["loss-tokens"], "train")["x"] == [s * tokens_per_step for s in steps]
    _same(_trace(figs["loss-tokens"], "validation")["y"], val["y"])
    for fig, key in (("lr", "lr"), ("grad-norm", "grad_norm"), ("tokens-per-s", "tokens_per_s"),
                     ("step-time", "step_time_s")):
        _same(figs[fig]["data"][0]["y"], [r[key] for r in rows])
    div = dict((u, d) for d, u in pg.BYTE_UNITS)[figs["memory-peak"]["layout"]["yaxis"]["title"]["text"]]
    _same(figs["memory-peak"]["data"][0]["y"], [r["mem_peak"] / div for r in rows])
    assert f"{6 * tokens_per_step:,}" in text  # tokens seen, in the summary table
    for s in SECTIONS:
        assert f'<section id="{s}">' in text
    assert "no pipeline parallelism" in text and "no mixture-of-experts" in text


def test_a_resumed_run_lists_both_invocations_and_its_devices(dense):
    info = json.loads((dense / "run_info.json").read_text())
    assert len(info["sessions"]) == 2
    last = info["sessions"][-1]
    assert last["world_size"] == 1 and last["ranks"][0]["device"] == "cpu"
    assert last["versions"]["torch"] == __import__("torch").__version__
    text, _ = _page(dense)
    assert last["ranks"][0]["device_name"] in text and last["versions"]["python"] in text


def test_memory_bars_show_each_rank_measured_next_to_its_stage_plan(pp_moe):
    from scaletrain.plan.exact import run_memory

    pp, _ = pp_moe
    ranks = json.loads((pp / "memory_ranks.json").read_text())["ranks"]
    rows = read_metrics(pp / "metrics.jsonl")
    _, figs = _page(pp)
    fig = figs["memory-ranks"]
    assert fig["data"][0]["x"] == [["rank 0", "rank 0", "rank 1", "rank 1"], ["measured", "planned"] * 2]
    cfg = make_config(PP)
    states = run_memory.model_state_bytes_per_stage(cfg)
    acts = run_memory.activation_bytes_per_stage(cfg)
    assert states[0]["params"] != states[1]["params"]  # the two stages differ: per-rank bars say something
    for cat in ("params", "grads", "optim", "activations"):
        planned = [s[cat] for s in states] if cat != "activations" else acts
        want = [v / MiB for r in range(2) for v in (ranks[r][f"mem_{cat}"], planned[r])]
        _same(_trace(fig, cat)["y"], want)
        # the per-rank files agree with metrics.jsonl, which holds the max over ranks
        assert max(r[f"mem_{cat}"] for r in ranks) == rows[-1][f"mem_{cat}"]
        assert max(planned) == rows[-1][f"plan_mem_{cat}"]


def test_pipeline_timelines_are_the_measured_trace_and_its_simulation(pp_moe):
    from scaletrain.parallel.pipeline import trace as tr

    pp, _ = pp_moe
    trace = tr.load(pp)
    _, figs = _page(pp)
    measured = figs["pp-measured"]["data"]
    events = trace.shifted()
    bars = [(t["name"], y, b, x, c) for t in measured for y, b, x, c in zip(t["y"], t["base"], t["x"], t["customdata"])]
    assert len(bars) == len(events) == 2 * 2 * 4  # 2 ranks x 4 micro-batches x (F, B)
    got = sorted((y, round(b, 9), c[1]) for _, y, b, _, c in bars)
    want = sorted((f"rank {e.rank}", round(e.start_s * 1e3, 9), e.microbatch) for e in events)
    assert got == want
    busy = [sum(x for _, y, _, x, _ in bars if y == f"rank {r}") / 1e3 for r in range(2)]
    _same(busy, trace.busy(), rel=1e-9)
    assert {c[2] for _, y, _, _, c in bars if y == "rank 1"} == {1}  # hover: stage of rank 1
    sim = [e for t in figs["pp-simulated"]["data"] for e in t["x"]]
    _same(sorted(sim), sorted((e.end_s - e.start_s) * 1e3 for e in trace.predicted().events), rel=1e-9)
    bubble = figs["pp-bubble"]["data"]
    _same(bubble[0]["y"], trace.bubble_per_rank())
    _same(bubble[1]["y"], trace.predicted().bubble_per_rank)
    assert "micro-batch %{customdata[1]}" in measured[0]["hovertemplate"]


def test_moe_and_communication_sections_follow_metrics(pp_moe):
    _, moe = pp_moe
    rows = read_metrics(moe / "metrics.jsonl")
    _, figs = _page(moe)
    steps = [r["step"] for r in rows]
    for li in range(len(rows[0]["moe_load"])):
        fig = figs[f"moe-load-{li}"]
        for e in range(4):
            t = _trace(fig, f"expert {e}")
            assert t["x"] == steps
            _same(t["y"], [r["moe_load"][li][e] for r in rows])
        _same(figs["moe-dropped"]["data"][li]["y"], [r["moe_dropped_frac"][li] for r in rows])
    _same(_trace(figs["moe-losses"], "loss_aux")["y"], [r["loss_aux"] for r in rows])
    kinds = [k for k in rows[-1] if k.startswith("comm_")]
    assert "comm_ep.all_to_all_bytes" in kinds
    div = dict((u, d) for d, u in pg.BYTE_UNITS)[figs["comm-bytes"]["layout"]["yaxis"]["title"]["text"]]
    for k in kinds:
        _same(_trace(figs["comm-bytes"], k[5:-6])["y"], [r[k] / div for r in rows])
    _same(figs["comm-time"]["data"][0]["y"], [r["moe_all_to_all_s"] for r in rows])


def test_fp16_loss_scale_and_skipped_steps(tmp_path):
    """A real fp16 run whose first loss scale overflows: the skipped steps and the backed-off scale."""
    from scaletrain.train.trainer import Trainer

    cfg = make_config({**NO_EVAL, "model.n_layers": 1, "train.steps": 3, "train.global_batch": 2,
                       "train.micro_batch": 2, "train.eval_every": 0, "train.dtype": "fp16",
                       "train.loss_scale": 1e30, "train.loss_scale_hysteresis": 1, "train.loss_scale_backoff": 1e-15,
                       "train.profile_steps": "2:100"})
    Trainer(cfg, tmp_path).run()
    # a window past the last step: the run ends inside it and writes what it recorded
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["rank0.steps2-3.json"]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["skipped"] for r in rows] == [True, True, False]
    _, figs = _page(tmp_path)
    _same(_trace(figs["loss-scale"], "loss scale")["y"], [r["loss_scale"] for r in rows])
    marks = _trace(figs["loss-scale"], "skipped step (overflow)")
    assert marks["x"] == [1, 2]
    assert figs["grad-norm"]["data"][0]["y"][:2] == [None, None]  # NaN norms of skipped steps: gaps, not NaN


def test_mfu_is_planner_flops_times_tokens_per_s_over_peak(dense, tmp_path, capsys):
    """--peak-flops: MFU = tokens/s x model FLOPs per token / (ranks x peak), with the FLOPs per token of a
    GELU GPT written out here: 6 x (4d^2 + 2 d d_ff) per layer + 12 L s d (attention) + 6 V d (logits)."""
    to = tmp_path / "r.html"
    assert main(["report", "run", str(dense), "--to", str(to), "--peak-flops", "2e9"]) == 0
    assert f"wrote {to}" in capsys.readouterr().out
    _, figs = _page(tmp_path, "r.html")
    L, d, s, V = 2, 32, 32, 256
    flops = 6 * L * (4 * d * d + 2 * d * 4 * d) + 12 * L * s * d + 6 * V * d
    rows = read_metrics(dense / "metrics.jsonl")
    _same(_trace(figs["tokens-per-s"], "MFU")["y"], [r["tokens_per_s"] * flops / 2e9 for r in rows], rel=1e-9)


def test_page_data_is_strict_json_that_cannot_close_its_script_tag():
    assert [pg.finite(x) for x in (1.5, float("nan"), float("inf"), -float("inf"), 3, True, None, "x")] == \
        [1.5, None, None, None, 3.0, 1.0, None, None]
    chart = pg.line_chart("c", "</script><script>alert(1)</script>", "x", "y", [pg.series([1, 2], [1.0, 2.0], "a")])
    text = pg.render(pg.Page("t", "s", [pg.Section("s", "S").add(chart)]))
    assert "</script><script>alert" not in text
    assert pg.figures_of(text)["c"]["layout"]["title"]["text"] == "</script><script>alert(1)</script>"
    with pytest.raises(ValueError):  # a NaN that skipped finite() is refused, not written as invalid JSON
        pg.render(pg.Page("t", "s", [pg.Section("s", "S").add(pg.Chart("d", [{"y": [float("nan")]}], {}))]))


# --------------------------------------------------------------------------- TensorBoard, profiler


def test_tensorboard_events_hold_every_scalar_of_metrics_jsonl(dense):
    """Read back with tensorboard's own reader. The run was resumed at step 3 after logging step 4: the
    purge step hides the first step 4, so each tag has one event per metrics row, with the row's value
    (step time and tokens/s differ between the two step 4s)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(dense / "tb"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    rows = read_metrics(dense / "metrics.jsonl")
    want: dict[str, dict[int, float]] = {}
    for r in rows:
        for tag, v in flatten(r).items():
            want.setdefault(tag, {})[r["step"]] = v
    assert set(acc.Tags()["scalars"]) == set(want)
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem_peak", "plan_mem_params"} <= set(want)
    for tag, by_step in want.items():
        events = acc.Scalars(tag)
        assert sorted(e.step for e in events) == sorted(by_step)
        for e in events:
            assert e.value == pytest.approx(by_step[e.step], rel=1e-6)  # float32 in the event file


def test_profiler_writes_a_trace_per_rank_linked_from_the_report(dense, pp_moe):
    pp, _ = pp_moe
    for out, ranks, steps in ((dense, [0], "2-3"), (pp, [0, 1], "2-2")):
        text, _ = _page(out)
        for r in ranks:
            path = out / "profile" / f"rank{r}.steps{steps}.json"
            events = json.loads(path.read_text())["traceEvents"]
            names = {e.get("name") for e in events}
            first, last = (int(x) for x in steps.split("-"))
            assert {f"scaletrain step {k}" for k in range(first, last + 1)} <= names
            assert f'href="profile/{path.name}"' in text


def test_profile_steps_and_tensorboard_are_validated(monkeypatch):
    for spec, msg in (("2-3", "must be a:b"), ("3:2", "1 <= a <= b"), ("0:1", "1 <= a <= b"), ("x", "must be a:b"),
                      ("1:2:3", "must be a:b"), ("300:400", "starts after the last step")):
        with pytest.raises(ConfigError, match=msg):
            validate(load_config(None, [f"train.profile_steps={spec}"]))
    validate(load_config(None, ["train.profile_steps=5", "train.tensorboard=true"]))
    monkeypatch.setattr("scaletrain.report.rules.tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match=r"train.tensorboard=true needs the tensorboard package"):
        validate(load_config(None, ["train.tensorboard=true"]))


# --------------------------------------------------------------------------- never failing a run; CLI errors


def test_a_report_that_cannot_be_written_does_not_fail_the_run(tmp_path, capsys):
    from scaletrain.train.trainer import Trainer

    (tmp_path / "report.html").mkdir()  # the report cannot replace a directory
    (tmp_path / "report.html" / "keep").write_text("x")
    cfg = make_config({**NO_EVAL, "model.n_layers": 1, "train.steps": 3, "train.global_batch": 2,
                       "train.micro_batch": 2, "train.eval_every": 0, "train.checkpoint_every": 2,
                       "train.profile_steps": "3"})
    result = Trainer(cfg, tmp_path).run()
    assert result.final_step == 3
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["rank0.steps3-3.json"]  # a single step
    err = [x for x in capsys.readouterr().err.splitlines() if x]
    assert len(err) == 2 and all(x.startswith("scaletrain: warning: writing the run report") for x in err)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert (tmp_path / "report.html" / "keep").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]


@pytest.mark.parametrize("argv, message", [
    (["report", "run", "{missing}"], "is not a directory"),
    (["report", "run", "{empty}"], "is not a scaletrain run (no config.yaml)"),
    (["report", "run", "{dense}", "--peak-flops", "-1"], "--peak-flops must be a positive number"),
    (["report", "run", "{dense}", "--gpu", "tpu-v9"], "tpu-v9"),
    (["report", "run", "{dense}", "--to", "{empty}"], "is a directory"),
    (["report", "run", "{broken}"], "config.yaml is not valid YAML"),
    (["report", "run", "{invalid}"], "model.n_heads"),
])
def test_report_command_errors_are_one_line(dense, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.yaml").write_text("model: [\n")
    (tmp_path / "invalid").mkdir()
    (tmp_path / "invalid" / "config.yaml").write_text("model:\n  n_heads: 5\n")
    before = (dense / "report.html").stat().st_mtime_ns
    subs = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "dense": dense, "broken": tmp_path / "broken",
            "invalid": tmp_path / "invalid"}
    assert main([a.format(**subs) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert (dense / "report.html").stat().st_mtime_ns == before


def test_a_line_cut_by_a_kill_ends_the_metrics_the_report_shows(dense, tmp_path, capsys):
    run = tmp_path / "cut"
    run.mkdir()
    shutil.copy(dense / "config.yaml", run / "config.yaml")
    lines = (dense / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:25])
    assert main(["report", "run", str(run)]) == 0
    capsys.readouterr()
    _, figs = _page(run)
    assert _trace(figs["loss-step"], "train")["x"] == [1, 2, 3]


# --------------------------------------------------------------------------- plan and scaling pages


def test_plan_html_shows_the_numbers_of_plan_json(tmp_path, capsys):
    argv = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "256", "--seq-len", "128",
            "--gpus", "8", "--global-batch", "32", "--top", "3"]
    assert main([*argv, "--json", "--html", str(tmp_path / "plan.html")]) == 0
    doc = json.loads(capsys.readouterr().out)
    _, figs = _page(tmp_path, "plan.html")
    for k in ("params", "grads", "optimizer", "activations", "buffers"):
        _same(_trace(figs["plan-memory"], k)["y"], [c["memory_bytes"][k] / 2**30 for c in doc["candidates"]])
    parts = figs["plan-time"]["data"]
    for i, c in enumerate(doc["candidates"]):
        assert {t["name"]: t["y"][i] for t in parts} == pytest.approx(c["time_breakdown_s"])
    text = (tmp_path / "plan.html").read_text()
    assert f"{doc['candidates'][0]['mfu']:.1%}" in text


def test_every_plan_mode_writes_its_page(tmp_path, capsys):
    """--params (model states per ZeRO stage), --flops-budget and --config (the run's exact memory)."""
    from scaletrain.plan import predict_run

    assert main(["plan", "--params", "1e9", "--gpus", "8", "--json", "--html", str(tmp_path / "p.html")]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    _, figs = _page(tmp_path, "p.html")
    _same(_trace(figs["plan-memory"], "optimizer")["y"], [r["memory_bytes"]["optimizer"] / 2**30 for r in rows])
    assert main(["plan", "--flops-budget", "1e21", "--gpus", "64", "--top", "2", "--html",
                 str(tmp_path / "b.html")]) == 0
    assert 'id="budget-table"' in (tmp_path / "b.html").read_text()
    (tmp_path / "c.yaml").write_text("model:\n  n_layers: 2\n")
    assert main(["plan", "--config", str(tmp_path / "c.yaml"), "--gpu", "a100-80gb", "--html",
                 str(tmp_path / "c.html")]) == 0
    capsys.readouterr()
    text, figs = _page(tmp_path, "c.html")
    pred = predict_run(load_config(tmp_path / "c.yaml"))
    assert f"{pred['plan_mem_params']:,}" in text and len(figs) == 3


def test_scaling_fit_html_draws_the_points_and_the_isoflop_fits(tmp_path, capsys):
    from test_scaling_fit import synthetic, write_csv

    from scaletrain.scaling.fit import fit_all

    pts = synthetic(sigma=0.002, seed=3, checkpoints=3)  # 126 points: enough for all three approaches
    write_csv(tmp_path / "runs.csv", pts)
    assert main(["scaling", "fit", str(tmp_path / "runs.csv"), "--bootstrap", "0", "--html",
                 str(tmp_path / "fit.html")]) == 0
    capsys.readouterr()
    _, figs = _page(tmp_path, "fit.html")
    report = fit_all(pts, bootstrap=0)
    curves = figs["scaling-curves"]["data"]
    n_runs = len(pts.run_indices())
    assert sum(len(t["x"]) for t in curves[:n_runs]) == len(pts)
    iso = [t for t in figs["scaling-isoflop"]["data"] if t["mode"] == "markers" and t["name"].startswith("C = ")]
    assert len(iso) == len(report.isoflop)
    for t, c in zip(iso, report.isoflop):
        _same(t["y"], list(c.loss), rel=1e-9)
    stars = [t for t in figs["scaling-isoflop"]["data"] if t["name"].startswith("minimum")]
    _same([t["x"][0] for t in stars], [c.n_opt for c in report.isoflop if c.n_opt is not None], rel=1e-9)


# --------------------------------------------------------------------------- in a real browser


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        pytest.skip("browser tests skipped: Debian's chromium is not installed (apt-get install chromium; "
                    "`make test` installs it when run as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser tests skipped: playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield b
        b.close()


def _load(browser, path: Path, shot: Path | None = None) -> tuple[object, list[str]]:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: problems.append(f"network request: {r.url}")
            if not r.url.startswith(("file:", "data:", "blob:", "about:")) else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=60_000)
    if shot is not None:
        page.screenshot(path=str(shot), full_page=True)
    return page, problems


def test_reports_load_in_a_browser_with_every_section_and_chart_drawn(browser, dense, pp_moe, tmp_path):
    """No console error or warning, no network request, every section present, every chart drawn by plotly
    (an SVG per chart), a full-page screenshot per report (SCALETRAIN_SCREENSHOTS=DIR keeps them)."""
    keep = Path(os.environ["SCALETRAIN_SCREENSHOTS"]) if os.environ.get("SCALETRAIN_SCREENSHOTS") else tmp_path
    keep.mkdir(parents=True, exist_ok=True)
    pp, moe = pp_moe
    for name, out, extra in (("dense", dense, ["loss-step", "tokens-per-s", "memory-ranks"]),
                             ("pp", pp, ["pp-measured", "pp-simulated", "pp-bubble"]),
                             ("moe", moe, ["moe-load-0", "moe-dropped", "comm-time"])):
        shot = keep / f"report-{name}.png"
        page, problems = _load(browser, out / "report.html", shot)
        assert problems == []
        figs = pg.figures_of((out / "report.html").read_text())
        assert page.get_attribute("body", "data-charts-drawn") == str(len(figs))
        for s in SECTIONS:
            assert page.locator(f"section#{s} h2").count() == 1
        for chart in [*figs, *extra]:
            assert page.locator(f"#{chart} .main-svg").count() >= 1, chart
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        page.close()


def test_pipeline_bars_show_op_micro_batch_stage_and_duration_on_hover(browser, pp_moe):
    pp, _ = pp_moe
    page, problems = _load(browser, pp / "report.html")
    chart = page.locator("#pp-measured")
    chart.scroll_into_view_if_needed()
    bar = chart.locator("g.trace.bars g.point path").first
    bar.hover(force=True)
    page.wait_for_selector("#pp-measured g.hoverlayer g.hovertext", timeout=10_000)
    hover = page.locator("#pp-measured g.hoverlayer").text_content()
    assert "micro-batch" in hover and "stage" in hover and "ms" in hover, hover
    assert problems == []
    page.close()


def test_plan_page_loads_in_a_browser(browser, tmp_path, capsys):
    assert main(["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "256", "--seq-len", "128",
                 "--gpus", "8", "--global-batch", "32", "--top", "3", "--html", str(tmp_path / "plan.html")]) == 0
    capsys.readouterr()
    page, problems = _load(browser, tmp_path / "plan.html", tmp_path / "plan.png")
    assert problems == []
    for chart in ("plan-memory", "plan-time", "plan-comm"):
        assert page.locator(f"#{chart} .main-svg").count() >= 1
    page.close()


# --------------------------------------------------------------------------- pictures a reviewer accepts (issue 36)


def test_axes_read_as_sizes_units_and_resume_marks(dense, pp_moe):
    """The figure data: sizes from zero with fixed-precision ticks, byte axes in binary units, the dense run's resume
    from its step-3 checkpoint marked on both loss charts, MoE panels named by block."""
    _, figs = _page(dense)
    for chart in ("tokens-per-s", "step-time", "memory-peak"):
        assert figs[chart]["layout"]["yaxis"]["rangemode"] == "tozero", chart
    assert figs["tokens-per-s"]["layout"]["yaxis"]["tickformat"] == ",.0f"
    assert figs["memory-peak"]["layout"]["yaxis"]["title"]["text"] in {u for _, u in pg.BYTE_UNITS}
    for chart, x in (("loss-step", 3), ("loss-tokens", 3 * 4 * 32)):
        (shape,), (note,) = figs[chart]["layout"]["shapes"], figs[chart]["layout"]["annotations"]
        assert shape["x0"] == shape["x1"] == x and note["text"] == "resumed", chart
    _, moe = pp_moe
    _, figs = _page(moe)
    assert figs["comm-bytes"]["layout"]["yaxis"]["title"]["text"] in {u for _, u in pg.BYTE_UNITS}
    assert (moe / "report.html").stat().st_size < 2.3e6  # plotly.js packed: 4.8 MB -> 1.96 MB


def test_fit_axis_gives_constant_series_a_range_and_log_axes_sparse_labels():
    assert pg.fit_axis({}, [1179648.0] * 5, zero=True)["range"] == [0.0, 1179648.0 * 1.1]
    assert pg.fit_axis({}, [2.5, 2.5])["range"] == [2.25, 2.75]
    assert "range" not in pg.fit_axis({}, [1.0, 2.0])
    assert pg.fit_axis({}, [0.01, 50.0], log=True)["dtick"] == 1
    assert pg.fit_axis({}, [0.5, 20.0], log=True)["dtick"] == "D2"
    assert pg.byte_unit(500e9) == (float(1 << 30), "GiB") and pg.byte_unit(100) == (1.0, "bytes")


def test_expert_load_png_names_blocks_and_has_a_legend_on_every_panel(pp_moe, tmp_path, monkeypatch):
    import matplotlib.figure

    from scaletrain.report.plots import plot_expert_load

    _, moe = pp_moe
    seen = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: seen.append(fig))
    assert plot_expert_load(moe / "metrics.jsonl", tmp_path / "load.png", [1, 3]) is not None
    (fig,) = seen
    axes = [ax for ax in fig.axes]
    assert [ax.get_title() for ax in axes] == ["block 1 (MoE): load per expert", "block 3 (MoE): load per expert"]
    assert all(ax.get_legend() is not None for ax in axes)


_GEOMETRY = """() => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  return [...document.querySelectorAll('.chart-box')].map(b => {
    const chart = b.querySelector('.chart');
    const labels = {};
    for (const ax of ['xtick', 'ytick', 'y2tick']) {
      labels[ax] = [...chart.querySelectorAll('g.' + ax + ' text')].map(t => [t.textContent, box(t)]);
    }
    const bar = chart.querySelector('.modebar');
    return {id: chart.id, title: box(b.querySelector('h3')), modebar: bar ? box(bar) : null, labels: labels};
  });
}"""


_NUMBER = re.compile(r"^[\u2212+-]?[\d.,]+(e[\u2212+-]?\d+)?[%kMGTPmµnp]?$")


def _overlap(a, b, slack: float = 0.5) -> bool:
    return a[0] < b[2] - slack and b[0] < a[2] - slack and a[1] < b[3] - slack and b[1] < a[3] - slack


@pytest.mark.parametrize("width,height", [(1280, 800), (1920, 1080)])
def test_titles_clear_of_the_toolbar_and_tick_labels_apart_in_a_browser(browser, dense, pp_moe, tmp_path, capsys,
                                                                        width, height):
    """Layout properties, not pixels: in every chart of the three run reports and a plan page, the title is clear
    of plotly's toolbar, and no two tick labels of one axis overlap or repeat."""
    assert main(["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "256", "--seq-len", "128",
                 "--gpus", "8", "--global-batch", "32", "--top", "5", "--html", str(tmp_path / "plan.html")]) == 0
    capsys.readouterr()
    pp, moe = pp_moe
    for path in (dense / "report.html", pp / "report.html", moe / "report.html", tmp_path / "plan.html"):
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(path.resolve().as_uri())
        page.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=60_000)
        charts = page.evaluate(_GEOMETRY)
        assert charts
        for c in charts:
            assert c["modebar"] is not None and not _overlap(c["title"], c["modebar"]), (path.name, c["id"])
            for axis, labels in c["labels"].items():
                texts = [t for t, _ in labels if _NUMBER.match(t)]  # category axes may repeat their names
                assert len(texts) == len(set(texts)), (path.name, c["id"], axis, texts)
                assert all(len(t) <= 9 for t in texts), (path.name, c["id"], axis, texts)
                boxes = [b for t, b in labels if t]
                for i in range(len(boxes)):
                    for j in range(i + 1, len(boxes)):
                        assert not _overlap(boxes[i], boxes[j]), (path.name, c["id"], axis, labels[i][0], labels[j][0])
        page.close()
