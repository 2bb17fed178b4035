"""`train.fp8_all_gather` (parallel/zero_fp8.py) refused outside what it is proven with, one line naming the value
and the reason. Its runs (dp 2 ZeRO-3 against one process, fp32 and bf16 parameters, and its all-gather bytes
against bf16's) are in test_fp8_layouts.py, sharing that module's processes and single-process references."""

from __future__ import annotations

import pytest
from harness import make_config
from test_fp8_layouts import FP8

from scaletrain.errors import ConfigError


@pytest.mark.parametrize("overrides, named", [
    ({"parallel.zero": 2}, "parallel.zero=2"),
    ({"parallel.zero": 3, "train.fp8_recipe": "rowwise"}, "train.fp8_recipe=rowwise"),
    ({"parallel.zero": 3, "parallel.tp": 2, "parallel.dp": 1}, "parallel.tp=2"),
    ({"parallel.zero": 3, "parallel.offload": "params"}, "parallel.offload=params"),
    ({"parallel.zero": 3, "train.precision": "autocast-bf16"}, "train.fp8_all_gather=True has no effect"),
])
def test_fp8_all_gather_refused_outside_zero3_tensorwise(overrides, named):
    with pytest.raises(ConfigError) as e:
        make_config({**FP8, "parallel.dp": 2, "train.fp8_all_gather": True, **overrides})
    assert named in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)
