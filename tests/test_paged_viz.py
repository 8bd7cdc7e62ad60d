"""The stage-3 drawings: the gather shows, slot by slot, which physical block each position comes
from; the slots each cache holds over a static batch follow its tokens."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from conftest import tiny_model  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from minipaged import viz  # noqa: E402
from minipaged.cache_manager import CacheManager  # noqa: E402
from minipaged.generation import generate_static  # noqa: E402
from minipaged.paged_cache import PagedCache  # noqa: E402
from minipaged.paged_generation import generate_paged  # noqa: E402

BS = 4
# seq -> tokens after one decode step
LENGTHS = {0: 8, 1: 11, 2: 4}


def small_pool():
    cm = CacheManager(12, BS, 1, 2, max_seqs=3, max_blocks_per_seq=4, seed=3)
    for s, n in LENGTHS.items():
        cm.reserve(s, n - 1)
    cm.grow(list(LENGTHS), 1)                 # a decode step: each wrote its token at n - 1
    return cm


def gids(fig, kind):
    return {p.get_gid() for p in fig.axes[0].patches
            if (p.get_gid() or "").startswith(kind)}


def test_every_position_comes_from_the_block_its_table_names():
    cm = small_pool()
    fig = viz.plot_gather(cm, [0, 1, 2])
    L = max(LENGTHS.values())
    expected_cells, expected_masked = set(), set()
    for s, n in LENGTHS.items():
        blocks = cm.blocks_of(s)
        assert len(blocks) == -(-n // BS)
        expected_cells |= {f"gathered-{s}-{p}-{blocks[p // BS]}" for p in range(n)}
        expected_masked |= {f"masked-{s}-{p}" for p in range(n, L)}
    assert gids(fig, "gathered-") == expected_cells
    assert gids(fig, "masked-") == expected_masked
    assert gids(fig, "gather-") == {f"gather-{s}-{j}" for s, n in LENGTHS.items()
                                    for j in range(-(-n // BS))}
    plt.close(fig)


def test_packed_draws_each_sequences_own_blocks_one_after_another():
    """A decode step whose rows differ in length gathers only the blocks sequences own: the
    drawing's cells, left to right, are the block tables' entries, sequence after sequence."""
    cm = small_pool()
    fig = viz.plot_gather(cm, [0, 1, 2], packed=True)
    cells = sorted((p.get_x(), p.get_gid()) for p in fig.axes[0].patches
                   if (p.get_gid() or "").startswith(("gathered-", "masked-")))
    expected = []
    for s, n in LENGTHS.items():
        table = cm.block_table_for([s])[0].tolist()          # the manager's own table
        held = [b for b in table if b >= 0]
        assert len(held) == -(-n // BS)
        expected += [f"gathered-{s}-{p}-{held[p // BS]}" for p in range(n)]
        expected += [f"masked-{s}-{p}" for p in range(n, len(held) * BS)]   # a last block's tail
    assert [gid for _, gid in cells] == expected
    assert len({y for y in (p.get_y() for p in fig.axes[0].patches
                            if (p.get_gid() or "").startswith("gathered-"))}) == 1   # one line
    plt.close(fig)


def test_the_newest_token_is_outlined_at_block_pos_div_bs_offset_pos_mod_bs():
    cm = small_pool()
    fig = viz.plot_gather(cm, [0, 1, 2])
    thick = {p.get_gid() for p in fig.axes[0].patches
             if isinstance(p, Rectangle) and p.get_linewidth() >= 2}
    expected = set()
    for s, n in LENGTHS.items():
        pos = n - 1
        expected.add(f"slot-{cm.blocks_of(s)[pos // BS]}-{pos % BS}")
        expected.add(f"gathered-{s}-{pos}-{cm.blocks_of(s)[pos // BS]}")
    assert thick == expected
    plt.close(fig)


def test_a_paged_cache_is_drawn_per_layer():
    model = tiny_model(n_layers=2)
    cache = PagedCache(model.args, num_blocks=12, block_size=BS, max_seqs=3, max_seq_len=32,
                       dtype=torch.float64)
    for s, n in LENGTHS.items():
        cache.prepare([s], n)
    figs = [viz.plot_gather(cache, [0, 1, 2], layer=layer) for layer in (0, 1)]
    drawn = [gids(f, "gathered-") for f in figs]
    for layer, cells in enumerate(drawn):
        m = cache.managers[layer]
        assert cells == {f"gathered-{s}-{p}-{m.blocks_of(s)[p // BS]}"
                         for s, n in LENGTHS.items() for p in range(n)}
    assert drawn[0] != drawn[1]                # the two layers keep the tokens in other blocks
    assert all(isinstance(p, FancyArrowPatch) for p in figs[0].axes[0].patches
               if (p.get_gid() or "").startswith("gather-"))
    for f in figs:
        plt.close(f)


def test_slots_held_over_a_static_batch_on_each_cache():
    """The contiguous cache holds max_seq_len slots per row throughout; the paged cache holds
    ceil(tokens / block_size) blocks per sequence: counts derived here from the prompts."""
    model = tiny_model()
    prompts, n, max_seq_len = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]], 6, 32
    runs = {"contiguous": [], "paged": []}
    generate_static(model, prompts, n, stop_tokens=[], max_seq_len=max_seq_len,
                    callback=lambda e, i, t, c: runs["contiguous"].append(c.usage()))
    generate_paged(model, prompts, n, block_size=BS, stop_tokens=[], max_seq_len=max_seq_len,
                   callback=lambda e, i, t, c: runs["paged"].append(c.usage()))
    fig = viz.plot_slots_held(runs)
    lines = {line.get_gid(): list(line.get_ydata()) for line in fig.axes[0].lines}
    # each prompt's prefill, then decode steps 1 .. n-1 of all three rows (every row now k longer)
    stored = [sum(len(p) for p in prompts[:i + 1]) for i in range(len(prompts))]
    held = [sum(-(-len(p) // BS) * BS for p in prompts[:i + 1]) for i in range(len(prompts))]
    for k in range(1, n):
        stored += [sum(len(p) + k for p in prompts)] * len(prompts)
        held += [sum(-(-(len(p) + k) // BS) * BS for p in prompts)] * len(prompts)
    assert set(lines) == {"held-contiguous", "held-paged", "stored-contiguous"}
    assert lines["stored-contiguous"] == stored               # the same tokens on both caches
    assert lines["held-paged"] == held
    assert lines["held-contiguous"] == [len(prompts) * max_seq_len] * len(stored)
    plt.close(fig)
