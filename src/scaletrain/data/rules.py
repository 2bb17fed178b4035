"""validate()'s rules for the data keys (`data.*`): where the tokens come from, the tokenizer, the mixture and the
held-out fraction; and the default `model.vocab_size` that `data.tokenizer` implies (its size).

Registered with `scaletrain.config.rules` / `scaletrain.config.load` when imported (scaletrain/__init__.py imports
it); torch-free. A Hugging Face tokenizer is read (with the `tokenizers` library, no torch) only when one is set.
"""

from __future__ import annotations

import math

from scaletrain.config.load import implied
from scaletrain.config.rules import rule
from scaletrain.config.schema import Config
from scaletrain.errors import DataError

SOURCES = "builtin, a text / JSONL / Parquet file or folder, a datasets folder or a .bin token file"


@rule("inputs")
def source(cfg: Config, world_size: int | None) -> list[str]:
    """An empty data.source would read the current folder as the corpus; an empty text field names no column."""
    d = cfg.data
    bad = [] if d.source.strip() else [f"data.source must be {SOURCES}; got ''"]
    bad += [] if d.text_field.strip() else ["data.text_field must name the text column of the rows; got ''"]
    bad += [] if d.tokenizer.strip() else ["data.tokenizer must be byte or a tokenizer.json (or its folder); got ''"]
    return bad


@rule("values")
def validation_split(cfg: Config, world_size: int | None) -> list[str]:
    """data.val_fraction: the end of each token stream held out for validation."""
    if not 0.0 < cfg.data.val_fraction < 0.5:
        return [f"data.val_fraction must be in (0, 0.5), got {cfg.data.val_fraction}"]
    return []


@rule("values")
def mixture(cfg: Config, world_size: int | None) -> list[str]:
    """data.mix: each entry a source with a positive, finite weight; instead of data.source, not beside it."""
    d, bad = cfg.data, []
    if d.mix and d.source != "builtin":
        bad.append(f"data.mix and data.source ({d.source}) are two corpora; set one (a mix entry may be "
                   f"{{source: {d.source}, weight: ...}})")
    for i, m in enumerate(d.mix):
        if not m.source.strip():
            bad.append(f"data.mix[{i}].source must be {SOURCES}; got ''")
        if not (math.isfinite(m.weight) and m.weight > 0):
            bad.append(f"data.mix[{i}].weight must be positive and finite, got {m.weight} ({m.source})")
    return bad


@rule("combinations")
def tokenizer_vocabulary(cfg: Config, world_size: int | None) -> list[str]:
    """A Hugging Face tokenizer must parse, and model.vocab_size must hold every one of its ids (it may be larger:
    padded tables, as GPT-2's 50,304)."""
    d = cfg.data
    if d.tokenizer == "byte" and not d.eot_token:
        return []  # nothing to read (and numpy stays unimported for torch-free commands)
    from scaletrain.data.tokenizer import BYTE, load_tokenizer

    try:
        tok = load_tokenizer(d.tokenizer, d.eot_token)
    except DataError as e:
        return [str(e)]
    if d.tokenizer != BYTE and cfg.model.vocab_size < tok.vocab_size:
        return [f"model.vocab_size ({cfg.model.vocab_size}) is smaller than data.tokenizer's vocabulary "
                f"({tok.vocab_size:,} ids, {d.tokenizer}); leave it unset to use the tokenizer's size"]
    return []


@implied
def vocab_from_tokenizer(cfg: Config) -> list[str]:
    """model.vocab_size defaults to a Hugging Face tokenizer's size (a run that sets it keeps its value)."""
    if cfg.data.tokenizer in ("byte", ""):
        return []
    from scaletrain.data.tokenizer import load_tokenizer

    try:
        return [f"model.vocab_size={load_tokenizer(cfg.data.tokenizer, cfg.data.eot_token).vocab_size}"]
    except DataError:
        return []  # validate() reports it (tokenizer_vocabulary above)
