"""The sparsely-gated MoE's balancing losses and its two-level gate (Shazeer et al., arXiv 1701.06538).

- Importance loss (Sec. 4): Importance(X)_i = Σ_{x∈X} G(x)_i, L_importance = w_importance · CV(Importance(X))².
- Load loss (appendix A): with the noisy gate H(x)_i = (x W_g)_i + ε · softplus((x W_noise)_i), the probability
  that expert i stays in the top k when only its own noise is redrawn is
  P(x, i) = Φ(((x W_g)_i − kth_excluding(H(x), k, i)) / softplus((x W_noise)_i)),
  kth_excluding(v, k, i) the k-th largest entry of v once entry i is left out; Load(X)_i = Σ_x P(x, i),
  L_load = w_load · CV(Load(X))².
- Hierarchical MoE (appendix B): a primary gate over a groups, a secondary gate G_i over the b experts of group i;
  Importance_H(X)_{i,j} = Σ_x G_primary(x)_i · G_i(x)_j and
  Load_H(X)_{i,j} = Load_primary(X)_i · Load_i(X^(i))_j / |X^(i)|, X^(i) the tokens whose primary gate chose i.

X is one dispatch group of S tokens (model/moe.py), so the losses do not depend on the layout; each group's loss
is multiplied by S (token-summed like the cross-entropy). CV² is the population variance over the squared mean,
with 1e-10 added to the mean² so that a group of all-zero values gives 0 (as the authors' released code does).
Pure tensor functions, no modules.
"""

from __future__ import annotations

import torch

CV_EPS = 1e-10


def cv_squared(v: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation over the last dim: mean((v - mean)²) / (mean² + 1e-10)."""
    mean = v.mean(-1, keepdim=True)
    return (v - mean).square().mean(-1) / (mean.squeeze(-1).square() + CV_EPS)


def kth_excluding(h: torch.Tensor, k: int) -> torch.Tensor:
    """For every entry i of the last dim (n > k entries), the k-th largest of the others: the (k+1)-th largest
    of all when i is among the top k, else the k-th largest."""
    top = h.topk(k + 1, dim=-1).values
    kth, after = top[..., k - 1: k], top[..., k: k + 1]
    return torch.where(h >= kth, after, kth)


def selection_probability(clean: torch.Tensor, noisy: torch.Tensor, std: torch.Tensor, k: int) -> torch.Tensor:
    """P(x, i) of the load loss: Φ((clean_i − kth_excluding(noisy, k, i)) / std_i); all (..., n)."""
    return torch.special.ndtr((clean - kth_excluding(noisy, k)) / std)


def importance_load_sum(gates: torch.Tensor, probs: torch.Tensor | None, w_importance: float,
                        w_load: float) -> torch.Tensor:
    """Σ over groups of S · (w_importance CV(Σ_x G(x))² + w_load CV(Σ_x P(x, ·))²); gates, probs (G, S, E)
    (gates 0 where an expert was not chosen; probs None when w_load is 0)."""
    S = gates.shape[1]
    loss = w_importance * cv_squared(gates.sum(1))
    if probs is not None and w_load > 0:
        loss = loss + w_load * cv_squared(probs.sum(1))
    return S * loss.sum()


def hierarchical_importance_load_sum(gates: torch.Tensor, primary_probs: torch.Tensor | None,
                                     secondary_probs: torch.Tensor | None, chosen: torch.Tensor,
                                     w_importance: float, w_load: float) -> torch.Tensor:
    """Appendix B's losses: gates (G, S, a, b) = G_primary(x)_i · G_i(x)_j (0 off the chosen pairs), primary_probs
    (G, S, a), secondary_probs (G, S, a, b) (P of each gate on its own), chosen (G, S, a) the primary choices."""
    G, S, a, b = gates.shape
    loss = w_importance * cv_squared(gates.sum(1).reshape(G, a * b))
    if primary_probs is not None and secondary_probs is not None and w_load > 0:
        mask = chosen.to(gates.dtype)
        count = mask.sum(1).clamp(min=1)  # |X^(i)|; a group no token chose contributes Load_i = 0
        secondary = (secondary_probs * mask.unsqueeze(-1)).sum(1) / count.unsqueeze(-1)  # (G, a, b)
        load = primary_probs.sum(1).unsqueeze(-1) * secondary
        loss = loss + w_load * cv_squared(load.reshape(G, a * b))
    return S * loss.sum()
