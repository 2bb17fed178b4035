"""Commands that need no torch start without importing it (lazy imports): `scaletrain --help`, `plan --help`,
`plan` from a catalog model, from dimensions or from a parameter count, and `scaling` (start-up times are in
benchmarks/RESULTS.md, `benchmarks/bench_startup.py`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, io, contextlib
from scaletrain.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(code, sorted(m for m in ("torch", "matplotlib") if m in sys.modules))
"""

COMMANDS = {
    "help": ["--help"],
    "plan help": ["plan", "--help"],
    "plan catalog": ["plan", "--model", "megatron-1.7b", "--gpus", "64", "--global-batch", "512", "--top", "2"],
    "plan dims json": ["plan", "--layers", "24", "--hidden", "2304", "--heads", "24", "--vocab", "51200",
                       "--seq-len", "2048", "--gpus", "64", "--global-batch", "512", "--json"],
    "plan params": ["plan", "--params", "7.5e9", "--gpus", "64"],
    "scaling optimal": ["scaling", "optimal", "--flops", "5.76e23", "--law", "chinchilla-1"],
    "data tokenizer help": ["data", "tokenizer", "--help"],
}


@pytest.mark.parametrize("argv", COMMANDS.values(), ids=COMMANDS.keys())
def test_command_runs_without_importing_torch(argv):
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[-2] == "0 []", p.stdout[-300:]


def test_sizing_a_run_on_the_meta_device_does_not_import_dynamo():
    """The launcher sizes a run before it starts ranks (`refuse_if_too_big`, the meta module of `plan --config`):
    torch's meta kernel of nn.Embedding's `normal_` would import torch._dynamo (about 0.85 s of CPU per launch here);
    `model.init.no_normal_init` keeps it out, and puts `nn.init.normal_` back."""
    probe = """
import sys, torch.nn as nn
from scaletrain.config import load_config, validate
from scaletrain.commands.train import refuse_if_too_big
before = nn.init.normal_
cfg = validate(load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "parallel.dp=2"]), 2)
refuse_if_too_big(cfg, 2)
print("torch._dynamo" in sys.modules, nn.init.normal_ is before)
"""
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[-2] == "False True", p.stdout[-300:]
