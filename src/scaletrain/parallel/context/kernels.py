"""Attention on one block of queries and keys, returning what an exact combination over blocks needs: the block's
output and the log-sum-exp of its scores, and the block's backward given the *combined* output and log-sum-exp.

Online softmax (Milakov & Gimelshein, arXiv 1805.02867; the blockwise form of FlashAttention, Dao et al., arXiv
2205.14135, that ring attention distributes, Liu et al., arXiv 2310.01889): a query's softmax over all keys is
recovered from blocks j by lse = logsumexp_j(lse_j) and out = sum_j exp(lse_j - lse) out_j (`merge_`). Backward per
block uses the global lse and out: P = exp(S - lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ out)), dQ = dS K s,
dK = dSᵀ Q s (s the softmax scale) — FlashAttention's backward, whose sum over blocks is the exact gradient.

Two kernels: on CPU without dropout torch's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and
its backward, which return and take the log-sum-exp: no s x s scores are stored); otherwise the explicit form in
fp32 or wider, which also applies a layout-independent dropout mask to the probabilities (`BlockDropout`: the
mask of element (row, head, query, key) is a hash of its global indices, model/dropout.py, so every layout drops
what one process drops). Grouped-query attention: key/value heads are repeated to the query heads for the block
(`expand_kv`) and their gradients summed back (`reduce_kv`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from scaletrain.model.dropout import keep_mask


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, h_kv, T, d) -> (B, heads, T, d): query head i reads key/value head i // (heads / h_kv) (GQA)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def reduce_kv(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `expand_kv`: sum each group of repeated heads."""
    B, h, T, d = g.shape
    return g if h == kv_heads else g.view(B, kv_heads, h // kv_heads, T, d).sum(2)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of outputs, log-sum-exps and gradients: fp32, or fp64 for fp64 runs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class BlockDropout:
    """Dropout of attention probabilities with global indices: p, the mask's key, the micro-batch's first global row,
    the global head offset and count, and the sequence length (`model.dropout.GlobalDropout` numbering)."""

    p: float
    key: int
    row: int
    head0: int
    heads: int
    seq_len: int

    def scale_mask(self, B: int, h: int, qpos: torch.Tensor, kpos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, h, Tq, Tk) mask / (1 - p) for queries at global positions `qpos` and keys at `kpos`."""
        dev = qpos.device
        rows = torch.arange(B, device=dev, dtype=torch.int64) + self.row
        heads = torch.arange(h, device=dev, dtype=torch.int64) + self.head0
        index = rows.view(B, 1, 1, 1) * self.heads + heads.view(1, h, 1, 1)
        index = (index * self.seq_len + qpos.view(1, 1, -1, 1)) * self.seq_len + kpos.view(1, 1, 1, -1)
        return keep_mask(index, self.key, self.p).to(dtype) * (1.0 / (1.0 - self.p))


def _fused(q: torch.Tensor, drop: BlockDropout | None) -> bool:
    return q.device.type == "cpu" and drop is None


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  drop: BlockDropout | None = None, qpos: torch.Tensor | None = None,
                  kpos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, h, Tq, d) in q's dtype, lse (B, h, Tq) in `acc_dtype`) of softmax(q kᵀ s + causal mask) v for one
    block; k and v may have fewer (kv) heads. `causal` masks key j > query i (blocks with Tq == Tk on the diagonal).
    With `drop`, the probabilities are dropped with the mask of global positions `qpos` x `kpos`."""
    h = q.shape[1]
    k, v = expand_kv(k, h), expand_kv(v, h)
    if _fused(q, drop):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(acc_dtype(q.dtype))
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale  # (B, h, Tq, Tk)
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if drop is not None:
        p = p * drop.scale_mask(q.shape[0], h, qpos, kpos, acc)
    return torch.matmul(p, v.to(acc)).to(q.dtype), lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float, drop: BlockDropout | None = None,
                   qpos: torch.Tensor | None = None,
                   kpos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block's contribution, in `acc_dtype`, from the combined `out` and `lse` of its queries;
    dk and dv have k's (kv) heads."""
    h, hkv = q.shape[1], k.shape[1]
    ke, ve = expand_kv(k, h), expand_kv(v, h)
    acc = acc_dtype(q.dtype)
    if _fused(q, drop):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse.to(_lse_dtype(q.dtype)), 0.0, causal, scale=scale)
        return dq.to(acc), reduce_kv(dk.to(acc), hkv), reduce_kv(dv.to(acc), hkv)
    qa, ka, va, da = q.to(acc), ke.to(acc), ve.to(acc), dout.to(acc)
    s = torch.matmul(qa, ka.transpose(-2, -1)) * scale
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))  # the globally normalised probabilities of this block
    dp = torch.matmul(da, va.transpose(-2, -1))
    if drop is not None:
        mask = drop.scale_mask(q.shape[0], h, qpos, kpos, acc)
        dv = torch.matmul((p * mask).transpose(-2, -1), da)
        dp = dp * mask
    else:
        dv = torch.matmul(p.transpose(-2, -1), da)
    delta = (da * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO ∘ O) of the combined output
    ds = p * (dp - delta)
    dq = torch.matmul(ds, ka) * scale
    dk = torch.matmul(ds.transpose(-2, -1), qa) * scale
    return dq, reduce_kv(dk, hkv), reduce_kv(dv, hkv)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp dtype torch's CPU flash kernel returns and expects: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: combine a block's (out, lse) into the running (out, lse) of the same queries (online softmax)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def default_scale(head_dim: int) -> float:
    """1 / sqrt(head size), the softmax scale of scaled dot-product attention."""
    return 1.0 / math.sqrt(head_dim)
