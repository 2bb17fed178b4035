"""The layers of docs/architecture.md are the import-linter contract of pyproject.toml (one picture, checked), and
the contracts hold: no module imports a higher layer, the torch-free modules never import torch, plan's exact half
is the only importer of the analytic half's direction, and no package has an import cycle (issue 26)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _contract_layers() -> list[str]:
    """The package's layers as import-linter reads them from pyproject.toml."""
    from importlinter.api import read_configuration

    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        contracts = read_configuration()["contracts_options"]
    finally:
        os.chdir(cwd)
    return next(c["layers"] for c in contracts if c["type"] == "layers" and c.get("containers") == ["scaletrain"])


def test_architecture_doc_draws_the_layers_of_the_contract():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## The layers, top to bottom\n\n```\n(.*?)```", doc, re.S).group(1)
    assert block.splitlines() == _contract_layers()


def test_every_package_of_the_source_is_in_a_layer():
    placed = {name.strip() for layer in _contract_layers() for name in layer.split("|")}
    src = ROOT / "src" / "scaletrain"
    present = {p.stem for p in src.glob("*.py")} | {p.name for p in src.iterdir() if (p / "__init__.py").is_file()}
    assert present - {"__init__", "__main__"} <= placed, present - placed


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "lint-imports is installed with the dev extra (make venv)"
    p = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "0 broken" in p.stdout
