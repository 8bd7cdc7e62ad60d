"""Stage 6 properties: random fork / write / free / lookup programs against a plain model.

The test keeps its own record of what every sequence has written (its tokens, and a unique
number per written slot) and checks the CacheManager after every operation:
  - each block's count equals the number of block tables that hold it;
  - a block is free, or cached-free, exactly when its count is zero (and never both);
  - every sequence reads back exactly what it (or the parent it was forked from) wrote, so a
    write never changes what another sequence reads;
  - a prefix lookup returns only blocks whose tokens, and every token before them, match.
"""

import pytest
from hypothesis import given, settings, strategies as st

from minipaged.sharing import SharedCacheManager
from minipaged.errors import OutOfBlocksError
from minipaged.prefix_cache import block_hashes

BS, NUM_BLOCKS, MAX_SEQS, MAX_BLOCKS = 4, 14, 6, 6


class Model:
    """What the sequences should read: the test's own record, kept without the manager."""

    def __init__(self, prefix_caching):
        self.cm = SharedCacheManager(NUM_BLOCKS, BS, 1, 1, MAX_SEQS, MAX_BLOCKS, seed=3,
                               prefix_caching=prefix_caching)
        self.tokens, self.vals = {}, {}        # seq -> tokens, seq -> value written per slot
        self.full = {}                         # block -> (tokens up to its end, its values)
        self.counter = 0.0

    def write(self, s, start):
        """Write fresh values into slots start.. of s's tokens, then name the full blocks."""
        table = self.cm.blocks_of(s)
        for p in range(start, len(self.tokens[s])):
            self.counter += 1
            self.cm.k_cache_paged[table[p // BS], p % BS, 0, 0] = self.counter
            self.vals[s].append(self.counter)
        hashes = block_hashes(self.tokens[s], BS)
        for j in range(start // BS, len(self.tokens[s]) // BS):
            b = table[j]
            self.full[b] = (tuple(self.tokens[s][:(j + 1) * BS]),
                            tuple(self.vals[s][j * BS:(j + 1) * BS]))
            self.cm.name_block(s, j, hashes[j])

    def check(self):
        cm = self.cm
        held = {}
        for s in cm.live_seq_ids():
            for b in cm.blocks_of(s):
                held[b] = held.get(b, 0) + 1
        for b in range(NUM_BLOCKS):
            assert cm.refs[b] == held.get(b, 0), f"block {b}: count {cm.refs[b]}, tables {held}"
        free = set(cm.free_blocks.ids())
        cached = set(cm.prefix.cached_free) if cm.prefix is not None else set()
        assert not free & cached
        assert free | cached == {b for b in range(NUM_BLOCKS) if held.get(b, 0) == 0}
        assert cm.num_free_blocks == NUM_BLOCKS - len(held)
        k = cm.k_cache_paged[:, :, 0, 0]
        assert sorted(self.tokens) == cm.live_seq_ids()
        for s, vals in self.vals.items():
            table = cm.blocks_of(s)
            assert int(cm.seq_lens[s]) == len(self.tokens[s]) == len(vals)
            read = [float(k[table[p // BS], p % BS]) for p in range(len(vals))]
            assert read == vals, f"sequence {s} reads {read}, wrote {vals}"


def run_program(data, prefix_caching):
    m = Model(prefix_caching)
    seen = []                                     # prompts started so far
    for _ in range(data.draw(st.integers(5, 40), label="length")):
        live = sorted(m.tokens)
        idle = [s for s in range(MAX_SEQS) if s not in m.tokens]
        op = data.draw(st.sampled_from(["start", "start", "write", "write", "fork", "free"]))
        try:
            if op == "start" and idle:
                s = data.draw(st.sampled_from(idle))
                prompt = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=14))
                if seen and data.draw(st.booleans()):      # often: a prefix seen before
                    old = data.draw(st.sampled_from(seen))
                    prompt = (old[:data.draw(st.integers(len(old) // 2, len(old)))] + prompt)[:20]
                seen.append(prompt)
                usable = (len(prompt) - 1) // BS           # never the block of the last token
                hit = m.cm.match_prefix(block_hashes(prompt[:usable * BS], BS))
                for j, b in enumerate(hit):                # the chain finds only true matches
                    tokens, vals = m.full[b]
                    assert tokens == tuple(prompt[:(j + 1) * BS])
                    assert [float(x) for x in m.cm.k_cache_paged[b, :, 0, 0]] == list(vals)
                m.cm.reserve(s, len(prompt), prefix_blocks=hit)
                m.tokens[s] = list(prompt)
                m.vals[s] = [v for b in hit for v in m.full[b][1]]
                m.write(s, len(hit) * BS)
            elif op == "write" and live:
                s = data.draw(st.sampled_from(live))
                new = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=6))
                m.cm.grow([s], len(new))
                start = len(m.tokens[s])
                m.tokens[s] += new
                m.write(s, start)
            elif op == "fork" and live and idle:
                parent, child = data.draw(st.sampled_from(live)), data.draw(st.sampled_from(idle))
                m.cm.fork(parent, child)
                m.tokens[child], m.vals[child] = list(m.tokens[parent]), list(m.vals[parent])
            elif op == "free" and live:
                s = data.draw(st.sampled_from(live))
                m.cm.free(s)
                del m.tokens[s], m.vals[s]
        except OutOfBlocksError:
            pass                                  # refused: nothing may have changed
        except Exception as e:                    # the table is too short for a long sequence
            if "max_blocks_per_seq" not in str(e):
                raise
        m.check()
    return m


@pytest.mark.parametrize("prefix_caching", [False, True])
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_random_programs_keep_counts_isolation_and_the_hash_chain(prefix_caching, data):
    run_program(data, prefix_caching)


def test_fork_then_write_copies_the_shared_partial_block_once():
    cm = SharedCacheManager(8, 4, 1, 1, 4, 4, seed=0)
    cm.reserve(0, 6)                                         # blocks [a, b], b half full
    cm.k_cache_paged[:, :, 0, 0] = 7.0
    cm.fork(0, 1)
    cm.fork(0, 2)
    a, b = cm.blocks_of(0)
    assert cm.refs[a] == cm.refs[b] == 3
    assert cm.blocks_needed([0, 1, 2], 1) == 2              # the last writer keeps b
    cm.grow([0, 1, 2], 1)
    tables = [cm.blocks_of(s) for s in range(3)]
    assert all(t[0] == a for t in tables)                    # full block: still shared
    lasts = [t[1] for t in tables]
    assert len(set(lasts)) == 3 and b in lasts
    assert cm.refs[a] == 3 and all(cm.refs[x] == 1 for x in lasts)
    for x in lasts:                                          # each copy holds b's K/V
        assert float(cm.k_cache_paged[x, 0, 0, 0]) == 7.0
    assert cm.num_free_blocks == 8 - 4


def test_a_freed_named_block_is_cached_then_evicted_least_recently_freed_first():
    cm = SharedCacheManager(3, 2, 1, 1, 4, 4, seed=0, prefix_caching=True)
    hashes = {}
    for s, tokens in enumerate([[1, 1], [2, 2]]):
        cm.reserve(s, 2)
        hashes[s] = block_hashes(tokens, 2)[0]
        cm.name_block(s, 0, hashes[s])
    first, second = cm.blocks_of(0)[0], cm.blocks_of(1)[0]
    cm.free(0)
    cm.free(1)
    assert cm.num_free_blocks == 3 and cm.num_cached_free_blocks == 2
    assert cm.match_prefix([hashes[1]]) == [second]
    cm.reserve(2, 4)                      # needs 2: the free block, then the oldest cached one
    assert first in cm.blocks_of(2) and cm.match_prefix([hashes[0]]) == []
    assert cm.match_prefix([hashes[1]]) == [second]


def test_equal_blocks_at_different_positions_have_different_hashes():
    h = block_hashes([5, 5, 5, 5], 2)
    assert h[0] != h[1]
    assert block_hashes([1, 2, 5, 5], 2)[1] != h[1]          # same tokens, other parent
    assert block_hashes([5, 5, 5], 2) == h[:1]               # a partial block gets no hash
