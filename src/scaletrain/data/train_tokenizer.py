"""`scaletrain data tokenizer`: train a byte-level BPE tokenizer on a corpus, for users with data but no tokenizer.

Byte-level BPE (Sennrich et al., arXiv 1508.07909, on bytes as GPT-2 does, Radford et al. 2019): the 256 bytes are
the initial alphabet (so any UTF-8 text encodes, nothing is unknown), GPT-2's pre-tokenizer splits words, and merges
are learned until the vocabulary has N tokens; `<|endoftext|>` (id 0) ends documents. The `tokenizers` library does
the training (on all cores); the result is a folder with tokenizer.json and tokenizer_config.json that
`data.tokenizer` and `transformers.AutoTokenizer.from_pretrained` both read.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scaletrain.data.sources import Source
from scaletrain.errors import DataError

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # the byte alphabet and the end-of-text token


@dataclass
class Trained:
    vocab_size: int
    documents: int
    text_bytes: int
    seconds: float
    files: list[Path]


def train_bpe(source: Source, vocab: int, out: Path, min_frequency: int = 2) -> Trained:
    """Train on every document of `source`; write the folder `out` (which must not exist or be empty)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stats = {"documents": 0, "bytes": 0}

    def texts():
        for doc, _ in source.documents(as_bytes=False):
            if doc:
                stats["documents"] += 1
                stats["bytes"] += len(doc)
                yield doc

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    start = time.perf_counter()
    tok.train_from_iterator(texts(), trainer)
    took = time.perf_counter() - start
    if not stats["documents"]:
        raise DataError(f"--from {source.spec} has no text")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": EOT, "unk_token": EOT,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked by the caller): replaced by the complete folder
    tmp.replace(out)
    return Trained(tok.get_vocab_size(), stats["documents"], stats["bytes"], took,
                   [out / "tokenizer.json", out / "tokenizer_config.json"])
