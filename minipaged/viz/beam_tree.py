"""Stage 6b drawn: the beams as a tree over time, the blocks they hold step by step, and what
sharing saves in beam search beside parallel sampling.

The drawings read a search's record (`BeamSearch.history`, one `BeamStep` per step, and
`BeamSearch.blocks_held`), never the search itself. The blocks each beam's table points at, and
the copy-on-write moment, are stage 6's drawings (`plot_shared_blocks`, `plot_copy_on_write`)
of a snapshot of the search's pool.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from .pool import EDGE_COLOR, seq_color
from .shared_blocks import SHARED_COLOR, _off_on_bars

PRUNED_COLOR = "#b0b0b0"      # a beam none of whose candidates survived: its blocks were freed


def _label(token, decode) -> str:
    text = decode([token]) if decode else str(token)
    text = text.replace("\n", "\\n")
    return text if len(text) <= 10 else text[:9] + "…"


def plot_beam_tree(history, decode=None, ax=None, title=None):
    """The search as a tree: step t's survivors in a column, best at the top, each joined to the
    beam it extends and labelled with its token. A solid edge continues the parent's cache row
    (in that row's colour); a dashed edge is a fork onto a new row sharing the parent's blocks.
    Squares finished on a stop token, diamonds at max_new_tokens; a grey cross is a beam pruned
    (no candidate of it survived: its blocks were freed at once) or dropped when the search
    ended early."""
    steps = len(history)
    width = max((len(s.tokens) for s in history), default=1)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.25 * steps + 2, 0.55 * width + 1.4))
    ax.scatter([0], [0], s=90, color=seq_color(0), zorder=3)
    live_at = [0]                                   # y of the previous step's live beams
    for t, step in enumerate(history, start=1):
        y_next, continued = [], set()
        for i, (parent, token, status, row) in enumerate(
                zip(step.parents, step.tokens, step.status, step.seq_ids)):
            y, py = -i, live_at[parent]
            forked = status == "live" and parent in continued
            if status == "live":
                continued.add(parent)
                y_next.append(y)
            color = seq_color(row) if status == "live" else \
                PRUNED_COLOR if status == "dropped" else EDGE_COLOR
            ax.plot([t - 1, t], [py, y], color=color, lw=1.4, ls="--" if forked else "-",
                    zorder=1)
            marker = {"live": "o", "stop": "s", "length": "D", "dropped": "x"}[status]
            ax.scatter([t], [y], s=110 if status == "dropped" else 70, marker=marker, zorder=3,
                       color=color if status in ("live", "dropped") else "white",
                       edgecolor=color if status != "dropped" else None)
            ax.text(t, y + 0.28, _label(token, decode), ha="center", fontsize=7)
        for p, py in enumerate(live_at):            # no candidate of it survived: pruned
            if p not in step.parents:
                ax.scatter([t - 1], [py], s=110, marker="x", color=PRUNED_COLOR, zorder=4)
        live_at = y_next
    ax.set_xticks(range(steps + 1), ["prompt"] + [str(t) for t in range(1, steps + 1)])
    ax.set_xlabel("step (tokens generated)")
    ax.set_yticks([])
    ax.set_xlim(-0.5, steps + 0.5)
    ax.set_ylim(-width + 0.4, 0.8)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or "the beams over time (● live, □ stop token, ◇ last step, × freed)",
                 fontsize=10)
    ax.figure.tight_layout()
    return ax.figure


def plot_beam_blocks(blocks_held, ax=None, title=None):
    """Blocks per layer after every forward of one search: held with sharing, and the same beams
    each holding its own copy; the gap between the lines is what sharing saves."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    held = [h for h, _ in blocks_held]
    unshared = [u for _, u in blocks_held]
    saved = 1 - sum(held) / sum(unshared)
    x = range(len(blocks_held) + 1)                 # forward i holds its blocks until i + 1
    held, unshared = held + held[-1:], unshared + unshared[-1:]
    ax.fill_between(x, held, unshared, color=SHARED_COLOR, alpha=0.3, step="post",
                    label="saved by sharing")
    ax.step(x, unshared, where="post", color=EDGE_COLOR, label="each beam its own copy")
    ax.step(x, held, where="post", color=SHARED_COLOR, lw=2, label="shared (held)")
    ax.set_xlabel("forward (0: the prompt's prefill)")
    ax.set_ylabel("KV blocks per layer")
    ax.set_title(title or f"blocks held during the search ({saved:.0%} saved on average)",
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.figure.tight_layout()
    return ax.figure


def plot_beam_savings(widths, beam_unshared, beam_held, ns, sample_off, sample_on,
                      paper_beam=(0.37, 0.66), paper_parallel=(0.06, 0.30)):
    """Two panels of KV blocks per layer (mean) without and with sharing, the saving over each
    pair: beam search by width (left: one prompt at a time) and stage 6's parallel sampling by
    n (right: the engine serving every prompt at once), each titled with the vLLM paper's
    range."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    _off_on_bars(axes[0], [f"width {w}" for w in widths], beam_unshared, beam_held,
                 ("each beam its own copy", "beams share blocks"), SHARED_COLOR,
                 "KV blocks per layer (mean, per prompt)",
                 f"beam search (paper: {paper_beam[0]:.0%}–{paper_beam[1]:.0%} saved)")
    _off_on_bars(axes[1], [f"n={n}" for n in ns], sample_off, sample_on,
                 ("independent samples", "samples share the prompt"), SHARED_COLOR,
                 "KV blocks per layer (mean, all prompts)",
                 f"parallel sampling (paper: {paper_parallel[0]:.0%}–{paper_parallel[1]:.0%} "
                 f"saved)")
    for ax, top in zip(axes, (max(beam_unshared), max(sample_off))):
        ax.set_ylim(0, 1.18 * top)                  # room for the savings over the bars
    fig.tight_layout()
    return fig
