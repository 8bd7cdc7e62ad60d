"""Stage 9b drawn: one request's move between the two pools, block ids remapped; the decode
steps' times, colocated and disaggregated."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import ConnectionPatch, Patch, Rectangle

from .pool import EDGE_COLOR, FREE_COLOR

SENT, SKIPPED, LAST = "#1f77b4", "#2ca02c", "#ff7f0e"


def _pool(ax, num_blocks, colors, labels, title):
    """A pool as a grid: block b at column b % cols, row b // cols; returns each block's centre."""
    cols = max(1, math.ceil(math.sqrt(num_blocks)))
    centres = {}
    for b in range(num_blocks):
        x, y = b % cols, -(b // cols)
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=colors.get(b, FREE_COLOR),
                               edgecolor=EDGE_COLOR, lw=0.6))
        ax.text(x + 0.5, y + 0.62, str(b), ha="center", va="center", fontsize=7)
        if b in labels:
            ax.text(x + 0.5, y + 0.3, labels[b], ha="center", va="center", fontsize=6,
                    color="white")
        centres[b] = (x + 0.5, y + 0.5)
    ax.set_xlim(-0.2, cols + 0.2)
    ax.set_ylim(-(num_blocks - 1) // cols - 0.2, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    return centres


def plot_move(move, remote_blocks: int, local_blocks: int, prompt_blocks: int):
    """The prefill side's pool (left) and the decode side's (right) for one layer: the request's
    logical block j labelled "j" on each; an arrow for every (remote id -> local id) pair moved;
    the blocks the decode side's prefix cache held (not sent) and the last ones it computes."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    colors_r, labels_r, colors_l, labels_l = {}, {}, {}, {}
    for j, b in enumerate(move.remote[:prompt_blocks]):
        colors_r[b] = SKIPPED if j < move.first else SENT if j < move.end else LAST
        labels_r[b] = f"j={j}"
    for j, b in enumerate(move.local[:move.end]):
        colors_l[b] = SKIPPED if j < move.first else SENT
        labels_l[b] = f"j={j}"
    a = _pool(left, remote_blocks, colors_r, labels_r,
              f"prefill side, layer {move.layer}: request {move.key}'s blocks")
    b = _pool(right, local_blocks, colors_l, labels_l,
              f"decode side, layer {move.layer}: its own ids for the same blocks")
    for r, loc in move.pairs:
        fig.add_artist(ConnectionPatch(a[r], b[loc], "data", "data", axesA=left, axesB=right,
                                       arrowstyle="->", color=SENT, lw=0.8, alpha=0.8))
    fig.legend(handles=[Patch(color=SENT, label="sent: remote id -> local id"),
                        Patch(color=SKIPPED, label="the decode side's prefix cache held it: "
                                                   "not sent"),
                        Patch(color=LAST, label="holds the last token: computed on the decode "
                                                "side"),
                        Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="other blocks")],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def plot_step_times(runs, cpu: str = ""):
    """One panel per run (`disaggregated_latency.Timeline`s), one above the other on the same
    axes: each step of the engine the chats decode on, as a bar from when it began, as tall as
    it took; a dashed line where a long prompt arrived; the worst gap between two tokens of a
    chat in the panel's title."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.3 * len(runs) + 0.6), sharex=True,
                             sharey=True, squeeze=False)
    for ax, run, color in zip(axes[:, 0], runs, (LAST, SENT)):
        ax.bar(run.step_start, [1e3 * s for s in run.step_seconds], width=run.step_seconds,
               align="edge", color=color)
        for t in run.arrivals:
            ax.axvline(t, color="black", ls="--", lw=0.8)
        ax.set_title(f"{run.name}: worst gap between two tokens of a chat "
                     f"{1e3 * run.worst_gap:.0f} ms", fontsize=9, loc="left")
        ax.set_ylabel("step time (ms)")
    axes[-1, 0].set_xlabel("seconds since the first request (dashed: a long prompt arrives)")
    if cpu:
        fig.suptitle(f"each step of the chats' engine, one trace served two ways; {cpu}",
                     fontsize=9)
    fig.tight_layout()
    return fig
