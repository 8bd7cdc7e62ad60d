"""Stage 5b drawn: the tokens each step runs, and what a running request waits for.

Everything here reads an `Engine(record=True).history`: each StepRecord lists the requests that
decoded a token (`decoded`) and the prompt tokens each request ran (`prefilled`: a whole prompt
without a budget, a chunk with one).

Latency is drawn from a deterministic stand-in rather than a clock: the tokens the model ran
between two tokens of a request (`token_gaps`). A step's time grows with the tokens it runs, so
a step that prefills a long prompt shows up as a long gap for every request decoding beside it.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from .pool import seq_color

CHUNK_HATCH = "////"


def step_tokens(rec) -> int:
    """Tokens one step ran through the model: its decodes and its prompt tokens."""
    return len(rec.decoded) + sum(rec.prefilled.values())


def _draw_budget(ax, history, budget=None):
    """One bar per step, stacked: a slice per request, its colour, hatched for prompt tokens."""
    for rec in history:
        bottom = 0
        for i in sorted(rec.decoded):
            ax.bar(rec.step, 1, bottom=bottom, width=0.85, color=seq_color(i), lw=0)
            bottom += 1
        for i, n in sorted(rec.prefilled.items()):
            ax.bar(rec.step, n, bottom=bottom, width=0.85, color=seq_color(i), alpha=0.55,
                   hatch=CHUNK_HATCH, edgecolor="white", lw=0)
            bottom += n
    if budget is not None:
        ax.axhline(budget, color="black", ls="--", lw=1)
        ax.text(1.0, budget, f" budget {budget}", transform=ax.get_yaxis_transform(),
                va="center", fontsize=8)
    ax.set_ylabel("tokens in the step")


def plot_token_budget(panels, title: str | None = None):
    """Each step a bar of the tokens it ran, split per request: decode tokens solid, prompt
    tokens (a whole prompt, or a chunk) hatched. `panels` is a list of (label, history, budget
    or None), drawn one above the other on the same scales — the same trace with and without a
    budget, say."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.0 + 2.3 * len(panels)),
                             sharex=True, sharey=True, squeeze=False)
    for ax, (label, history, budget) in zip(axes[:, 0], panels):
        _draw_budget(ax, history, budget)
        ax.set_title(label, fontsize=9, loc="left")
    req_ids = sorted({i for _, h, _ in panels for rec in h
                      for i in list(rec.decoded) + list(rec.prefilled)})
    handles = [Patch(facecolor=seq_color(i), label=f"req {i}") for i in req_ids]
    handles += [Patch(facecolor="white", edgecolor="grey", hatch=CHUNK_HATCH,
                      label="prompt tokens (hatched)")]
    axes[0, 0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
                      frameon=False)
    axes[-1, 0].set_xlabel("engine step")
    fig.suptitle(title or "the tokens of every step", fontsize=10)
    fig.tight_layout()
    return fig


def token_gaps(history, req_id: int) -> list[int]:
    """The tokens the model ran between one token of a request and the next (steps it waited
    included), for every decode step of it: a deterministic stand-in for inter-token latency."""
    gaps, since = [], None
    for rec in history:
        if since is not None:
            since += step_tokens(rec)
        if req_id in rec.decoded:
            if since is not None:
                gaps.append(since)
            since = 0
    return gaps


def time_to_first_token(history, req_id: int) -> int:
    """Tokens the model ran from a request's arrival to its first token: through the last step
    that ran its prompt before it first decoded (or at all, if it never decoded)."""
    arrival = next(rec.step for rec in history if req_id in rec.states)
    first_decode = next((rec.step for rec in history if req_id in rec.decoded), None)
    last = max(rec.step for rec in history if req_id in rec.prefilled and
               (first_decode is None or rec.step < first_decode))
    return sum(step_tokens(rec) for rec in history if arrival <= rec.step <= last)


def plot_token_latency(runs, req_ids, title: str | None = None):
    """What the running requests `req_ids` wait for, per run (`{label: history}`): left, the
    tokens run between each of their tokens and the next (the largest over the requests, by
    token number); right, the largest such gap and the steps the whole trace took."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4),
                                      gridspec_kw=dict(width_ratios=[2.2, 1]))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(runs)))
    worst, steps = [], []
    for color, (label, history) in zip(colors, runs.items()):
        gaps = [token_gaps(history, i) for i in req_ids]
        longest = max(len(g) for g in gaps)
        per_token = [max(g[k] for g in gaps if k < len(g)) for k in range(longest)]
        left.plot(range(2, longest + 2), per_token, color=color, lw=1.3, label=label)
        worst.append(max(per_token))
        steps.append(len(history))
    left.set_xlabel("token number of a running request")
    left.set_ylabel("tokens run since its last token")
    left.set_yscale("log")
    left.legend(fontsize=8, frameon=False)
    x = np.arange(len(runs))
    right.bar(x, worst, color=colors, width=0.6)
    for xi, w in zip(x, worst):
        right.text(xi, w, f"{w}", ha="center", va="bottom", fontsize=8)
    right.set_xticks(x, [label.replace(", ", ",\n") for label in runs], fontsize=7)
    right.set_ylabel("largest gap (tokens)")
    twin = right.twinx()
    twin.plot(x, steps, color="black", marker="o", lw=1)
    twin.set_ylabel("steps for the whole trace")
    twin.set_ylim(0, max(steps) * 1.25)
    right.margins(y=0.2)
    fig.suptitle(title or "what a running request waits for", fontsize=10)
    fig.tight_layout()
    return fig
