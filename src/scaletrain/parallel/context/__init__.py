"""Context parallelism: every sequence split over `parallel.cp` ranks, attention included — ring attention with
causal load balancing (Liu et al., arXiv 2310.01889) or DeepSpeed-Ulysses all-to-all (Jacobs et al., arXiv
2309.14509). See docs/context_parallel.md.

`layout.py` (which positions a rank holds), `comm.py` (the ring's point-to-point exchanges and Ulysses' all-to-alls,
apart from the layers), `kernels.py` (block attention with the log-sum-exp, online-softmax combination), `ring.py`
and `ulysses.py` (the two attentions), `core.py` (the ring core an attention module calls), `apply.py` (the pass),
`rules.py` (validate()'s rules, torch-free).

The names below are loaded on first use (scaletrain/lazy.py): importing the rules imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletrain import lazy

if TYPE_CHECKING:
    from scaletrain.parallel.context.apply import apply_cp, positions_of
    from scaletrain.parallel.context.layout import chunks_of, local_positions

__all__ = ["apply_cp", "chunks_of", "local_positions", "positions_of"]
__getattr__ = lazy.exports(__name__, {"apply_cp": "apply", "positions_of": "apply", "chunks_of": "layout",
                                      "local_positions": "layout"})
