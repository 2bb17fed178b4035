"""Parameter counts of a model, in total, active per token and per rank of a layout.

Exact from the dimensions: the form of Narayanan et al. (Megatron-LM 2021, arXiv 2104.04473) eq. 2,
P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)), generalised to SwiGLU, grouped-query attention (arXiv 2305.13245; its
key/value projection split over at most n_kv_heads tp ranks), query/key/value biases (Qwen2), untied heads,
bias-free norms and experts (GShard arXiv 2006.16668, Switch arXiv 2101.03961: E bias-free expert MLPs per
MoE layer, k active plus the router); split over tp (Megatron-LM, arXiv 1909.08053), pp stages and ep ranks.
Also the factored statistics Adafactor (arXiv 1804.04235) and SM3 (arXiv 1901.11150) keep per parameter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from scaletrain.plan.analytic.inputs import Layout
from scaletrain.plan.catalog import ModelSpec


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    position: int
    layer_tp: float
    """Per layer, split over tp: attention and dense-MLP matrices and column-parallel biases (grouped-query
    attention's key/value projections are `layer_kv`)."""
    layer_rep: float
    """Per layer, replicated over tp: norms, row-parallel biases, the router."""
    layer_expert: float
    """Per layer, all experts together (split over ep, replicated over tp as in our engine).

    The three per-layer counts are means over the layers when only every `moe_every`-th one is MoE."""
    final_norm: int
    head: int
    """Untied output projection (0 when tied to the embedding)."""
    tensors: int
    """Number of parameter tensors (AdamW keeps one `step` scalar per tensor)."""
    layer_kv: float = 0.0
    """Per layer, grouped-query attention's key/value projection (weight and bias): split over at most `kv_heads`
    tp ranks, each key/value head copied on tp / kv_heads ranks when tp is larger (parallel/tp_plan.py)."""
    kv_heads: int = 1

    @property
    def per_layer(self) -> int:
        return self.layer_tp + self.layer_kv + self.layer_rep + self.layer_expert

    def layer_per_rank(self, t: int, ep: int = 1) -> float:
        """Per layer on one rank of t tensor-parallel (and ep expert-parallel) ranks."""
        return self.layer_tp / t + self.layer_kv / min(t, self.kv_heads) + self.layer_rep + self.layer_expert / ep


@functools.lru_cache(maxsize=256)
def param_counts(m: ModelSpec) -> ParamCounts:
    d, h, f, b = m.d_model, m.width, m.ffn, int(m.bias)  # stream and block widths (h < d: reversible blocks)
    bq = int(m.bias or m.qkv_bias)  # biases of q, k and v
    kv = m.kv_heads * m.head_dim
    gqa = m.kv_heads != m.n_heads  # q and a fused kv projection (k, v), instead of the fused qkv
    kv_proj = (h * 2 * kv + bq * 2 * kv) if gqa else 0
    qkv = h * (h + 2 * kv) + bq * (h + 2 * kv) - kv_proj
    proj_w, proj_b = h * h, b * h
    norm = h * (1 + b)
    n_mats = 3 if m.mlp == "swiglu" else 2
    mlp_tp = n_mats * h * f + b * (n_mats - 1) * f  # column-parallel biases split with their matrix
    mlp_rep = b * h  # the down-projection bias
    tensors_attn = (1 + gqa) * (1 + bq) + (1 + b) + 2 * (1 + b)  # qkv (or q, kv), proj, ln1, ln2 (weight [+ bias])
    tensors_mlp = n_mats * (1 + b)
    L, Lm = m.n_layers, m.n_moe_layers
    dense = (qkv + proj_w + mlp_tp, proj_b + 2 * norm + mlp_rep, 0)
    # MoE block: attention as dense; router Linear(h, E, bias=False); E bias-free expert MLPs, stacked
    moe = (qkv + proj_w, proj_b + 2 * norm + h * router_outputs(m), m.n_experts * n_mats * h * f)
    layer_tp, layer_rep, layer_expert = (((L - Lm) * d + Lm * x) / L for d, x in zip(dense, moe))
    routers = 2 if m.expert_groups > 1 else 1
    tensors_layers = (L - Lm) * (tensors_attn + tensors_mlp) + Lm * (tensors_attn + n_mats + routers)
    position = m.seq_len * d if m.position == "learned" else 0
    head = 0 if m.tie_embeddings else m.vocab_size * d
    tensors = 1 + (position > 0) + tensors_layers + (1 + b) + (head > 0)
    return ParamCounts(m.vocab_size * d, position, layer_tp, layer_rep, layer_expert, d * (1 + b), head, tensors,
                       kv_proj, m.kv_heads)


def router_outputs(m: ModelSpec) -> int:
    """Outputs of an MoE layer's routers (their weights are h x this): E, or with the two-level hierarchical MoE
    (arXiv 1701.06538 appendix B) the primary gate's groups plus the E outputs of the stacked secondary gates."""
    return m.n_experts + (m.expert_groups if m.expert_groups > 1 else 0)


def total_params(m: ModelSpec) -> int:
    c = param_counts(m)
    layers = m.n_layers * c.per_layer
    if m.share_blocks:  # one copy of the (uniform: moe.every = 1 or dense) layer; every other layer adds its two norms
        layers = c.per_layer + (m.n_layers - 1) * 2 * m.width * (1 + int(m.bias))
    return int(round(c.embedding + c.position + layers + c.final_norm + c.head))


def expert_params(m: ModelSpec) -> int:
    """Parameters of one expert MLP (bias-free)."""
    return (3 if m.mlp == "swiglu" else 2) * m.width * m.ffn if m.n_experts else 0


def active_params(m: ModelSpec) -> int:
    """Parameters a token passes through: the dense part, the routers and k experts per MoE layer
    (k = top_k; expert choice: its expected c). Capacity padding is not a parameter (see FLOPs)."""
    if not m.n_experts:
        return total_params(m)
    return int(round(total_params(m) - m.n_moe_layers * (m.n_experts - m.top_k) * expert_params(m)))


@dataclass(frozen=True)
class StageParams:
    dense: float
    """Parameters on one rank that are replicated over the whole dp group."""
    expert: float
    """Expert parameters on one rank (replicated over dp / ep ranks only)."""

    @property
    def total(self) -> float:
        return self.dense + self.expert


def stage_params(m: ModelSpec, lay: Layout) -> tuple[StageParams, StageParams]:
    """Parameters held by one rank of the first and of the last pipeline stage."""
    c = param_counts(m)
    t, lps = lay.tp, m.n_layers / lay.pp
    layers = lps * (c.layer_per_rank(t) - c.layer_expert)
    expert = lps * c.layer_expert / lay.ep  # experts replicated over tp (docs/moe.md)
    emb = c.embedding / t  # vocabulary-parallel embedding
    first = layers + emb + c.position
    if lay.pp == 1:
        return (StageParams(first + c.final_norm + c.head / t, expert),) * 2
    # The last stage holds the output projection; a tied one is a copy of the embedding (Megatron).
    last = layers + c.final_norm + (c.head / t if c.head else emb)
    return StageParams(first, expert), StageParams(last, expert)


OPTIMIZERS = ("adamw", "adafactor", "sm3")


def factored_statistics(m: ModelSpec) -> float:
    """Numbers Adafactor / SM3 keep per parameter for their factored statistics: rows + columns of every
    matrix (an n x m matrix keeps n + m, not n·m) over the model's elements, weighted like the parameters.
    Our engine keeps them whole on every rank under ZeRO (`parallel/zero_factored.py`); they are tiny
    (about 2/d_model of the parameters)."""
    d, h, f, kv = m.d_model, m.width, m.ffn, m.kv_heads * m.head_dim
    n_mats = 3 if m.mlp == "swiglu" else 2
    layer = (h + h + 2 * kv) + 2 * h + n_mats * (h + f)
    position = m.seq_len + d if m.position == "learned" else 0
    rows_cols = m.n_layers * layer + (m.vocab_size + d) * (1 + (not m.tie_embeddings)) + position
    return rows_cols / total_params(m)


@functools.lru_cache(maxsize=256)
def block_kinds(m: ModelSpec) -> tuple[ModelSpec, ModelSpec]:
    """The model with only dense blocks and with only MoE blocks: the per-block numbers of each kind."""
    if not m.n_experts:
        return m, m
    return replace(m, n_experts=0), replace(m, moe_every=1)


def layer_kind_counts(m: ModelSpec, moe: bool) -> tuple[float, float, float]:
    """(split over tp, replicated over tp, experts) parameters of one dense block, or of one MoE block."""
    c = param_counts(block_kinds(m)[moe])
    return c.layer_tp, c.layer_rep, c.layer_expert
