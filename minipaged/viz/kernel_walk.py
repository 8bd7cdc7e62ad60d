"""Stage 3b drawn: the kernel's programs and the blocks they read, the online softmax of one row
block by block, v2's partitions and their merge, and what the key layout and block size mean
to the memory a kernel reads."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import colormaps
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from ..triton_attention import launch
from .pool import EDGE_COLOR, FREE_COLOR, _draw_pool, _grid_cols, seq_color

BLOCK_SHADES = ("#4c72b0", "#dd8452")      # alternate blocks along a row


# -- the grid ------------------------------------------------------------------------------------

def plot_program_grid(cm, seq_ids=None, n_heads: int | None = None, cols: int | None = None):
    """The kernel's grid next to the pool it reads: one program per (sequence, KV head), and
    an arrow from each sequence's programs to every block they read, numbered in walk order.

    `cm` is a CacheManager (one layer's pool); `n_heads` the query heads (default: as many as
    KV heads), so each program's label lists the query heads it serves. Every KV head of a
    sequence walks the same blocks (its own slice of each); slots past a sequence's length —
    the pale part of its last block — are never read. Returns the matplotlib Figure.
    """
    seq_ids = cm.live_seq_ids() if seq_ids is None else list(seq_ids)
    Hk = cm.k_cache_paged.shape[2]
    group = (n_heads or Hk) // Hk
    cols = cols or _grid_cols(cm.num_blocks)
    pool_rows = math.ceil(cm.num_blocks / cols)
    lens = dict(zip(seq_ids, cm.seq_lens_for(seq_ids).tolist())) if seq_ids else {}
    box_w, gap = 2.6, 3.0
    pool_x = Hk * box_w + gap
    height = max(len(seq_ids) * 1.4, pool_rows)
    fig, ax = plt.subplots(figsize=(min(16, 0.6 * (pool_x + cols) + 1.5), 0.6 * height + 1.4))
    corners = _draw_pool(ax, cm, cols, origin=(pool_x, 0.0))
    for r, s in enumerate(seq_ids):
        y = -r * 1.4
        ax.text(-0.2, y + 0.5, f"seq {s}\n{lens[s]} tokens", ha="right", va="center",
                fontsize=8)
        for h in range(Hk):
            heads = f"q {h * group}" if group == 1 else f"q {h * group}-{(h + 1) * group - 1}"
            ax.add_patch(Rectangle((h * box_w + 0.05, y + 0.05), box_w - 0.1, 0.9,
                                   facecolor=seq_color(s), alpha=0.3, edgecolor=EDGE_COLOR,
                                   gid=f"program-{s}-{h}"))
            ax.text(h * box_w + box_w / 2, y + 0.5, f"program ({r}, {h})\nkv head {h}, {heads}",
                    ha="center", va="center", fontsize=6.5)
        for j, b in enumerate(cm.blocks_of(s)):
            bx, by = corners[b]
            ax.add_patch(FancyArrowPatch((Hk * box_w, y + 0.5), (bx + 0.05, by + 0.5),
                                         arrowstyle="-|>", mutation_scale=9, lw=0.8,
                                         color=seq_color(s), alpha=0.8,
                                         connectionstyle="arc3,rad=0.12",
                                         gid=f"reads-{s}-{j}-{b}"))
            ax.text(bx + 0.12, by + 0.78, str(j + 1), fontsize=6, color=seq_color(s),
                    fontweight="bold")
    ax.text(Hk * box_w / 2, 1.3, f"the grid: {len(seq_ids)} sequences x {Hk} KV heads",
            ha="center", fontsize=9)
    ax.text(pool_x + cols / 2, 1.3, "the pool (numbers: the order a program reads its blocks)",
            ha="center", fontsize=9)
    ax.set_xlim(-2.2, pool_x + cols + 0.2)
    ax.set_ylim(-height + 0.6, 1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


# -- the online softmax of one row ----------------------------------------------------------------

def _program_steps(trace, b, kv_head):
    steps = [s for s in trace if (s.b, s.kv_head) == (b, kv_head)]
    if not steps:
        raise ValueError(f"the trace holds no step of program ({b}, {kv_head}): it read no block")
    return steps


def plot_running_softmax(trace, b: int = 0, kv_head: int = 0, row: int = 0):
    """One row of one program, block by block: the scores of each block it reads (top, dots,
    coloured by block) with the running max m after each block (line), and the running sum l
    (bottom), rescaled by exp(m_old - m_new) each time the max grows.

    `trace` is the list `paged_attention_v1(..., trace=trace)` fills. Returns the Figure.
    """
    steps = _program_steps(trace, b, kv_head)
    bs = steps[0].scores.shape[1]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.2),
                                      gridspec_kw={"height_ratios": [3, 2]})
    m_prev, l_prev = -math.inf, 0.0
    for k, s in enumerate(steps):
        pos = s.j * bs + np.arange(bs)
        scores = s.scores[row].double().numpy()
        seen = np.isfinite(scores)
        color = BLOCK_SHADES[k % 2]
        top.axvspan(s.j * bs - 0.5, (s.j + 1) * bs - 0.5, color=color, alpha=0.07)
        top.scatter(pos[seen], scores[seen], s=18, color=color, zorder=3, gid=f"scores-{s.j}")
        top.text((s.j + 0.5) * bs - 0.5, 1.0, f"blk {s.block}", transform=top.get_xaxis_transform(),
                 ha="center", va="bottom", fontsize=7, color=color)
        m, l = float(s.m[row]), float(s.l[row])
        top.plot([s.j * bs - 0.5, (s.j + 1) * bs - 0.5], [m, m], color="black", lw=1.6,
                 gid=f"m-{s.j}")
        # l = alpha * l_prev + this block's sum: the earlier blocks' part, rescaled, at the
        # bottom of the bar (grey), this block's on top.
        alpha = math.exp(m_prev - m) if math.isfinite(m_prev) else 0.0
        x = (s.j + 0.5) * bs - 0.5
        bottom.bar(x, alpha * l_prev, width=bs * 0.9, color="#999999", gid=f"l-before-{s.j}")
        bottom.bar(x, l - alpha * l_prev, bottom=alpha * l_prev, width=bs * 0.9, color=color,
                   alpha=0.8, gid=f"l-{s.j}")
        if math.isfinite(m_prev) and m > m_prev:         # the max grew: the old sum shrinks
            bottom.annotate(f"old sum x{alpha:.2f}", (x, l), xytext=(0, 3),
                            textcoords="offset points", ha="center", fontsize=7)
            top.annotate("", (s.j * bs - 0.5, m), (s.j * bs - 0.5, m_prev),
                         arrowprops=dict(arrowstyle="->", color="black", lw=0.8))
        m_prev, l_prev = m, l
    top.set_ylabel("score q·k / sqrt(d)")
    top.set_title(f"program ({b}, {kv_head}), row {row}: the running max m (line) after each "
                  f"block", fontsize=9, loc="left", pad=14)
    bottom.set_ylabel("running sum l")
    bottom.set_xlabel("key position (blocks of the row, in block-table order)")
    bottom.set_title(f"l = the earlier blocks' sum (grey; x exp(m_old - m_new) when m grows) "
                     f"+ this block's sum of exp(score - m); final l = {l_prev:.3g}", fontsize=9,
                     loc="left")
    fig.tight_layout()
    return fig


def plot_partitions(partitions, b: int = 0, kv_head: int = 0, row: int = 0):
    """v2 for one row: each partition's own max m_p and sum l_p (left), and what each is worth
    under the overall max M — exp(m_p - M) * l_p, its share of the softmax (right).

    `partitions` is the list `paged_attention_v2(..., trace=partitions)` fills. Returns the
    Figure.
    """
    parts = [p for p in partitions if (p.b, p.kv_head) == (b, kv_head)]
    m = np.array([float(p.m[row]) for p in parts])
    l = np.array([float(p.l[row]) for p in parts])
    M = m[np.isfinite(m)].max() if np.isfinite(m).any() else 0.0
    worth = np.where(np.isfinite(m), np.exp(np.where(np.isfinite(m), m - M, 0.0)), 0.0) * l
    labels = [f"p{p.p}\nblocks {p.blocks.start}-{p.blocks.stop - 1}" if len(p.blocks) else
              f"p{p.p}\n(none)" for p in parts]
    x = np.arange(len(parts))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.bar(x - 0.2, np.where(np.isfinite(m), m, 0.0), width=0.4, color="#4c72b0",
             label="max m_p", gid="m_p")
    left.bar(x + 0.2, l, width=0.4, color="#dd8452", label="sum l_p (under its own max)",
             gid="l_p")
    left.axhline(M, color="black", ls="--", lw=1, label=f"overall max M = {M:.3g}")
    left.set_xticks(x, labels, fontsize=7)
    left.legend(fontsize=7, frameon=False)
    left.set_title("each partition, walked on its own", fontsize=9, loc="left")
    share = worth / worth.sum()
    right.bar(x, share, color="#55a868", gid="share")
    for xi, w, sh in zip(x, np.exp(np.where(np.isfinite(m), m - M, -np.inf)), share):
        right.text(xi, sh, f"x{w:.2f}", ha="center", va="bottom", fontsize=7)
    right.set_xticks(x, labels, fontsize=7)
    right.set_ylabel("share of the softmax")
    right.set_title(f"merged: weight exp(m_p - M) (written above) x l_p; total "
                    f"L = {worth.sum():.3g}", fontsize=9, loc="left")
    fig.suptitle(f"v2, program ({b}, {kv_head}), row {row}: output = "
                 f"sum_p exp(m_p - M) acc_p / L", fontsize=9)
    fig.tight_layout()
    return fig


# -- memory: the key layout and the block size ---------------------------------------------------

def key_layout_order(layout: str, block_size: int, n_kv_heads: int, head_dim: int, x: int):
    """The 16-byte pieces of one block of keys, in address order: a list of
    (token, kv_head, first dim) for the layout "flash" — (num_blocks, block_size, n_kv_heads,
    head_dim), flash-attn's and this repository's — or "vllm" — vLLM's CUDA kernel's
    (num_blocks, n_kv_heads, head_dim / x, block_size, x), x elements to 16 bytes."""
    chunks = range(head_dim // x)
    if layout == "flash":
        return [(t, h, c * x) for t in range(block_size) for h in range(n_kv_heads) for c in chunks]
    if layout == "vllm":
        return [(t, h, c * x) for h in range(n_kv_heads) for c in chunks for t in range(block_size)]
    raise ValueError(f"layout must be 'flash' or 'vllm', not {layout!r}")


def plot_key_layouts(block_size: int = 8, n_kv_heads: int = 2, head_dim: int = 32,
                     element_bytes: int = 2, per_line: int = 16):
    """One block of keys laid out in memory, 16 bytes a cell, in both layouts. Cells of KV head
    0 are coloured by token; the outlined cells are what consecutive threads read when each
    loads the first 16 bytes of its own token — spread out in flash-attn's layout, side by side
    (one coalesced read) in vLLM's. Returns the Figure."""
    x = 16 // element_bytes
    cmap = colormaps["viridis"]
    fig, axes = plt.subplots(2, 1, figsize=(min(16, 0.75 * per_line + 1), 2.2 + 0.55 * (
        2 * math.ceil(block_size * n_kv_heads * head_dim / x / per_line))))
    titles = {"flash": f"(num_blocks, block_size={block_size}, n_kv_heads={n_kv_heads}, "
                       f"head_dim={head_dim}): flash-attn, minipaged",
              "vllm": f"(num_blocks, n_kv_heads, head_dim/x, block_size, x={x}): vLLM's "
                      f"paged_attention kernel"}
    for ax, layout in zip(axes, ("flash", "vllm")):
        order = key_layout_order(layout, block_size, n_kv_heads, head_dim, x)
        lines = math.ceil(len(order) / per_line)
        for a, (t, h, d0) in enumerate(order):
            cx, cy = a % per_line, -(a // per_line)
            read = h == 0 and d0 == 0
            color = cmap(t / max(1, block_size - 1)) if h == 0 else FREE_COLOR
            ax.add_patch(Rectangle((cx + 0.04, cy + 0.04), 0.92, 0.92, facecolor=color,
                                   edgecolor="red" if read else EDGE_COLOR, lw=2.2 if read else 0.4,
                                   gid=f"{layout}-{a}-t{t}-h{h}-d{d0}"))
            ax.text(cx + 0.5, cy + 0.5, f"t{t}\nd{d0}-{d0 + x - 1}", ha="center", va="center",
                    fontsize=5.5, color="white" if h == 0 and t < block_size / 2 else "black")
        reads = [a for a, (t, h, d0) in enumerate(order) if h == 0 and d0 == 0]
        span = (reads[-1] - reads[0] + 1) * 16
        ax.set_title(f"{titles[layout]}\nthe first 16 bytes of tokens 0-{block_size - 1} "
                     f"(outlined) span {span} bytes", fontsize=8, loc="left")
        ax.set_xlim(0, per_line)
        ax.set_ylim(-lines + 1, 1)
        ax.set_aspect("equal")
        ax.axis("off")
    axes[0].legend(handles=[Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR,
                                  label="other KV heads")],
                   loc="lower right", bbox_to_anchor=(1.0, 1.2), fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def plot_tiles_over_blocks(length: int = 160, block_sizes=(1, 3, 16, 256), group: int = 4):
    """One row of `length` keys cut into blocks (colour bands) and into the Triton kernel's
    tiles (black frames), for each block size: a tile spans several small blocks — one table
    lookup per key — or lies inside one big block. flash-attn 2 looks the table up once per
    tile and reads the whole tile from one block, so its blocks must hold whole tiles (of up
    to 256 keys). Returns the Figure."""
    fig, axes = plt.subplots(len(block_sizes), 1, figsize=(10, 0.9 * len(block_sizes) + 0.6),
                             squeeze=False)
    tile = launch(1, 1, group, 1).tile
    for ax, bs in zip(axes[:, 0], block_sizes):
        for p in range(length):
            ax.add_patch(Rectangle((p, 0), 1, 1, facecolor=BLOCK_SHADES[(p // bs) % 2],
                                   alpha=0.75, edgecolor="white", lw=0.3, gid=f"key-{bs}-{p}"))
        for first in range(0, length, tile):
            ax.add_patch(Rectangle((first, -0.08), min(tile, length - first), 1.16,
                                   fill=False, edgecolor="black", lw=1.6, gid=f"tile-{bs}-{first}"))
        spans = (f"{tile / bs:.3g} blocks" if bs < tile else "one block" if bs == tile
                 else f"1/{bs // tile} of a block")
        blocks = -(-length // bs)
        ax.text(0, 1.25, f"block size {bs}: {blocks} block{'s' * (blocks > 1)}; a tile of "
                f"{tile} keys spans {spans}", fontsize=8)
        ax.set_xlim(-0.5, length + 0.5)
        ax.set_ylim(-0.3, 1.9)
        ax.axis("off")
    axes[-1, 0].text(0, -0.3, f"key positions 0-{length - 1} of one row", fontsize=8, va="top")
    fig.tight_layout()
    return fig
