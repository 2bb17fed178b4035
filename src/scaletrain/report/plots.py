"""Plots of a run: the loss curve (train and validation) from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def plot_loss(metrics_path: Path, png: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "scaletrain loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot_expert_load(metrics_path: Path, png: Path, blocks: list[int] | None = None) -> Path | None:
    """Fraction of routed tokens per expert over training, one panel per MoE layer (`moe_load` rows), each panel
    named by its transformer block (`blocks`: the block index of each MoE layer, `config.sizes.moe_layers`) and
    carrying its own legend."""
    rows = [r for r in read_metrics(metrics_path) if r.get("moe_load")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    layers = len(rows[0]["moe_load"])
    names = blocks if blocks is not None and len(blocks) == layers else None
    fig, axes = plt.subplots(1, layers, figsize=(4 * layers, 3.4), squeeze=False)
    for li, ax in enumerate(axes[0]):
        experts = len(rows[0]["moe_load"][li])
        for e in range(experts):
            ax.plot(steps, [r["moe_load"][li][e] for r in rows], lw=1, label=f"expert {e}")
        ax.axhline(1 / experts, color="k", ls=":", lw=0.8, label="uniform 1/E")
        ax.set_title(f"block {names[li]} (MoE): load per expert" if names else f"MoE layer {li}: load per expert",
                     fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, ncol=2 if experts > 4 else 1)
    axes[0][0].set_ylabel("fraction of tokens")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
