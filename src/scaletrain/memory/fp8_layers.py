"""Which linear layers `train.precision=fp8` runs in float8: the stated rule, the user's filter (`train.fp8_layers`) and
why everything else stays in bf16/fp32.

The rule (as torchtitan's and Megatron-core's FP8 recipes draw it; FP8 formats: Micikevicius et al., arXiv 2209.05433):
the linear layers of the transformer blocks convert — attention's fused q/k/v projection and output projection, the
MLP's layers (`fc`, `proj`; SwiGLU's `gate`, `up`, `proj`) — since they hold nearly all of a model's GEMM FLOPs.
`EXCLUDED` lists what never converts, each with its reason. The filter then picks among the blocks' layers by name
(`blocks.3.mlp.fc`): a comma list of patterns where `*` matches anything and `!pattern` excludes.

Torch-free: validate() (memory/rules.py), `scaletrain plan --config` and the run report read it; the pass
(parallel/fp8.py) converts exactly `fp8_layer_names(cfg)`'s layers of each rank's blocks and checks that it did.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from scaletrain.config.sizes import kv_heads

EXCLUDED = {
    "embeddings (wte, wpe)": "a table lookup, not a GEMM: there is nothing to compute in FP8",
    "output layer (lm_head)": "its logits feed the softmax cross-entropy over the whole vocabulary, the GEMM most "
                              "sensitive to quantization error (and with tied embeddings its weight is the embedding "
                              "table); torchtitan's and Megatron-core's FP8 recipes keep it in bf16",
    "norms (ln1, ln2, ln_f)": "element-wise statistics, not GEMMs; they compute in fp32",
    "attention's q kᵀ, softmax and p v": "they run inside scaled_dot_product_attention in bf16 with the softmax "
                                          "statistics in fp32; torchao's float8 training converts linear layers only",
}
"""What never runs in FP8, and why (docs/precision.md prints this table)."""


def block_linear_names(model: Any) -> tuple[str, ...]:
    """The linear layers of one dense transformer block (model/block.py), by their name inside the block."""
    mlp = ("mlp.gate", "mlp.up", "mlp.proj") if model.mlp == "swiglu" else ("mlp.fc", "mlp.proj")
    # grouped-query attention projects queries and key/values apart (model/block.py)
    attn = ("attn.qkv",) if kv_heads(model) == model.n_heads else ("attn.q", "attn.kv")
    return (*attn, "attn.proj", *mlp)


def candidate_names(model: Any) -> list[str]:
    """Every linear layer the rule allows to convert: each block's, by its name in the plain model."""
    return [f"blocks.{i}.{rel}" for i in range(model.n_layers) for rel in block_linear_names(model)]


def parse_filter(text: str) -> tuple[list[str], list[str]]:
    """`train.fp8_layers` -> (include patterns, exclude patterns); an empty item is an error (ValueError)."""
    items = [s.strip() for s in str(text).split(",")]
    if not items or any(not s or s == "!" for s in items):
        raise ValueError(f"train.fp8_layers must be a comma list of name patterns such as blocks.* or "
                         f"blocks.*,!blocks.0.*, got {text!r}")
    include = [s for s in items if not s.startswith("!")]
    exclude = [s[1:] for s in items if s.startswith("!")]
    return include or ["blocks.*"], exclude


def select(names: list[str], text: str) -> list[str]:
    """The names the filter keeps: matched by an include pattern and by no exclude pattern."""
    include, exclude = parse_filter(text)
    return [n for n in names if any(fnmatchcase(n, p) for p in include) and not any(fnmatchcase(n, p) for p in exclude)]


def fp8_layer_names(model: Any, train: Any) -> list[str]:
    """The linear layers a run computes in FP8 (empty unless train.precision=fp8), from its model and train configs."""
    if train.precision != "fp8":
        return []
    return select(candidate_names(model), train.fp8_layers)


def filter_errors(model: Any, train: Any) -> list[str]:
    """Why `train.fp8_layers` is unusable: malformed, a pattern that matches no block linear layer (a typo, or a
    layer the rule never converts), or nothing selected at all."""
    text = train.fp8_layers
    try:
        include, exclude = parse_filter(text)
    except ValueError as e:
        return [str(e)]
    names = candidate_names(model)
    rels = ", ".join(block_linear_names(model))
    errors = []
    for p in include + exclude:
        if not any(fnmatchcase(n, p) for n in names):
            errors.append(f"train.fp8_layers pattern {p!r} matches no linear layer of the blocks (FP8 converts "
                          f"blocks.<0..{model.n_layers - 1}>.<{rels}>; the embeddings, output layer, norms "
                          "and attention stay bf16/fp32, docs/precision.md)")
    if not errors and not select(names, text):
        errors.append(f"train.fp8_layers={text} selects no layer: every block linear layer is excluded")
    return errors


def describe(names: list[str], model: Any) -> str:
    """A short line naming `names`: `blocks 0-5: attn.qkv, attn.proj, mlp.fc, mlp.proj` when every block converts
    the same layers, else the names themselves."""
    if not names:
        return "none"
    by_block: dict[int, list[str]] = {}
    for n in names:
        _, i, rel = n.split(".", 2)
        by_block.setdefault(int(i), []).append(rel)
    kinds = {tuple(v) for v in by_block.values()}
    blocks = sorted(by_block)
    if len(kinds) == 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
        span = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
        return f"{len(names)} linear layers, {span}: {', '.join(next(iter(kinds)))}"
    return f"{len(names)} linear layers: {', '.join(names)}"
