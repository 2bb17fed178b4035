"""Our Llama-family model (grouped-query attention, arXiv 2305.13245; Llama 3.1 RoPE scaling) against transformers'
own `LlamaForCausalLM` with the same weights, and what grouped-query attention costs or saves in our model (issue 27).

Side by side in one process, alternated and repeated (median and range):
1. forward + backward of the mean token cross-entropy on the same (batch, seq) tokens: scaletrain's GPT imported from
   a transformers Llama directory (`interop/hf.py`) vs that transformers model (`attn_implementation="sdpa"`);
   both first checked to give the same loss;
2. our model with n_kv_heads = n_heads (fused qkv) vs n_kv_heads < n_heads: step time, parameters, and the bytes
   saved for backward (measured with saved_tensors_hooks, distinct storages, as the trainer counts them).

    .venv/bin/python benchmarks/bench_attention_variants.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _hf_llama(directory: Path, args) -> torch.nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.d_model, intermediate_size=args.d_ff, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq * 2,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": args.seq // 2},
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(directory)
    return model.train()


def _ours(directory: Path, overrides: list[str] | None = None) -> tuple[torch.nn.Module, object]:
    from scaletrain.config import validate
    from scaletrain.config.load import load_config_keys
    from scaletrain.interop.hf import read_hf_weights
    from scaletrain.interop.hf_config import apply_hf_model
    from scaletrain.model import build_gpt

    cfg, explicit = load_config_keys(None, overrides or [])
    apply_hf_model(cfg, explicit, directory)
    cfg = validate(cfg)
    model = build_gpt(cfg.model, 0, "cpu", torch.float32)
    weights = read_hf_weights(directory, cfg.model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model.train(), cfg


def _step(model, x, y, hf: bool) -> float:
    out = model(x)
    logits = out.logits if hf else out
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def _time(model, x, y, hf: bool, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        _step(model, x, y, hf)
    return (time.perf_counter() - t0) / iters


def _saved_bytes(model, x) -> int:
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def _table(title: str, rows: dict[str, list[float]], base: str) -> None:
    print(f"\n{title}")
    print("| | ms per step | ratio to " + base + " |\n|---|---|---|")
    ref = statistics.median(rows[base])
    for k, v in rows.items():
        print(f"| {k} | {1e3 * statistics.median(v):.1f} ({1e3 * min(v):.1f}-{1e3 * max(v):.1f}) | "
              f"{statistics.median(v) / ref:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=3, help="steps per timed block")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=704)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(1)
    x = torch.randint(0, 256, (args.batch, args.seq))
    y = torch.randint(0, 256, (args.batch, args.seq))
    with tempfile.TemporaryDirectory() as tmp:
        hf = _hf_llama(Path(tmp), args)
        ours, cfg = _ours(Path(tmp), [f"model.seq_len={args.seq}"])
        a, b = _step(ours, x, y, False), _step(hf, x, y, True)
        print(f"Llama-shaped model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
              f"{args.kv_heads} kv heads, seq {args.seq}, batch {args.batch}, fp32, {torch.get_num_threads()} threads;"
              f" first loss ours {a:.6f}, transformers {b:.6f}")
        times = {"scaletrain": [], "transformers": []}
        for r in range(args.repeats):
            for name in (("scaletrain", "transformers") if r % 2 == 0 else ("transformers", "scaletrain")):
                times[name].append(_time(ours if name == "scaletrain" else hf, x, y, name != "scaletrain", args.iters))
        _table(f"forward + backward, median of {args.repeats} alternated blocks of {args.iters} (range):", times,
               "transformers")

    from dataclasses import replace

    from scaletrain.model import build_gpt

    variants = {f"n_kv_heads={args.heads} (multi-head)": replace(cfg.model, n_kv_heads=0),
                f"n_kv_heads={args.kv_heads}": cfg.model,
                "n_kv_heads=1 (multi-query)": replace(cfg.model, n_kv_heads=1)}
    models = {k: build_gpt(m, 0, "cpu", torch.float32).train() for k, m in variants.items()}
    times = {k: [] for k in models}
    for r in range(args.repeats):
        for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
            times[k].append(_time(models[k], x, y, False, args.iters))
    _table(f"scaletrain, grouped-query attention against multi-head, median of {args.repeats} alternated blocks:",
           times, list(models)[0])
    print("\n| | parameters | bytes saved for backward |\n|---|---|---|")
    for k, m in models.items():
        print(f"| {k} | {sum(p.numel() for p in m.parameters()):,} | {_saved_bytes(m, x):,} |")


if __name__ == "__main__":
    main()
