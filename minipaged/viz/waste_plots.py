"""Stage 4 drawn: where KV memory goes under each allocation policy."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from rich.table import Table

from ..fragmentation import PAPER_FIG2
from .pool import EDGE_COLOR, FREE_COLOR


KIND_COLORS = {"token states": "#4c72b0", "reservation": "#dd8452", "internal": "#c44e52",
               "external": "#8172b3", "idle": FREE_COLOR}


def _kind_legend(fig, extra=(), **kw):
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
    extra = [Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch="////", lw=0.5,
                   label="not broken down (paper)")] if paper else []
    _kind_legend(fig, loc="lower center", extra=extra)
    fig.suptitle("where the KV memory goes", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def plot_block_size_sweep(results):
    """Paged policies only: waste and block-table size against the block size."""
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
