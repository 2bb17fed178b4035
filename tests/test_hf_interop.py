"""Hugging Face round trips against the real `transformers` (tiny random models built locally, nothing downloaded).

- Families: GPT-2 (`gelu_new`, the tanh GELU of every GPT-2 checkpoint), Llama with grouped-query attention (2 of 4
  heads), RoPE base 500000 and `rope_type: llama3` scaling, Qwen2 (q/k/v biases, multi-query attention, tied
  embeddings) and Mistral (GQA, sliding_window null). For each: `train --init-from DIR` with no model key given
  takes every model value from DIR/config.json; our model's logits equal theirs (fp32, 1e-5) and our greedy decoding
  generates what `generate(do_sample=False)` generates; the first training step's loss is the HF model's loss on
  that batch (1e-5 relative); `export --format hf` writes a directory `AutoModelForCausalLM` loads (Mistral as
  LlamaForCausalLM, the same computation) whose logits equal the trained checkpoint's (1e-5) and whose greedy
  `generate` equals `scaletrain sample --temperature 0` for three prompts.
- Export of natively trained models (GPT-2 and Llama shapes, multi-head, exact GELU): the same logits and greedy
  text checks.
- An imported model trains under dp2, tp2 (Llama: 2 kv heads split over 2 ranks; Qwen2: its one kv head copied on
  both, with sequence parallelism) and pp2 exactly as a plain single-process loop on the same weights (fp64, torch's
  AdamW; losses and every final parameter within 1e-9 relative); that loop in turn equals transformers' own model
  trained the same way (losses 1e-8 relative, measured <= 1.4e-9; parameters 2e-5 of each tensor's largest value,
  measured <= 2.3e-6: transformers computes RoPE's angles in float32).
- Bad input (an unsupported model type, field or value, weights whose shapes disagree with config.json, a --set
  contradicting config.json, n_kv_heads not dividing n_heads, a RoPE type we do not implement, sliding windows,
  MoE checkpoints, pickled weights, a missing folder, a preset or reversible blocks with --init-from): one line,
  exit 2, before any training, an existing run folder untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from harness import TINY, run_ranks

from scaletrain.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _tf():
    """transformers, imported when a test needs it (not by the ranks of the multi-process test, which import this
    module to find their function)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


TOL = 1e-5
PROMPTS = ("def ", "import numpy as", "class Foo(")
GPT2 = {**TINY, "train.dtype": "fp32", "train.steps": 2, "train.checkpoint_every": 2, "train.report": False}
LLAMA = {**GPT2, "model.position": "rope", "model.mlp": "swiglu", "model.norm": "rmsnorm", "model.bias": False,
         "model.tie_embeddings": False}
# --init-from: only training choices (model.seq_len is one); every other model key comes from config.json
RUN = {"model.seq_len": 32, "train.steps": 1, "train.global_batch": 8, "train.micro_batch": 2, "train.warmup_steps": 1,
       "train.eval_every": 0, "train.dtype": "fp32", "train.lr": 1e-4, "train.report": False}
NO_TOKENS = dict(vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # < 32 positions: every band of frequencies is changed
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
FAMILIES = {  # name: (the architecture the export loads as, its config)
    "gpt2": ("GPT2LMHeadModel", lambda: _tf().GPT2Config(
        n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new", **NO_TOKENS)),
    "llama": ("LlamaForCausalLM", lambda: _tf().LlamaConfig(
        **SMALL, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=LLAMA3, **NO_TOKENS)),
    "qwen2": ("Qwen2ForCausalLM", lambda: _tf().Qwen2Config(
        **SMALL, num_key_value_heads=1, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6, **NO_TOKENS)),
    "mistral": ("LlamaForCausalLM", lambda: _tf().MistralConfig(
        **SMALL, num_key_value_heads=2, head_dim=8, sliding_window=None, rms_norm_eps=1e-5, rope_theta=1e6,
        **NO_TOKENS)),
}


def _sets(overrides: dict) -> list[str]:
    return [x for k, v in overrides.items() for x in ("--set", f"{k}={v}")]


def _save_tiny(config, directory: Path):
    """A random transformers model of `config`, its norms and biases moved off 1 and 0 (a wrong mapping shows),
    saved with save_pretrained."""
    torch.manual_seed(0)
    model = _tf().AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model.eval()


def _imported_config(directory: Path, overrides: dict):
    """The config `train --init-from DIR` resolves (commands/train.py: the model from config.json, then validate)."""
    from scaletrain.config import validate
    from scaletrain.config.load import load_config_keys
    from scaletrain.interop.hf_config import apply_hf_model

    cfg, explicit = load_config_keys(None, [f"{k}={v}" for k, v in overrides.items()])
    apply_hf_model(cfg, explicit, directory)
    return validate(cfg)


def _imported_model(directory: Path, cfg, dtype=torch.float32):
    from scaletrain.interop.hf import read_hf_weights
    from scaletrain.model import build_gpt

    model = build_gpt(cfg.model, cfg.train.seed, "cpu", dtype)
    weights = read_hf_weights(directory, cfg.model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def _our_logits(directory: Path, x: torch.Tensor) -> torch.Tensor:
    from scaletrain.train.checkpoint import find_checkpoint
    from scaletrain.train.sample import load_model

    _, model = load_model(find_checkpoint(directory, note=False))
    with torch.no_grad():
        return model(x)


def _greedy_matches_sample(run: Path, hf, capsys) -> None:
    """`scaletrain sample --temperature 0` on the run equals the HF model's greedy `generate` for every prompt, and
    the continuations depend on the prompt (the comparison means something)."""
    continuations = set()
    for prompt in PROMPTS:
        assert main(["sample", "--out", str(run), "--prompt", prompt, "--tokens", "12", "--temperature", "0"]) == 0
        text = capsys.readouterr().out.rstrip("\n")
        gen = hf.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert bytes(gen[0].tolist()).decode("utf-8", errors="replace") == text, prompt
        continuations.add(text[len(prompt):])
    assert len(continuations) >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_hugging_face_model_imports_trains_exports_and_generates_alike(family, tmp_path, capsys):
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.train.sample import generate

    arch, make = FAMILIES[family]
    hf_dir, run, exported = tmp_path / "hf", tmp_path / "run", tmp_path / "exported"
    hf = _save_tiny(make(), hf_dir)
    cfg = _imported_config(hf_dir, RUN)
    model = _imported_model(hf_dir, cfg).eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() <= TOL
    for prompt in PROMPTS[:2]:  # the imported model decodes greedily what transformers does
        ids = torch.tensor([list(prompt.encode())])
        ours = generate(model, ids, 12, cfg, 0.0, 50, torch.Generator())
        assert torch.equal(ours, hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)), prompt

    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), 32, 8, cfg.train.seed,
                         cfg.data.val_fraction, 256)
    xb, yb = loader.global_batch_at(1)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(hf(xb).logits.flatten(0, 1).double(), yb.flatten()).item()
    assert main(["train", "--out", str(run), "--init-from", str(hf_dir), *_sets(RUN)]) == 0
    capsys.readouterr()
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and abs(first["loss"] - loss) <= 1e-5 * loss
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]  # config.json's values, seq_len ours
    assert {k: saved[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "rope_theta", "qkv_bias", "seq_len",
                                  "activation", "tie_embeddings")} == \
        {k: getattr(cfg.model, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "rope_theta", "qkv_bias",
                                            "seq_len", "activation", "tie_embeddings")}

    assert main(["export", str(run), "--format", "hf", "--to", str(exported)]) == 0
    assert arch in capsys.readouterr().out
    back = _tf().AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(back).__name__ == arch
    with torch.no_grad():
        assert (_our_logits(run, x) - back(x).logits).abs().max() <= TOL
    _greedy_matches_sample(run, back, capsys)


@pytest.mark.parametrize("name, overrides, arch", [("gpt2", GPT2, "GPT2LMHeadModel"),
                                                   ("llama", LLAMA, "LlamaForCausalLM")])
def test_export_loads_in_transformers_with_our_logits_and_greedy_text(name, overrides, arch, tmp_path, capsys):
    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--out", str(run), *_sets({**overrides, "train.steps": 1})]) == 0
    assert main(["export", str(run), "--format", "hf", "--to", str(hf_dir)]) == 0
    assert arch in capsys.readouterr().out
    assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                        "tokenizer_config.json"]  # the byte tokenizer (issue 28)
    assert _tf().AutoTokenizer.from_pretrained(hf_dir)("def ")["input_ids"] == list(b"def ")
    from scaletrain.config import load_config
    from scaletrain.data.tokenizer import folder_tokenizer, load_tokenizer

    data = load_config(None, [], base=folder_tokenizer(hf_dir)).data  # what `train --init-from` the export reads
    assert load_tokenizer(data.tokenizer, data.eot_token).eot_id == 0  # documents still end with NUL
    hf = _tf().AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf).__name__ == arch
    x = torch.randint(0, 256, (2, TINY["model.seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (_our_logits(run, x) - hf(x).logits).abs().max() <= TOL
    _greedy_matches_sample(run, hf, capsys)


# --------------------------------------------------------------------------- an imported model under layouts

STEPS = {"model.seq_len": 32, "train.steps": 4, "train.global_batch": 8, "train.micro_batch": 2,
         "train.warmup_steps": 2, "train.eval_every": 0, "train.dtype": "fp64", "train.lr": 3e-3,
         "train.report": False, "train.checkpoint_every": 0}
LAYOUTS = [("llama", {"parallel.dp": 2}), ("llama", {"parallel.tp": 2}), ("llama", {"parallel.pp": 2}),
           ("qwen2", {"parallel.tp": 2, "parallel.sequence_parallel": True})]


def _layout_rank(rank: int, world: int, jobs: list) -> list:
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for hf_dir, overrides, run in jobs:
        trainer = Trainer(_imported_config(hf_dir, overrides), run, DistEnv(rank, world, 0, "test"), init_from=hf_dir)
        losses = trainer.run().losses
        state = trainer.full_state()
        out.append((losses, state if rank == 0 else None))
    return out


def _plain_loop(model, cfg, logits_of) -> list[float]:
    """Train `model` in place as the paper's recipe says, independently of the engine: the loader's global batch of
    every step at once, mean token cross-entropy, clipping by the global norm, torch's AdamW (decay on matrices),
    the run's learning-rate schedule."""
    from scaletrain.data import BatchLoader, load_tokens
    from scaletrain.train.schedule import lr_at

    t, o = cfg.train, cfg.optim
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), cfg.model.seq_len, t.global_batch, t.seed,
                         cfg.data.val_fraction, cfg.model.vocab_size)
    losses = []
    for step in range(1, t.steps + 1):
        x, y = loader.global_batch_at(step)
        loss = torch.nn.functional.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss.item())
        norm = torch.sqrt(sum(p.grad.square().sum() for p in params)).item()
        for p in params:
            p.grad.mul_(min(1.0, t.grad_clip / (norm + 1e-6)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        opt.zero_grad()
    return losses


def test_an_imported_model_trains_under_dp_tp_and_pp_as_one_process(tmp_path):
    from scaletrain.interop.hf import from_hf

    dirs = {}
    for family in ("llama", "qwen2"):
        dirs[family] = tmp_path / family
        _save_tiny(FAMILIES[family][1](), dirs[family])
    jobs = [(dirs[f], {**STEPS, **par}, tmp_path / f"run{i}") for i, (f, par) in enumerate(LAYOUTS)]
    runs = run_ranks(_layout_rank, 2, jobs, timeout=400)[0]
    for family, directory in dirs.items():
        cfg = _imported_config(directory, STEPS)
        ours = _imported_model(directory, cfg, torch.float64)
        losses = _plain_loop(ours, cfg, lambda m, x: m(x))
        state = {k: v.detach() for k, v in ours.state_dict().items()}
        hf = _tf().AutoModelForCausalLM.from_pretrained(directory).double()
        hf_losses = _plain_loop(hf, cfg, lambda m, x: m(x).logits)  # transformers' own model, the same recipe
        assert all(abs(a - b) <= 1e-8 * a for a, b in zip(losses, hf_losses)), (losses, hf_losses)
        theirs = from_hf(cfg.model, {k: v.detach() for k, v in hf.state_dict().items()}, family)
        for name, p in ours.named_parameters():
            assert (p.detach() - theirs[name]).abs().max() <= 2e-5 * p.detach().abs().max(), name
        for (f, par), (par_losses, par_state) in zip(LAYOUTS, runs):
            if f != family:
                continue
            assert list(par_losses) == list(range(1, 5))
            for step, loss in par_losses.items():
                assert abs(loss - losses[step - 1]) <= 1e-9 * losses[step - 1], (par, step)
            for name, value in state.items():
                torch.testing.assert_close(par_state[name], value, rtol=1e-9, atol=1e-12,
                                           msg=lambda m, n=name, p=par: f"{p} {n}: {m}")


# --------------------------------------------------------------------------- bad input


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_bad_hugging_face_directories_exit_2_and_leave_the_run_folder_alone(tmp_path, capsys):
    gpt2, llama = tmp_path / "gpt2", tmp_path / "llama"
    _save_tiny(FAMILIES["gpt2"][1](), gpt2)
    _save_tiny(FAMILIES["llama"][1](), llama)
    capsys.readouterr()
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    cases = [  # (directory, extra --set, fragment of the one-line message)
        (_edit_config(gpt2, tmp_path / "bert", model_type="bert", architectures=["BertModel"]), {},
         "model_type 'bert'"),
        (_edit_config(gpt2, tmp_path / "relu", activation_function="relu"), {}, "activation_function 'relu'"),
        (gpt2, {"model.d_model": 48}, "config.json has n_embd 32 but model.d_model=48 is set"),
        (llama, {"model.n_kv_heads": 4}, "num_key_value_heads 2 but model.n_kv_heads=4 is set"),
        (llama, {"model.seq_len": 128}, "model.seq_len (128) is above the 64 positions"),
        (_edit_config(llama, tmp_path / "yarn", rope_parameters=yarn, rope_scaling=None), {}, "rope_type 'yarn'"),
        (_edit_config(llama, tmp_path / "kv3", num_key_value_heads=3), {},
         "model.n_heads (4) is not divisible by model.n_kv_heads (3)"),
        (_edit_config(llama, tmp_path / "kv1", num_key_value_heads=1), {},
         "blocks.0.attn.kv.weight has shape (32, 32), but config.json's model needs (16, 32)"),
        (_edit_config(llama, tmp_path / "head_dim", head_dim=16), {}, "head_dim 16 x num_attention_heads 4"),
        (_edit_config(llama, tmp_path / "window", model_type="mistral", sliding_window=4096), {},
         "sliding_window 4096"),
        (_edit_config(llama, tmp_path / "experts", num_local_experts=8), {}, "num_local_experts 8"),
        (_edit_config(llama, tmp_path / "mixtral", model_type="mixtral"), {}, "model_type 'mixtral'"),
        (_edit_config(llama, tmp_path / "o_bias", attention_bias=True), {}, "attention_bias true is not supported"),
        (gpt2, {"model.preset": "gpt2"}, "model.preset=gpt2 with --init-from"),
        (gpt2, {"model.reversible": True}, "model.reversible=true"),
        (tmp_path / "missing", {}, "is not a directory"),
    ]
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((gpt2 / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    cases.append((pickled, {}, "only pickled .bin weights"))
    out = tmp_path / "existing-run"  # an existing run folder: nothing in it may change
    out.mkdir()
    (out / ".scaletrain-run").write_text("")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    train = {k: v for k, v in RUN.items() if k != "model.seq_len"}
    for directory, extra, fragment in cases:
        code = main(["train", "--out", str(out), "--init-from", str(directory), *_sets({**train, **extra})])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and fragment in err, (directory.name, extra, err)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before, directory.name


def test_a_model_without_a_hugging_face_twin_is_not_exported(tmp_path, capsys):
    run, to = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--out", str(run), *_sets({**GPT2, "train.steps": 1, "model.n_kv_heads": 2})]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "--format", "hf", "--to", str(to)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GPT-2 has no grouped-query attention" in err, err
    assert not to.exists()
