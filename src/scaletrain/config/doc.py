"""`scaletrain config show --doc`: every config key with its value and its documentation, aligned.

No paper: the documentation is each field's docstring in config/schema.py (`field_docs`). Values are printed as YAML
scalars (true, 'gelu', 0.0), nested sections (model.moe) as indented blocks, never as Python reprs, so the
output reads as the YAML a user would write, with one `# ...` comment per key in one column.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml


def _scalar(value: Any) -> str:
    if isinstance(value, list):  # a list of sections (data.mix) as one YAML flow line
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).splitlines()[0]


def _rows(node: Any, indent: int) -> list[tuple[str, str]]:
    """(left part, documentation) per line; a section's own line carries its docstring."""
    docs = field_docs(type(node))
    rows: list[tuple[str, str]] = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        pad = "  " * indent
        if dataclasses.is_dataclass(value):
            rows.append((f"{pad}{f.name}:", docs.get(f.name, "")))
            rows += _rows(value, indent + 1)
        else:
            rows.append((f"{pad}{f.name}: {_scalar(value)}", docs.get(f.name, "")))
    return rows


def doc_text(cfg: Any) -> str:
    """The resolved config as YAML with each key's documentation as an aligned comment."""
    rows = _rows(cfg, 0)
    width = max(len(left) for left, _ in rows) + 2
    return "".join(f"{left:<{width}}# {doc}\n" if doc else f"{left}\n" for left, doc in rows)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (for `config show --doc`)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs
