"""Ring attention with causal load balancing (Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", arXiv 2310.01889).

Each of the n cp ranks keeps its queries and passes its key/value chunk around the ring: in step i rank r holds
the keys and values of rank (r - i) mod n, computes that block of attention and combines it with what it has by
online softmax (`kernels.merge_`), while the next chunk is already on its way (`comm.Ring.exchange` is posted before
the block is computed). After n steps every query has seen every key, exactly.

Load balancing (`layout.py`): rank r holds sequence chunks r and 2n-1-r of 2n. Against the keys of rank s the
causal mask leaves exactly one rectangle to compute: s = r, the local causal attention over its two chunks (the
diagonal block, in increasing global order, so the plain causal mask is right); s < r, every local query against
the first of s's chunks; s > r, the second local chunk's queries against both of s's chunks. Each is half of the
local queries x keys, so every rank computes the same amount in every step.

Backward passes the key/value chunks around the ring again, with their gradient accumulators travelling beside
them: the accumulator of rank s's keys collects each rank's contribution as it passes and arrives back at s after
n hops. Bytes per attention call and rank: forward (n-1) key/value chunks; backward (n-1) key/value chunks and n
accumulators (in fp32, fp64 for fp64 runs); `plan/analytic/context.py` predicts them.
"""

from __future__ import annotations

import torch

from scaletrain.parallel.context.comm import TAG_DKV, TAG_KV, Ring
from scaletrain.parallel.context.kernels import BlockDropout, acc_dtype, block_backward, block_forward, merge_


def _block(r: int, src: int, c: int) -> tuple[slice, slice, bool]:
    """(local queries, keys of rank `src`, causal) of the one rectangle the causal mask leaves (module docstring);
    c = tokens of one chunk."""
    if src == r:
        return slice(None), slice(None), True
    if src < r:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _ring_forward(q, kv, out, lse, ring: Ring, scale: float, drop, positions, c: int) -> None:
    """The forward ring: combine every rank's block into (out, lse) in place."""
    n, r = ring.size, ring.index
    for i in range(n):
        pending = ring.exchange(kv, TAG_KV) if i < n - 1 else None  # the next chunk moves while this one computes
        src = (r - i) % n
        qs, ks, causal = _block(r, src, c)
        bo, bl = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal, scale, drop,
                               positions[r][qs], positions[src][ks])
        merge_(out[:, :, qs], lse[:, :, qs], bo, bl)
        if pending is not None:
            kv = pending.wait()


class RingAttention(torch.autograd.Function):
    """softmax(q kᵀ s + causal mask) v over the whole sequence, q, k, v holding this rank's two chunks:
    q (B, h, T/n, d), k and v (B, h_kv, T/n, d). `positions[j]` are rank j's global positions (for dropout)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, drop: BlockDropout | None, positions: list[torch.Tensor]):
        c = q.shape[2] // 2
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per ring step
        with torch.autocast(q.device.type, enabled=False):  # the blocks keep their own precision (kernels.acc_dtype)
            _ring_forward(q, kv, out, lse, ring, scale, drop, positions, c)
        result = torch.empty_like(q).copy_(out)  # q's layout, as SDPA gives its output
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring, ctx.scale, ctx.drop, ctx.positions = ring, scale, drop, positions
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, drop, positions = ctx.ring, ctx.scale, ctx.drop, ctx.positions
        n, r = ring.size, ring.index
        c = q.shape[2] // 2
        acc = acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # the accumulator of this rank's own chunk
        sent = None
        for i in range(n):
            pending = ring.exchange(kv, TAG_KV) if i < n - 1 else None
            src = (r - i) % n
            qs, ks, causal = _block(r, src, c)
            gq, gk, gv = block_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                        out[:, :, qs], lse[:, :, qs], causal, scale, drop,
                                        positions[r][qs], positions[src][ks])
            dq[:, :, qs] += gq
            if sent is not None:
                dkv = sent.wait()  # rank src's accumulator, from the previous rank (it was computing meanwhile)
            dkv[0][:, :, ks] += gk
            dkv[1][:, :, ks] += gv
            sent = ring.exchange(dkv, TAG_DKV)  # on to the next rank; after n hops it is back with its owner
            if pending is not None:
                kv = pending.wait()
        dkv = sent.wait()  # this rank's own chunk, with every rank's contribution
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None
