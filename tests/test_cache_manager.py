"""The block allocator's claims, checked against a plain-Python model of what should be true.

The model keeps only each sequence's length; everything else (how many blocks it must hold,
which calls must fail) is derived from that with ceil(length / block_size), independently of
the code under test.
"""

import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from minipaged.benchmarks import bookkeeping as bench
from minipaged.cache_manager import PAD_BLOCK, CacheManager
from minipaged.kv_budget import bytes_per_block, num_blocks_for_budget
from minipaged.sizing import kv_budget_from_free_memory, make_cache_managers
from minipaged.errors import OutOfBlocksError, RequestError
from minipaged.model import ModelArgs
from minipaged.paged_cache import PagedCache

ROOT = Path(__file__).resolve().parents[1]


def make(num_blocks=16, block_size=4, max_seqs=8, max_blocks_per_seq=16, seed=0):
    return CacheManager(num_blocks, block_size, 2, 3, max_seqs, max_blocks_per_seq, seed=seed)


def snapshot(cm):
    """Everything a call could change: tables, lengths, free ids in order, the dice."""
    return (cm.block_table.clone(), cm.seq_lens.clone(), cm.num_blocks_held.clone(),
            list(cm.free_blocks._ids), cm.free_blocks._rng.getstate(), cm.live_seq_ids())


def assert_same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert a[3:] == b[3:]


def check_invariants(cm, lengths):
    """lengths: {seq_id: tokens}, the independent model."""
    bs = cm.block_size
    assert cm.live_seq_ids() == sorted(lengths)
    owned = []
    for s, n in lengths.items():
        blocks = cm.blocks_of(s)
        assert len(blocks) == math.ceil(n / bs), (s, n, blocks)
        row = cm.block_table[s].tolist()
        assert row == blocks + [PAD_BLOCK] * (cm.max_blocks_per_seq - len(blocks))
        assert all(0 <= b < cm.num_blocks for b in blocks)
        owned += blocks
    assert len(owned) == len(set(owned)), "a physical block belongs to two sequences"
    free = cm.free_blocks.ids()
    assert sorted(owned + free) == list(range(cm.num_blocks)), "free + used != all blocks"
    assert cm.num_free_blocks + cm.num_used_blocks == cm.num_blocks
    assert cm.num_used_blocks == len(owned)
    for s in range(cm.max_seqs):                    # rows of ended sequences are padding
        if s not in lengths:
            assert (cm.block_table[s] == PAD_BLOCK).all()
    if lengths:
        seqs = sorted(lengths)
        table = cm.block_table_for(seqs)
        width = max(1, max(math.ceil(lengths[s] / bs) for s in seqs))
        assert table.dtype == torch.int32 and tuple(table.shape) == (len(seqs), width)
        for row, s in zip(table.tolist(), seqs):
            blocks = cm.blocks_of(s)
            assert row == blocks + [PAD_BLOCK] * (width - len(blocks))
        assert cm.seq_lens_for(seqs).tolist() == [lengths[s] for s in seqs]
        assert cm.seq_lens_for(seqs).dtype == torch.int32


# -- thousands of random operations, checked after every one -----------------------------------

class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 20), block_size=st.sampled_from([1, 2, 3, 4, 16]),
                max_blocks_per_seq=st.integers(1, 12), seed=st.integers(0, 2**16))
    def setup(self, num_blocks, block_size, max_blocks_per_seq, seed):
        self.cm = make(num_blocks, block_size, 6, max_blocks_per_seq, seed)
        self.lengths = {}

    def _blocks_for(self, n):
        return math.ceil(n / self.cm.block_size)

    @rule(data=st.data(), seq=st.integers(0, 5))
    def reserve(self, data, seq):
        limit = self.cm.block_size * (self.cm.max_blocks_per_seq + 1)  # now and then too long
        tokens = data.draw(st.integers(0, limit))
        before, need = snapshot(self.cm), self._blocks_for(tokens)
        if seq in self.lengths:
            with pytest.raises(RequestError):
                self.cm.reserve(seq, tokens)
        elif need > self.cm.max_blocks_per_seq:
            with pytest.raises(RequestError):
                self.cm.reserve(seq, tokens)
        elif need > self.cm.num_free_blocks:
            event("reserve: out of blocks")
            with pytest.raises(OutOfBlocksError):
                self.cm.reserve(seq, tokens)
        else:
            assert len(self.cm.reserve(seq, tokens)) == need
            self.lengths[seq] = tokens
            return
        assert_same(before, snapshot(self.cm))

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def grow(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.lengths)), min_size=1,
                                  unique=True))
        n = data.draw(st.sampled_from([0, 1, 1, 1, 1, 2, self.cm.block_size]))
        new = {s: self.lengths[s] + n for s in seqs}
        need = sum(self._blocks_for(new[s]) - self._blocks_for(self.lengths[s]) for s in seqs)
        too_long = any(self._blocks_for(v) > self.cm.max_blocks_per_seq for v in new.values())
        before = snapshot(self.cm)
        if too_long or need > self.cm.num_free_blocks:
            event("grow: refused, too long" if too_long else "grow: out of blocks")
            with pytest.raises(RequestError if too_long else OutOfBlocksError):
                self.cm.grow(seqs, n)
            assert_same(before, snapshot(self.cm))
        else:
            event(f"grow: {'several' if len(seqs) > 1 else 'one'} sequence(s)")
            assert self.cm.grow(seqs, n) == need
            self.lengths.update(new)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        free_before = self.cm.num_free_blocks
        returned = self.cm.free(seq)
        assert len(returned) == self._blocks_for(self.lengths.pop(seq))
        assert self.cm.num_free_blocks == free_before + len(returned)

    @precondition(lambda self: self.cm.num_free_blocks == 0 or len(self.lengths) == 6)
    @rule()
    def end_everything(self):
        for s in list(self.lengths):
            self.cm.free(s)
        self.lengths.clear()
        assert self.cm.num_free_blocks == self.cm.num_blocks
        assert self.cm.free_blocks.ids() == list(range(self.cm.num_blocks))

    @invariant()
    def consistent(self):
        check_invariants(self.cm, self.lengths)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_long_random_program_over_layers():
    """3 layers driven in lockstep, as the paged cache drives them, for 3000 random operations."""
    rng = random.Random(1234)
    layers = [make(num_blocks=40, block_size=4, max_seqs=10, max_blocks_per_seq=12, seed=i)
              for i in range(3)]
    lengths, failures = {}, 0
    for _ in range(3000):
        op = rng.random()
        live = sorted(lengths)
        try:
            if op < 0.25 or not live:
                s, n = rng.randrange(10), rng.randrange(0, 30)
                if s in lengths:
                    continue
                for cm in layers:
                    cm.reserve(s, n)
                lengths[s] = n
            elif op < 0.85:
                seqs = rng.sample(live, rng.randint(1, len(live)))
                n = rng.choice([1, 1, 1, 3, 9])
                ids = torch.tensor(seqs) if rng.random() < 0.5 else seqs
                for cm in layers:
                    cm.grow(ids, n)
                for s in seqs:
                    lengths[s] += n
            else:
                s = rng.choice(live)
                for cm in layers:
                    cm.free(s)
                del lengths[s]
        except (OutOfBlocksError, RequestError):
            failures += 1     # identical layers fail on the first one: none of them changed
        for cm in layers:
            check_invariants(cm, lengths)
    assert failures > 50                     # the program really ran the pool dry, often
    logical = [[cm.blocks_of(s) for s in sorted(lengths)] for cm in layers]
    assert logical[0] != logical[1] != logical[2]     # same logical blocks, other physical ones
    for s in list(lengths):
        for cm in layers:
            cm.free(s)
    assert all(cm.num_free_blocks == cm.num_blocks for cm in layers)


# -- failures take nothing ------------------------------------------------------------------------

def test_grow_failing_halfway_changes_nothing_not_even_the_dice():
    cm, twin = make(num_blocks=11, block_size=4), make(num_blocks=11, block_size=4)
    for m in (cm, twin):
        for s in range(4):
            m.reserve(s, 8)                   # 4 sequences, 2 full blocks each: 3 blocks free
    before = snapshot(cm)
    with pytest.raises(OutOfBlocksError, match=r"needs 4 new block\(s\) but only 3 of 11"):
        cm.grow([0, 1, 2, 3], 1)              # the first three would fit, the fourth does not
    assert_same(before, snapshot(cm))
    assert cm.grow([0, 1, 2], 1) == twin.grow([0, 1, 2], 1) == 3
    assert [cm.blocks_of(s) for s in range(4)] == [twin.blocks_of(s) for s in range(4)]


def test_too_long_for_the_table_is_refused_without_damage():
    cm = make(num_blocks=32, block_size=4, max_blocks_per_seq=3)
    cm.reserve(0, 12)
    before = snapshot(cm)
    with pytest.raises(RequestError, match="max_blocks_per_seq=3"):
        cm.grow([0], 1)
    assert_same(before, snapshot(cm))


# -- the random free set ------------------------------------------------------------------------

def allocation_order(seed, num_blocks=64):
    cm = make(num_blocks=num_blocks, block_size=2, max_blocks_per_seq=num_blocks, seed=seed)
    return cm.reserve(0, 2 * num_blocks)


def test_same_seed_same_order_other_seed_other_order():
    assert allocation_order(7) == allocation_order(7)
    orders = [tuple(allocation_order(seed)) for seed in range(10)]
    assert len(set(orders)) == 10
    for order in orders:
        assert sorted(order) == list(range(64)) and list(order) != sorted(order)


def test_first_pick_is_uniform_over_free_blocks():
    counts = [0] * 8
    for seed in range(4000):
        counts[make(num_blocks=8, block_size=1, seed=seed).reserve(0, 1)[0]] += 1
    assert all(400 <= c <= 600 for c in counts), counts    # 500 expected, sd about 21


def test_freed_blocks_are_reused():
    cm = make(num_blocks=6, block_size=4)
    cm.reserve(0, 9)                          # 3 blocks
    cm.reserve(1, 12)                         # the other 3: the pool is full
    returned = cm.free(0)
    assert cm.num_free_blocks == 3            # all three back: the seed kept one
    assert sorted(cm.reserve(2, 10)) == sorted(returned)


def test_layers_of_a_model_map_logical_blocks_to_different_physical_blocks():
    args = ModelArgs(dim=16, n_layers=4, n_heads=2, n_kv_heads=1, vocab_size=8, max_seq_len=64)
    cms = make_cache_managers(args, budget_bytes=200 * bytes_per_block(4, 1, 8, n_layers=4),
                              block_size=4, max_seqs=2)
    tables = []
    for cm in cms:
        cm.reserve(0, 30)
        tables.append(tuple(cm.blocks_of(0)))
    assert len(set(tables)) == 4


# -- the seed's picture and its corners -----------------------------------------------------------

def test_the_seed_articles_block_table():
    """{0: [7, 1, 3], 1: [5, 2]}: request A has 3 tokens in block 3, B has 2 in block 2."""
    cm = CacheManager(9, 4, 1, 1, max_seqs=2, max_blocks_per_seq=3, seed=96440)
    cm.reserve(0, 11)
    cm.reserve(1, 6)
    assert {s: cm.blocks_of(s) for s in (0, 1)} == {0: [7, 1, 3], 1: [5, 2]}
    assert cm.block_table_for([0, 1]).tolist() == [[7, 1, 3], [5, 2, -1]]
    owner, filled = cm.pool_usage()
    assert owner.tolist() == [-1, 0, 1, 0, -1, 1, -1, 0, -1]
    assert (filled[3], filled[2], filled[7], filled[5]) == (3, 2, 4, 4)


def test_a_prompt_filling_whole_blocks_takes_a_new_block_on_the_next_token():
    cm = make(block_size=4)
    assert len(cm.reserve(0, 8)) == 2         # the seed recorded 8 % 4 = 0 tokens in block 2
    assert cm.grow([0], 1) == 1 and len(cm.blocks_of(0)) == 3
    assert cm.grow([0], 3) == 0 and cm.grow([0], 1) == 1


def test_block_table_is_a_padded_copy_in_the_order_asked():
    cm = make(block_size=4)
    cm.reserve(3, 9)
    cm.reserve(5, 1)
    table = cm.block_table_for(torch.tensor([5, 3]))
    assert table.tolist() == [cm.blocks_of(5) + [-1, -1], cm.blocks_of(3)]
    table.fill_(0)
    assert cm.block_table_for([3])[0].tolist() == cm.blocks_of(3) != [0, 0, 0]


# -- sizing from bytes ----------------------------------------------------------------------------

def test_bytes_per_block_matches_llama3_8b():
    # Llama 3 8B in bf16: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB/token
    assert bytes_per_block(1, 8, 128, torch.bfloat16, n_layers=32) == 128 * 1024
    assert num_blocks_for_budget(2**30, 16, 8, 128, torch.bfloat16, 32) == 512
    assert num_blocks_for_budget(2**30 - 1, 16, 8, 128, torch.bfloat16, 32) == 511
    assert num_blocks_for_budget(2**30, 16, 8, 128, torch.float32, 32) == 256


def test_pools_built_from_a_budget_fit_in_it():
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=8, max_seq_len=256)
    budget = 5_000_000
    cms = make_cache_managers(args, budget, block_size=16, max_seqs=4, dtype=torch.bfloat16)
    used = sum(cm.k_cache_paged.nbytes + cm.v_cache_paged.nbytes for cm in cms)
    one_more = sum((cm.k_cache_paged.nbytes + cm.v_cache_paged.nbytes) // cm.num_blocks
                   for cm in cms)
    assert used <= budget < used + one_more
    assert cms[0].k_cache_paged.shape == (cms[0].num_blocks, 16, 2, 16)
    assert cms[0].max_blocks_per_seq == 256 // 16


def test_budget_errors_say_what_to_do():
    with pytest.raises(OutOfBlocksError, match="holds no block.*raise the budget"):
        num_blocks_for_budget(1000, 16, 8, 128, torch.bfloat16, 32)
    with pytest.raises(RequestError, match="give the KV budget in bytes"):
        kv_budget_from_free_memory(0.9, device="cpu")


# -- error messages -------------------------------------------------------------------------------

def test_errors_name_the_problem():
    cm = make(num_blocks=4, block_size=4)
    cm.reserve(0, 4)
    with pytest.raises(RequestError, match="already holds blocks"):
        cm.reserve(0, 4)
    with pytest.raises(RequestError, match=r"sequences \[3\] hold no blocks"):
        cm.grow([0, 3], 1)
    with pytest.raises(RequestError, match="appears twice"):
        cm.grow([0, 0], 1)
    with pytest.raises(RequestError, match="non-negative integer"):
        cm.grow([0], -1)
    with pytest.raises(RequestError, match="outside"):
        cm.reserve(99, 1)
    with pytest.raises(RequestError, match="no sequence ids"):
        cm.block_table_for([])
    with pytest.raises(OutOfBlocksError, match="Nothing was allocated"):
        cm.reserve(1, 17)
    cm.free(0)
    with pytest.raises(RequestError, match="already been freed"):
        cm.free(0)
    with pytest.raises(RequestError, match="num_blocks must be a positive integer"):
        CacheManager(0, 4, 1, 1, 1, 1)


# -- the benchmark runs ---------------------------------------------------------------------------

BAD_COUNTS = [1.5, float("nan"), True, 2**31, -1, "3", None, torch.tensor(2.0)]
BAD_IDS = [1.5, float("nan"), True, 2**31, "1", None, torch.tensor(1.0)]


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
def test_a_token_count_that_is_not_a_whole_number_is_refused_before_anything_changes(bad):
    cm = make()
    cm.reserve(1, 5)
    before = snapshot(cm)
    for call in (lambda: cm.reserve(2, bad), lambda: cm.grow([1], bad),
                 lambda: cm.blocks_needed([1], bad)):
        with pytest.raises(RequestError, match="token count must be a non-negative integer"):
            call()
        assert_same(snapshot(cm), before)


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_a_sequence_id_that_is_not_an_integer_is_refused_before_anything_changes(bad):
    """`free(1.5)` used to free sequence 1: every call that takes an id refuses it now."""
    cm = make()
    cm.reserve(1, 5)
    before = snapshot(cm)
    for call in (lambda: cm.free(bad), lambda: cm.reserve(bad, 3), lambda: cm.grow([bad], 1),
                 lambda: cm.blocks_of(bad), lambda: cm.block_table_for([bad]),
                 lambda: cm.seq_lens_for([bad])):
        with pytest.raises(RequestError):
            call()
        assert_same(snapshot(cm), before)
    with pytest.raises(RequestError, match="sequence ids must be integers"):
        cm.grow(torch.tensor([1.0]), 1)
    assert_same(snapshot(cm), before)


@pytest.mark.parametrize("bad", BAD_IDS[:4] + BAD_COUNTS[:4], ids=repr)
def test_a_paged_cache_refuses_such_ids_and_counts_in_every_layer(bad):
    args = ModelArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=64)
    cache = PagedCache(args, num_blocks=16, block_size=4, max_seqs=4, max_seq_len=64)
    cache.prepare([1], 5)
    before = [snapshot(m) for m in cache.managers]
    for call in (lambda: cache.prepare([bad], 1), lambda: cache.prepare([1], bad),
                 lambda: cache.free(bad)):
        with pytest.raises(RequestError):
            call()
        for m, b in zip(cache.managers, before):
            assert_same(snapshot(m), b)


def test_benchmark_runs_and_prints_both_implementations(capsys):
    bench.main(["--steps", "20", "--batch", "8", "--layers", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "Python loops, dicts" in out and "minipaged CacheManager" in out

