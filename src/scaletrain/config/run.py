"""The config in effect in a run folder: `config.yaml` (the config the run started with) and the changes each
resume recorded in `resumes.jsonl` (docs/checkpoints.md). Torch-free: the run report and `scaletrain replay` read
it before anything of the engine is imported; the trainer and the runners write both files (train/resume.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

HISTORY = "resumes.jsonl"


def current_config(out: Path) -> dict[str, Any]:
    """The config in effect in a run: `config.yaml` (the config it started with) with the changes each resume
    recorded in `resumes.jsonl` applied in order (a line cut by a kill is skipped). Raises OSError / yaml errors of
    config.yaml as reading it does."""
    config = yaml.safe_load((Path(out) / "config.yaml").read_text()) or {}
    history = Path(out) / HISTORY
    lines = history.read_text().splitlines() if history.exists() else []
    for line in lines:
        try:
            changed = json.loads(line).get("changed", {})
        except (ValueError, AttributeError):
            continue
        for key, values in changed.items():
            node, *path = [config, *key.split(".")]
            for part in path[:-1]:
                node = node.setdefault(part, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict) and isinstance(values, list) and len(values) == 2:
                node[path[-1]] = values[1]
    return config
