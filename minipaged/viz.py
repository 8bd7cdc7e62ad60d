"""Drawings shared by the notebooks, the chat and the README: matplotlib figures, rich renderables.

Stage 1 (the contiguous cache): `plot_contiguous_cache` draws each sequence's reserved row of
slots, coloured by what each slot holds — prompt, generated token, or nothing yet.

Stage 2 (the block pool): `plot_pool` draws a layer's physical blocks coloured by the sequence
that owns them, filled as far as that sequence has written; `plot_block_tables` draws each
sequence's logical blocks with an arrow to the physical block holding it; `rich_pool` renders
the same picture in a terminal. Every function reads a CacheManager, never changes it.
"""

from __future__ import annotations

import math

FREE_COLOR = "#e6e6e6"     # a free block
EDGE_COLOR = "#555555"


def seq_color(seq_id: int) -> str:
    """A sequence's colour (matplotlib's tab10, cycled), the same in figures and the terminal."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex
    return to_hex(colormaps["tab10"](seq_id % 10))


def _grid_cols(num_blocks: int) -> int:
    return max(1, min(32, math.ceil(math.sqrt(num_blocks))))


def _draw_pool(ax, cm, cols, origin=(0.0, 0.0), labels=True):
    """Block b at column b % cols, row b // cols (row 0 on top); returns {block: (x, y)} corners."""
    from matplotlib.patches import Rectangle
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
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=seq_color(s), label=f"seq {s}") for s in seq_ids]
    handles.append(Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)


def plot_pool(managers, cols: int | None = None, titles=None, labels: bool | None = None):
    """The physical pool of one CacheManager, or one panel per layer for a list of them.

    A block's colour says which sequence owns it (grey: free), its solid part how many of its
    `block_size` slots hold tokens. Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt
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
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle
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
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text
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


# -- stage 1: the contiguous cache ----------------------------------------------------------------

def plot_contiguous_cache(snapshots, max_seq_len: int, prompt_lens, titles=None, show: int | None = None):
    """One heat map per snapshot: rows = sequences, columns = reserved slots.

    snapshots: a list of per-sequence stored-token counts (what `ContiguousCache.usage()[0]`
    returns); prompt_lens: each sequence's prompt length, so prompt and generated slots get
    their own colours. `show` limits the columns drawn (the rest are reserved and empty too).
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    import numpy as np

    cols = show or max_seq_len
    fig, axes = plt.subplots(len(snapshots), 1, figsize=(10, 0.5 + 0.45 * len(prompt_lens) * len(snapshots)),
                             squeeze=False)
    cmap = ListedColormap([FREE_COLOR, "#4c72b0", "#dd8452"])    # empty, prompt, generated
    for k, (ax, used) in enumerate(zip(axes[:, 0], snapshots)):
        grid = np.zeros((len(used), cols))
        for row, (n, p) in enumerate(zip(used, prompt_lens)):
            grid[row, :min(n, p, cols)] = 1
            grid[row, min(p, cols):min(n, cols)] = 2
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(len(used)), [f"seq {i}" for i in range(len(used))])
        share = sum(used) / (len(used) * max_seq_len)
        ax.set_title((titles[k] + " — " if titles else "") +
                     f"{sum(used)} of {len(used) * max_seq_len} reserved slots hold a token ({share:.1%})",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("slot (position)" + (f" — first {cols} of {max_seq_len} shown" if cols < max_seq_len else ""))
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=c, label=l) for c, l in
                        zip(cmap.colors, ["reserved, empty", "prompt", "generated"])],
               loc="upper right", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


# -- the embedded model's training -----------------------------------------------------------------

def plot_loss_curve(history, report, path=None):
    """Training loss per step, with the held-out loss and the unigram baseline as lines."""
    import matplotlib
    import matplotlib.pyplot as plt

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


# -- stage 4: where KV memory goes -------------------------------------------------------------

KIND_COLORS = {"token states": "#4c72b0", "reservation": "#dd8452", "internal": "#c44e52",
               "external": "#8172b3", "idle": FREE_COLOR}


def _kind_legend(fig, extra=(), **kw):
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=c, edgecolor=EDGE_COLOR, lw=0.5, label=k)
               for k, c in KIND_COLORS.items()] + list(extra)
    fig.legend(handles=handles, ncol=len(handles), fontsize=8, frameon=False, **kw)


def _stacked_bars(ax, labels, rows):
    """rows: per bar, the five kinds' shares in percent (None: not known)."""
    bottoms = [0.0] * len(rows)
    for i, kind in enumerate(KIND_COLORS):
        heights = [r[i] or 0.0 for r in rows]
        ax.bar(range(len(rows)), heights, bottom=bottoms, color=KIND_COLORS[kind],
               edgecolor=EDGE_COLOR, lw=0.5, width=0.7)
        for x, (h, b) in enumerate(zip(heights, bottoms)):
            if h >= 4:
                ax.text(x, b + h / 2, f"{h:.1f}", ha="center", va="center", fontsize=7,
                        color="white" if kind != "idle" else "black")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of KV memory")


def plot_waste_bars(results, paper: bool = True):
    """Where the KV memory goes, per policy, in the style of the vLLM paper's Fig. 2.

    results: SimResults (shares averaged over the steps where requests wait for memory). With
    `paper`, a second panel shows the paper's own Fig. 2 numbers beside them.
    """
    import matplotlib.pyplot as plt
    from .fragmentation import PAPER_FIG2
    fig, axes = plt.subplots(1, 2 if paper else 1, squeeze=False,
                             figsize=(10 if paper else 5.5, 4.2),
                             gridspec_kw={"width_ratios": [1, 1] if paper else [1]})
    rows = [[100 * v for v in r.shares().values()] for r in results]
    _stacked_bars(axes[0][0], [r.policy.label.replace(", ", "\n") for r in results], rows)
    axes[0][0].set_title("this simulator", fontsize=10)
    if paper:
        ax = axes[0][1]
        rows = [list(v) + [0.0] for v in PAPER_FIG2.values()]
        _stacked_bars(ax, [k.replace(" (", "\n(") for k in PAPER_FIG2], rows)
        ax.bar([len(rows) - 1], [100 - rows[-1][0]], bottom=[rows[-1][0]], width=0.7,
               color="white", edgecolor=EDGE_COLOR, hatch="////", lw=0.5)
        ax.set_title("vLLM paper, Fig. 2", fontsize=10)
    from matplotlib.patches import Patch
    extra = [Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch="////", lw=0.5,
                   label="not broken down (paper)")] if paper else []
    _kind_legend(fig, loc="lower center", extra=extra)
    fig.suptitle("where the KV memory goes", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def plot_block_size_sweep(results):
    """Paged policies only: waste and block-table size against the block size."""
    import matplotlib.pyplot as plt
    paged = sorted((r for r in results if r.policy.kind == "paged"),
                   key=lambda r: r.policy.block_size)
    sizes = [r.policy.block_size for r in paged]
    shares = [r.shares() for r in paged]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    tail = [100 * (s["reservation"] + s["internal"]) for s in shares]
    ax.plot(sizes, tail, "o-", color=KIND_COLORS["reservation"],
            label="last blocks' empty slots (reservation + internal)")
    ax.plot(sizes, [100 * s["internal"] for s in shares], "s--", color=KIND_COLORS["internal"],
            label="of which never filled (internal)")
    ax.plot(sizes, [100 * s["idle"] for s in shares], "^:", color="#888888",
            label="free (idle)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("% of KV memory")
    ax.set_title("waste grows with the block", fontsize=10)
    ax.legend(fontsize=7.5, frameon=False)
    ax2.plot(sizes, [r.table_entries_per_request() for r in paged], "o-", color="#55a868")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xticks(sizes, [str(b) for b in sizes])
    ax2.set_xlabel("block size (tokens)")
    ax2.set_ylabel("block-table entries per running request")
    ax2.set_title("the table (and the kernel's gathers) shrink with it", fontsize=10)
    fig.tight_layout()
    return fig


def plot_concurrency(results):
    """Requests served at once under one KV budget (left); running requests over time (right)."""
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
    means = [r.mean_running() for r in results]
    base = means[0]
    colors = ["#c44e52" if r.policy.kind != "paged" else "#4c72b0" for r in results]
    ax.barh(range(len(results)), means, color=colors, edgecolor=EDGE_COLOR, lw=0.5)
    for i, m in enumerate(means):
        ax.text(m, i, f" {m:.0f}  ({m / base:.1f}x)", va="center", fontsize=8)
    ax.set_yticks(range(len(results)), [r.policy.label for r in results], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(means) * 1.3)
    ax.set_xlabel(f"requests running at once (mean while others wait), x = vs {results[0].policy.label}",
                  fontsize=8)
    gib = results[0].capacity * results[0].bytes_per_slot / 2**30
    ax.set_title(f"one KV budget: {results[0].capacity:,} token slots ({gib:.3g} GiB)", fontsize=10)
    cmap = colormaps["tab10"]
    for i, r in enumerate(results):
        if r.policy.kind != "paged" or r.policy.block_size == 16:
            ax2.plot(r.series["running"], lw=1, color=cmap(i % 10), label=r.policy.label)
    ax2.set_xlabel("step (one token per running request)")
    ax2.set_ylabel("requests running")
    ax2.set_title("the same trace, served: paged finishes first", fontsize=10)
    ax2.legend(fontsize=7.5, frameon=False)
    fig.tight_layout()
    return fig


def plot_workload(workload, bins: int = 60):
    """Histograms of a workload's prompt and output lengths, with their means."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    for ax, lens, what in zip(axes, (workload.prompt_lens, workload.output_lens),
                              ("prompt", "output")):
        ax.hist(lens, bins=bins, color="#4c72b0", alpha=0.8)
        ax.axvline(lens.mean(), color="#c44e52", ls="--", label=f"mean {lens.mean():.1f}")
        ax.set_xlabel(f"{what} length (tokens)")
        ax.set_ylabel("requests")
        ax.legend(fontsize=8, frameon=False)
    fig.suptitle(workload.describe(), fontsize=10)
    fig.tight_layout()
    return fig


def plot_waste_over_time(result, title: str | None = None):
    """One run's KV memory by kind, step by step (a stacked area, % of the KV memory)."""
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(9, 3.2))
    steps = np.arange(result.num_steps)
    ax.stackplot(steps, *[100 * result.series[k] / result.capacity for k in KIND_COLORS],
                 colors=list(KIND_COLORS.values()), lw=0)
    ax.set_xlim(0, result.num_steps)
    ax.set_ylim(0, 100)
    ax.set_xlabel("step")
    ax.set_ylabel("% of KV memory")
    ax.set_title(title or result.policy.label, fontsize=10)
    _kind_legend(fig, loc="upper right", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def plot_slot_map(slot_map, title: str = "", row_labels=None, cols: int | None = None,
                  marks=None):
    """Every slot coloured by kind: a paged pool's (num_blocks, block_size) map, one block a row,
    or a contiguous region's (capacity,) map cut into rows of `cols` slots. `marks` writes a
    label into slots, {flat slot index: text} (say, each request's name at its first slot)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    grid = np.asarray(slot_map)
    if grid.ndim == 1:
        cols = cols or 32
        grid = np.pad(grid, (0, -len(grid) % cols), constant_values=-1).reshape(-1, cols)
    rows, width = grid.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.3 * width), 0.9 + 0.3 * rows))
    cmap = ListedColormap(["white"] + list(KIND_COLORS.values()))
    ax.imshow(grid + 1, cmap=cmap, vmin=0, vmax=5, aspect="equal", interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, width), minor=True)
    ax.set_yticks(np.arange(-0.5, rows), minor=True)
    ax.grid(which="minor", color="white", lw=1)
    ax.tick_params(which="both", length=0)
    ax.set_xticks([])
    if row_labels is not None:
        ax.set_yticks(range(rows), row_labels, fontsize=7)
    else:
        ax.set_yticks([])
    for slot, text in (marks or {}).items():
        ax.text(slot % width, slot // width, text, ha="center", va="center", fontsize=8,
                color="white", fontweight="bold")
    ax.set_title(title, fontsize=10)
    _kind_legend(fig, loc="lower center")
    fig.tight_layout(rect=(0, 0.12 if rows < 6 else 0.06, 1, 1))
    return fig


def rich_policy_table(results, workload=None, budget_slots=None, bytes_per_slot=None):
    """The comparison as a rich Table: shares of KV memory, concurrency, steps, preemptions."""
    from rich.table import Table
    title = "where the KV memory goes (mean over the steps where requests wait for memory)"
    if workload is not None:
        title += f"\n{workload.describe()}"
    if budget_slots is not None and bytes_per_slot:
        title += (f"; KV budget {budget_slots:,} token slots = "
                  f"{budget_slots * bytes_per_slot / 2**30:.3g} GiB")
    table = Table(title=title)
    table.add_column("policy", no_wrap=True)
    for name in ("token\nstates", "reser-\nvation", "internal", "external", "idle",
                 "tokens /\nallocated", "running\n(mean)", "vs\n" + results[0].policy.kind,
                 "steps", "pre-\nempted"):
        table.add_column(name, justify="right")
    base = results[0].mean_running()
    for r in results:
        s = r.shares()
        table.add_row(r.policy.label + ("" if r.saturated else " *"),
                      *(f"{100 * s[k]:.1f}%" for k in KIND_COLORS),
                      f"{100 * r.token_share_of_allocated():.1f}%", f"{r.mean_running():.1f}",
                      f"{r.mean_running() / base:.1f}x", f"{r.num_steps:,}", f"{r.preemptions:,}")
    if not all(r.saturated for r in results):
        table.caption = ("* no request ever waited: the budget did not limit this policy, and its "
                         "shares are over all steps; offer more requests or a smaller budget")
    return table
