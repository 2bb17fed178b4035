"""`scaletrain batch-size --max`: the search, the size parser, and one real CPU search against the planner's
independent formula for the bytes our GPT saves for backward (plan/exact/run_memory.py implementation_activation_bytes).
"""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.cli import main
from scaletrain.errors import UserError
from scaletrain.plan.catalog import from_model_config
from scaletrain.plan.exact.run_memory import implementation_activation_bytes
from scaletrain.scaling.batch import Trial, parse_bytes, search_max
from tests.harness import TINY, make_config


@pytest.mark.parametrize("text, value", [
    ("2GiB", 2 * 2**30), ("2 GiB", 2 * 2**30), ("2G", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
    ("2e9", 2_000_000_000), ("1048576", 2**20), ("64kB", 64_000), ("1TiB", 2**40),
])
def test_parse_bytes_reads_binary_and_decimal_units(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["0", "-1GiB", "0.1", "2XB", "GiB", "", "1.2.3G", "nan"])
def test_parse_bytes_rejects_non_positive_and_unparsable_sizes(text):
    with pytest.raises(UserError, match="--memory-limit"):
        parse_bytes(text)


@pytest.mark.parametrize("answer", [1, 2, 3, 5, 8, 13, 64, 100, 1000])
def test_search_finds_the_exact_largest_fitting_size_in_about_two_log2_trials(answer):
    def measure(b: int) -> Trial:
        return Trial(b, 1000 + 10 * b, b <= answer)

    best, capped, trials = search_max(measure, cap=4096)
    assert (best, capped) == (answer, False)
    assert len(trials) <= 2 * math.ceil(math.log2(answer + 1)) + 1
    assert len({t.micro_batch for t in trials}) == len(trials)  # no size measured twice


def test_search_stops_at_the_cap_and_reports_nothing_fits():
    def fits_all(b: int) -> Trial:
        return Trial(b, b, True)

    assert search_max(fits_all, cap=20)[:2] == (20, True)
    assert search_max(fits_all, cap=16)[:2] == (16, True)
    assert search_max(lambda b: Trial(b, None, False), cap=16)[0] == 0


def test_cpu_search_with_real_steps_matches_the_independent_memory_formula(capsys):
    """One real search on CPU (fp64 tiny GPT). Model states: params, grads, Adam m and v, 8 bytes each per
    parameter (plus AdamW's step scalars); saved activations from the planner's formula. The limit sits
    half a sequence above micro_batch 3, so the answer must be 3."""
    cfg = make_config(TINY)
    spec = from_model_config(cfg.model)
    n_params = 34688  # 2 layers x 12,704 + 256 x 32 tied embedding + 32 x 32 positions + final norm 64
    static = 4 * 8 * n_params
    act = {b: implementation_activation_bytes(spec, b, 8) for b in (1, 2, 3, 4, 8)}
    limit = int(static + act[3] + act[1] / 2)
    sets = [x for k, v in TINY.items() for x in ("--set", f"{k}={v}")]
    assert main(["batch-size", "--max", "--memory-limit", str(limit), "--json", "--set", "train.device=cpu",
                 *sets]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_micro_batch"] == 3 and out["device"] == "cpu" and out["memory_limit"] == limit
    assert [t["micro_batch"] for t in out["trials"]] == [1, 2, 4, 3]
    for t in out["trials"]:
        p = t["parts"]
        assert p["params"] == p["grads"] == 8 * n_params
        assert 2 * 8 * n_params <= p["optim"] <= 2 * 8 * n_params + 1024
        assert p["activations"] == pytest.approx(act[t["micro_batch"]], rel=0.01)
        assert t["bytes"] == sum(p.values()) and t["fits"] == (t["bytes"] <= limit)


@pytest.mark.parametrize("argv, words", [
    (["batch-size", "--max", "--memory-limit", "0"], "must be positive"),
    (["batch-size", "--max", "--memory-limit=-2GiB"], "must be positive"),
    (["batch-size", "--max", "--memory-limit", "lots"], "must be a size"),
    (["batch-size", "--max", "--set", "train.device=cpu"], "give --memory-limit"),
    (["batch-size", "--memory-limit", "1GiB"], "needs --max"),
    (["batch-size", "--max", "--memory-limit", "1GiB", "--cap", "0"], "--cap"),
    (["batch-size", "--max", "--memory-limit", "1KiB", "--set", "train.device=cpu", "--set", "model.n_layers=1",
      "--set", "model.d_model=16", "--set", "model.n_heads=2", "--set", "model.seq_len=16"], "micro_batch 1 needs"),
])
def test_batch_size_bad_input_exits_2_with_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
