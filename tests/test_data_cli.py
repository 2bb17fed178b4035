"""Real data end to end (issue 28): `data tokenizer`, training on a JSONL corpus with it, `sample` and `export`
with the run's tokenizer, `--init-from` taking a folder's tokenizer; a weighted mixture trained under dp 2 x ZeRO-1
equal to a plain single-process loop over independently computed batches (fp64); exact resume of a mixture run; and
every bad input of the issue as one line, exit 2, nothing existing changed."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from data_corpus import documents, write_jsonl, write_parquet
from harness import TINY, assert_same_run, make_config, train_parallel

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.data.tokenizer import folder_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CLI_TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.n_heads=2",
            "--set", "model.seq_len=16", "--set", "train.steps=2", "--set", "train.global_batch=4",
            "--set", "train.micro_batch=2", "--set", "train.eval_every=0", "--set", "train.warmup_steps=1"]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = int(e.code)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A JSONL corpus, a Parquet corpus with another text field, and a tokenizer trained by the command."""
    root = tmp_path_factory.mktemp("datacli")
    docs = documents()
    jsonl = write_jsonl(root / "a.jsonl", docs)
    parquet = write_parquet(root / "b.parquet", docs[20:] + docs[:20], field="body")
    code, out, err = run(["data", "tokenizer", "--from", str(jsonl), "--vocab", "400", "--out", str(root / "tok")])
    assert code == 0, err
    assert "byte-level BPE tokenizer of 400 tokens" in out
    return {"root": root, "docs": docs, "jsonl": jsonl, "parquet": parquet, "tok": root / "tok"}


def test_tokenizer_train_sample_export_and_init_from(world):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, tok = world["root"], world["tok"]
    sets = ["--set", f"data.tokenizer={tok}", "--set", f"data.source={world['jsonl']}"]
    code, out, err = run(["train", *CLI_TINY, *sets, "--out", str(root / "run")])
    assert code == 0, err
    lib = Tokenizer.from_file(str(tok / "tokenizer.json"))
    n = sum(len(e.ids) + 1 for e in lib.encode_batch([d for d in world["docs"] if d], add_special_tokens=False))
    assert f"data: {n:,} tokens in {world['jsonl']}" in out  # the corpus's size, said before training
    assert yaml.safe_load((root / "run" / "config.yaml").read_text())["model"]["vocab_size"] == 400
    code, out, err = run(["sample", "--out", str(root / "run"), "--prompt", "def main(", "--tokens", "12",
                          "--temperature", "0"])
    assert code == 0 and out.startswith("def main("), (out, err)
    code, out, err = run(["export", str(root / "run"), "--format", "hf", "--to", str(root / "hf")])
    assert code == 0 and "tokenizer.json" in out, err
    auto = AutoTokenizer.from_pretrained(str(root / "hf"))
    text = world["docs"][5][:80]
    assert auto(text)["input_ids"] == lib.encode(text, add_special_tokens=False).ids
    assert auto.eos_token == "<|endoftext|>"
    assert AutoModelForCausalLM.from_pretrained(str(root / "hf")).config.vocab_size == 400
    # `train --init-from DIR` loads its config with DIR's tokenizer below the file and --set (commands/train.py)
    init = load_config(None, [], base=folder_tokenizer(root / "hf"))
    assert (init.data.tokenizer, init.model.vocab_size) == (str(root / "hf"), 400)
    assert load_config(None, ["data.tokenizer=byte"], base=folder_tokenizer(root / "hf")).data.tokenizer == "byte"


def test_byte_tokenizer_exports_as_a_hugging_face_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from scaletrain.data.tokenizer import ByteTokenizer, encode

    ByteTokenizer().save(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    text = 'def f(x):\n    return "é\x00✓"  \t'
    assert auto(text)["input_ids"] == encode(text).tolist()
    assert auto.decode(auto(text)["input_ids"]) == text


# --------------------------------------------------------------------------- a mixture under dp 2 x ZeRO-1


def mix_overrides(world) -> dict:
    mix = f"[{{source: {world['jsonl']}, weight: 0.7}}, {{source: {world['parquet']}, weight: 0.3, text_field: body}}]"
    return {"data.tokenizer": str(world["tok"]), "data.mix": mix, "model.seq_len": 16, "train.steps": 3,
            "train.micro_batch": 4}


def plain_loop(world, overrides: dict) -> tuple[dict, dict]:
    """One process, written from the documented rules alone: streams from the library's `encode_batch` (each
    document then <|endoftext|>), the last 5% of each held out, and for step k a generator PCG64([seed, 0, k])
    drawing each window's source with the weights, then its offset; AdamW (torch), global-norm clipping."""
    from tokenizers import Tokenizer

    from scaletrain.model import build_gpt, loss_sum
    from scaletrain.train.schedule import lr_at

    cfg = make_config({**TINY, **overrides})
    t, o, T = cfg.train, cfg.optim, cfg.model.seq_len
    lib = Tokenizer.from_file(str(world["tok"] / "tokenizer.json"))
    docs = world["docs"], world["docs"][20:] + world["docs"][:20]
    streams = [np.array([i for e in lib.encode_batch([d for d in ds if d], add_special_tokens=False)
                         for i in [*e.ids, 0]]) for ds in docs]
    train = [s[: len(s) - max(int(len(s) * 0.05), T + 2)] for s in streams]
    model = build_gpt(cfg.model, t.seed, "cpu", torch.float64)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    losses = {}
    for step in range(1, t.steps + 1):
        rng = np.random.Generator(np.random.PCG64([t.seed, 0, step]))
        which = rng.choice(2, size=t.global_batch, p=[0.7, 0.3])
        offsets = rng.integers(0, np.array([len(s) - T - 1 for s in train])[which])
        rows = torch.from_numpy(np.stack([train[w][i: i + T + 1] for w, i in zip(which, offsets)]).astype(np.int64))
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model(rows[:, :-1]), rows[:, 1:]) / cfg.tokens_per_step
        loss.backward()
        losses[step] = loss.item()
        norm = torch.sqrt(sum(p.grad.square().sum() for p in params)).item()
        if t.grad_clip > 0 and t.grad_clip / (norm + 1e-6) < 1:
            for p in params:
                p.grad.mul_(t.grad_clip / (norm + 1e-6))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_mixture_under_dp2_zero1_equals_a_plain_loop_over_the_documented_batches(world):
    overrides = mix_overrides(world)
    from scaletrain.data import load_corpus

    load_corpus(make_config({**TINY, **overrides}).data)  # the cache, built once before the ranks start
    reference = plain_loop(world, overrides)
    parallel = train_parallel({**overrides, "parallel.dp": 2, "parallel.zero": 1}, 2)
    assert_same_run(reference, parallel, rtol=1e-10, atol=1e-12)


def test_mixture_run_resumes_exactly(world, tmp_path):
    from scaletrain.train.trainer import Trainer

    def trainer(steps: int, out: Path) -> Trainer:
        return Trainer(make_config({**TINY, **mix_overrides(world), "train.steps": steps,
                                    "train.checkpoint_every": 2}), out)

    straight = trainer(3, tmp_path / "a")
    losses = straight.run().losses
    trainer(2, tmp_path / "b").run()
    resumed = trainer(3, tmp_path / "b")
    again = resumed.run().losses
    assert set(again) == {3} and again[3] == losses[3], (again, losses)
    for (name, a), (_, b) in zip(straight.full_state().items(), resumed.full_state().items()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- bad input: one line, exit 2


def _bad(world, tmp: Path, kind: str) -> tuple[list[str], list[str]]:
    tok = ["--set", f"data.tokenizer={world['tok']}"]
    if kind == "missing-text-field":
        return ["--set", f"data.source={world['jsonl']}", "--set", "data.text_field=body"], \
            ["line 1 has no field 'body'", "set data.text_field"]
    if kind == "empty-text-field":
        return ["--set", f"data.source={world['jsonl']}", "--set", "data.text_field="], ["data.text_field must name"]
    if kind == "all-texts-empty":
        return ["--set", f"data.source={write_jsonl(tmp / 'e.jsonl', ['', ''])}"], ["has no text"]
    if kind == "not-jsonl":
        (tmp / "x.jsonl").write_text('{"text": "ok"}\nthis is not json\n')
        return ["--set", f"data.source={tmp / 'x.jsonl'}"], ["x.jsonl line 2 is not JSON"]
    if kind == "not-parquet":
        (tmp / "x.parquet").write_text("plain text, not parquet")
        return ["--set", f"data.source={tmp / 'x.parquet'}"], ["x.parquet is not a Parquet file"]
    if kind == "not-gzip":
        (tmp / "x.jsonl.gz").write_text('{"text": "not compressed"}\n')
        return ["--set", f"data.source={tmp / 'x.jsonl.gz'}"], ["x.jsonl.gz is not a complete gzip file"]
    if kind == "non-utf8":
        (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 50)
        return ["--set", f"data.source={tmp / 'latin1.txt'}"], ["latin1.txt is not UTF-8 text (byte 3"]
    if kind == "id-above-vocab":
        (np.arange(4000, dtype=np.uint16) % 300).tofile(tmp / "ids.bin")
        return ["--set", f"data.source={tmp / 'ids.bin'}"], ["token id 299", "model.vocab_size is 256"]
    if kind == "tokenizer-does-not-parse":
        (tmp / "broken.json").write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
        return ["--set", f"data.tokenizer={tmp / 'broken.json'}"], ["broken.json does not parse as a Hugging Face"]
    if kind == "mix-weight-not-positive":
        mix = f"data.mix=[{{source: {world['jsonl']}, weight: 1}}, {{source: {world['jsonl']}, weight: -0.5}}]"
        return ["--set", mix], ["data.mix[1].weight must be positive and finite, got -0.5"]
    if kind == "stream-of-another-tokenizer":
        (np.arange(4000, dtype=np.uint16) % 200).tofile(tmp / "other.bin")
        meta = {"dtype": "uint16", "tokenizer": {"name": "someone-else", "digest": "0123456789abcdef"}}
        (tmp / "other.bin.json").write_text(json.dumps(meta))
        return [*tok, "--set", f"data.source={tmp / 'other.bin'}"], ["was tokenized by someone-else"]
    raise AssertionError(kind)


BAD = ["missing-text-field", "empty-text-field", "all-texts-empty", "not-jsonl", "not-parquet", "not-gzip",
       "non-utf8", "id-above-vocab", "tokenizer-does-not-parse", "mix-weight-not-positive",
       "stream-of-another-tokenizer"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_data_is_one_line_exit_2_and_nothing_changes(world, tmp_path, kind):
    existing = tmp_path / "run"
    existing.mkdir()
    (existing / "keep.txt").write_text("an existing output")
    sets, fragments = _bad(world, tmp_path, kind)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    code, out, err = run(["train", *CLI_TINY, *sets, "--out", str(tmp_path / "new")])
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before and not (tmp_path / "new").exists()


def test_data_tokenizer_refuses_bad_arguments(world, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    code, _, err = run(["data", "tokenizer", "--from", str(world["jsonl"]), "--vocab", "300", "--out",
                        str(tmp_path / "full")])
    assert code == 2 and "is not an empty folder" in err and (tmp_path / "full" / "x").read_text() == "keep"
    code, _, err = run(["data", "tokenizer", "--from", str(world["jsonl"]), "--vocab", "100", "--out",
                        str(tmp_path / "t")])
    assert code == 2 and "--vocab" in err and not (tmp_path / "t").exists()
