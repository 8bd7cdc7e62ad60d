"""Stage 7 drawn: the lookahead slots of a verify step in the block table, which of them are
accepted, rejected and given back, the rollback across a block boundary, the copy-on-write of a
shared last block before drafts land in it, the acceptance rate against k, and the drafting
policy's choices step by step (`plot_draft_policy`).

The traces run stage 7's own code (`PagedCache.prepare` for the lookahead slots, `rollback`
after the verify pass) on a tiny SharedPagedCache with no model: the drawing needs the tables,
not the K/V.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ..model import ModelArgs
from ..sharing import SharedPagedCache
from ..speculative import rollback

SLOT_COLORS = {"kept": "#4c72b0", "last": "#8172b2", "draft": "#dd8452", "accepted": "#55a868",
               "rejected": "#c44e52", "empty": "white"}
SLOT_LABELS = {"kept": "in the cache before the step", "last": "last token (fed to the model)",
               "draft": "draft (lookahead slot)", "accepted": "accepted draft",
               "rejected": "rejected draft (past the length: overwritten later)",
               "empty": "empty slot"}


def _tiny_cache(num_blocks: int, block_size: int, seed: int) -> SharedPagedCache:
    args = ModelArgs(dim=2, n_layers=1, n_heads=1, n_kv_heads=1, vocab_size=8, multiple_of=1,
                     max_seq_len=64)
    return SharedPagedCache(args, num_blocks, block_size, 2, 64, seed=seed)


def _row(cache, s, title, states, freed=(), copied=None) -> dict:
    m = cache.managers[0]
    return {"title": title, "table": m.blocks_of(s), "block_size": cache.block_size,
            "states": list(states), "freed": list(freed), "copied": copied,
            "num_free": cache.num_free_blocks}


def speculation_trace(steps=((3, 1), (4, 4), (4, 0)), prompt_len: int = 6, block_size: int = 4,
                      num_blocks: int = 10, seed: int = 0) -> list[dict]:
    """One sequence through verify steps of (drafts, accepted): before each verify pass (the
    lookahead slots taken) and after its rollback. Rows for `plot_speculation_steps`."""
    cache = _tiny_cache(num_blocks, block_size, seed)
    cache.prepare([0], prompt_len - 1)          # the cache holds all but the newest token
    held = prompt_len - 1
    rows = [_row(cache, 0, f"start: {held} tokens cached", ["kept"] * held)]
    for i, (d, a) in enumerate(steps, 1):
        cache.prepare([0], 1 + d)               # lookahead: last token + d drafts
        before = ["kept"] * held + ["last"] + ["draft"] * d
        rows.append(_row(cache, 0, f"step {i}: verify 1 + {d} slots", before))
        old = cache.managers[0].blocks_of(0)
        rollback(cache, 0, held + 1 + a)
        kept = cache.managers[0].blocks_of(0)
        after = ["kept"] * held + ["last"] + ["accepted"] * a + ["rejected"] * (d - a)
        rows.append(_row(cache, 0, f"step {i}: {a} of {d} accepted", after,
                         freed=[b for b in old if b not in kept]))
        held += 1 + a
    return rows


def copy_on_write_trace(prompt_len: int = 6, drafts: int = 3, accepted: int = 1,
                        block_size: int = 4, seed: int = 0) -> list[dict]:
    """Two samples forked from one prompt share its partial last block; the second one's drafts
    would land in it, so growing copies it first. Rows for `plot_speculation_steps`."""
    cache = _tiny_cache(8, block_size, seed)
    n = prompt_len - 1
    cache.prepare([0], n)
    cache.fork(0, 1)
    rows = [_row(cache, 0, "sample 1 after the fork", ["kept"] * n),
            _row(cache, 1, "sample 2 after the fork", ["kept"] * n)]
    shared = cache.managers[0].blocks_of(1)[-1]
    cache.prepare([1], 1 + drafts)
    rows.append(_row(cache, 1, f"sample 2: verify 1 + {drafts} slots",
                     ["kept"] * n + ["last"] + ["draft"] * drafts,
                     copied=(shared, cache.managers[0].blocks_of(1)[n // block_size])))
    rollback(cache, 1, n + 1 + accepted)
    rows.append(_row(cache, 1, f"sample 2: {accepted} of {drafts} accepted",
                     ["kept"] * n + ["last"] + ["accepted"] * accepted +
                     ["rejected"] * (drafts - accepted)))
    rows.append(_row(cache, 0, "sample 1: untouched", ["kept"] * n))
    return rows


def plot_speculation_steps(rows, title: str = "Lookahead slots in the block table"):
    """One row per moment: the sequence's logical blocks left to right, each labelled with its
    physical block, slots coloured by what they hold; blocks a rollback gave back drawn dashed
    after them; a copy-on-write noted."""
    bs = rows[0]["block_size"]
    width = max(len(r["table"]) + len(r["freed"]) for r in rows) * (bs + 1)
    fig, ax = plt.subplots(figsize=(2.2 + 0.42 * width, 0.75 * len(rows) + 1.2))
    for y, r in enumerate(reversed(rows)):
        states = r["states"] + ["empty"] * (len(r["table"]) * bs - len(r["states"]))
        for j, b in enumerate(r["table"]):
            x0 = j * (bs + 1)
            for i in range(bs):
                state = states[j * bs + i]
                ax.add_patch(Rectangle((x0 + i, y), 1, 0.6, facecolor=SLOT_COLORS[state],
                                       edgecolor="black", lw=0.8))
            ax.text(x0 + bs / 2, y + 0.7, f"block {b}", ha="center", fontsize=8)
        for j, b in enumerate(r["freed"], start=len(r["table"])):
            x0 = j * (bs + 1)
            ax.add_patch(Rectangle((x0, y), bs, 0.6, facecolor="#eeeeee", edgecolor="grey",
                                   ls="--", lw=1.0))
            ax.text(x0 + bs / 2, y + 0.25, f"{b}: freed", ha="center", fontsize=8, color="grey")
        note = f"   (copy of block {r['copied'][0]} → {r['copied'][1]})" if r["copied"] else ""
        ax.text(-0.5, y + 0.3, r["title"] + note, ha="right", va="center", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black")
               for c in SLOT_COLORS.values()]
    ax.legend(handles, SLOT_LABELS.values(), loc="upper center", bbox_to_anchor=(0.5, -0.02),
              ncol=3, fontsize=8, frameon=False)
    ax.set_xlim(-0.5, width)
    ax.set_ylim(-0.2, len(rows))
    ax.axis("off")
    ax.set_title(f"{title} (block_size={bs})")
    fig.tight_layout()
    return fig


def plot_acceptance(results: dict, title: str = "n-gram drafts: what verification keeps"):
    """results: kind -> [(k, acceptance rate, tokens per step)]. Left: the share of drafts the
    model accepts against k; right: tokens a sequence gains per verify step (1 = no gain)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for kind, points in results.items():
        ks = [p[0] for p in points]
        left.plot(ks, [p[1] for p in points], marker="o", label=kind)
        right.plot(ks, [p[2] for p in points], marker="o", label=kind)
    left.set(xlabel="num_speculative_tokens k", ylabel="acceptance rate (accepted / drafted)",
             ylim=(0, 1))
    right.set(xlabel="num_speculative_tokens k", ylabel="tokens per step per sequence")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_draft_policy(trace, title: str = "The drafting policy, step by step"):
    """trace: `DraftPolicy(trace=[])`'s rows (step, req_id, k, found, drafts, kept). Left: the
    drafts each request could ask for at each step (k; 0 while it waits); right: how many of
    the drafts that ran the verify pass kept (colour: the share; blank: no draft ran; ×: lookup
    found drafts that the batch gate did not run)."""
    reqs = sorted({r["req_id"] for r in trace})
    steps = sorted({r["step"] for r in trace})
    col = {s: j for j, s in enumerate(steps)}
    k = np.full((len(reqs), len(steps)), np.nan)
    kept = np.full((len(reqs), len(steps)), np.nan)
    for r in trace:
        i, j = reqs.index(r["req_id"]), col[r["step"]]
        k[i, j] = r["k"]
        if r["drafts"]:
            kept[i, j] = r["kept"] / r["drafts"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(reqs) + 2.2), sharey=True)
    a = left.imshow(k, aspect="auto", cmap="Blues", vmin=0, vmax=np.nanmax(k) or 1)
    b = right.imshow(kept, aspect="auto", cmap="RdYlGn", vmin=0, vmax=1)
    for r in trace:
        i, j = reqs.index(r["req_id"]), col[r["step"]]
        if r["drafts"]:
            right.text(j, i, r["kept"], ha="center", va="center", fontsize=7)
        if r["found"] > r["drafts"]:
            right.text(j, i + 0.3, "×", ha="center", va="center", fontsize=7, color="grey")
    left.set(title="k: drafts the request may ask for (0: waiting)", xlabel="engine step",
             ylabel="request")
    right.set(title="drafts kept of those run (colour: share kept; ×: drafts found, not run)",
              xlabel="engine step")
    for ax in (left, right):
        ax.set_yticks(range(len(reqs)), [f"request {q}" for q in reqs])
        ax.set_xticks(range(0, len(steps), max(1, len(steps) // 12)),
                      [steps[j] for j in range(0, len(steps), max(1, len(steps) // 12))])
    fig.colorbar(a, ax=left, fraction=0.04, label="k")
    fig.colorbar(b, ax=right, fraction=0.04, label="share of the run drafts kept")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
