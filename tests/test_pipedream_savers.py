"""PipeDream (arXiv 1806.03377) with the memory savers: recomputation (Chen et al., arXiv 1604.06174; full, every:k,
the attention core of Korthikanti et al., arXiv 2205.05198), activation offload (ZeRO-R Pa+cpu, arXiv 1910.02054),
activation compression (Gist, ISCA 2018) and contiguous buffers (ZeRO-R, arXiv 1910.02054 section 6.3).

The trap: a saver that rebuilds or re-reads at backward time what the forward computed must read the weight version
the forward read (weight stashing), not the newest one. Each saver is proven as PipeDream itself is, by the
version-log replay (tests/pipedream_replay.py, a plain fp64 loop written from the paper): the losses of every step
and every final parameter equal the replay's (rtol 1e-10) and every backward read its forward's version; pp2 for each
saver, and pp4 with vertical sync, full recomputation, offload and contiguous buffers in tests/test_pipedream.py's pp4
runs (one more run in the same processes). Lossy compression (bf16, int8) with recomputation is refused: the
recomputation starts from the compressed checkpoint, which the replay does not model.
"""

from __future__ import annotations

import pytest
from harness import run_ranks
from test_pipedream import BASE, _assert_replayed, _assert_stashing, _run

from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError

STEPS = 4  # PipeDream at pp2 differs from synchronous training from step 3 on (tests/test_pipedream.py)
SAVERS2 = {
    "recompute-full-offload-contiguous": {"memory.recompute": "full", "memory.offload_activations": "true",
                                          "memory.contiguous": "true"},
    "recompute-every2-relu-mask": {"memory.recompute": "every:2", "memory.compress": "relu-mask"},
    "recompute-attn-core": {"memory.recompute": "attn-core"},
    "compress-bf16-offload": {"memory.compress": "bf16", "memory.offload_activations": "true"},
    "compress-int8-vsync": {"memory.compress": "int8", "parallel.vertical_sync": "true"},
}


@pytest.fixture(scope="module")
def savers2():
    runs = [{"parallel.pp": 2, "train.steps": STEPS, **s} for s in SAVERS2.values()]
    outs = run_ranks(_run, 2, runs, timeout=300)
    return {name: ([o[i] for o in outs], runs[i]) for i, name in enumerate(SAVERS2)}


@pytest.mark.parametrize("name", list(SAVERS2))
def test_pp2_with_a_memory_saver_replays_exactly_from_the_version_log(savers2, name):
    ranks, overrides = savers2[name]
    _assert_replayed(name, ranks, overrides)
    _assert_stashing(ranks, 2, "parallel.vertical_sync" in overrides, STEPS)


@pytest.mark.parametrize("sets", [{"memory.compress": "bf16", "memory.recompute": "full"},
                                  {"memory.compress": "int8", "memory.recompute": "every:2"},
                                  {"memory.recompute": "nth:2"}])
def test_unproven_saver_combinations_are_refused_with_the_reason(sets):
    cfg = load_config(None, [f"{k}={v}" for k, v in {**BASE, "parallel.pp": 2, **sets}.items()])
    why = "not proven" if "nth" in sets.get("memory.recompute", "") else "recomputation starts from the compressed"
    with pytest.raises(ConfigError, match=why) as e:
        validate(cfg, 2)
    assert "\n" not in str(e.value)
