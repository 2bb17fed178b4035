"""A plain decoder-only GPT (Radford et al. 2019, GPT-2; Vaswani et al., arXiv 1706.03762).

Token + learned position embeddings (RoPE, arXiv 2104.09864, with Llama 3's base and scaling as options:
model/rope.py), pre-norm blocks (LayerNorm, or RMSNorm as an option: model/norm.py), causal self-attention through
`scaled_dot_product_attention` (grouped-query, arXiv 2305.13245, as an option), GELU MLP (tanh-approximated GELU or
SwiGLU, arXiv 2002.05202, as options), optional weight tying. The Llama / Mistral / Qwen2 families are these options
together (interop/hf.py). There is no distributed code here: parallelism
is applied by passes in `scaletrain.parallel` that swap or wrap these modules by name.

Shapes: B batch, T sequence, C = d_model, nh heads, hs = C / nh head size, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.config import ModelConfig
from scaletrain.config.sizes import ffn_size
from scaletrain.model.block import Block, make_dropout
from scaletrain.model.dropout import DropoutContext, name_sites
from scaletrain.model.init import gpt_rules, init_parameters, no_normal_init
from scaletrain.model.norm import make_norm
from scaletrain.model.reversible import ReversibleBlock
from scaletrain.model.rope import model_rope_tables


def make_block(cfg: ModelConfig, layer: int, context: DropoutContext) -> nn.Module:
    """Block `layer`: the standard one, or with `model.reversible` a reversible block (model/reversible.py: a
    different architecture whose backward rebuilds activations instead of storing them)."""
    if cfg.reversible:
        return ReversibleBlock(cfg, layer, context)
    return Block(cfg, layer, context)


def block_width(cfg: ModelConfig) -> int:
    """Width of the blocks' attention and MLP: d_model, or d_model / 2 for reversible blocks (each acts on half
    of the stream)."""
    return cfg.d_model // 2 if cfg.reversible else cfg.d_model


def head_size(cfg: ModelConfig) -> int:
    return block_width(cfg) // cfg.n_heads


def rope_for(cfg: ModelConfig, T: int, device: torch.device,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The RoPE tables (cos, sin) of positions 0..T-1, or of the global `positions` (context parallelism), for the
    blocks' heads (model.rope_theta and model.rope_scaling, model/rope.py), on `device`; None with learned positions.
    The whole model and a pipeline stage compute them alike."""
    if cfg.position != "rope":
        return None
    cos, sin = model_rope_tables(cfg, T, head_size(cfg), positions)
    return cos.to(device), sin.to(device)


def share_block_weights(blocks: nn.ModuleList) -> None:
    """WideNet / ALBERT sharing (arXiv 2107.11817, 1909.11942): every block's attention and MLP become block 0's
    modules (one parameter each, its gradient summed over the layers by autograd); each block keeps its norms."""
    for block in list(blocks)[1:]:
        block.attn = blocks[0].attn
        block.mlp = blocks[0].mlp


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.position == "learned" else None
        context = DropoutContext()  # shared by all dropout sites: the engine sets (step, row) per micro-batch
        self.drop = make_dropout(cfg, context, ("seq", "feature"))
        self.blocks = nn.ModuleList(make_block(cfg, i, context) for i in range(cfg.n_layers))
        if cfg.share_blocks:
            share_block_weights(self.blocks)
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        name_sites(self)  # each dropout's site is its name in this plain model, whatever a pass does later
        # The global position of each input column (None: 0..T-1). Context parallelism gives a rank some positions
        # of every sequence and sets them here, so learned positions and RoPE see global indices.
        self.positions: torch.Tensor | None = None

    def token_positions(self, T: int, device: torch.device) -> torch.Tensor:
        """Positions of the T input columns: `positions`, or 0..T-1."""
        return torch.arange(T, device=device) if self.positions is None else self.positions.to(device)

    def rope(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        return rope_for(self.cfg, T, device, self.positions)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, V)."""
        B, T = idx.shape
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(self.token_positions(T, idx.device))
        x = self.drop(x)
        rope = self.rope(T, idx.device)
        for block in self.blocks:
            x = block(x, rope)
        return self.lm_head(self.ln_f(x))


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, in fp32 or wider. The trainer divides by the global token count."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def model_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token, 6N plus attention 6·L·T·C (forward+backward; Kaplan arXiv 2001.08361); the
    blocks' C is `block_width` (d_model / 2 for reversible blocks, whose recomputation is not counted)."""
    w = block_width(cfg)
    ff = ffn_size(dataclasses.replace(cfg, d_model=w))
    mats = 4 * w**2 + (3 if cfg.mlp == "swiglu" else 2) * w * ff
    n = cfg.n_layers * mats + cfg.d_model * cfg.vocab_size  # matmul parameters incl. the head
    return 6 * n + 6 * cfg.n_layers * cfg.seq_len * w


def gpt_on_meta(cfg: ModelConfig) -> GPT:
    """The plain GPT on the meta device: shapes only, no values (not even initial ones: `no_normal_init`)."""
    with torch.device("meta"), no_normal_init():
        return GPT(cfg)


def build_gpt(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> GPT:
    """Build the plain GPT on the meta device, materialise it on `device` and initialise it (model/init.py)."""
    model = gpt_on_meta(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    model.to(dtype)
    init_parameters(model, seed, gpt_rules(cfg.n_layers, cfg.moe.switch_init_scale))
    return model
