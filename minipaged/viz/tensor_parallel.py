"""Stage 9 drawn: which heads and features each rank owns, one block split across ranks, and
what rank 0's messages change in a worker's block tables."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from ..tensor_parallel import apply_changes, owned
from .pool import FREE_COLOR

APPENDED, REPLACED, FREED = "#55a868", "#dd8452", "#c44e52"   # what a message does to a table
RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
               "#8c8c8c"]


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def plot_head_split(args, world_size: int, title: str | None = None):
    """Three rows of boxes coloured by the rank that owns them: the query heads, the KV heads
    (each query head's KV head drawn below it, as grouped-query attention shares them) and the
    MLP's hidden features (in N runs). Returns the Figure."""
    rows = [("query heads\n(wq's columns, wo's rows)", args.n_heads),
            ("KV heads\n(wk, wv's columns;\nthe cache's heads)", args.n_kv_heads),
            (f"MLP features ({args.hidden_dim})\n(w1, w3's columns,\nw2's rows)", world_size)]
    fig, ax = plt.subplots(figsize=(10, 3.2))
    width = 10.0
    for y, (label, count) in zip((2, 1, 0), rows):
        box = width / count
        for i in range(count):
            rank = i // (count // world_size)        # contiguous, equal shares (`owned`)
            ax.add_patch(Rectangle((i * box + 0.04, y + 0.1), box - 0.08, 0.7,
                                   facecolor=rank_color(rank), alpha=0.85, edgecolor="white"))
            text = (f"{owned(args.hidden_dim, i, world_size).start}–"
                    f"{owned(args.hidden_dim, i, world_size).stop - 1}") if y == 0 else str(i)
            ax.text(i * box + box / 2, y + 0.45, text, ha="center", va="center", color="white",
                    fontsize=8)
        ax.text(-0.2, y + 0.45, label, ha="right", va="center", fontsize=8)
    ax.set_xlim(-3.2, width)
    ax.set_ylim(-0.1, 3)
    ax.axis("off")
    ax.legend(handles=[Patch(facecolor=rank_color(r), label=f"rank {r}")
                       for r in range(world_size)], loc="upper right", ncol=world_size,
              fontsize=8, frameon=False, bbox_to_anchor=(1.0, 1.08))
    ax.set_title(title or f"{world_size} ranks: what each one holds of every layer", fontsize=10)
    fig.tight_layout()
    return fig


def plot_block_across_ranks(full, ranks, block: int, heads_of, title: str | None = None):
    """Block `block`'s keys in one process's pool (`full`, a CacheManager), one row per slot and
    a column per (KV head, dim); below, the same block id in each rank's pool (`ranks`), which
    holds only its own heads (`heads_of[r]`). Same colour scale everywhere. Returns the Figure."""
    k = full.k_cache_paged[block].flatten(1).float()                       # (slots, Hk * D)
    lim = float(k.abs().max()) or 1.0
    fig, axes = plt.subplots(1 + len(ranks), 1, figsize=(10, 1.2 + 1.1 * (1 + len(ranks))),
                             squeeze=False)
    axes = axes[:, 0]
    axes[0].imshow(k, cmap="coolwarm", vmin=-lim, vmax=lim, aspect="auto")
    axes[0].set_title(f"one process: block {block}, every KV head", fontsize=9)
    D = full.k_cache_paged.shape[-1]
    for ax, (r, cm) in zip(axes[1:], enumerate(ranks)):
        heads = list(heads_of[r])
        ax.imshow(cm.k_cache_paged[block].flatten(1).float(), cmap="coolwarm", vmin=-lim,
                  vmax=lim, aspect="auto",
                  extent=(heads[0] * D - 0.5, (heads[-1] + 1) * D - 0.5, full.block_size - 0.5,
                          -0.5))
        ax.set_xlim(-0.5, k.shape[1] - 0.5)
        ax.set_title(f"rank {r}: block {block}, KV head{'s' * (len(heads) > 1)} "
                     f"{', '.join(map(str, heads))} only",
                     fontsize=9, color=rank_color(r))
    for ax in axes:
        ax.set_ylabel("slot", fontsize=8)
        ax.set_xticks([h * D + D / 2 - 0.5 for h in range(k.shape[1] // D)])
        ax.set_xticklabels([f"head {h}" for h in range(k.shape[1] // D)], fontsize=8)
    fig.suptitle(title or "The same block id on every rank, each holding its own heads' keys",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_messages(messages, show, layer: int = 0):
    """A worker's copy of one layer's block tables, built from nothing by applying `messages`
    in order, drawn just before each message of `show` (their indices) with what that message
    changes: block ids appended (green), a table replaced whole (orange), a sequence whose
    blocks all went back (red, struck through); the message's K/V copies in that layer in the
    title. One panel per message. Returns the Figure."""
    tables, before = {}, {}
    for i, m in enumerate(messages[:max(show) + 1]):
        before[i] = tables
        if m.tables:
            tables = apply_changes(tables, m.tables[layer])
    fig, axes = plt.subplots(1, len(show), figsize=(4.4 * len(show), 2.9), squeeze=False)
    for ax, i in zip(axes[0], show):
        m, old = messages[i], before[i]
        ch = m.tables[layer] if m.tables else {"appended": {}, "replaced": {}, "freed": []}
        seqs = sorted(set(old) | set(ch["replaced"]))
        for row, s in enumerate(seqs):
            if s in ch["replaced"]:
                cells = [(b, REPLACED) for b in ch["replaced"][s]]
            else:
                cells = [(b, FREE_COLOR) for b in old[s]] + \
                    [(b, APPENDED) for b in ch["appended"].get(s, [])]
            for j, (b, color) in enumerate(cells):
                ax.add_patch(Rectangle((j, -row - 0.4), 0.9, 0.8, facecolor=color,
                                       edgecolor="white"))
                ax.text(j + 0.45, -row, str(b), ha="center", va="center", fontsize=8)
            ax.text(-0.2, -row, f"seq {s}", ha="right", va="center", fontsize=8)
            if s in ch["freed"]:
                ax.plot([-0.1, len(cells) - 0.1], [-row, -row], color=FREED, lw=2)
        copies = [f"{src} -> {dst}" for kind, lay, src, dst in m.moves if lay == layer]
        ax.set_title(f"message {m.number}: {len(m.tokens)} x {len(m.tokens[0])} tokens"
                     + (f"\nK/V copied: {', '.join(copies)}" if copies else ""), fontsize=9)
        ax.set_xlim(-1.6, max([4] + [len(t) for t in old.values()]) + 2)
        ax.set_ylim(-max(1, len(seqs)) + 0.4, 0.6)
        ax.axis("off")
    axes[0][-1].legend(handles=[Patch(facecolor=c, label=t) for c, t in (
        (FREE_COLOR, "held already"), (APPENDED, "appended"), (REPLACED, "replaced whole"),
        (FREED, "freed"))], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
        frameon=False)
    fig.suptitle(f"a worker's block tables, layer {layer}, before each message and what it "
                 f"changes", fontsize=10)
    fig.tight_layout()
    return fig
