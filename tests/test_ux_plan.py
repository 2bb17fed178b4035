"""One layout notation with a legend (plan/report.py, report/plan_page.py), step times with a fixed number of
significant digits, `plan --config` saying it benchmarks the machine before it does, and the throughput statistics
named in the console summary (commands/train.py, commands/plan.py; issue 36)."""

import contextlib
import io
import json
import re

import pytest

from scaletrain.cli import main
from scaletrain.commands.train import throughput_line
from scaletrain.plan import report
from scaletrain.plan.analytic.inputs import Layout
from scaletrain.report.plan_page import build, layout_label, legend

LAYOUT_COL = 1


@pytest.fixture(scope="module")
def gpt3(tmp_path_factory):
    """`plan` of GPT-3 175B on 1,024 A100-40GB (pipelines, sequence parallelism, interleaving in the top 5): the
    console table and the page built from the same run."""
    html = tmp_path_factory.mktemp("plan") / "plan.html"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "400")
        so, se = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            assert main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-40gb",
                         "--html", str(html)]) == 0
            assert main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-40gb", "--json"]) == 0
    text = so.getvalue()
    doc = json.loads(text[text.index("\n{") + 1:])
    return text[:text.index("\n{")], doc, html.read_text()


def rows(text):
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def test_plan_table_has_a_legend_for_every_abbreviation_it_uses(gpt3):
    text, doc, _ = gpt3
    labels = [r[LAYOUT_COL] for r in rows(text)]
    assert len(labels) == 5
    said = next(x for x in text.split("\n") if x.startswith("layout: dpN tpN ppN = data-, tensor- and pipeline-"))
    idx = text.index(said)
    legend_text = " ".join(text[idx:].split("\nmodel assumptions")[0].split())  # the caption may wrap
    assert text.index("└") < idx  # under the table
    used = {t for lab in labels for t in lab.split()}
    for token in used:
        word = re.sub(r"\d+", "N", token)
        if word in ("dpN", "tpN", "ppN", "zN", "mbN", "sp"):
            assert word in legend_text, word
        elif token.startswith(("interleavedx", "zb-", "1f1b", "gpipe")):
            assert token.split("x")[0] in legend_text and "pipeline schedule" in legend_text
        elif token.startswith("off:"):
            assert "off:X" in legend_text
        else:  # a recomputation policy
            assert f"{token}" in legend_text.split(" after mbN")[0], token
    assert "interleaved" in " ".join(labels) and "xN = N virtual stages" in legend_text
    assert "ep" not in legend_text.split("; ")[1]  # no expert parallelism in these layouts: not explained


def test_legend_names_only_what_is_used():
    plain = report.layout_legend([Layout(dp=8)])
    assert "sp =" not in plain and "off:X" not in plain and "pipeline schedule" not in plain and "epN" not in plain
    full = report.layout_legend([Layout(dp=2, tp=2, pp=2, ep=2, zero=1, sequence_parallel=True, offload="optimizer",
                                        schedule="interleaved", virtual_stages=2, recompute="full")], True)
    for part in ("epN = expert-parallel degree", "full after mbN", "interleaved = pipeline schedule, xN = N virtual",
                 "sp = sequence parallelism", "off:X = X kept in host memory", "[a,bxN,c] = transformer blocks"):
        assert part in full, part


@pytest.mark.parametrize("x, shown", [(16.0, "16.0"), (14.93, "14.9"), (0.25, "0.250"), (9.996, "10.0"),
                                      (0.001234, "0.00123"), (123.4, "123"), (1234.0, "1,230"), (0.0, "0.00")])
def test_step_seconds_have_three_significant_digits(x, shown):
    assert report.sig(x) == shown


def test_step_column_has_three_significant_digits_in_table_and_page(gpt3):
    text, doc, html = gpt3
    table = rows(text)
    for r, c in zip(table, doc["candidates"], strict=True):  # the same plan: --json holds the unrounded times
        assert r[LAYOUT_COL] == layout_label(c)
        assert r[5] == report.sig(c["step_time_s"])
        assert len(re.sub(r"^0\.0*|[.,]", "", r[5])) == 3, r[5]  # 3 significant digits, trailing zeros kept
    page_rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]+)</td>", html)
    assert [lab for _, lab in page_rows[:5]] == [r[LAYOUT_COL] for r in rows(text)]  # one notation
    for c in doc["candidates"]:
        assert f"<td>{report.sig(c['step_time_s'])}</td>" in html


def test_page_uses_the_console_notation_and_its_legend(gpt3):
    _, doc, html = gpt3
    cands = doc["candidates"]
    assert [layout_label(c) for c in cands] == [r for r in re.findall(r"<tr><td>\d+</td><td>([^<]+)</td>", html)][:5]
    assert legend(cands) in html.replace("&#x27;", "'")
    assert "dp=" not in " ".join(layout_label(c) for c in cands)
    one = build({**doc, "candidates": cands[:1]})  # a one-row page explains only what its row uses
    assert legend(cands[:1]) in str(one.__dict__).replace("&#x27;", "'")


def test_plan_config_says_it_benchmarks_before_it_does(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  n_layers: 1\n  d_model: 16\n  n_heads: 2\n  seq_len: 16\n"
                   "train:\n  global_batch: 4\n  micro_batch: 2\n  dtype: fp64\n")
    seen = []

    class Stop(Exception):
        pass

    def fake_calibrate_run(cfg):
        seen.append(capsys.readouterr().err)  # what was said before the measurement began
        raise Stop

    monkeypatch.setattr("scaletrain.plan.exact.run_calibrate.calibrate_run", fake_calibrate_run)
    with pytest.raises(Stop):
        main(["plan", "--config", str(cfg)])
    assert seen == ["plan: benchmarking this machine at the run's sizes in 1 local process (9 timed repeats of each "
                    "block); this takes up to about a minute (--gpu NAME or --cluster FILE plans without measuring) "
                    "...\n"]


def test_plan_with_a_named_gpu_says_nothing_of_benchmarks(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  n_layers: 1\n  d_model: 16\n  n_heads: 2\n  seq_len: 16\n"
                   "train:\n  global_batch: 4\n  micro_batch: 2\n  dtype: fp64\n")
    assert main(["plan", "--config", str(cfg), "--gpu", "a100-80gb"]) == 0
    assert "benchmark" not in capsys.readouterr().err


def test_console_throughput_names_both_statistics():
    rows_ = [{"step": s, "tokens_per_s": v} for s, v in ((2, 100.0), (4, 300.0), (6, 200.0), (8, 250.0))]
    assert throughput_line(rows_, 4, 64, 2.0) == (
        "throughput      225 tokens/s over 8 steps (median of the logged steps, as in report.html); 128 tokens/s over "
        "this invocation's 2 s wall time (4 steps, start-up included)")
    assert throughput_line(rows_[:1], 1, 64, 4.0).endswith("16 tokens/s over this invocation's 4 s wall time (1 step, "
                                                           "start-up included)")

