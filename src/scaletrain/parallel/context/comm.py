"""The communication of context parallelism, apart from the layers: the ring of ring attention (point-to-point
exchanges with the neighbours, posted before the block computation they overlap) and the all-to-alls of Ulysses.

Every call adds the bytes this rank sends to a `CommStats` under its kind: `cp.ring` (key/value chunks in forward
and backward, and the travelling key/value gradient accumulators) and `cp.all_to_all` ((n - 1) / n of each
all-to-all's buffer: the part that leaves the rank). The planner predicts both (plan/analytic/context.py), and
tests/test_context_parallel.py checks the counts against it. A group of one rank sends nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scaletrain.distributed.comm import CommStats, group_size

TAG_KV, TAG_DKV = 41, 42  # separate tags: forward / backward key-value chunks, and gradient accumulators


class Ring:
    """The cp group as a ring: member i sends to member i + 1 and receives from member i - 1 (mod cp)."""

    def __init__(self, group: dist.ProcessGroup | None, members: list[int], rank: int,
                 stats: CommStats | None = None):
        self.group, self.members, self.stats = group, list(members), stats
        self.size = len(self.members)
        self.index = self.members.index(rank)  # this rank's position on the ring (its cp rank)
        self.next = self.members[(self.index + 1) % self.size]
        self.prev = self.members[(self.index - 1) % self.size]

    def exchange(self, send: torch.Tensor, tag: int) -> _Exchange:
        """Post: send `send` to the next rank, receive a tensor of its shape from the previous one. The returned
        handle's `wait()` gives the received tensor (compute in between overlaps the transfer)."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        if self.stats is not None:
            self.stats.add("cp.ring", send.numel() * send.element_size())
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return _Exchange(dist.batch_isend_irecv(ops), send, recv)


class _Exchange:
    def __init__(self, works: list, send: torch.Tensor, recv: torch.Tensor):
        self.works, self.send, self.recv = works, send, recv  # `send` is kept alive until the transfer is done

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.recv


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (chunk j goes to member j; chunk j of the result came from member j)."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    if stats is not None:
        stats.add("cp.all_to_all", (n - 1) / n * x.numel() * x.element_size())
    return out


def seq_to_heads(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    """(B, h, T/n, d), this rank's tokens of every head -> (B, h/n, T, d), every token of this rank's heads (the
    sequence chunks concatenated in member order, i.e. global order for the contiguous Ulysses layout)."""
    n = group_size(group)
    if n == 1:
        return x
    B, h, t, d = x.shape
    chunks = x.reshape(B, n, h // n, t, d).movedim(1, 0)  # (n, B, h/n, t, d): head block j goes to member j
    got = all_to_all(chunks, group, stats)  # (n, B, h/n, t, d): member j's tokens of my heads
    return got.movedim(0, 2).reshape(B, h // n, n * t, d)


def heads_to_seq(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    """The inverse of `seq_to_heads`: (B, h/n, T, d) -> (B, h, T/n, d)."""
    n = group_size(group)
    if n == 1:
        return x
    B, hl, T, d = x.shape
    chunks = x.reshape(B, hl, n, T // n, d).movedim(2, 0)  # (n, B, h/n, t, d): token chunk j goes to member j
    got = all_to_all(chunks, group, stats)  # (n, B, h/n, t, d): member j's heads of my tokens
    return got.movedim(0, 1).reshape(B, n * hl, T // n, d)


class SeqToHeads(torch.autograd.Function):
    """`seq_to_heads` forward, `heads_to_seq` of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return seq_to_heads(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group, ctx.stats), None, None


class HeadsToSeq(torch.autograd.Function):
    """`heads_to_seq` forward, `seq_to_heads` of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return heads_to_seq(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group, ctx.stats), None, None
