"""Stage 2's checks: the block allocator (tasks 2.take, 2.reserve, 2.grow, 2.free)."""

from __future__ import annotations

import random

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ...cache_manager import PAD_BLOCK, CacheManager, FreeBlockSet
from ...errors import OutOfBlocksError, RequestError
from ...paged_cache import generate_paged
from ..grader import CheckFailed, expect
from .common import contiguous_tokens, expect_same_tokens, prompts_of, prop, tiny_model
from .stage6 import sampling_shares_blocks_and_keeps_tokens


@prop(30)
@given(st.integers(1, 12), st.integers(0, 2**16),
       st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=8))
def take_matches_the_documented_draw(num_blocks, seed, ops):
    """`take(k)` removes k distinct free ids, each drawn as the docstring says: index
    int(rng.random() * len(free)), swapped with the last id, popped (so a seed replays)."""
    fs = FreeBlockSet(num_blocks, seed)
    model, rng, taken = list(range(num_blocks)), random.Random(seed), []
    for is_take, k in ops:
        if is_take:
            k = min(k, len(model))
            want = []
            for _ in range(k):
                i = int(rng.random() * len(model))
                model[i], model[-1] = model[-1], model[i]
                want.append(model.pop())
            got = fs.take(k)
            expect(got == want, f"FreeBlockSet({num_blocks}, seed={seed}).take({k}) gave {got}; "
                                f"the draw described in the docstring gives {want}")
            taken += got
        elif taken:
            back = taken[:k]
            taken = taken[k:]
            fs.put(back)
            model.extend(back)
        expect(sorted(fs.ids()) == sorted(model) and len(fs) == len(model),
               f"after take/put the free set holds {sorted(fs.ids())}, but should hold "
               f"{sorted(model)}")


def _snapshot(cm: CacheManager):
    return (cm.block_table.clone(), cm.seq_lens.clone(), cm.num_blocks_held.clone(),
            sorted(cm.free_blocks.ids()), cm.free_blocks._rng.getstate(), cm.live_seq_ids())


def _same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


ALLOC_OPS = st.lists(st.tuples(st.sampled_from(["reserve", "grow", "grow", "free"]),
                               st.integers(0, 3), st.integers(0, 7),
                               st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True)),
                     min_size=1, max_size=14)


@prop(40)
@example(1, 3, 0, [("reserve", 0, 1, [0]), ("reserve", 1, 1, [0]), ("grow", 0, 1, [0, 1])])
@example(2, 4, 0, [("reserve", 0, 2, [0]), ("reserve", 1, 3, [0]), ("grow", 0, 1, [1, 0]),
                   ("free", 1, 0, [0]), ("reserve", 2, 7, [0])])
@given(st.integers(1, 4), st.integers(2, 10), st.integers(0, 99), ALLOC_OPS)
def allocator_matches_a_list_model(block_size, num_blocks, seed, ops):
    """A CacheManager driven by random reserve/grow/free calls agrees with a plain Python model:
    each sequence holds ceil(length / block_size) blocks, keeps its old blocks in order as it
    grows, no block has two owners, every block is either held or free, and a call that runs
    out of blocks raises OutOfBlocksError and changes nothing."""
    cm = CacheManager(num_blocks, block_size, 1, 1, max_seqs=4, max_blocks_per_seq=num_blocks,
                      seed=seed)
    lens: dict[int, int] = {}           # the model: seq -> tokens
    blocks: dict[int, list[int]] = {}   # seq -> its blocks, in order
    ceil = lambda n: -(-n // block_size)                                   # noqa: E731
    for op, s, n, group in ops:
        free_now = num_blocks - sum(len(b) for b in blocks.values())
        before = _snapshot(cm)
        if op == "reserve" and s not in lens:
            call = f"reserve({s}, {n})"
            if ceil(n) > free_now:
                try:
                    cm.reserve(s, n)
                    expect(False, f"{call} with {free_now} free blocks of {block_size} "
                                  f"should raise OutOfBlocksError")
                except (OutOfBlocksError, RequestError):
                    expect(_same(before, _snapshot(cm)), f"{call} ran out of blocks but "
                                                         f"changed the manager's state")
                continue
            got = cm.reserve(s, n)
            lens[s] = n
            blocks[s] = cm.blocks_of(s)
            expect(list(got) == blocks[s] and len(got) == ceil(n),
                   f"{call} returned {got}: it should return the {ceil(n)} block(s) it took "
                   f"for {n} tokens of {block_size} per block")
        elif op == "grow" and lens:
            seqs = [x for x in group if x in lens] or [min(lens)]
            call = f"grow({seqs}, {n}) (lengths {[lens[x] for x in seqs]})"
            need = sum(ceil(lens[x] + n) - ceil(lens[x]) for x in seqs)
            if need > free_now or max(ceil(lens[x] + n) for x in seqs) > num_blocks:
                try:
                    cm.grow(seqs, n)
                    expect(False, f"{call} needs {need} new blocks with {free_now} free (or a "
                                  f"table longer than {num_blocks}): it should raise "
                                  f"OutOfBlocksError (or RequestError)")
                except (OutOfBlocksError, RequestError):
                    expect(_same(before, _snapshot(cm)), f"{call} ran out of blocks but "
                                                         f"changed the manager's state")
                continue
            got = cm.grow(seqs, n)
            expect(got == need, f"{call} returned {got}; it took {need} new block(s)")
            for x in seqs:
                lens[x] += n
                now = cm.blocks_of(x)
                expect(now[:len(blocks[x])] == blocks[x],
                       f"after {call} sequence {x}'s blocks are {now}: it must keep its old "
                       f"blocks {blocks[x]} first, in order")
                blocks[x] = now
        elif op == "free" and s in lens:
            got = cm.free(s)
            expect(sorted(got) == sorted(blocks[s]),
                   f"free({s}) returned {got}, but sequence {s} held {blocks[s]}")
            del lens[s], blocks[s]
        else:
            continue
        _allocator_invariants(cm, lens, blocks, block_size, f"after {call if op != 'free' else f'free({s})'}")


def _allocator_invariants(cm, lens, blocks, block_size, when):
    ceil = lambda n: -(-n // block_size)                                   # noqa: E731
    held = []
    for s, n in lens.items():
        mine = cm.blocks_of(s)
        expect(len(mine) == ceil(n), f"{when}: sequence {s} has {n} tokens and holds "
                                     f"{len(mine)} blocks; it should hold ceil({n} / "
                                     f"{block_size}) = {ceil(n)}")
        expect(int(cm.seq_lens[s]) == n, f"{when}: seq_lens[{s}] is {int(cm.seq_lens[s])}, "
                                         f"but sequence {s} has {n} tokens")
        expect(mine == blocks[s], f"{when}: sequence {s}'s blocks changed to {mine}")
        expect(int(cm.num_blocks_held[s]) == len(mine),
               f"{when}: num_blocks_held[{s}] is {int(cm.num_blocks_held[s])}, but sequence {s} "
               f"holds {len(mine)} blocks")
        row = cm.block_table[s].tolist()
        expect(all(b == PAD_BLOCK for b in row[len(mine):]),
               f"{when}: block_table row {s} is {row}; past its blocks it must hold "
               f"PAD_BLOCK ({PAD_BLOCK})")
        held += mine
    expect(len(held) == len(set(held)), f"{when}: a block has two owners: {sorted(held)}")
    free = cm.free_blocks.ids()
    expect(sorted(held + free) == list(range(cm.num_blocks)),
           f"{when}: held blocks {sorted(held)} and free blocks {free} must together be every "
           f"block 0..{cm.num_blocks - 1}, each once")
    for s in range(cm.max_seqs):
        if s not in lens:
            expect(s not in cm and int(cm.seq_lens[s]) == 0 and
                   int(cm.num_blocks_held[s]) == 0 and
                   all(b == PAD_BLOCK for b in cm.block_table[s].tolist()),
                   f"{when}: sequence {s} was freed (or never started) but still has a length "
                   f"or blocks in the tables")
    expect(cm.live_seq_ids() == sorted(lens), f"{when}: the live sequences are "
                                              f"{cm.live_seq_ids()}, expected {sorted(lens)}")


def paged_cache_tokens():
    """Stage 3's paged cache on your allocator gives the contiguous cache's greedy tokens
    (prompts of 3, 9, 14; blocks of 4, so blocks are taken mid-generation)."""
    lengths, n = (3, 9, 14), 6
    got = generate_paged(tiny_model(), prompts_of(lengths), n, block_size=4, backend="torch",
                         stop_tokens=[])
    want = contiguous_tokens(lengths, n)
    expect_same_tokens(got, want, lengths, "on the paged cache", "the contiguous cache")


def later_stages_build_on_your_allocator():
    """Stage 6's SharedCacheManager inherits your reserve, grow and free and overrides the
    helpers they call (`_take`, `_release`: reference counts): parallel samples on shared
    blocks still give the contiguous cache's tokens."""
    try:
        sampling_shares_blocks_and_keeps_tokens()
    except CheckFailed as e:
        raise CheckFailed(f"stage 6 builds on your allocator and now goes wrong: {e}. Take and "
                          f"return blocks through self._take and self._release (stage 6 "
                          f"overrides them to count references), not self.free_blocks "
                          f"directly") from None
