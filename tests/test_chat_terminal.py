"""The chat's terminal views fit the terminal: `/blocks` in 80x24 (and more of it in a larger
one), replies broken into lines at words."""

import io
import random
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from minipaged import ModelArgs
from minipaged.chat.app import show_blocks
from minipaged.sharing import SharedPagedCache
from minipaged.viz.terminal import WordWrap


def pool(n_layers, num_blocks, context, tokens, block_size=16):
    """A chat's pool (tiny tensors) whose conversation (sequence 0) holds `tokens` tokens."""
    args = ModelArgs(dim=32, n_layers=n_layers, n_heads=2, n_kv_heads=1, vocab_size=64,
                     max_seq_len=context)
    cache = SharedPagedCache(args, num_blocks, block_size, 1, context, prefix_caching=True)
    if tokens:
        cache.prepare([0], tokens)
    return cache


def blocks_screen(cache, width, height):
    """What `/blocks` prints on a terminal of `width` x `height`, as lines of plain text."""
    out = io.StringIO()
    console = Console(file=out, width=width, height=height, color_system=None)
    show_blocks(SimpleNamespace(cache=cache, seq_id=0), [], console)
    return out.getvalue().rstrip("\n").split("\n")


CASES = {   # the embedded model's pool after a few turns, near its full context, and a
            # Llama 3 8B's (32 layers, 4,096 tokens in blocks of 16) after a long talk
    "embedded, 3 turns": (4, 128, 2048, 150),
    "embedded, nearly full": (4, 128, 2048, 1990),
    "8B, long talk": (32, 256, 4096, 3000),
    "fresh": (4, 128, 2048, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_blocks_fits_80_by_24(case):
    cache = pool(*CASES[case])
    lines = blocks_screen(cache, 80, 24)
    assert len(lines) <= 23, "\n".join(lines)                # and a line for the next prompt
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    cm = cache.managers[0]
    assert re.search(rf"layer 0 of {len(cache.managers)}: {cm.num_used_blocks} of "
                     rf"{cm.num_blocks} blocks used", lines[0])
    if not CASES[case][3]:
        assert "holds no blocks yet" in lines[-1]
        return
    text = "\n".join(lines)
    held = cm.blocks_of(0)
    assert f"you: {CASES[case][3]} tokens in {len(held)} blocks of 16" in text
    shown = {int(j): int(b) for j, b in re.findall(r"L(\d+)->(\d+) \(\d+/16\)", text)}
    assert all(held[j] == b for j, b in shown.items())       # each entry the allocator's
    left_out = re.search(r"L(\d+) to L(\d+): (\d+) more", text)
    if left_out:                                             # the rest counted, not drawn
        first, last, n = map(int, left_out.groups())
        assert n == last - first + 1 and set(shown) | set(range(first, last + 1)) == \
            set(range(len(held)))
    else:
        assert set(shown) == set(range(len(held)))
    layer_rows = [line for line in lines if re.match(r"\d+ +\d+ ", line)]
    assert layer_rows and all(int(line.split()[1]) == cache.managers[int(line.split()[0])]
                              .blocks_of(0)[0] for line in layer_rows)   # each layer's L0


def test_blocks_uses_a_larger_terminal():
    cache = pool(4, 128, 2048, 150)
    small, large = blocks_screen(cache, 80, 24), blocks_screen(cache, 160, 50)
    assert all(len(line) <= 160 for line in large) and len(large) <= 49
    ids = lambda lines: max(len(re.findall(r"\d+\*?(?= |$)", line)) for line in lines[:5])
    assert ids(large) > ids(small)                            # more blocks on a row
    assert len(re.findall(r"^\d+ ", "\n".join(large), re.M)) == 4    # every layer's row


TEXT = ("A block table maps each sequence's logical blocks to the physical blocks where its "
        "keys and values actually live, computed once per step.\nEntry i of a sequence's "
        "table is the block that holds its tokens i x block_size to (i + 1) x block_size - 1; "
        "supercalifragilisticexpialidociousandmore-than-a-line-long words are cut.")


@pytest.mark.parametrize("width", [20, 33, 80])
def test_streamed_text_wraps_at_words(width):
    rng = random.Random(width)
    wrap, out, i = WordWrap(width, column=7), [], 0
    while i < len(TEXT):                        # pieces of random length, as tokens arrive
        n = rng.randint(1, 6)
        out.append(wrap.push(TEXT[i:i + n]))
        i += n
    out.append(wrap.flush())
    lines = "".join(out).split("\n")
    assert len(" " * 7 + lines[0]) <= width and all(len(line) <= width for line in lines)
    long = "supercalifragilisticexpialidociousandmore-than-a-line-long"
    words = [w for w in TEXT.split() if len(w) <= width]
    assert [w for w in " ".join(lines).split() if len(w) <= width and w in TEXT.split()] == \
        [w for w in words]                      # every word that fits a line is whole
    assert "".join("".join(lines).split()) == "".join(TEXT.split())   # nothing lost
    assert len(long) <= width or all(len(p) <= width for p in lines)
