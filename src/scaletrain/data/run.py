"""A run's data before its first step: `scaletrain train` tokenizes into the cache (with a progress bar), verifies
cached streams' checksums, checks every token id against `model.vocab_size`, keeps a copy of a Hugging Face tokenizer
in the run folder, and says in one line how many tokens the corpus has. All of this happens once, before any process
starts, so bad data fails with one line (exit 2) and ranks only map the verified streams.

No paper.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.config import Config
from scaletrain.data.corpus import load_corpus
from scaletrain.data.loader import BatchLoader
from scaletrain.data.tokenizer import save_run_copy


def keep_tokenizer(cfg: Config, out: Path) -> None:
    """The run folder's copy of a Hugging Face tokenizer (after the folder is marked as a run)."""
    save_run_copy(cfg.data.tokenizer, cfg.data.eot_token, out)


def prepare(cfg: Config) -> str:
    """Load (tokenize, verify, check) the run's data; returns the line that describes it."""
    corpus = load_corpus(cfg.data, progress=True, verify=True)
    loader = BatchLoader(corpus, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed, cfg.data.val_fraction,
                         cfg.model.vocab_size)
    return loader.describe(cfg.tokens_per_step, cfg.train.steps)
