"""The chat's live views, as rich renderables: the pool, a block table, the layers, the stats.

Every function reads a cache (a PagedCache, its CacheManagers, or a ContiguousCache) and returns
something a rich Console prints; none changes what it reads. `owners` maps a sequence id to a
(label, colour, mark) triple, so the chat can say "you" and the demo "conv 2" instead of
"seq 3"; the mark (one character after a block's id) shows the owner where there is no colour.
"""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .pool import seq_color


def _owner(owners, s):
    return (owners or {}).get(s, (f"seq {s}", seq_color(s), "abcdefghijklmnopqrstuvwxyz"[s % 26]))


def pool_grid(cm, owners=None, cols: int = 16, title: str = "KV block pool"):
    """One layer's physical blocks in a grid: each coloured by its owner, free ones dim.

    A block's cell shows its id; a block whose owner has not filled it yet is drawn in the
    owner's colour on a dark background instead of filled with it."""
    owner, filled = cm.pool_usage()
    digits = len(str(cm.num_blocks - 1))
    grid = Text()
    for b in range(cm.num_blocks):
        s = int(owner[b])
        if s < 0:
            style, mark = "dim", " "
        else:
            _, color, mark = _owner(owners, s)
            full = filled[b] == cm.block_size
            style = f"bold white on {color}" if full else f"bold {color} on grey23"
        grid.append(f"{b:>{digits}}{mark}", style=style)
        grid.append("\n" if b % cols == cols - 1 and b != cm.num_blocks - 1 else " ")
    legend = Text("  ")
    for s in cm.live_seq_ids():
        label, color, mark = _owner(owners, s)
        legend.append(f" {label} ({mark}) ", style=f"bold white on {color}")
        legend.append(f" {len(cm.blocks_of(s))} blocks  ")
    legend.append(f"{cm.num_free_blocks} free", style="dim")
    return Panel(Text.assemble(grid, "\n", legend), title=f"{title}: {cm.num_used_blocks} of "
                 f"{cm.num_blocks} blocks used", title_align="left", expand=False)


def block_table(cm, seq_id: int, owners=None):
    """A sequence's block table as `L0 -> 17 (16/16)`: logical block, physical block, fill."""
    label, color, _ = _owner(owners, seq_id)
    n = int(cm.seq_lens_for([seq_id])[0])
    out = Text(f"{label}: {n} tokens in {len(cm.blocks_of(seq_id))} blocks of "
               f"{cm.block_size} (logical -> physical)\n", style=f"bold {color}")
    for j, b in enumerate(cm.blocks_of(seq_id)):
        held = min(cm.block_size, n - j * cm.block_size)
        out.append(f"L{j}->{b} ({held}/{cm.block_size})")
        out.append("\n" if j % 6 == 5 else "   ")
    return out


def layers_table(cache, seq_id: int, max_blocks: int = 12, max_layers: int = 8):
    """The same logical blocks in every layer: each layer's pool hands out its own blocks."""
    held = [m.blocks_of(seq_id) for m in cache.managers]
    n = len(held[0])
    t = Table(title="each layer: its own pool, its own block table", title_justify="left")
    t.add_column("layer")
    for j in range(min(n, max_blocks)):
        t.add_column(f"L{j}", justify="right")
    if n > max_blocks:
        t.add_column("...")
    for layer, blocks in enumerate(held[:max_layers]):
        t.add_row(str(layer), *(str(b) for b in blocks[:max_blocks]),
                  *(["..."] if n > max_blocks else []))
    if len(held) > max_layers:
        t.add_row(f"+{len(held) - max_layers}", *(["..."] * min(n, max_blocks)),
                  *(["..."] if n > max_blocks else []))
    return t


def blocks_view(cache, seq_id: int, layer: int = 0, owners=None, cols: int = 16):
    """What `/blocks` prints: the pool of one layer, the block table, the layers side by side."""
    if not hasattr(cache, "managers"):
        return contiguous_view(cache, seq_id)
    cm = cache.managers[layer]
    parts = [pool_grid(cm, owners, cols, title=f"layer {layer} of {len(cache.managers)}")]
    if seq_id in cm:
        parts += [block_table(cm, seq_id, owners), layers_table(cache, seq_id)]
    else:
        parts.append(Text("the conversation holds no blocks yet: say something first"))
    return Group(*parts)


def contiguous_view(cache, seq_id: int, width: int = 64):
    """The contiguous cache's row for this conversation: reserved up front, filled in order."""
    n, total = int(cache.seq_lens[seq_id]), cache.max_seq_len
    used = min(width, -(-n * width // total)) if n else 0
    out = Text(f"contiguous cache: row {seq_id} reserves {total} slots in every layer; "
               f"{n} hold tokens ({n / total:.1%})\n")
    out.append("█" * used, style="bold green")
    out.append("░" * (width - used), style="dim")
    out.append(f"\none character = {total / width:g} slots; run without --cache contiguous "
               f"to see blocks")
    return out


def stats_table(rows, title: str = "KV memory of this conversation"):
    """A two-column table of (what, value) rows."""
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    for what, value in rows:
        t.add_row(what, value)
    return t


def status_line(info: dict, cache) -> str:
    """After a reply: speed, what the prefill processed, and the blocks in use."""
    rate = info["new_tokens"] / max(info["seconds"], 1e-9)
    line = (f"{info['new_tokens']} tokens, {rate:.0f} tok/s · prefill {info['prefill_tokens']} "
            f"new tokens of {info['history_tokens']} in the history")
    if info.get("cached_tokens"):
        line += f" ({info['cached_tokens']} found in the prefix cache)"
    if info.get("rebuilt"):
        line += f" (oldest {info['dropped']} exchange(s) dropped: cache rebuilt)"
    if hasattr(cache, "managers"):
        line += f" · blocks {cache.num_blocks - cache.num_free_blocks}/{cache.num_blocks} in use"
    return line
