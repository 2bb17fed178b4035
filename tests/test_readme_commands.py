"""Every `scaletrain train` command of the README is accepted by validate() as written (with its --nproc as the
world size): a setting a later change made mandatory, or a value it now refuses, fails here instead of in a new
user's first hour. Commands whose config comes from files the README assumes (--config, --init-from, a user's
corpus or tokenizer) or from several machines are left out; each of those features has its own tests."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from scaletrain.config import load_config, validate

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS_FILES = ("--config", "--init-from", "--nnodes", "data.source", "data.mix", "data.tokenizer")


def train_commands() -> list[str]:
    lines, out = README.read_text().splitlines(), []
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        if line.startswith(".venv/bin/scaletrain train"):
            out.append(line.split("  #", 1)[0].strip())
        i += 1
    return out


def test_the_readme_has_train_commands_to_check():
    assert len([c for c in train_commands() if not any(k in c for k in NEEDS_FILES)]) >= 15


@pytest.mark.parametrize("command", [c for c in train_commands() if not any(k in c for k in NEEDS_FILES)])
def test_readme_train_command_is_accepted(command):
    argv = shlex.split(command)[2:]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    nproc = int(argv[argv.index("--nproc") + 1]) if "--nproc" in argv else None
    validate(load_config(None, sets), nproc)
