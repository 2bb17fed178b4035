"""FLOPs of a training step: model FLOPs (what MFU counts) and hardware FLOPs (what the GPUs execute).

Model FLOPs per step are 3 x forward; forward per token and layer 2 x (matmul parameters) + 4sh (attention scores
and values, the full s x s square as in Narayanan et al. arXiv 2104.04473 eq. 3 and Korthikanti et al. arXiv
2205.05198 App. A), logits 2Vh. Hardware FLOPs add the recomputed forward (full) or attention core (selective)
and, for mixture-of-experts layers (GShard arXiv 2006.16668, Switch arXiv 2101.03961), the empty capacity slots
(capacity_factor x k slots per token are computed; model FLOPs count k).
"""

from __future__ import annotations

import functools

from scaletrain.plan.analytic.inputs import Recompute, recompute_policy
from scaletrain.plan.analytic.params import router_outputs
from scaletrain.plan.catalog import ModelSpec


@functools.lru_cache(maxsize=1024)
def layer_matmul_flops(m: ModelSpec, padded: bool = True) -> tuple[float, float]:
    """Forward matmul FLOPs per token of the whole model's blocks: (split over tp: attention and dense
    MLPs, replicated over tp: routers and experts). An MoE layer's experts compute `expert_slots_per_token`
    rows per token when `padded` (capacity_factor x k: empty capacity slots are computed too, GShard /
    Switch), k rows otherwise (the useful work, for model FLOPs / MFU)."""
    h, f = m.width, m.ffn
    kv = m.kv_heads * m.head_dim
    attn_mats = h * (h + 2 * kv) + h * h
    mlp = (3 if m.mlp == "swiglu" else 2) * h * f
    L, Lm = m.n_layers, m.n_moe_layers
    rows = m.expert_slots_per_token if padded else m.top_k
    return 2.0 * (L * attn_mats + (L - Lm) * mlp), 2.0 * Lm * (mlp * rows + h * router_outputs(m))


def forward_flops_per_token(m: ModelSpec, padded: bool = True) -> tuple[float, float, float]:
    """(layer matmuls, attention core, logits) forward FLOPs per token for the whole model."""
    split, rep = layer_matmul_flops(m, padded)
    return split + rep, 4.0 * m.n_layers * m.seq_len * m.width, 2.0 * m.vocab_size * m.d_model


def attention_kept(pol: Recompute, attention: str) -> bool:
    """Whether `ops:<kinds>` keeps the attention core's outputs: the fused kernel's (`attention`, flash) or the
    unfused scores and their product with v, which are matmuls (`matmul`, standard attention)."""
    return pol.kind == "ops" and ("attention" if attention == "flash" else "matmul") in pol.ops


def step_flops(m: ModelSpec, tokens: float, pol: Recompute | str, attention: str = "flash") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one optimizer step over `tokens` tokens. Model FLOPs count the
    routed tokens' expert work (6 N_active per token plus attention); hardware FLOPs also the empty
    capacity slots and the recomputation of the checkpointing policy `pol`: the whole forward of the blocks it
    checkpoints (full, every:k, nth:k's 1/k), the matmuls and attention core the kept ops do not cover (ops:...),
    the attention core (attn-core); reversible blocks run every layer's forward again in backward."""
    pol = recompute_policy(pol) if isinstance(pol, str) else pol
    mats, attn, logits = forward_flops_per_token(m, padded=False)
    model = 3.0 * (mats + attn + logits) * tokens
    padded = forward_flops_per_token(m)[0]
    if pol.kind == "ops":
        extra = (0.0 if "matmul" in pol.ops else padded) + (0.0 if attention_kept(pol, attention) else attn)
    elif pol.kind == "nth":
        extra = (padded + attn) * sum(pol.checkpointed(i) for i in range(m.n_layers)) / m.n_layers
    else:
        extra = {"none": 0.0, "attn-core": attn}.get(pol.kind, padded + attn)
    extra += (padded + attn) * m.reversible
    return model, model + (3.0 * (padded - mats) + extra) * tokens
