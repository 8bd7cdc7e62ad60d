"""Stages 1-3 drawn: the contiguous cache's rows, the block pool, block tables, the gather, and
the slots each cache holds over a run."""

from __future__ import annotations

import itertools
import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap, to_hex
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

FREE_COLOR = "#e6e6e6"     # a free block
EDGE_COLOR = "#555555"


def seq_color(seq_id: int) -> str:
    """A sequence's colour (matplotlib's tab10, cycled), the same in figures and the terminal."""
    return to_hex(colormaps["tab10"](seq_id % 10))


def _grid_cols(num_blocks: int) -> int:
    return max(1, min(32, math.ceil(math.sqrt(num_blocks))))


def _draw_pool(ax, cm, cols, origin=(0.0, 0.0), labels=True):
    """Block b at column b % cols, row b // cols (row 0 on top); returns {block: (x, y)} corners."""
    owner, filled = cm.pool_usage()
    x0, y0 = origin
    corners = {}
    for b in range(cm.num_blocks):
        x, y = x0 + b % cols, y0 - b // cols
        corners[b] = (x, y)
        s = int(owner[b])
        color = FREE_COLOR if s < 0 else seq_color(s)
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=color,
                               alpha=1.0 if s < 0 else 0.25, edgecolor=EDGE_COLOR, lw=0.6))
        if s >= 0:                                  # the filled part, from the bottom up
            frac = filled[b] / cm.block_size
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9 * frac, facecolor=color,
                                   edgecolor="none", gid=f"fill-{b}"))
        if labels:
            ax.text(x + 0.5, y + 0.5, str(b), ha="center", va="center", fontsize=8,
                    color="black" if s < 0 else "white" if filled[b] * 2 >= cm.block_size
                    else "black")
    return corners


def _legend(ax, seq_ids):
    handles = [Patch(facecolor=seq_color(s), label=f"seq {s}") for s in seq_ids]
    handles.append(Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)


def plot_pool(managers, cols: int | None = None, titles=None, labels: bool | None = None):
    """The physical pool of one CacheManager, or one panel per layer for a list of them.

    A block's colour says which sequence owns it (grey: free), its solid part how many of its
    `block_size` slots hold tokens. Returns the matplotlib Figure.
    """
    cms = managers if isinstance(managers, (list, tuple)) else [managers]
    cols = cols or _grid_cols(cms[0].num_blocks)
    rows = math.ceil(cms[0].num_blocks / cols)
    labels = cms[0].num_blocks <= 256 if labels is None else labels
    size = min(0.8, 8.0 / cols)
    fig, axes = plt.subplots(1, len(cms), squeeze=False,
                             figsize=(len(cms) * (cols * size + 1.2), rows * size + 0.8))
    for i, (ax, cm) in enumerate(zip(axes[0], cms)):
        _draw_pool(ax, cm, cols, labels=labels)
        ax.set_xlim(0, cols)
        ax.set_ylim(-rows + 1, 1)
        ax.set_aspect("equal")
        ax.axis("off")
        used = cm.num_used_blocks
        default = f"layer {i}: {used} of {cm.num_blocks} blocks used"
        ax.set_title(titles[i] if titles else default, fontsize=9)
    live = sorted(set().union(*(cm.live_seq_ids() for cm in cms)))
    _legend(axes[0][-1], live)
    fig.tight_layout()
    return fig


def plot_block_tables(cm, seq_ids=None, cols: int | None = None, title: str | None = None):
    """Each sequence's logical blocks (left) with an arrow to the physical block that holds them.

    Logical block j of a sequence holds its tokens j*block_size ... (j+1)*block_size - 1; the
    arrow shows where in the pool they really are. Returns the matplotlib Figure.
    """
    seq_ids = cm.live_seq_ids() if seq_ids is None else list(seq_ids)
    cols = cols or _grid_cols(cm.num_blocks)
    pool_rows = math.ceil(cm.num_blocks / cols)
    held = {s: cm.blocks_of(s) for s in seq_ids}
    width = max([len(b) for b in held.values()] + [1])
    lens = dict(zip(seq_ids, cm.seq_lens_for(seq_ids).tolist())) if seq_ids else {}
    left, gap = 2.2, 2.5                                  # label room, logical -> pool gap
    pool_x = left + width + gap
    height = max(len(seq_ids) * 1.4, pool_rows)
    fig, ax = plt.subplots(figsize=(min(16, 0.55 * (pool_x + cols) + 1.5), 0.55 * height + 1.2))
    corners = _draw_pool(ax, cm, cols, origin=(pool_x, 0.0), labels=cm.num_blocks <= 256)
    for r, s in enumerate(seq_ids):
        y = -r * 1.4
        ax.text(left - 0.2, y + 0.5, f"seq {s}\n{lens[s]} tokens", ha="right", va="center",
                fontsize=8)
        for j, b in enumerate(held[s]):
            in_block = min(cm.block_size, lens[s] - j * cm.block_size)
            ax.add_patch(Rectangle((left + j + 0.05, y + 0.05), 0.9, 0.9,
                                   facecolor=seq_color(s), alpha=0.25, edgecolor=EDGE_COLOR))
            ax.add_patch(Rectangle((left + j + 0.05, y + 0.05), 0.9,
                                   0.9 * in_block / cm.block_size, facecolor=seq_color(s)))
            ax.text(left + j + 0.5, y + 0.5, f"L{j}\n{in_block}/{cm.block_size}", ha="center",
                    va="center", fontsize=6.5)
            bx, by = corners[b]
            ax.add_patch(FancyArrowPatch((left + j + 0.5, y + 0.05), (bx + 0.05, by + 0.5),
                                         arrowstyle="-|>", mutation_scale=9, lw=0.8,
                                         color=seq_color(s), alpha=0.8,
                                         connectionstyle="arc3,rad=0.15", gid=f"arrow-{s}-{j}"))
    ax.text(left + width / 2, 1.3, "logical blocks", ha="center", fontsize=9)
    ax.text(pool_x + cols / 2, 1.3, "physical blocks (the pool)", ha="center", fontsize=9)
    ax.set_xlim(0, pool_x + cols + 0.2)
    ax.set_ylim(-height + 0.6, 1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def rich_pool(cm, cols: int | None = None, title: str = "KV block pool"):
    """The pool and the block tables as a rich renderable (print it with a rich Console)."""
    owner, filled = cm.pool_usage()
    cols = cols or _grid_cols(cm.num_blocks)
    digits = len(str(cm.num_blocks - 1))
    grid = Text()
    for b in range(cm.num_blocks):
        s = int(owner[b])
        style = "dim" if s < 0 else f"bold white on {seq_color(s)}"
        grid.append(f" {b:>{digits}} ", style=style)
        if b % cols == cols - 1 and b != cm.num_blocks - 1:
            grid.append("\n")
    used = cm.num_used_blocks
    pool = Panel(grid, title=f"{title}: {used} used, {cm.num_free_blocks} free",
                 expand=False)
    tables = Table(title="block tables (logical -> physical)", title_justify="left")
    tables.add_column("seq")
    tables.add_column("tokens", justify="right")
    tables.add_column("blocks")
    tables.add_column("empty slots in last block", justify="right")
    for s in cm.live_seq_ids():
        blocks = cm.blocks_of(s)
        n = int(cm.seq_lens_for([s])[0])
        tables.add_row(Text(f"seq {s}", style=f"bold {seq_color(s)}"), str(n),
                       " ".join(str(b) for b in blocks),
                       str(len(blocks) * cm.block_size - n))
    return Group(pool, tables)


# -- stage 3: what attention gathers -------------------------------------------------------------

def plot_gather(cache, seq_ids=None, layer: int = 0, cols: int | None = None, newest: bool = True,
                packed: bool = False):
    """One layer's pool, slot by slot (top), gathered into the contiguous (B, L) view (bottom).

    `cache` is a PagedCache (its `managers[layer]` is drawn) or a CacheManager. Row b of the
    view holds sequence seq_ids[b]'s tokens in order, L = the longest sequence; each group of
    `block_size` slots is copied from the physical block its block table names (arrows). Slots
    past a row's length are masked (hatched). With `packed`, the gather of a decode step whose
    rows differ in length: only the blocks each sequence holds, one sequence's after the other
    on one line (hatched: the slots of a last block past the sequence's length, copied but not
    read). With `newest`, each sequence's last token — the one a decode step just wrote at
    block = pos // block_size, offset = pos % block_size — is outlined in both places.
    Returns the matplotlib Figure.
    """
    cm = cache.managers[layer] if hasattr(cache, "managers") else cache
    seq_ids = cm.live_seq_ids() if seq_ids is None else list(seq_ids)
    bs, owner, filled = cm.block_size, *cm.pool_usage()
    lens = cm.seq_lens_for(seq_ids).tolist() if seq_ids else []
    held = {s: cm.blocks_of(s) for s in seq_ids}
    L = max(lens + [1])
    n = -(-L // bs)                                        # blocks per gathered row
    cols = cols or max(1, min(math.ceil(math.sqrt(2 * cm.num_blocks)), 64 // (bs + 1)))
    newest_slot = {s: (held[s][(m - 1) // bs], (m - 1) % bs) for s, m in zip(seq_ids, lens) if m}

    def cell(ax, x, y, color, alpha=1.0, hatch=None, gid=None, outline=False):
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=color, alpha=alpha, hatch=hatch,
                               edgecolor="black" if outline else EDGE_COLOR,
                               lw=2.0 if outline else 0.4, gid=gid))

    pool_rows = -(-cm.num_blocks // cols)
    view_top = -pool_rows * 1.5 - 1.5                      # the gathered view sits below the pool
    view_rows = 1 if packed else len(seq_ids)
    # where each sequence's part of the view starts: its own row, or after the one before it
    starts = list(itertools.accumulate([len(held[s]) * (bs + 0.5) + 1 for s in seq_ids],
                                       initial=2.0)) if packed else [2.0] * len(seq_ids)
    width = max(cols * (bs + 1), (starts[-1] if packed else n * (bs + 0.5) + 2))
    fig, ax = plt.subplots(figsize=(min(16, 0.32 * width + 1), 0.32 * (pool_rows * 1.5 + 1.5 * view_rows + 3) + 1))
    corner = {}
    for b in range(cm.num_blocks):                         # the pool: block b, slots 0..bs-1
        x0, y0 = (b % cols) * (bs + 1), -(b // cols) * 1.5
        corner[b] = (x0, y0)
        ax.text(x0 + bs / 2, y0 + 1.05, str(b), ha="center", fontsize=7)
        s = int(owner[b])
        for o in range(bs):
            full = s >= 0 and o < filled[b]
            cell(ax, x0 + o, y0, seq_color(s) if s >= 0 else FREE_COLOR,
                 alpha=1.0 if full or s < 0 else 0.25, gid=f"slot-{b}-{o}",
                 outline=newest and s in newest_slot and newest_slot[s] == (b, o))
    for r, (s, m) in enumerate(zip(seq_ids, lens)):        # the view: sequence r's positions
        y, x0 = (view_top, starts[r]) if packed else (view_top - r * 1.5, 2.0)
        if packed:
            ax.text(x0, y - 0.6, f"seq {s}", va="center", fontsize=8)
        else:
            ax.text(-0.3, y + 0.45, f"seq {s}", ha="right", va="center", fontsize=8)
        for p in range(len(held[s]) * bs if packed else L):
            j, x = p // bs, x0 + p + (p // bs) * 0.5
            if p < m:
                cell(ax, x, y, seq_color(s), gid=f"gathered-{s}-{p}-{held[s][j]}",
                     outline=newest and p == m - 1)
            else:
                cell(ax, x, y, FREE_COLOR, hatch="////", gid=f"masked-{s}-{p}")
        for j, b in enumerate(held[s]):                    # arrows: block table entry j -> block b
            bx, by = corner[b]
            x = x0 + j * (bs + 0.5) + bs / 2
            ax.text(x, y + 1.0, f"blk {b}", ha="center", fontsize=6.5)
            ax.add_patch(FancyArrowPatch((bx + bs / 2, by - 0.05), (x, y + 1.35),
                                         arrowstyle="-|>", mutation_scale=8, lw=0.7,
                                         color=seq_color(s), alpha=0.6,
                                         connectionstyle="arc3,rad=0.1", gid=f"gather-{s}-{j}"))
    if not packed:
        for j in range(n):                                 # positions under the last row
            ax.text(2 + j * (bs + 0.5), view_top - 1.5 * len(seq_ids) + 0.9, f"pos {j * bs}",
                    fontsize=6.5)
    ax.text(0, 1.8, f"layer {layer}: the pool, {cm.num_blocks} blocks x {bs} slots",
            fontsize=9)
    title = (f"packed ({sum(map(len, held.values()))} blocks): each sequence's own blocks, one "
             f"sequence after another, hatched = copied, not read") if packed else (
             f"gathered view ({len(seq_ids)}, L={L}): blocks in block-table order, hatched = masked")
    ax.text(0, view_top + 1.9, title, fontsize=9)
    ax.set_xlim(-2.5, width + 0.5)
    ax.set_ylim(view_top - 1.5 * max(view_rows, 1) + 1, 2.4)
    ax.set_aspect("equal")
    ax.axis("off")
    _legend(ax, seq_ids)
    fig.tight_layout()
    return fig


def plot_slots_held(runs, title: str | None = None, log: bool = True):
    """KV slots each cache holds (solid) beside the tokens stored in them (dashed), over runs.

    `runs` maps a label to one generation's moments: `cache.usage()` recorded after every token
    (`generate_static`'s callback), a (used, reserved) pair of per-sequence lists, which the
    contiguous and the paged cache both answer. The contiguous cache holds `max_seq_len` slots
    per row from the first token to the last; the paged cache holds the blocks its tokens fill,
    and a finished sequence's blocks go back at once. Returns the matplotlib Figure.
    """
    fig, ax = plt.subplots(figsize=(9, 3.4))
    stored = {}                                   # one dashed line per distinct series
    for k, (label, moments) in enumerate(runs.items()):
        ax.step(range(len(moments)), [sum(held) for _, held in moments], where="post",
                color=colormaps["tab10"](k), lw=1.8, label=f"{label}: slots held",
                gid=f"held-{label}")
        stored.setdefault(tuple(sum(used) for used, _ in moments), label)
    for series, label in stored.items():
        ax.step(range(len(series)), series, where="post", color="black", lw=1.0, ls="--",
                label="tokens stored" + (f" ({label})" if len(stored) > 1 else ""),
                gid=f"stored-{label}")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("tokens produced so far (each prefill, then each decode token)")
    ax.set_ylabel("KV slots per layer")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "what a static batch holds", fontsize=10, loc="left")
    fig.tight_layout()
    return fig


# -- stage 1: the contiguous cache ----------------------------------------------------------------

def plot_contiguous_cache(snapshots, max_seq_len: int, prompt_lens=None, titles=None,
                          show: int | None = None):
    """One heat map per snapshot: rows = sequences, columns = reserved slots.

    snapshots: a list of per-sequence stored-token counts (what `ContiguousCache.usage()[0]`
    returns); prompt_lens: each sequence's prompt length, so prompt and generated slots get
    their own colours (None: the split is not known, every stored token gets one colour).
    `show` limits the columns drawn (the rest are reserved and empty too). A title counts the
    reserved slots as rows x slots, so a batch's total is not mistaken for one row's length.
    """

    cols = show or max_seq_len
    rows = len(snapshots[0])
    fig, axes = plt.subplots(len(snapshots), 1, figsize=(10, max(2.0, 0.8 + 0.5 * rows * len(snapshots))),
                             squeeze=False)
    if prompt_lens is None:
        colors, labels = [FREE_COLOR, "#8172b3"], ["reserved, empty", "holds a token"]
    else:
        colors, labels = [FREE_COLOR, "#4c72b0", "#dd8452"], ["reserved, empty", "prompt", "generated"]
    cmap = ListedColormap(colors)
    for k, (ax, used) in enumerate(zip(axes[:, 0], snapshots)):
        grid = np.zeros((len(used), cols))
        for row, n in enumerate(used):
            p = n if prompt_lens is None else prompt_lens[row]
            grid[row, :min(n, p, cols)] = 1
            grid[row, min(p, cols):min(n, cols)] = 2
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(colors) - 1, aspect="auto",
                  interpolation="nearest")
        ax.set_yticks(range(len(used)), [f"seq {i}" for i in range(len(used))])
        total = len(used) * max_seq_len
        reserved = (f"{len(used)} rows x {max_seq_len:,} = {total:,}" if len(used) > 1
                    else f"{max_seq_len:,}")
        ax.set_title((titles[k] + " — " if titles else "") +
                     f"{sum(used):,} of {reserved} reserved slots hold a token "
                     f"({sum(used) / total:.1%})", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("slot (position in the row)" +
                           (f" — first {cols:,} of {max_seq_len:,} shown" if cols < max_seq_len else ""))
    fig.legend(handles=[Patch(color=c, label=l) for c, l in zip(colors, labels)],
               loc="upper right", ncol=len(colors), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig
