"""Loading a run configuration: defaults, then a YAML file, then `--set key=value` overrides, each converted to the
field's type with a `ConfigError` naming the key when it does not fit; then `model.preset` fills the model keys
neither gave (config/presets.py). Does not validate (`config/validate.py`)."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from scaletrain.config.presets import apply_preset
from scaletrain.config.schema import Config
from scaletrain.errors import ConfigError, UserError
from scaletrain.guards import MAX_INT, load_yaml, read_input, short, shown


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_text(typ: Any) -> bool:
    """A str field, or a closed set of strings (a Literal of the schema)."""
    return typ is str or (typing.get_origin(typ) is typing.Literal and isinstance(typing.get_args(typ)[0], str))


def _convert(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML or command-line value to the field's type, or raise ConfigError naming it."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = args[0]
    if origin is typing.Literal:  # a closed set: converted to its values' type here, the value checked by validate()
        typ = type(typing.get_args(typ)[0])
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{key}: expected true or false, got {short(value)}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, int):
            if abs(value) > MAX_INT:
                raise ConfigError(f"{key} ({short(value, 40)}) is beyond 64 bits (at most {MAX_INT:,})")
            return value
        raise ConfigError(f"{key}: expected an integer, got {short(value)}")
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{key} ({short(value, 40)}) is beyond the range of a number") from None
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {short(value)}")
    if origin is list:  # a list of sections (data.mix): each item a mapping of that section's keys
        item = typing.get_args(typ)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {short(value)}")
        if not dataclasses.is_dataclass(item):
            return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        items = [item() for _ in value]
        for i, (node, v) in enumerate(zip(items, value)):
            _apply(node, v, f"{key}[{i}].")
        return items
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {short(value)}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {typ!r}")


def _apply(node: Any, values: dict[str, Any], prefix: str, seen: set[str] | None = None) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {short(values)}")
    hints = _field_types(type(node))
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(hints)
            raise ConfigError(f"unknown config key '{dotted}' (known here: {known})")
        current = getattr(node, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, dotted + ".", seen)
        else:
            setattr(node, key, _convert(value, hints[key], dotted))
            if seen is not None:
                seen.add(dotted)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict (`Config.to_dict()`, a checkpoint's config) as dotted keys, e.g. {'model.d_model': 64}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def set_value(cfg: Config, dotted: str, raw: str) -> None:
    """Apply one `--set key=value` override (the value parsed as YAML scalar, then type-converted)."""
    parts = dotted.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        hints = _field_types(type(node))
        if part not in hints:
            where = ".".join(parts[:i]) or "config"
            raise ConfigError(f"unknown config key '{dotted}' (no '{part}' in {where})")
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(node, part)):
                raise ConfigError(f"'{dotted}' is a section; set one of its keys, e.g. {dotted}.<key>=...")
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                value = raw
            if _is_text(hints[part]) and not isinstance(value, str):
                value = raw  # keep strings such as "1f1b" or "007" verbatim
            setattr(node, part, _convert(value, hints[part], dotted))
        else:
            node = getattr(node, part)
            if not dataclasses.is_dataclass(node):
                raise ConfigError(f"unknown config key '{dotted}' ('{part}' is not a section)")


Implied = Callable[[Config], list[str]]
_IMPLIED: list[Implied] = []


def implied(fn: Implied) -> Implied:
    """Register `fn(cfg) -> ["key=value", ...]`: defaults that other settings imply (model.vocab_size from
    data.tokenizer, data/rules.py). load_config applies them below the YAML file and `--set`, so a value the user
    gave wins. Registered by the features' torch-free rules modules, like validate()'s rules."""
    same = [i for i, f in enumerate(_IMPLIED) if (f.__module__, f.__qualname__) == (fn.__module__, fn.__qualname__)]
    if same:
        _IMPLIED[same[0]] = fn
    else:
        _IMPLIED.append(fn)
    return fn


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                base: list[str] | None = None) -> Config:
    """Defaults, then `base` (`key=value` defaults from outside the config, e.g. what --init-from implies), then the
    YAML file, then `key=value` overrides in order; then again with the defaults those settings imply (`implied`)
    below all of them; then the model preset under the keys the file or `--set` gave. Does not validate."""
    return load_config_keys(path, overrides, base)[0]


def load_config_keys(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                     base: list[str] | None = None) -> tuple[Config, set[str]]:
    """`load_config`, and the dotted keys the YAML file or the overrides set (what a preset or a Hugging Face
    config.json must not change: `train --init-from` refuses one that contradicts it)."""
    cfg, explicit = _load(path, overrides, base)
    extra = [kv for fn in _IMPLIED for kv in fn(cfg)]
    if extra:
        cfg, explicit = _load(path, overrides, [*extra, *(base or [])])
    apply_preset(cfg.model, explicit)
    return cfg, explicit


def _load(path: str | os.PathLike | None, overrides: list[str] | None,
          base: list[str] | None) -> tuple[Config, set[str]]:
    cfg = Config()
    explicit: set[str] = set()
    for item in base or []:
        key, raw = item.split("=", 1)
        set_value(cfg, key.strip(), raw.strip())
    if path is not None:
        p = Path(path)
        try:  # guards.py: FIFOs, devices, link loops, non-UTF-8, duplicate keys, alias bombs, deep nesting
            data = load_yaml(read_input(p, "--config", "config file"), f"config file {shown(p)}")
        except UserError as e:
            raise ConfigError(str(e)) from None
        if data is not None:
            _apply(cfg, data, "", explicit)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        set_value(cfg, key.strip(), raw.strip())
        explicit.add(key.strip())
    return cfg, explicit


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    _apply(cfg, data, "")
    return cfg
