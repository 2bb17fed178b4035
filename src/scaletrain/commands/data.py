"""Subcommand `data`: `data tokenizer` trains a byte-level BPE tokenizer on a corpus (docs/data.md)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.guards import bounded_int

MAX_VOCAB = 1 << 24


def add_parser(sub) -> None:
    d = sub.add_parser("data", help="data tools: train a tokenizer on your corpus")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(d))
    t = dsub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (tokenizer.json) on a corpus")
    t.add_argument("--from", dest="source", required=True, metavar="SOURCE",
                   help="the corpus: a text / JSONL / Parquet file or folder, a datasets folder, or builtin")
    t.add_argument("--vocab", type=bounded_int(257, MAX_VOCAB), required=True, metavar="N",
                   help=f"vocabulary size: the 256 bytes, <|endoftext|> and merges (257 to {MAX_VOCAB:,})")
    t.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder for tokenizer.json")
    t.add_argument("--text-field", default="text", help="the text column of JSONL / Parquet / datasets rows")
    t.add_argument("--min-frequency", type=bounded_int(1), default=2, help="merge only pairs seen this often")
    t.set_defaults(func=cmd_tokenizer)


def cmd_tokenizer(args) -> int:
    from scaletrain.data.sources import find_source
    from scaletrain.data.train_tokenizer import train_bpe

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; give a new folder (nothing is overwritten)")
    if not args.text_field.strip():
        raise UserError("--text-field must name the text column; got ''")
    if Path(args.source).suffix == ".bin":
        raise UserError(f"--from {args.source} is a token file; a tokenizer is trained on text")
    source = find_source(args.source, args.text_field, what="--from")
    result = train_bpe(source, args.vocab, out, args.min_frequency)
    note = "" if result.vocab_size == args.vocab else f" (the corpus has merges for {result.vocab_size:,} only)"
    print(f"byte-level BPE tokenizer of {result.vocab_size:,} tokens{note}, trained on {args.source} "
          f"({result.documents:,} documents, {result.text_bytes / 1e6:,.1f} MB of text) in {result.seconds:.1f} s "
          f"-> {out}/tokenizer.json, tokenizer_config.json")
    print(f"use it with: --set data.tokenizer={out}")
    return 0
