"""Hugging Face round trips against the real `transformers` (tiny random models built locally, nothing downloaded).

- Export: a scaletrain checkpoint of a GPT-2-shaped model (learned positions, GELU, LayerNorm, biases) and of a
  Llama-shaped one (RoPE, SwiGLU, RMSNorm, no biases, untied head) is written with `scaletrain export`, loaded with
  `AutoModelForCausalLM.from_pretrained`, and gives our logits on the same tokens within 1e-5 (fp32; measured
  <= 1e-6: the GPT-2 path is the same arithmetic, Llama's RMSNorm and RoPE differ in rounding); its greedy
  `generate` equals `scaletrain sample --temperature 0` for four prompts (with different continuations).
- Import: `GPT2LMHeadModel` / `LlamaForCausalLM` with random weights saved by `save_pretrained` are read by
  `--init-from`; our model's logits equal theirs within 1e-5, and the first training step of
  `scaletrain train --init-from` reports the loss the HF model gives on that step's batch.
- Bad input: an unknown architecture, mismatched dims (named with both values), GPT-2's tanh GELU, pickled .bin
  weights only: each one line, exit 2, before any training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from harness import TINY, make_config

from scaletrain.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
transformers.utils.logging.disable_progress_bar()

TOL = 1e-5
GPT2 = {**TINY, "train.dtype": "fp32", "train.steps": 2, "train.checkpoint_every": 2, "train.report": False}
LLAMA = {**GPT2, "model.position": "rope", "model.mlp": "swiglu", "model.norm": "rmsnorm", "model.bias": False,
         "model.tie_embeddings": False}


def _sets(overrides: dict) -> list[str]:
    return [x for k, v in overrides.items() for x in ("--set", f"{k}={v}")]


def _our_logits(directory: Path, x: torch.Tensor) -> torch.Tensor:
    from scaletrain.train.checkpoint import find_checkpoint
    from scaletrain.train.sample import load_model

    _, model = load_model(find_checkpoint(directory, note=False))
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name, overrides, arch", [("gpt2", GPT2, "GPT2LMHeadModel"),
                                                   ("llama", LLAMA, "LlamaForCausalLM")])
def test_export_loads_in_transformers_with_our_logits_and_greedy_text(name, overrides, arch, tmp_path, capsys):
    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--out", str(run), *_sets({**overrides, "train.steps": 1})]) == 0
    assert main(["export", str(run), "--format", "hf", "--to", str(hf_dir)]) == 0
    assert arch in capsys.readouterr().out
    assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                        "tokenizer_config.json"]  # the byte tokenizer (issue 28)
    assert transformers.AutoTokenizer.from_pretrained(hf_dir)("def ")["input_ids"] == list(b"def ")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf).__name__ == arch
    x = torch.randint(0, 256, (2, TINY["model.seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(x).logits
    ours = _our_logits(run, x)
    assert (ours - theirs).abs().max() <= TOL
    continuations = set()
    for prompt in ("def ", "import numpy as", "class Foo(", "while True:"):
        assert main(["sample", "--out", str(run), "--prompt", prompt, "--tokens", "12", "--temperature", "0"]) == 0
        text = capsys.readouterr().out.rstrip("\n")
        gen = hf.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert bytes(gen[0].tolist()).decode("utf-8", errors="replace") == text, prompt
        continuations.add(text[len(prompt):])
    assert len(continuations) >= 3  # the continuations depend on the prompt: the comparison means something


def _hf_model(kind: str, d: Path):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      activation_function="gelu", bos_token_id=None, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                                       eos_token_id=None)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their initial 1 and 0, so a wrong mapping shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(d)
    return model.eval()


@pytest.mark.parametrize("kind, overrides", [("gpt2", {**GPT2, "train.steps": 1}),
                                             ("llama", {**LLAMA, "train.steps": 1, "model.d_ff": 128})])
def test_init_from_transformers_gives_their_logits_and_first_loss(kind, overrides, tmp_path, capsys):
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.interop.hf import read_hf_weights
    from scaletrain.model import build_gpt

    hf_dir = tmp_path / "hf"
    hf = _hf_model(kind, hf_dir)
    cfg = make_config(overrides)
    model = build_gpt(cfg.model, 0, "cpu", torch.float32)
    weights = read_hf_weights(hf_dir, cfg.model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), cfg.model.seq_len, cfg.train.global_batch,
                         cfg.train.seed, cfg.data.val_fraction, cfg.model.vocab_size)
    x, y = loader.global_batch_at(1)
    with torch.no_grad():
        theirs = hf(x).logits
        assert (model.eval()(x) - theirs).abs().max() <= TOL
        loss = torch.nn.functional.cross_entropy(theirs.flatten(0, 1).double(), y.flatten()).item()
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--init-from", str(hf_dir), *_sets(overrides)]) == 0
    capsys.readouterr()
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and abs(first["loss"] - loss) <= 1e-5 * loss


def test_bad_hugging_face_directories_exit_2_before_training(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    _hf_model("gpt2", hf_dir)
    capsys.readouterr()
    cases = []
    for name, change, fragment in [
        ("bert", lambda c: {**c, "model_type": "bert", "architectures": ["BertModel"]}, "model_type 'bert'"),
        ("dims", lambda c: {**c, "n_embd": 48}, "n_embd 48 vs model.d_model 32"),
        ("tanh", lambda c: {**c, "activation_function": "gelu_new"}, "activation_function 'gelu_new'"),
    ]:
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
        (d / "config.json").write_text(json.dumps(change(json.loads((hf_dir / "config.json").read_text()))))
        cases.append((d, fragment))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((hf_dir / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    cases += [(pickled, "only pickled .bin weights"), (tmp_path / "missing", "is not a directory")]
    sets = _sets({**GPT2, "train.steps": 1})
    for d, fragment in cases:
        out = tmp_path / f"run-{d.name}"
        code = main(["train", "--out", str(out), "--init-from", str(d), *sets])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and fragment in err, (d.name, err)
        assert not (out / "checkpoints").exists()
    out = tmp_path / "run-reversible"  # half-width reversible blocks have no Hugging Face counterpart
    code = main(["train", "--out", str(out), "--init-from", str(hf_dir), *sets, "--set", "model.reversible=true"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "model.reversible=true" in err, err
    assert not (out / "checkpoints").exists()
