"""Stage 3b's drawings show what the kernel does: each program's arrows go to the blocks its
table lists, the running max and sum drawn are the trace's, v2's shares are each partition's
exp(m_p - M) * l_p over the total, and the key layouts are the memory order of real tensors."""

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minipaged import viz  # noqa: E402
from minipaged.cache_manager import CacheManager  # noqa: E402
from minipaged.online_softmax import paged_attention_v1, paged_attention_v2  # noqa: E402

LENGTHS = [7, 22, 3]


def pool_and_trace():
    torch.manual_seed(0)
    cm = CacheManager(16, 4, 2, 8, max_seqs=3, max_blocks_per_seq=8, seed=3)
    cm.k_cache_paged.normal_()
    cm.v_cache_paged.normal_()
    for s, n in enumerate(LENGTHS):
        cm.reserve(s, n)
    table = cm.block_table_for([0, 1, 2]).clamp(min=0).long()
    args = (torch.randn(3, 1, 4, 8) * 2, cm.k_cache_paged, cm.v_cache_paged, table,
            cm.seq_lens_for([0, 1, 2]))
    return cm, args


def patches(fig, prefix, ax=0):
    return {p.get_gid(): p for p in fig.axes[ax].patches if (p.get_gid() or "").startswith(prefix)}


def test_each_program_points_at_the_blocks_its_table_lists():
    cm, _ = pool_and_trace()
    fig = viz.plot_program_grid(cm, n_heads=4)
    assert set(patches(fig, "program-")) == {f"program-{s}-{h}" for s in range(3) for h in range(2)}
    assert set(patches(fig, "reads-")) == {f"reads-{s}-{j}-{b}" for s in range(3)
                                           for j, b in enumerate(cm.blocks_of(s))}
    assert len(patches(fig, "reads-")) == sum(-(-n // 4) for n in LENGTHS)
    plt.close(fig)


def test_the_running_max_and_sum_drawn_are_the_traces():
    _, args = pool_and_trace()
    trace = []
    paged_attention_v1(*args, trace=trace)
    fig = viz.plot_running_softmax(trace, b=1, kv_head=0, row=1)
    steps = [s for s in trace if (s.b, s.kv_head) == (1, 0)]
    lines = {line.get_gid(): line for line in fig.axes[0].lines}
    before, mine = patches(fig, "l-before-", ax=1), patches(fig, "l-", ax=1)
    prev_m, prev_l = -math.inf, 0.0
    for s in steps:
        m, l = float(s.m[1]), float(s.l[1])
        assert lines[f"m-{s.j}"].get_ydata()[0] == pytest.approx(m)
        rescaled = math.exp(prev_m - m) * prev_l if math.isfinite(prev_m) else 0.0
        assert before[f"l-before-{s.j}"].get_height() == pytest.approx(rescaled, abs=1e-6)
        assert rescaled + mine[f"l-{s.j}"].get_height() == pytest.approx(l, rel=1e-6)
        prev_m, prev_l = m, l
    with pytest.raises(ValueError, match="no step"):
        viz.plot_running_softmax(trace, b=1, kv_head=5)
    plt.close(fig)


def test_v2_shares_are_each_partitions_worth_under_the_overall_max():
    _, args = pool_and_trace()
    parts = []
    paged_attention_v2(*args, partition_size=8, trace=parts)
    fig = viz.plot_partitions(parts, b=1, kv_head=1, row=0)
    mine = [p for p in parts if (p.b, p.kv_head) == (1, 1)]
    M = max(float(p.m[0]) for p in mine)
    worth = [math.exp(float(p.m[0]) - M) * float(p.l[0]) for p in mine]
    bars = [p for p in fig.axes[1].patches if p.get_gid() == "share"]
    assert [b.get_height() for b in bars] == pytest.approx([w / sum(worth) for w in worth])
    plt.close(fig)


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_key_layout_order_is_the_memory_order_of_a_real_tensor(layout):
    bs, Hk, D, x = 4, 2, 16, 8
    t, h, d = torch.meshgrid(torch.arange(bs), torch.arange(Hk), torch.arange(D), indexing="ij")
    code = t * 10_000 + h * 100 + d                                  # (bs, Hk, D): which key
    if layout == "vllm":                                             # (Hk, D / x, bs, x)
        code = code.view(bs, Hk, D // x, x).permute(1, 2, 0, 3).contiguous()
    memory = code.flatten()[::x].tolist()                            # every 16 bytes (fp16)
    expected = [(c // 10_000, c // 100 % 100, c % 100) for c in memory]
    assert viz.key_layout_order(layout, bs, Hk, D, x) == expected
    fig = viz.plot_key_layouts(block_size=bs, n_kv_heads=Hk, head_dim=D)
    plt.close(fig)


def test_tiles_cover_the_row_in_the_kernels_tile_size():
    """A row of 160 keys is walked in tiles of 64 keys (64, 64, then 32) at every block size."""
    fig = viz.plot_tiles_over_blocks(length=160, block_sizes=(1, 16, 256))
    for ax in fig.axes:
        tiles = sorted((p.get_x(), p.get_width()) for p in ax.patches
                       if (p.get_gid() or "").startswith("tile-"))
        assert tiles == [(0, 64), (64, 64), (128, 32)]
    plt.close(fig)
