"""Stage 5 drawn: the scheduler's timeline, the pool over time, the benchmark."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from .pool import FREE_COLOR, seq_color


STATE_COLORS = {"waiting": "#d9d9d9", "preempted": "#d62728", "swapped": "#ff7f0e"}
STATE_STYLES = {                    # hatched, so no request's own colour is mistaken for them
    "waiting": dict(facecolor="#eeeeee", edgecolor="#bbbbbb", hatch=None),
    "preempted": dict(facecolor="white", edgecolor=STATE_COLORS["preempted"], hatch="////"),
    "swapped": dict(facecolor="white", edgecolor=STATE_COLORS["swapped"], hatch="xxxx"),
}


def _runs(history, req_id):
    """[(state, first step, number of steps)] for one request, from an engine's history."""
    runs = []
    for rec in history:
        state = rec.states.get(req_id)
        if runs and runs[-1][0] == state and runs[-1][1] + runs[-1][2] == rec.step:
            runs[-1][2] += 1
        elif state is not None:
            runs.append([state, rec.step, 1])
    return runs


def plot_timeline(history, title: str | None = None):
    """A Gantt chart of requests over engine steps: waiting (grey), running (the request's
    colour), preempted by recompute and waiting again (red hatching), swapped out (orange
    hatching); a cross marks each preemption. `history` is `Engine(record=True).history`."""
    req_ids = sorted({i for rec in history for i in rec.states})
    fig, ax = plt.subplots(figsize=(10, 0.7 + 0.32 * len(req_ids)))
    for row, i in enumerate(req_ids):
        for state, start, n in _runs(history, i):
            style = dict(facecolor=seq_color(i), edgecolor="white") if state == "running" \
                else STATE_STYLES[state]
            ax.broken_barh([(start, n)], (row - 0.38, 0.76), lw=0.5, **style)
    for rec in history:
        for i, mode in rec.preempted:
            ax.plot(rec.step, req_ids.index(i), marker="x", color="black", ms=6, mew=1.5)
    ax.set_yticks(range(len(req_ids)), [f"req {i}" for i in req_ids], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("engine step")
    ax.set_xlim(0, history[-1].step + 1)
    handles = [Patch(facecolor=seq_color(0), label="running (its own colour)")]
    handles += [Patch(label=state, **style) for state, style in STATE_STYLES.items()]
    handles.append(plt.Line2D([], [], marker="x", color="black", ls="", label="preempted here"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    ax.set_title(title or "requests over time", fontsize=10)
    fig.tight_layout()
    return fig


def plot_pool_over_time(history, num_blocks: int, title: str | None = None):
    """The KV pool over engine steps: blocks held by each request, stacked, free blocks on top;
    a dashed line at every step with a preemption (labelled R for recompute, S for swap)."""
    steps = [rec.step for rec in history]
    req_ids = sorted({i for rec in history for i in rec.blocks})
    layers = np.array([[rec.blocks.get(i, 0) for rec in history] for i in req_ids])  # (R, S)
    used = layers.sum(0) if len(req_ids) else np.zeros(len(steps))
    fig, ax = plt.subplots(figsize=(10, 3.6))
    if len(req_ids):
        ax.stackplot(steps, layers, colors=[seq_color(i) for i in req_ids], step="post",
                     labels=[f"req {i}" for i in req_ids], lw=0)
    ax.fill_between(steps, used, num_blocks, step="post", color=FREE_COLOR, label="free")
    for rec in history:
        if rec.preempted:
            ax.axvline(rec.step, color="black", ls="--", lw=0.8)
            modes = "".join("R" if m == "recompute" else "S" for _, m in rec.preempted)
            ax.text(rec.step, num_blocks * 1.01, modes, ha="center", va="bottom", fontsize=7)
    ax.set_xlim(steps[0], steps[-1] + 1)
    ax.set_ylim(0, num_blocks * 1.08)
    ax.set_xlabel("engine step")
    ax.set_ylabel("blocks (per layer)")
    ax.set_title(title or f"the pool over time: {num_blocks} blocks", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False,
              ncol=1 + len(req_ids) // 14)
    fig.tight_layout()
    return fig


def plot_preemption_costs(stats_by_mode, title: str | None = None):
    """Recompute vs swap from two runs of one trace: what each paid (`{mode: EngineStats}`).
    Recompute runs prompt tokens through the model again; swap copies bytes both ways."""
    modes = list(stats_by_mode)
    panels = [("preemptions", lambda s: s.preemptions),
              ("tokens prefilled again", lambda s: s.recomputed_tokens),
              ("KiB copied to/from the CPU pool", lambda s: s.swap_bytes / 1024),
              ("engine steps", lambda s: s.steps)]
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 2.8))
    colors = {"recompute": STATE_COLORS["preempted"], "swap": STATE_COLORS["swapped"]}
    for ax, (name, value) in zip(axes, panels):
        vals = [value(stats_by_mode[m]) for m in modes]
        ax.bar(modes, vals, color=[colors.get(m, "#4c72b0") for m in modes])
        for x, v in enumerate(vals):
            ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.margins(y=0.2)
    fig.suptitle(title or "what preemption cost", fontsize=10)
    fig.tight_layout()
    return fig


BENCH_COLORS = ["#8c8c8c", "#4c72b0", "#55a868"]      # (a) contiguous, (b) paged static, (c)


def plot_bench(results, title: str | None = None, timed: bool = True):
    """Bars for the serving benchmark's three servers (`benchmarks.serving.Result`s): generated
    tokens per second and the mean batch. With `timed=False`, the mean batch and the
    preemptions: no clock, so the figure is the same on every run and every machine."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    names = [r.name.replace(", ", ",\n") for r in results]
    panels = [("generated tokens / s", lambda r: r.tokens_per_s, ",.1f"),
              ("mean concurrent requests", lambda r: r.mean_concurrent, ",.1f")]
    if not timed:
        panels = panels[1:] + [("preemptions", lambda r: r.preemptions, ",d")]
    for ax, (label, get, fmt) in zip(axes, panels):
        vals = [get(r) for r in results]
        ax.barh(names, vals, color=BENCH_COLORS[:len(results)])
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:{fmt}}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=9)
        ax.margins(x=0.25)
    axes[1].set_yticks([])
    fig.suptitle(title or "one trace, one KV budget", fontsize=10)
    fig.tight_layout()
    return fig


def plot_throughput_vs_budget(budgets_bytes, results_per_budget, title: str | None = None):
    """Generated tokens per second (wall clock, and per CPU-second) against the KV memory
    budget, one line per server."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    mib = [b / 2**20 for b in budgets_bytes]
    panels = [("generated tokens / s (wall clock)", lambda r: r.tokens_per_s),
              ("generated tokens / CPU-second", lambda r: r.tokens_per_cpu_s)]
    for ax, (label, get) in zip(axes, panels):
        for k, color in enumerate(BENCH_COLORS):
            ys = [get(results[k]) for results in results_per_budget]
            ax.plot(mib, ys, marker="o", color=color, label=results_per_budget[0][k].name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(mib, [f"{m:g}" for m in mib])
        ax.set_xlabel("KV cache budget (MiB, all layers)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "throughput against KV memory", fontsize=10)
    fig.tight_layout()
    return fig
