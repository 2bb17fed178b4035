"""Teacher-forced routing: record a run's mixture-of-experts routing decisions by token, replay them in another run.

Routing is discrete: a token whose two best expert scores lie within rounding of each other goes to either expert,
and which one depends on the last bits of its hidden state, so on summation order and on the CPU's kernels. In fp64
that never happens between a layout and one process (their differences, ~1e-15, are far below any score gap of a
real model); in fp32, bf16 and fp16 it does, and one moved token changes every later step (a chaotic comparison:
the same layout, on two machines, differed from one process by 0.07 and 0.22 in its gradient norm). The layout
matrix therefore compares low-precision MoE layouts under the *reference's* decisions (teacher forcing, as in
sequence models trained on the reference's outputs): the single-process run records, per (layer, step, token), the
experts each token chose and whether it kept them (token choice: top-k, Switch, GShard's random second expert) or
the tokens each expert took in each group (expert choice, Zhou et al., arXiv 2202.09368); the layout routes every
token as the reference did. Everything continuous stays the layout's own: router logits, gates and combine weights
(gathered at the forced experts), capacity placement (GShard, arXiv 2006.16668: from the forced choices, in token
order), the balance and z-losses, the experts, their gradients. What is left between the two runs is rounding, not
a different model.

The layout's own decisions are still computed and counted against the forced ones (`differ` of `decisions`): a
router that the layout computes wrongly (unsynchronised weights, a wrong sequence shard) disagrees on most tokens,
rounding on a few percent. fp64 layouts route by their own scores, so the routing code itself stays under the
element-wise fp64 test.

A token is identified by its global position in the step's batch, (global row) x seq_len + position: the MoE layer
knows its first global row (`MoE.key`, set by the trainer per step) and which positions of each sequence it holds:
one equal slice (`MoE.seq_shard`, under sequence parallelism) or any set of global positions
(`MoE.token_positions`, under context parallelism, where a ring rank holds two chunks from both ends of every
sequence); groups by their first token. No distributed code here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scaletrain.model.moe import MoE, Routing

Decisions = dict[tuple[int, int], torch.Tensor]
"""(layer, step) -> int64 table indexed by global token id: token choice (expert..., keep...) per token; expert
choice the group's (E x K) slot tokens at its first token's id; -1 where nothing was recorded."""


class MissingDecision(RuntimeError):
    """The replaying run routed tokens the recording run never routed: the two did not compute the same batch."""


class RoutingTape:
    """Records routing decisions (`decisions=None`) or replays `decisions` in every MoE layer it is attached to."""

    def __init__(self, decisions: Decisions | None = None):
        self.replay = decisions is not None
        self.decisions: Decisions = dict(decisions or {})
        self.differ = 0
        """Decisions (token-choice tokens, expert-choice slots) where this run's own router chose otherwise."""
        self.total = 0

    def attach(self, modules) -> RoutingTape:
        """Put this tape into every MoE layer of `modules` (a module or a list of them)."""
        for module in modules if isinstance(modules, list | tuple) else [modules]:
            for m in module.modules():
                if isinstance(m, MoE):
                    m.tape = self
        return self

    def route(self, moe: MoE, own: Routing, decide: Callable[..., Routing], rows: int) -> Routing:
        """Called by `MoE.route` with its own routing: recorded, or replaced by the recorded one's choices."""
        G, E, K = own.slot_token.shape
        S = moe.cfg.group_tokens
        ids = self._token_ids(moe, rows, G * S)
        _, step, _ = moe.key
        key = (moe.layer, step)
        if len(own.decision) == 2:  # token choice: (expert, keep) per token
            mine = torch.cat([own.decision[0], own.decision[1].long()], -1).reshape(G * S, -1)
            where = ids
        else:  # expert choice: the tokens of each group's E x K slots
            mine = own.decision[0].reshape(G, E * K)
            where = ids.view(G, S)[:, 0]
        if not self.replay:
            self._store(key, where, mine)
            return own
        table = self.decisions.get(key)
        if table is None or int(where.max()) >= table.shape[0] or bool((table[where.cpu()] < 0).any()):
            raise MissingDecision(f"teacher-forced routing: the tape has no decision for layer {moe.layer} step {step} "
                               f"(tokens {int(where.min())}..{int(where.max())})")
        forced = table[where.cpu()].to(mine.device)
        self.differ += int((forced != mine).any(-1).sum()) if len(own.decision) == 2 else int((forced != mine).sum())
        self.total += forced.shape[0] if len(own.decision) == 2 else forced.numel()
        if len(own.decision) == 2:
            k = own.decision[0].shape[-1]
            forced = forced.view(G, S, 2 * k)
            return decide((forced[..., :k].contiguous(), forced[..., k:].bool()))
        return decide((forced.view(G, E, K),))

    @staticmethod
    def _token_ids(moe: MoE, rows: int, tokens: int) -> torch.Tensor:
        """Global ids of this forward's tokens in the layer's flat (rows x local positions) order."""
        _, _, first = moe.key
        local = tokens // rows
        row = torch.arange(first, first + rows).view(rows, 1)
        if moe.token_positions is not None:  # context parallelism: the layer's tokens sit at these global positions
            held, total = moe.token_positions
            return (row * total + held.cpu().view(1, local)).reshape(-1)
        index, parts = moe.seq_shard
        pos = torch.arange(local).view(1, local) + index * local
        return (row * (local * parts) + pos).reshape(-1)

    def _store(self, key: tuple[int, int], where: torch.Tensor, values: torch.Tensor) -> None:
        values = values.detach().cpu()
        where = where.cpu()
        table = self.decisions.get(key)
        need = int(where.max()) + 1
        if table is None or table.shape[0] < need:
            grown = torch.full((need, values.shape[-1]), -1, dtype=torch.long)
            if table is not None:
                grown[: table.shape[0]] = table
            table = self.decisions[key] = grown
        table[where] = values
