"""Real data (issue 28): Hugging Face tokenizers, JSONL / Parquet / datasets corpora, the token cache, uint32 streams
and the `.bin` rule, weighted mixtures. References are independent: the `tokenizers` library's own `encode_batch`
(and plain UTF-8 bytes for the byte tokenizer) on the same documents."""

from __future__ import annotations

import json
import mmap
import os
import threading

import numpy as np
import pytest
import torch
from data_corpus import documents, train_tokenizer, write_datasets, write_jsonl, write_parquet, write_text_folder

from scaletrain.config import DataConfig, MixSource, load_config, validate
from scaletrain.data import BatchLoader, Corpus, load_corpus, load_tokenizer
from scaletrain.data import cache as cache_mod
from scaletrain.data.stream import TokenStream, sidecar
from scaletrain.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents in every format, a trained tokenizer, and a private cache folder."""
    root = tmp_path_factory.mktemp("corpus")
    docs = documents()
    return {
        "root": root, "docs": docs, "cache": str(root / "cache"),
        "tok": train_tokenizer(root / "tok", docs),
        "jsonl": write_jsonl(root / "a.jsonl", docs), "gz": write_jsonl(root / "a.jsonl.gz", docs, gz=True),
        "parquet": write_parquet(root / "a.parquet", docs), "datasets": write_datasets(root / "ds", docs),
        "text": write_text_folder(root / "texts", docs),
    }


def reference_ids(tok_dir, docs: list[str]) -> np.ndarray:
    """The library's own batch encoding, each non-empty document followed by <|endoftext|>."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eot = t.token_to_id("<|endoftext|>")
    kept = [d for d in docs if d]
    return np.array([i for e in t.encode_batch(kept, add_special_tokens=False) for i in [*e.ids, eot]])


@pytest.mark.parametrize("kind", ["jsonl", "gz", "parquet", "datasets", "text"])
def test_every_format_gives_the_librarys_tokens(corpus, kind):
    data = DataConfig(source=str(corpus[kind]), tokenizer=str(corpus["tok"]), cache_dir=corpus["cache"])
    stream = load_corpus(data).streams[0]
    assert stream.dtype == np.uint16
    np.testing.assert_array_equal(stream.tokens, reference_ids(corpus["tok"], corpus["docs"]))
    byte = load_corpus(DataConfig(source=str(corpus[kind]), cache_dir=corpus["cache"])).streams[0]
    expected = b"".join(d.encode() + b"\0" for d in corpus["docs"] if d)
    np.testing.assert_array_equal(byte.tokens, np.frombuffer(expected, np.uint8))


def test_tokenizer_roundtrip_size_and_end_of_text(corpus):
    tok = load_tokenizer(str(corpus["tok"]))
    assert (tok.vocab_size, tok.eot_token, tok.eot_id) == (400, "<|endoftext|>", 0)
    text = corpus["docs"][5][:60]
    assert tok.decode(tok.encode(text)) == text
    assert load_tokenizer(str(corpus["tok"] / "tokenizer.json")).digest == tok.digest
    with pytest.raises(DataError, match="not a token of"):
        load_tokenizer(str(corpus["tok"]), eot="<nope>")


def test_vocab_size_defaults_to_the_tokenizer_and_a_set_value_wins(corpus):
    tok = f"data.tokenizer={corpus['tok']}"
    assert load_config(None, [tok]).model.vocab_size == 400
    assert load_config(None, [tok, "model.vocab_size=512"]).model.vocab_size == 512  # padded: allowed
    with pytest.raises(ConfigError, match=r"model.vocab_size \(300\) is smaller than data.tokenizer's vocabulary"):
        validate(load_config(None, [tok, "model.vocab_size=300"]))
    assert load_config(None, []).model.vocab_size == 256


def test_cache_is_built_once_and_shared_by_concurrent_loaders(corpus, tmp_path, monkeypatch):
    builds = []
    real = cache_mod.build
    monkeypatch.setattr(cache_mod, "build", lambda *a, **k: builds.append(1) or real(*a, **k))
    data = DataConfig(source=str(corpus["jsonl"]), tokenizer=str(corpus["tok"]), cache_dir=str(tmp_path))
    threads = [threading.Thread(target=load_corpus, args=(data,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    load_corpus(data)
    assert len(builds) == 1


def _cache_file(folder):
    (found,) = [p for p in folder.glob("*.bin")]
    return found


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-sidecar", "bad-sidecar"])
def test_partial_or_corrupt_cache_is_detected_and_rebuilt(corpus, tmp_path, damage):
    data = DataConfig(source=str(corpus["jsonl"]), cache_dir=str(tmp_path))  # any tokenizer: the byte one is fast
    good = np.array(load_corpus(data).streams[0].tokens)
    path = _cache_file(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(raw[:-2])
    elif damage == "flip":  # same size: only the checksum tells (verify=True, as `scaletrain train` loads)
        raw[100] ^= 0xFF
        path.write_bytes(raw)
    elif damage == "no-sidecar":
        sidecar(path).unlink()
    else:
        sidecar(path).write_text("{not json")
    again = load_corpus(data, verify=True).streams[0].tokens
    np.testing.assert_array_equal(again, good)
    assert cache_mod.check_cache(path, json.loads(sidecar(path).read_text())["key"], load_tokenizer(),
                                 verify=True) is None


def test_changing_the_source_or_the_tokenizer_makes_a_new_cache(corpus, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", corpus["docs"][:10])
    data = DataConfig(source=str(src), cache_dir=str(tmp_path / "cache"))
    first = np.array(load_corpus(data).streams[0].tokens)
    write_jsonl(src, corpus["docs"][10:20])
    os.utime(src, ns=(1, 1))  # a new identity (size and time)
    second = np.array(load_corpus(data).streams[0].tokens)
    assert not np.array_equal(first, second)
    load_corpus(DataConfig(source=str(src), tokenizer=str(corpus["tok"]), cache_dir=data.cache_dir))
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 3


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    """A word-level tokenizer of 70,001 ids (more than uint16 holds) and a corpus that uses ids above 65,535."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("big")
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{i}" for i in rng.integers(60_000, 70_000, size=300)) for _ in range(20)]
    return root, docs


def test_large_vocabulary_streams_are_uint32(big_vocab):
    root, docs = big_vocab
    src = write_jsonl(root / "big.jsonl", docs)
    data = DataConfig(source=str(src), tokenizer=str(root / "tok"), cache_dir=str(root / "cache"))
    stream = load_corpus(data).streams[0]
    assert stream.dtype == np.uint32 and stream.max_id > 65_535
    expected = [int(w[1:]) + 1 for d in docs for w in [*d.split(), "w-1"]]  # w-1: the end-of-text id 0
    np.testing.assert_array_equal(stream.tokens, expected)
    assert load_config(None, [f"data.tokenizer={root / 'tok'}"]).model.vocab_size == 70_001
    # the cache file is itself a valid data.source: a .bin with its sidecar
    cached = _cache_file(root / "cache")
    again = load_corpus(DataConfig(source=str(cached), tokenizer=str(root / "tok"), cache_dir=str(root / "c2")))
    np.testing.assert_array_equal(again.streams[0].tokens, stream.tokens)


def test_bin_rule_uint32_needs_its_sidecar(big_vocab, tmp_path):
    root, _ = big_vocab
    ids = np.arange(1000, dtype=np.uint32) + 60_000
    path = tmp_path / "t.bin"
    ids.tofile(path)
    with pytest.raises(DataError, match="every second token 0, the signature of uint32"):
        load_corpus(DataConfig(source=str(path)))
    with pytest.raises(DataError, match="cannot hold the ids of data.tokenizer"):
        load_corpus(DataConfig(source=str(path), tokenizer=str(root / "tok")))
    sidecar(path).write_text('{"dtype": "uint32"}')
    stream = load_corpus(DataConfig(source=str(path), tokenizer=str(root / "tok"))).streams[0]
    np.testing.assert_array_equal(stream.tokens, ids)
    assert stream.max_id == 60_999
    sidecar(path).write_text('{"dtype": "uint32", "tokens": 999}')
    with pytest.raises(DataError, match="has 1,000 tokens but t.bin.json says 999"):
        load_corpus(DataConfig(source=str(path), tokenizer=str(root / "tok")))


def test_a_stream_from_another_tokenizer_is_refused(corpus, big_vocab, tmp_path):
    root, _ = big_vocab
    data = DataConfig(source=str(corpus["jsonl"]), tokenizer=str(corpus["tok"]), cache_dir=str(tmp_path))
    load_corpus(data)
    with pytest.raises(DataError, match="was tokenized by .* but data.tokenizer is another"):
        load_corpus(DataConfig(source=str(_cache_file(tmp_path)), tokenizer=str(root / "tok")))


def test_mixture_proportions_match_the_weights_and_batches_are_a_function_of_seed_and_step():
    a = TokenStream.of_array(np.full(50_000, 1, np.uint16), "a")
    b = TokenStream.of_array(np.full(20_000, 2, np.uint16), "b")
    c = TokenStream.of_array(np.full(30_000, 3, np.uint16), "c")
    loader = BatchLoader(Corpus([a, b, c], [0.5, 0.3, 0.2]), 16, 8, seed=7)
    counts = np.zeros(4)
    for step in range(1, 2001):
        x, _ = loader.global_batch_at(step)
        counts += np.bincount(x[:, 0].numpy(), minlength=4)
    share = counts[1:] / counts.sum()
    # 16,000 draws: a share's standard deviation is at most 0.004; the bound (set before measuring) is 0.02
    assert np.abs(share - [0.5, 0.3, 0.2]).max() < 0.02, share
    again = BatchLoader(Corpus([a, b, c], [0.5, 0.3, 0.2]), 16, 8, seed=7)
    assert torch.equal(again.global_batch_at(123)[0], loader.global_batch_at(123)[0])
    parts = [mb[0] for r in range(2) for mb in loader.micro_batches(9, r, 2, 2)]
    assert torch.equal(torch.cat(parts), loader.global_batch_at(9)[0])
    val = loader.global_batch_at(5, loader.val)[0]
    assert set(val[:, 0].tolist()) <= {1, 2, 3}


def test_mix_config_reads_each_source_with_its_own_text_field(corpus, tmp_path):
    other = write_parquet(tmp_path / "body.parquet", corpus["docs"][:12], field="body")
    data = DataConfig(tokenizer=str(corpus["tok"]), cache_dir=corpus["cache"],
                      mix=[MixSource(str(corpus["jsonl"]), 0.7), MixSource(str(other), 0.3, "body")])
    c = load_corpus(data)
    assert c.weights == pytest.approx([0.7, 0.3])
    np.testing.assert_array_equal(c.streams[1].tokens, reference_ids(corpus["tok"], corpus["docs"][:12]))


def test_a_large_stream_costs_a_rank_only_the_pages_of_a_batch(tmp_path, monkeypatch):
    """Windows read from a 256 MiB stream: with the release the mapped file pages stay near zero; without it
    (the bound set before measuring) they grow by the pages of every window read."""
    from scaletrain.data import stream as stream_mod

    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(256 << 20)
    sidecar(path).write_text(json.dumps({"format": stream_mod.FORMAT, "dtype": "uint16", "max_id": 0}))

    def rss_file_kb() -> int:
        line = next(x for x in open("/proc/self/status") if x.startswith("RssFile:"))
        return int(line.split()[1])

    def growth(release_bytes: int) -> int:
        monkeypatch.setattr(stream_mod, "RELEASE_BYTES", release_bytes)
        loader = BatchLoader(load_corpus(DataConfig(source=str(path))), 64, 64, seed=1)
        for step in range(1000, 1020):  # warm up: the code paths' own pages
            loader.global_batch_at(step)
        before = rss_file_kb()
        for step in range(300):
            loader.global_batch_at(step)
        return rss_file_kb() - before

    assert hasattr(mmap, "MADV_DONTNEED")
    released, kept = growth(1 << 20), growth(1 << 40)
    assert released < 2_000, released  # KiB: at most one batch's pages
    assert kept > 10 * max(released, 100), (kept, released)

