"""Tokenizers: the byte tokenizer (token id = UTF-8 byte, vocabulary 256) and Hugging Face `tokenizer.json` files
through the `tokenizers` library (byte-level BPE as GPT-2 uses it, Radford et al. 2019, after Sennrich et al.,
arXiv 1508.07909; or any model the library reads: WordPiece, Unigram, ...). Needs no downloads.

`data.tokenizer` is `byte` or the path of a `tokenizer.json` or of a folder holding one (a Hugging Face model folder,
or what `scaletrain data tokenizer` writes). A document ends with the tokenizer's end-of-text token (`eot_id`):
`data.eot_token` when set, else the folder's tokenizer_config.json `eos_token`, else the first of `EOT_NAMES` in the
vocabulary; the byte tokenizer ends documents with NUL (token 0). The vocabulary size is the largest id + 1 (added
tokens included), which `model.vocab_size` defaults to. `digest` identifies the tokenizer (its canonical JSON and its
end-of-text id) in the token cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

from scaletrain.errors import DataError

BYTE = "byte"
VOCAB_SIZE = 256
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def encode(text: str | bytes) -> np.ndarray:
    """UTF-8 bytes of `text` as uint16 token ids (the byte tokenizer)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode(tokens) -> str:
    """Byte token ids back to text; ids >= 256 (from a non-byte vocabulary) and invalid UTF-8 become U+FFFD."""
    arr = np.asarray(tokens, dtype=np.int64)
    arr = np.where((arr >= 0) & (arr < 256), arr, ord("?"))
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class ByteTokenizer:
    """Token id = byte value; documents end with NUL (token 0)."""

    name = BYTE
    vocab_size = VOCAB_SIZE
    eot_id = 0
    eot_token = "\\x00"
    digest = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return encode(text).tolist()

    def encode_documents(self, docs: list[bytes], dtype: np.dtype) -> np.ndarray:
        """The documents' tokens, each followed by the end-of-text token, as one flat array of `dtype`."""
        return np.frombuffer(b"\x00".join(docs) + b"\x00", dtype=np.uint8).astype(dtype)

    def decode(self, ids) -> str:
        return decode(ids)

    def save(self, out: Path) -> list[Path]:
        """The byte tokenizer as a Hugging Face tokenizer.json (a byte-level BPE with the 256 bytes and no merges:
        id = byte value, as GPT-2's byte-to-character table spells bytes), so exported runs load with AutoTokenizer."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = _byte_alphabet()
        tok = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)}, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  "eos_token": alphabet[0]}  # NUL ends documents: `train --init-from` the export keeps it
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
        return [out / "tokenizer.json", out / "tokenizer_config.json"]


def _byte_alphabet() -> list[str]:
    """GPT-2's printable character for each byte (printable Latin-1 bytes stand for themselves, the others are
    shifted to 256 + k), which the `ByteLevel` pre-tokenizer and decoder use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that `data.tokenizer` names (a file, or a folder holding one); DataError when there is
    none."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        slow = [n for n in ("vocab.json", "merges.txt", "tokenizer.model") if (path / n).is_file()]
        hint = (f" (it has {', '.join(slow)}: save a fast tokenizer with AutoTokenizer.from_pretrained(DIR)"
                ".save_pretrained(DIR))") if slow else ""
        raise DataError(f"data.tokenizer {spec} is a folder without tokenizer.json{hint}")
    if not path.is_file():
        raise DataError(f"data.tokenizer {spec} not found (byte, a tokenizer.json or a folder holding one)")
    return path


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` read from a tokenizer.json, with its end-of-text token."""

    def __init__(self, spec: str, eot: str = ""):
        from tokenizers import Tokenizer

        self.file = tokenizer_file(spec)
        self.name = str(spec)
        try:
            self.tok = Tokenizer.from_file(str(self.file))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for unparsable files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"data.tokenizer {self.file} does not parse as a Hugging Face tokenizer.json ({first})"
                            ) from None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"data.tokenizer {self.file} has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        self.eot_token = self._eot(eot, vocab)
        self.eot_id = vocab[self.eot_token]
        canonical = self.tok.to_str().encode()
        self.digest = hashlib.sha256(canonical + f"\0{self.eot_id}".encode()).hexdigest()[:16]

    def _eot(self, given: str, vocab: dict[str, int]) -> str:
        if given:
            if given not in vocab:
                raise DataError(f"data.eot_token {given!r} is not a token of {self.file}")
            return given
        config = self.file.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except (OSError, ValueError, AttributeError):
                raise DataError(f"{config} is not a JSON object") from None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str) and eos in vocab:
                return eos
        for name in EOT_NAMES:
            if name in vocab:
                return name
        raise DataError(f"data.tokenizer {self.file} has no end-of-text token (none of {', '.join(EOT_NAMES)}, and "
                        "no eos_token in a tokenizer_config.json beside it); set data.eot_token")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_documents(self, docs: list[str], dtype: np.dtype) -> np.ndarray:
        """The documents' tokens, each followed by the end-of-text token, as one flat array of `dtype` (the
        library encodes the batch on all cores)."""
        encodings = self.tok.encode_batch_fast(docs, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
        out = np.empty(int(lengths.sum()), dtype=dtype)
        end = np.cumsum(lengths)
        for e, stop, n in zip(encodings, end, lengths):
            out[stop - n: stop - 1] = e.ids
        out[end - 1] = self.eot_id
        return out

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, out: Path) -> list[Path]:
        """Write tokenizer.json and a tokenizer_config.json (the folder's own when it has one, else one naming the
        end-of-text token) into `out`, so `transformers.AutoTokenizer.from_pretrained(out)` loads it."""
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "tokenizer.json"]
        written[0].write_text(self.tok.to_str())
        for name in HF_FILES[1:]:
            own = self.file.parent / name
            if own.is_file() and self.file.name == "tokenizer.json":
                (out / name).write_bytes(own.read_bytes())
                written.append(out / name)
        if not (out / "tokenizer_config.json").is_file():
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eot_token,
                      "bos_token": self.eot_token, "unk_token": self.eot_token, "clean_up_tokenization_spaces": False}
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
            written.append(out / "tokenizer_config.json")
        return written


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str = BYTE, eot: str = "") -> Tokenizer:
    """`data.tokenizer` (and `data.eot_token`) as a tokenizer; DataError naming the value when unusable."""
    if spec == BYTE:
        if eot and eot != "\\x00":
            raise DataError(f"data.eot_token {eot!r} is for Hugging Face tokenizers; the byte tokenizer ends "
                            "documents with NUL")
        return ByteTokenizer()
    return _cached(str(spec), eot, _stamp(tokenizer_file(spec)))


@functools.lru_cache(maxsize=8)
def _cached(spec: str, eot: str, stamp: tuple) -> HFTokenizer:
    return HFTokenizer(spec, eot)


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


RUN_COPY = "tokenizer"  # the run folder's copy of its Hugging Face tokenizer


def save_run_copy(spec: str, eot: str, run: Path) -> Path | None:
    """Copy a Hugging Face tokenizer into the run folder (`RUN/tokenizer/`), once, so `sample` and `export` use the
    tokenizer the run trained with even when the original moves; None for the byte tokenizer."""
    if spec == BYTE:
        return None
    folder = run / RUN_COPY
    if not (folder / "tokenizer.json").is_file():
        import shutil

        tmp = run / f".{RUN_COPY}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        load_tokenizer(spec, eot).save(tmp)
        tmp.replace(folder)
    return folder


def folder_tokenizer(folder: str | Path | None) -> list[str]:
    """`data.tokenizer=FOLDER` when `folder` (e.g. `train --init-from DIR`) holds a tokenizer.json, else nothing:
    a default below the config file and `--set` (config/load.py's `base`)."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return []
    return [f"data.tokenizer={Path(folder)}"]


def run_tokenizer(spec: str, eot: str, checkpoint: Path) -> Tokenizer:
    """The tokenizer of the run a checkpoint belongs to: the run folder's copy when there is one, else `spec`."""
    for run in (checkpoint, *list(checkpoint.parents)[:2]):
        if spec != BYTE and (run / RUN_COPY / "tokenizer.json").is_file():
            return load_tokenizer(str(run / RUN_COPY), eot)
    return load_tokenizer(spec, eot)
