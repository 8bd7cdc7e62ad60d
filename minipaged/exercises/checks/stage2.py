"""Stage 2's checks: the block allocator (tasks 2.take, 2.reserve, 2.grow, 2.free)."""

from __future__ import annotations

import random

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ...cache_manager import PAD_BLOCK, CacheManager, FreeBlockSet
from ...errors import OutOfBlocksError, RequestError
from ...paged_generation import generate_paged
from ..grader import CheckFailed, expect
from .common import contiguous_tokens, expect_same_tokens, prompts_of, prop, tiny_model
from .stage6 import sampling_shares_blocks_and_keeps_tokens


# the draws `take`'s docstring allows: each picks a uniform index into the free list
DRAWS = {"int(rng.random() * len(free))": lambda rng, n: int(rng.random() * n),
         "rng.randrange(len(free))": lambda rng, n: rng.randrange(n)}


@prop(30)
@given(st.integers(1, 12), st.integers(0, 2**16),
       st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=8))
def take_matches_the_documented_draw(num_blocks, seed, ops):
    """`take(k)` removes k distinct free ids, each drawn as the docstring says: a uniform index
    into the free list (int(rng.random() * len(free)) or rng.randrange(len(free)), one of the
    two throughout), swapped with the last id, popped (so a seed replays)."""
    fs = FreeBlockSet(num_blocks, seed)
    models = {name: (list(range(num_blocks)), random.Random(seed)) for name in DRAWS}
    taken = []
    for is_take, k in ops:
        k = min(k, len(fs))
        if is_take:
            got, wants = fs.take(k), {}
            for name, (model, rng) in models.items():
                want = []
                for _ in range(k):
                    i = DRAWS[name](rng, len(model))
                    model[i], model[-1] = model[-1], model[i]
                    want.append(model.pop())
                wants[name] = want
            expect(any(got == w for w in wants.values()),
                   f"FreeBlockSet({num_blocks}, seed={seed}).take({k}) gave {got}; the draws the "
                   f"docstring allows give " + " or ".join(f"{w} ({name})" for name, w in
                                                           wants.items()))
            models = {name: m for name, m in models.items() if wants[name] == got}
            taken += got
        elif taken:
            back, taken = taken[:k], taken[k:]
            fs.put(back)
            for model, _ in models.values():
                model.extend(back)
        model = next(iter(models.values()))[0]
        expect(sorted(fs.ids()) == sorted(model) and len(fs) == len(model),
               f"after take/put the free set holds {sorted(fs.ids())}, but should hold "
               f"{sorted(model)}")


def _snapshot(cm: CacheManager):
    return (cm.block_table.clone(), cm.seq_lens.clone(), cm.num_blocks_held.clone(),
            sorted(cm.free_blocks.ids()), cm.free_blocks._rng.getstate(), cm.live_seq_ids())


def _changes(before, after) -> str:
    """What differs between two snapshots, in words."""
    names = ("block_table", "seq_lens", "num_blocks_held", "the free blocks", None, "live ids")
    out = [f"{name} {b.tolist() if isinstance(b, torch.Tensor) else b} became "
           f"{a.tolist() if isinstance(a, torch.Tensor) else a}"
           for name, b, a in zip(names, before, after) if name and not _same([b], [a])]
    if not _same(before[4:5], after[4:5]):
        out.append("the free set's generator drew (a seed no longer replays)")
    return "; ".join(out)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


# (op, seq id, tokens, the ids a grow names, whether a grow keeps only live ids): ids run from
# -1 to 4 on a manager of 4 rows, so some are invalid, never started, or freed twice; a count
# of -1 tokens is invalid
ALLOC_OPS = st.lists(st.tuples(st.sampled_from(["reserve", "reserve", "grow", "grow", "free"]),
                               st.integers(-1, 4), st.integers(-1, 9),
                               st.lists(st.integers(-1, 4), min_size=1, max_size=4),
                               st.sampled_from([True, True, True, False])),
                     min_size=1, max_size=16)


def _refusal(op, s, n, group, lens, free_now, max_blocks, ceil):
    """Why the list model refuses the call (the exception it must raise, a reason), or None."""
    if op in ("reserve", "free") and not 0 <= s < 4:
        return RequestError, f"sequence id {s} is outside the table's rows [0, 4)"
    if op != "free" and n < 0:
        return RequestError, f"a token count of {n} is negative"
    if op == "reserve":
        if s in lens:
            return RequestError, f"sequence {s} is live: a new sequence needs an id that holds nothing"
        if ceil(n) > max_blocks:
            return RequestError, (f"{n} tokens need {ceil(n)} blocks, more than a table row's "
                                  f"max_blocks_per_seq={max_blocks}")
        if ceil(n) > free_now:
            return OutOfBlocksError, f"{n} tokens need {ceil(n)} blocks and {free_now} are free"
        return None
    if op == "free":
        return (RequestError, f"sequence {s} is not live (never started, or freed already)") \
            if s not in lens else None
    bad = [x for x in group if x not in lens]
    if bad:
        return RequestError, f"sequence(s) {bad} are not live"
    if len(set(group)) < len(group):
        return RequestError, f"the ids {group} repeat one"
    if max(ceil(lens[x] + n) for x in group) > max_blocks:
        return RequestError, f"a sequence would need more than max_blocks_per_seq={max_blocks} blocks"
    need = sum(ceil(lens[x] + n) - ceil(lens[x]) for x in group)
    if need > free_now:
        return OutOfBlocksError, f"it needs {need} new blocks and {free_now} are free"
    return None


@prop(50)
@example(2, 8, 2, 0, [("reserve", 0, 6, [0], True)])               # a prompt past its row
@example(2, 8, 2, 0, [("reserve", 0, 4, [0], True), ("grow", 0, 1, [0], True)])   # a row full
@example(2, 3, 3, 0, [("reserve", 0, 3, [0], True), ("reserve", 1, 3, [0], True)])  # 1 free, 2 asked
@example(2, 4, 4, 0, [("reserve", 0, 8, [0], True), ("reserve", 1, 1, [0], True)])  # an exact fill
@example(1, 6, 6, 0, [("grow", 0, 1, [1], False)])                    # grow a never-started id
@example(1, 6, 6, 0, [("reserve", 0, 2, [0], True), ("grow", 0, 1, [0, 0], False)])  # repeated
@example(1, 6, 6, 0, [("reserve", 0, 2, [0], True), ("reserve", 0, 1, [0], True)])   # live again
@example(1, 6, 6, 0, [("reserve", 0, 2, [0], True), ("free", 0, 0, [0], True),
                      ("free", 0, 0, [0], True)])                      # a double free
@example(1, 6, 6, 0, [("reserve", 4, 1, [0], True), ("free", -1, 0, [0], True)])  # outside
@example(1, 6, 6, 0, [("reserve", 0, -1, [0], True), ("reserve", 0, 1, [0], True),
                      ("grow", 0, -1, [0], True)])                     # a negative count
@example(1, 3, 3, 0, [("reserve", 0, 1, [0], True), ("reserve", 1, 1, [0], True),
                      ("grow", 0, 2, [0, 1], True)])                   # exactly the free blocks
@example(2, 4, 4, 0, [("reserve", 0, 2, [0], True), ("reserve", 1, 3, [0], True),
                      ("grow", 0, 1, [1, 0], True), ("free", 1, 0, [0], True),
                      ("reserve", 2, 7, [0], True)])
@given(st.integers(1, 4), st.integers(2, 10), st.integers(1, 10), st.integers(0, 99), ALLOC_OPS)
def allocator_matches_a_list_model(block_size, num_blocks, max_blocks, seed, ops):
    """A CacheManager driven by random reserve/grow/free calls agrees with a plain Python model:
    each sequence holds ceil(length / block_size) blocks, keeps its old blocks in order as it
    grows, no block has two owners, every block is either held or free. Rows may be shorter
    than the pool (max_blocks_per_seq below num_blocks), and ids may be invalid, never started,
    repeated or freed twice: a call the model refuses (a row too short: RequestError; too few
    free blocks: OutOfBlocksError; a bad id: RequestError) must raise and change nothing, and
    an exact fit must succeed."""
    max_blocks = min(max_blocks, num_blocks)
    cm = CacheManager(num_blocks, block_size, 1, 1, max_seqs=4, max_blocks_per_seq=max_blocks,
                      seed=seed)
    where = f"(blocks of {block_size}, {num_blocks} in the pool, rows of {max_blocks})"
    lens: dict[int, int] = {}           # the model: seq -> tokens
    blocks: dict[int, list[int]] = {}   # seq -> its blocks, in order
    ceil = lambda n: -(-n // block_size)                                   # noqa: E731
    log = []
    for op, s, n, group, live_only in ops:
        free_now = num_blocks - sum(len(b) for b in blocks.values())
        if op == "grow":
            group = ([x for x in group if x in lens] or sorted(lens)[:1]) if live_only else group
            if not group:
                continue
        call = {"reserve": f"reserve({s}, {n})", "free": f"free({s})",
                "grow": f"grow({group}, {n})"}[op]
        at = f"after {', '.join(log) or 'nothing'}: {call} {where}"
        refused = _refusal(op, s, n, group, lens, free_now, max_blocks, ceil)
        before = _snapshot(cm)
        if refused:
            error, reason = refused
            try:
                getattr(cm, op)(*{"reserve": (s, n), "free": (s,), "grow": (group, n)}[op])
                raised = None
            except (OutOfBlocksError, RequestError) as e:
                raised = e
            except Exception as e:                   # IndexError, KeyError, ...: not a refusal
                raise CheckFailed(f"{at} raised {type(e).__name__}: {e}; {reason}, so it must "
                                  f"raise {error.__name__} before changing anything") from None
            expect(raised is not None, f"{at} returned normally, but {reason}: it must raise "
                                       f"{error.__name__} and change nothing")
            after = _snapshot(cm)
            expect(_same(before, after),
                   f"{at} raised {type(raised).__name__} (right: {reason}) but changed the "
                   f"manager first: {_changes(before, after)}. Check everything before taking "
                   f"a block")
            continue
        log.append(call)
        if op == "reserve":
            got = cm.reserve(s, n)
            lens[s] = n
            blocks[s] = cm.blocks_of(s)
            expect(list(got) == blocks[s] and len(got) == ceil(n),
                   f"{at} returned {got}: it should return the {ceil(n)} block(s) it took "
                   f"for {n} tokens of {block_size} per block")
        elif op == "grow":
            need = sum(ceil(lens[x] + n) - ceil(lens[x]) for x in group)
            got = cm.grow(group, n)
            expect(got == need, f"{at} returned {got}; it took {need} new block(s)")
            for x in group:
                lens[x] += n
                now = cm.blocks_of(x)
                expect(now[:len(blocks[x])] == blocks[x],
                       f"{at}: sequence {x}'s blocks are {now}: it must keep its old "
                       f"blocks {blocks[x]} first, in order")
                blocks[x] = now
        else:
            got = cm.free(s)
            expect(sorted(got) == sorted(blocks[s]),
                   f"{at} returned {got}, but sequence {s} held {blocks[s]}")
            del lens[s], blocks[s]
        _allocator_invariants(cm, lens, blocks, block_size, at)


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
