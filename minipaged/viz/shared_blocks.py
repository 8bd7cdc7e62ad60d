"""Stage 6 drawn: blocks shared by several tables with their counts, the copy-on-write moment,
the hash chain of a prompt's blocks, a prefix-cache hit, and what sharing saves.

The drawings read a `sharing_snapshot` (plain lists taken from a CacheManager at one moment),
so "before" and "after" pictures can be taken while the manager keeps changing.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

from ..prefix_cache import block_hashes
from .pool import EDGE_COLOR, FREE_COLOR, seq_color

SHARED_COLOR = "#f2b134"     # a block held by two tables or more
CACHED_COLOR = "#b9d7ea"     # cached-free: count zero, K/V and hash kept for a later prompt
HIT_COLOR = "#d62728"        # outline of blocks a prefix hit reused


def sharing_snapshot(cm, seq_ids=None) -> dict:
    """What the drawings need from one CacheManager now: each table, count, length, and which
    blocks are cached-free. Copies, so the manager may go on changing."""
    seq_ids = cm.live_seq_ids() if seq_ids is None else [int(s) for s in seq_ids]
    return {"num_blocks": cm.num_blocks, "block_size": cm.block_size,
            "tables": {s: cm.blocks_of(s) for s in seq_ids},
            "lens": {s: int(cm.seq_lens[s]) for s in seq_ids},
            "refs": cm.refs.tolist(),
            "cached": list(cm.prefix.cached_free) if cm.prefix is not None else []}


def _draw_tables(ax, snap, highlight=(), title=None, names=None):
    """The pool as one row of blocks (count written in each), each sequence's table below it,
    an arrow from every logical block to its physical block."""
    n, bs = snap["num_blocks"], snap["block_size"]
    cached = set(snap["cached"])
    for b in range(n):
        refs = snap["refs"][b]
        owners = [s for s, t in snap["tables"].items() if b in t]
        color = SHARED_COLOR if refs > 1 else seq_color(owners[0]) if owners else \
            CACHED_COLOR if b in cached else FREE_COLOR
        hit = b in highlight
        ax.add_patch(Rectangle((b + 0.05, 0.05), 0.9, 0.9, facecolor=color,
                               edgecolor=HIT_COLOR if hit else EDGE_COLOR, lw=2.5 if hit else 0.6))
        ax.text(b + 0.5, 0.62, str(b), ha="center", va="center", fontsize=8)
        ax.text(b + 0.5, 0.28, f"×{refs}" if refs else ("cached" if b in cached else ""),
                ha="center", va="center", fontsize=7, weight="bold" if refs > 1 else "normal")
    ax.text(-0.3, 0.5, "pool", ha="right", va="center", fontsize=9)
    for row, (s, table) in enumerate(snap["tables"].items()):
        y = -1.6 - 1.3 * row
        length = snap["lens"][s]
        for j, b in enumerate(table):
            x = j * 1.0
            filled = min(bs, length - j * bs) / bs
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=seq_color(s),
                                   alpha=0.25, edgecolor=EDGE_COLOR, lw=0.6))
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9 * filled, 0.9,
                                   facecolor=seq_color(s), edgecolor="none"))
            ax.text(x + 0.5, y + 0.5, f"{j}→{b}", ha="center", va="center", fontsize=7,
                    color="white" if filled > 0.5 else "black")
            ax.add_patch(FancyArrowPatch((x + 0.5, y + 0.95), (b + 0.5, 0.05),
                                         arrowstyle="-|>", mutation_scale=7, lw=0.7,
                                         color=seq_color(s), alpha=0.8))
        label = names[s] if names and s in names else f"seq {s}"
        ax.text(-0.3, y + 0.5, label, ha="right", va="center", fontsize=9, color=seq_color(s))
    rows = len(snap["tables"])
    ax.set_xlim(-2.6, max(n, 1) + 0.2)
    ax.set_ylim(-1.6 - 1.3 * max(rows - 1, 0) - 0.2, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)


def plot_shared_blocks(snapshot, title: str | None = None, highlight=(), names=None):
    """One moment of a pool with sharing: each physical block with its reference count (gold:
    shared, blue: cached-free), each sequence's block table with arrows into the pool.
    `snapshot`: from `sharing_snapshot` (or a CacheManager). Returns the Figure."""
    snap = snapshot if isinstance(snapshot, dict) else sharing_snapshot(snapshot)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * snap["num_blocks"] + 2),
                                    1.6 + 0.65 * len(snap["tables"])))
    _draw_tables(ax, snap, highlight, title, names)
    fig.tight_layout()
    return fig


def plot_copy_on_write(before, after, titles=("before the write", "after: copy-on-write")):
    """Two moments side by side (top: before, bottom: after) of one pool: the shared block
    whose count drops, and the fresh copy the writer's table now points at (outlined)."""
    fresh = {b for s, t in after["tables"].items() for b in t
             if b not in before["tables"].get(s, [])}
    rows = max(len(before["tables"]), len(after["tables"]))
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.45 * before["num_blocks"] + 2),
                                            2 * (1.6 + 0.65 * rows)))
    _draw_tables(axes[0], before, (), titles[0])
    _draw_tables(axes[1], after, fresh, titles[1])
    fig.tight_layout()
    return fig


def plot_hash_chain(tokens, block_size: int, hit_blocks: int = 0, decode=None, ax=None):
    """A prompt cut into blocks: each full block's name is the hash of its tokens and of the
    name before it (arrows). The first `hit_blocks` are drawn as found in the cache; the
    partial last block has no name. `decode(ids)` turns token ids into text (else numbers)."""

    hashes = block_hashes(list(tokens), block_size)
    k = -(-len(tokens) // block_size)
    if ax is None:
        _, ax = plt.subplots(figsize=(2.3 * k + 1, 2.2))
    for j in range(k):
        chunk = list(tokens[j * block_size:(j + 1) * block_size])
        text = decode(chunk) if decode else " ".join(map(str, chunk))
        text = text if len(text) <= 28 else text[:26] + "…"
        full = j < len(hashes)
        x = 2.3 * j
        ax.add_patch(Rectangle((x, 0), 2.0, 1.2, facecolor=CACHED_COLOR if j < hit_blocks
                               else "white" if full else FREE_COLOR,
                               edgecolor=HIT_COLOR if j < hit_blocks else EDGE_COLOR,
                               lw=2 if j < hit_blocks else 0.8))
        ax.text(x + 1.0, 0.85, f"block {j}", ha="center", fontsize=8, weight="bold")
        ax.text(x + 1.0, 0.5, text, ha="center", fontsize=6, wrap=True)
        ax.text(x + 1.0, 0.15, f"h{j} = {hashes[j].hex()[:8]}" if full else "partial: no hash",
                ha="center", fontsize=7, family="monospace")
        if 0 < j < len(hashes):
            ax.add_patch(FancyArrowPatch((x - 0.3, 0.2), (x + 0.05, 0.2), arrowstyle="-|>",
                                         mutation_scale=8, lw=0.8))
    ax.text(0, -0.35, "h_j = hash(h_{j-1}, tokens of block j): a match means the whole prefix "
            "matches", fontsize=7)
    ax.set_xlim(-0.2, 2.3 * k)
    ax.set_ylim(-0.6, 1.4)
    ax.axis("off")
    return ax.figure


def plot_sharing_savings(ns, blocks_off, blocks_on, prefill_off=None, prefill_on=None,
                         labels=None, paper=(0.06, 0.30)):
    """Left: KV blocks held (mean) for n parallel samples without and with sharing, the saving
    written over each pair and the paper's range as a band. Right (optional): prefill tokens
    run without and with prefix caching, per case."""
    panels = 2 if prefill_off is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    _off_on_bars(axes[0, 0], [f"n={n}" for n in ns], blocks_off, blocks_on,
                 ("independent samples", "shared prompt blocks"), SHARED_COLOR,
                 "KV blocks per layer (mean)",
                 f"parallel sampling (paper: {paper[0]:.0%}–{paper[1]:.0%} saved)")
    if panels == 2:
        _off_on_bars(axes[0, 1], labels or [str(i) for i in range(len(prefill_off))],
                     prefill_off, prefill_on, ("no prefix caching", "prefix caching"),
                     CACHED_COLOR, "prefill tokens run", "prefix caching")
    fig.tight_layout()
    return fig


def _off_on_bars(ax, ticks, off_values, on_values, names, on_color, ylabel, title):
    """Pairs of bars, without and with sharing, each pair labelled with the saving."""
    x = np.arange(len(ticks))
    ax.bar(x - 0.2, off_values, 0.4, label=names[0], color=FREE_COLOR, edgecolor=EDGE_COLOR)
    ax.bar(x + 0.2, on_values, 0.4, label=names[1], color=on_color)
    for i, (off, on) in enumerate(zip(off_values, on_values)):
        ax.text(i, max(off, on) * 1.02, f"−{1 - on / off:.0%}", ha="center", fontsize=9)
    ax.set_xticks(x, ticks)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
