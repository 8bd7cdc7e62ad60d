"""The embedded model's training, drawn."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt

def plot_loss_curve(history, report, path=None):
    """Training loss per step, with the held-out loss and the unigram baseline as lines."""

    if path is not None:
        matplotlib.use("Agg")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(history, lw=1, color="#4c72b0", label="training loss (batch)")
    ax.axhline(report["heldout_loss"], color="#dd8452", ls="--",
               label=f"held-out loss {report['heldout_loss']:.2f}")
    ax.axhline(report["unigram_heldout_loss"], color="#888888", ls=":",
               label=f"unigram baseline {report['unigram_heldout_loss']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("the embedded model learning its corpus", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
