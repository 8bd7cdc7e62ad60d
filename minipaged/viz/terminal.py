"""The chat's live views, as rich renderables: the pool, a block table, the layers, the stats.

Every function reads a cache (a PagedCache, its CacheManagers, or a ContiguousCache) and returns
something a rich Console prints; none changes what it reads. `owners` maps a sequence id to a
(label, colour, mark) triple, so the chat can say "you" and the demo "conv 2" instead of
"seq 3"; the mark (one character after a block's id) shows the owner where there is no colour.
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.cells import cell_len
from rich.text import Text

from .pool import seq_color


def _owner(owners, s):
    return (owners or {}).get(s, (f"seq {s}", seq_color(s), "abcdefghijklmnopqrstuvwxyz"[s % 26]))


def pool_grid(cm, owners=None, cols: int = 16, title: str = "KV block pool",
              compact: bool = False, panel: bool = True):
    """One layer's physical blocks in a grid: each coloured by its owner, free ones dim.

    A block's cell shows its id and its owner's mark; a block whose owner has not filled it yet
    is drawn in the owner's colour on a dark background instead of filled with it. `compact`:
    one character a block (the owner's mark, `.` when free), each row led by its first block's
    id, for pools too large to show every id. `panel=False`: no frame, the title on a line of
    its own (two lines and four columns fewer)."""
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
        if compact:
            if b % cols == 0:
                grid.append(f"{b:>{digits}} ", style="dim")
            grid.append(mark if s >= 0 else ".", style=style)
            if b % cols == cols - 1 and b != cm.num_blocks - 1:
                grid.append("\n")
            continue
        grid.append(f"{b:>{digits}}{mark}", style=style)
        if b != cm.num_blocks - 1:
            grid.append("\n" if b % cols == cols - 1 else " ")
    legend = Text("  ")
    for s in cm.live_seq_ids():
        label, color, mark = _owner(owners, s)
        legend.append(f" {label} ({mark}) ", style=f"bold white on {color}")
        legend.append(f" {len(cm.blocks_of(s))} blocks  ")
    legend.append(f"{cm.num_free_blocks} free", style="dim")
    if compact:
        legend.append(" (.)", style="dim")
    heading = f"{title}: {cm.num_used_blocks} of {cm.num_blocks} blocks used"
    if not panel:
        return Text.assemble((heading, "bold"), "\n", grid, "\n", legend)
    return Panel(Text.assemble(grid, "\n", legend), title=heading, title_align="left",
                 expand=False)


def _entry(cm, j: int, b: int, n: int) -> str:
    return f"L{j}->{b} ({min(cm.block_size, n - j * cm.block_size)}/{cm.block_size})"


def block_table(cm, seq_id: int, owners=None, width: int = 80, max_rows: int | None = None):
    """A sequence's block table as `L0->17 (16/16)`: logical block, physical block, fill; as
    many entries a line as `width` holds, never one broken across lines. Past `max_rows`
    lines of entries, the middle ones are left out (and their count said)."""
    label, color, _ = _owner(owners, seq_id)
    n = int(cm.seq_lens_for([seq_id])[0])
    blocks = cm.blocks_of(seq_id)
    header = Text(f"{label}: {n} tokens in {len(blocks)} blocks of {cm.block_size} "
                  f"(logical -> physical)", style=f"bold {color}")
    entries = [_entry(cm, j, b, n) for j, b in enumerate(blocks)]
    cell = max(map(len, entries), default=1) + 2
    per_row = max(1, (width + 2) // cell)
    rows = [entries[i:i + per_row] for i in range(0, len(entries), per_row)]
    if max_rows is not None and len(rows) > max_rows:
        keep = max(1, max_rows - 1)
        head, tail = rows[:keep - 1], rows[-1:] if keep > 1 else []
        left_out = len(entries) - sum(map(len, head + tail))
        first = sum(map(len, head))
        rows = head + [[f"... L{first} to L{first + left_out - 1}: {left_out} more ..."]] + tail
    lines = ["".join(e.ljust(cell) for e in row).rstrip() for row in rows]
    return Text.assemble(header, *("\n" + line for line in lines))


def layers_table(cache, seq_id: int, max_blocks: int = 12, max_layers: int = 8):
    """The same logical blocks in every layer: each layer's pool hands out its own blocks.
    At most `max_blocks` columns and `max_layers` rows (the others are counted, not drawn)."""
    held = [m.blocks_of(seq_id) for m in cache.managers]
    n = len(held[0])
    shown = max(1, min(n, max_blocks))
    t = Table(title="each layer: its own pool, its own block table", title_justify="left",
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    t.add_column("layer")
    for j in range(min(n, shown)):
        t.add_column(f"L{j}", justify="right")
    if n > shown:
        t.add_column(f"+{n - shown}")
    rows = held if len(held) <= max_layers else held[:max(1, max_layers - 1)]   # and "+N"
    for layer, blocks in enumerate(rows):
        t.add_row(str(layer), *(str(b) for b in blocks[:shown]), *(["..."] if n > shown else []))
    if len(rows) < len(held):
        t.add_row(f"+{len(held) - len(rows)}", *(["..."] * min(n, shown)),
                  *(["..."] if n > shown else []))
    return t


def blocks_view(cache, seq_id: int, layer: int = 0, owners=None, width: int = 80,
                height: int = 24):
    """What `/blocks` prints: the pool of one layer, the block table, the layers side by side,
    in at most `width` columns and `height` lines (a terminal's size).

    The pool is framed with every block's id when all of it fits, unframed when that makes it
    fit, else drawn one character a block; the block table and then the per-layer table get
    the lines left, and say what they leave out."""
    if not hasattr(cache, "managers"):
        return contiguous_view(cache, seq_id, width=max(8, min(64, width - 2)))
    cm = cache.managers[layer]
    title = f"layer {layer} of {len(cache.managers)}"
    pools = [_pool(cm, owners, title, width, how) for how in ("framed", "bare", "compact")]
    if seq_id not in cm:
        pool = next((p for p in pools if _count_lines(p, width) < height), pools[-1])
        return Group(pool, Text("the conversation holds no blocks yet: say something first"))
    views = [_with_tables(cache, cm, seq_id, owners, pool, width, height) for pool in pools]
    return next((view for view, whole in views if whole), views[-1][0])


def _with_tables(cache, cm, seq_id, owners, pool, width: int, height: int):
    """(the view, whether it is whole: the block table's every entry, the per-layer table's
    every layer): the pool, then the block table and the per-layer table in the lines left."""
    n_blocks, n_layers = len(cm.blocks_of(seq_id)), len(cache.managers)
    layers_min = 4 if n_layers == 1 else 5    # title, header, rule, layer 0, "+N" (or layer 1)
    room = height - _count_lines(pool, width)
    table = block_table(cm, seq_id, owners, width=width, max_rows=max(1, room - layers_min - 1))
    whole = "more ..." not in table.plain
    room -= _count_lines(table, width)
    if room < layers_min:                     # no room left for the per-layer table
        return Group(pool, table), False
    for max_blocks in range(n_blocks, 0, -1):
        layers = layers_table(cache, seq_id, max_blocks=max_blocks, max_layers=room - 3)
        if _measure(layers, width) <= width:
            break
    whole = whole and room - 3 >= n_layers    # every layer's row (not every column)
    return Group(pool, table, layers), whole and _count_lines(pool, width) + \
        _count_lines(table, width) + _count_lines(layers, width) <= height


def _pool(cm, owners, title, width: int, how: str):
    """The pool grid: `framed` or `bare` with every block's id, or `compact`."""
    if how == "compact":
        digits = len(str(cm.num_blocks - 1))
        return pool_grid(cm, owners, max(8, min(64, (width - digits - 1) // 8 * 8)), title,
                         compact=True, panel=False)
    cell = len(str(cm.num_blocks - 1)) + 2              # id, mark, space
    inner = width - 4 if how == "framed" else width
    return pool_grid(cm, owners, max(1, min(32, (inner + 1) // cell)), title,
                     panel=how == "framed")


def _measure(renderable, width: int) -> int:
    """How wide `renderable` would be given all the room it asks for (rich would squeeze a
    wider one into `width`, cutting its cells to `…`)."""
    console = Console(width=10 * width, file=io.StringIO(), color_system=None)
    return Measurement.get(console, console.options, renderable).maximum


def _count_lines(renderable, width: int) -> int:
    """How many lines `renderable` takes on a console `width` columns wide."""
    console = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    return len(console.render_lines(renderable, console.options.update(width=width), pad=False))


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


class WordWrap:
    """Streamed text broken into lines of at most `width` columns at spaces, never inside a word
    (a word longer than a line is cut). `push(piece)` returns what can be printed now: a word
    is held until the character after it shows where it ends. `column`: where the cursor starts
    (after a prompt such as `model> `)."""

    def __init__(self, width: int, column: int = 0):
        self.width, self.column = max(2, width), column
        self.spaces, self.word = "", ""

    def push(self, piece: str) -> str:
        out = []
        for ch in piece:
            if ch == "\n":
                out.append(self._word() + "\n")
                self.column, self.spaces = 0, ""
            elif ch == " ":
                out.append(self._word())
                self.spaces += ch
            else:
                self.word += ch
        return "".join(out)

    def flush(self) -> str:
        return self._word()

    def _word(self) -> str:
        """The held word, after the spaces before it or on a new line."""
        word, self.word = self.word, ""
        if not word:
            return ""
        n, out = cell_len(word), ""
        if self.column + cell_len(self.spaces) + n <= self.width:
            out, self.column = self.spaces + word, self.column + cell_len(self.spaces) + n
        else:
            out, self.column = ("\n" if self.column else ""), 0
            while cell_len(word) > self.width:                # longer than a line: cut it
                out += word[:self.width] + "\n"
                word = word[self.width:]
            out += word
            self.column = cell_len(word)
        self.spaces = ""
        return out
