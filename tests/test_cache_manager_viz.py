"""The stage-2 drawings show what the CacheManager holds: checked on the seed article's example."""

import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402
from rich.console import Console  # noqa: E402

from minipaged import viz  # noqa: E402
from minipaged.cache_manager import CacheManager  # noqa: E402


def article_example(seed=96440):
    cm = CacheManager(9, 4, 1, 1, max_seqs=2, max_blocks_per_seq=3, seed=seed)
    cm.reserve(0, 11)     # request A: blocks 7, 1, 3 with 4 + 4 + 3 tokens
    cm.reserve(1, 6)      # request B: blocks 5, 2 with 4 + 2 tokens
    return cm


def fills(ax):
    """{block: (height, colour)} of the solid 'filled' rectangles the pool drawing made."""
    return {int(p.get_gid().split("-")[1]): (round(p.get_height(), 4), to_hex(p.get_facecolor()))
            for p in ax.patches
            if isinstance(p, Rectangle) and (p.get_gid() or "").startswith("fill-")}


def test_pool_colours_blocks_by_owner_and_fills_them_by_tokens():
    fig = viz.plot_pool(article_example())
    got = fills(fig.axes[0])
    a, b = viz.seq_color(0), viz.seq_color(1)
    assert got == {7: (0.9, a), 1: (0.9, a), 3: (round(0.9 * 3 / 4, 4), a),
                   5: (0.9, b), 2: (round(0.9 * 2 / 4, 4), b)}
    assert "5 of 9 blocks used" in fig.axes[0].get_title()
    plt.close(fig)


def test_one_panel_per_layer():
    fig = viz.plot_pool([article_example(), article_example(seed=1)])
    assert len(fig.axes) == 2
    assert fills(fig.axes[0]).keys() != fills(fig.axes[1]).keys()
    plt.close(fig)


def test_block_table_arrows_point_at_the_physical_blocks():
    cm = article_example()
    fig = viz.plot_block_tables(cm)
    arrows = {p.get_gid(): p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)}
    assert sorted(arrows) == ["arrow-0-0", "arrow-0-1", "arrow-0-2", "arrow-1-0", "arrow-1-1"]
    # every arrow ends at the left edge of its physical cell; cells sit in rows of 3 (9 blocks)
    ends = {gid: tuple(round(v, 2) for v in arrow._posA_posB[1])     # (start, end) in data units
            for gid, arrow in arrows.items()}
    pool_x = 2.2 + 3 + 2.5
    for gid, block in [("arrow-0-0", 7), ("arrow-0-1", 1), ("arrow-0-2", 3),
                       ("arrow-1-0", 5), ("arrow-1-1", 2)]:
        assert ends[gid] == (round(pool_x + block % 3 + 0.05, 2), round(-(block // 3) + 0.5, 2))
    plt.close(fig)


def test_rich_rendering_lists_the_tables():
    console = Console(record=True, width=100, color_system=None)
    console.print(viz.rich_pool(article_example()))
    text = console.export_text()
    assert "5 used, 4 free" in text
    assert re.search(r"seq 0\s*│\s*11\s*│\s*7 1 3\s*│\s*1\s*│", text)
    assert re.search(r"seq 1\s*│\s*6\s*│\s*5 2\s*│\s*2\s*│", text)
