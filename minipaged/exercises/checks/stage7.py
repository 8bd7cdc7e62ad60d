"""Stage 7's checks: n-gram drafts and rollback."""

from __future__ import annotations

import functools

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ... import speculative
from ...cache_manager import PAD_BLOCK
from ...errors import OutOfBlocksError, RequestError
from ...model import ModelArgs
from ...sharing import SharedPagedCache
from ...speculative import SpeculativeEngine
from ..grader import expect
from .common import no_cache_greedy, prop, tiny_model


def _brute_force_drafts(tokens, k, min_n, max_n):
    """n-gram lookup written plainly: for n from max_n down to min_n, list every place before the
    end where the last n tokens appear, take the latest, return up to k tokens after it."""
    tokens = list(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue                               # no room for an earlier copy of the tail
        tail = tokens[len(tokens) - n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tail]
        if starts:
            i = max(starts)
            return tokens[i + n:i + n + k]
    return []


@prop(120)
@example([3, 3], 2, 1, 1, False)                       # the only match overlaps the tail
@example([5, 5], 4, 2, 3, False)                       # too short for n = 2
@example([1, 2, 1], 4, 1, 2, False)                    # fewer than k tokens follow the match
@example([4, 5, 4, 6, 4], 2, 1, 1, True)               # the latest match, not the first
@example([1, 2, 3, 4, 1, 2], 2, 1, 3, False)           # n = 2 found before n = 1 is tried
@example([7, 1, 2, 9, 1, 2, 9, 8, 2], 3, 2, 2, False)  # n = 1 would match, but min_n = 2
@example([1, 2, 1, 3, 2, 1], 3, 1, 2, False)           # the match at the very start
@example([], 3, 1, 4, False)
@example([1, 2, 3, 4, 5, 6, 0, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5], 2, 1, 4, False)   # n = 5 vs 4
@example([2, 3, 4, 5, 6, 9, 3, 4, 5, 7, 2, 3, 4, 5], 2, 1, 3, False)            # n = 4 vs 3
@given(st.lists(st.integers(0, 3), max_size=14), st.integers(1, 5), st.integers(1, 3),
       st.integers(0, 4), st.booleans())
def ngram_propose_matches_brute_force(tokens, k, min_n, extra, as_tuple):
    """ngram_propose(tokens, k, min_n, max_n) returns a list of up to k drafts: what followed the
    latest earlier occurrence of the last n tokens, trying n from max_n down to min_n (the tail
    itself is not an earlier occurrence); [] when none of those n-grams appeared before. Left
    out, min_n and max_n are 1 and 4."""
    max_n = min_n + extra
    given_tokens = tuple(tokens) if as_tuple else list(tokens)
    got = speculative.ngram_propose(given_tokens, k, min_n, max_n)
    want = _brute_force_drafts(tokens, k, min_n, max_n)
    call = f"ngram_propose({given_tokens!r}, k={k}, min_n={min_n}, max_n={max_n})"
    expect(isinstance(got, list), f"{call} returned {got!r}, a {type(got).__name__}: return a list")
    expect(got == want, f"{call} returned {got}, but the latest earlier match of the longest tail "
                        f"(n from {max_n} down to {min_n}) is followed by {want}")
    expect(list(given_tokens) == tokens, f"{call} changed the tokens it was given")
    got = speculative.ngram_propose(given_tokens, k)
    want = _brute_force_drafts(tokens, k, 1, 4)
    expect(got == want, f"ngram_propose({given_tokens!r}, k={k}) returned {got}, but with the "
                        f"default n-gram lengths (min_n=1, max_n=4) the drafts are {want}")


def _repetitive_prompts():
    """Prompts that repeat pieces of themselves, so n-gram lookup finds drafts."""
    gen = torch.Generator().manual_seed(4)
    out = []
    for length, reps in ((4, 3), (6, 2), (3, 4)):
        piece = torch.randint(0, 96, (length,), generator=gen).tolist()
        noise = torch.randint(0, 96, (2,), generator=gen).tolist()
        out.append(noise + piece * reps + noise[:1])
    return out


@functools.lru_cache(maxsize=None)
def _no_cache_continuations(n: int):
    return no_cache_greedy(_repetitive_prompts(), n)


def speculative_greedy_tokens():
    """The engine with n-gram speculation (k = 1, 3, 6 drafts; blocks of 1, 3, 4; with prefix
    caching and a small pool that preempts) gives the greedy tokens of the no-cache forward,
    as it does without speculation; drafts were verified, and every block is back in the pool."""
    model, n = tiny_model(), 14
    want = _no_cache_continuations(n)
    for k, bs, blocks, extra in ((3, 4, 64, {}), (6, 1, 96, {}), (1, 3, 40, {}),
                                 (3, 3, 64, {"prefix_caching": True}), (3, 2, 24, {})):
        for how in ((None, None), ("ngram", k)):
            engine = SpeculativeEngine(model, blocks, bs, max_num_seqs=4, backend="torch",
                                       speculative=how[0],
                                       num_speculative_tokens=how[1], **extra)
            for p in _repetitive_prompts():
                engine.add_request(p, n, stop_tokens=[])
            got = [r.output for r in engine.run()]
            what = (f"blocks of {bs}, {blocks} in the pool, " + (f"{k} drafts a step" if
                    how[0] else "no speculation") + (", prefix caching" if extra else ""))
            expect(got == want, f"{what}: the engine's greedy tokens are {got}, but the no-cache "
                                f"forward gives {want}")
            expect(engine.cache.num_free_blocks == blocks,
                   f"{what}: when every request finished, {blocks - engine.cache.num_free_blocks} "
                   f"block(s) were still held")
            if how[0]:
                expect(engine.spec.draft_tokens > 0, f"{what}: no draft was ever proposed on "
                                                     f"prompts that repeat themselves")


ROLL_OPS = st.lists(st.tuples(st.sampled_from(["prepare", "prepare", "fork", "roll", "roll", "roll",
                                               "free"]),
                              st.integers(0, 3), st.integers(0, 3), st.integers(-1, 8)),
                    min_size=1, max_size=16)


def _layer_state(cache):
    """Everything a rollback could touch, per layer: tables, lengths, counts, the free set."""
    return [(m.block_table.clone(), m.seq_lens.clone(), m.num_blocks_held.clone(),
             m.refs.copy(), sorted(m.free_blocks.ids())) for m in cache.managers]


@prop(80)
# in ("roll", a, b, n): n counts back from the end (-1: one past it); an odd b names blocks
@example(2, 10, 0, [("prepare", 0, 1, 5), ("prepare", 0, 1, 6), ("roll", 0, 1, 4)])
@example(3, 12, 0, [("prepare", 0, 0, 7), ("roll", 0, 1, 7), ("roll", 0, 0, 0)])  # to 0, twice
@example(2, 12, 0, [("prepare", 0, 0, 5), ("roll", 0, 0, 0), ("roll", 0, 0, -1)])
@example(2, 12, 0, [("prepare", 0, 0, 3), ("roll", 0, 0, 4)])                     # to -1
@example(2, 12, 1, [("prepare", 0, 0, 6), ("fork", 0, 1, 0), ("prepare", 1, 0, 4),
                    ("roll", 1, 1, 9), ("roll", 0, 0, 5)])          # a shared block loses one ref
@given(st.sampled_from([1, 2, 3]), st.integers(6, 16), st.integers(0, 99), ROLL_OPS)
def rollback_keeps_the_allocator_whole(block_size, num_blocks, seed, ops):
    """rollback(cache, s, n) on a SharedPagedCache (2 layers) between random prepare/fork/free
    calls: in every layer s keeps its first ceil(n / block_size) blocks in order, the rest of its
    table row is padded, its length is n; each block it let go loses exactly one reference and
    is free exactly when no table holds it; it returns the blocks per layer given back; its
    prefix-cache names are cut to its full blocks; no other sequence changes; n < 0 or n past
    the length raises RequestError and changes nothing."""
    args = ModelArgs(dim=8, n_layers=2, n_heads=1, n_kv_heads=1, vocab_size=8, max_seq_len=64)
    cache = SharedPagedCache(args, num_blocks, block_size, 4, 64, seed=seed)
    lens: dict[int, int] = {}
    log = []
    ceil = lambda n: -(-n // block_size)                                   # noqa: E731
    for op, a, b, n in ops:
        if op == "prepare" and n > 0:
            try:
                cache.prepare([a], n)
            except (OutOfBlocksError, RequestError):
                continue
            lens[a] = lens.get(a, 0) + n
            log.append(f"prepare([{a}], {n})")
            continue
        if op == "fork" and a in lens and b not in lens:
            cache.fork(a, b)
            lens[b] = lens[a]
            log.append(f"fork({a}, {b})")
            continue
        if op == "free" and a in lens:
            cache.free(a)
            del lens[a]
            log.append(f"free({a})")
            continue
        if op != "roll" or not lens:
            continue
        a = sorted(lens)[a % len(lens)]
        n = max(-1, lens[a] - n)                   # n counts tokens back from the end
        names = [f"name of block {j} of {a}" for j in range(lens[a] // block_size)]
        if b % 2:
            cache.hashes[a] = list(names)          # as the prefix cache keeps them
        else:
            cache.hashes.pop(a, None)
        other_names = {s: list(v) for s, v in cache.hashes.items() if s != a}
        before = _layer_state(cache)
        call = f"after {', '.join(log) or 'nothing'}: rollback(cache, {a}, {n})"
        where = f" (blocks of {block_size}, {num_blocks} in the pool, 2 layers)"
        if not 0 <= n <= lens[a]:
            try:
                speculative.rollback(cache, a, n)
                expect(False, f"{call}{where}: sequence {a} holds {lens[a]} tokens, so rolling it "
                              f"to {n} must raise RequestError")
            except RequestError:
                pass
            after = _layer_state(cache)
            expect(all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and
                       torch.equal(x[2], y[2]) and (x[3] == y[3]).all() and x[4] == y[4]
                       for x, y in zip(before, after)),
                   f"{call}{where}: a refused rollback changed the cache")
            continue
        got = speculative.rollback(cache, a, n)
        log.append(f"rollback({a}, {n})")
        keep = ceil(n)
        expect(got == ceil(lens[a]) - keep,
               f"{call}{where}: returned {got}; sequence {a} held {ceil(lens[a])} blocks and "
               f"keeps {keep}, so it gives back {ceil(lens[a]) - keep} per layer")
        for layer, (m, (table0, lens0, held0, refs0, free0)) in enumerate(zip(cache.managers,
                                                                             before)):
            at = f"{call}{where}, layer {layer}"
            old = [int(x) for x in table0[a, :int(held0[a])]]
            expect(m.blocks_of(a) == old[:keep],
                   f"{at}: sequence {a} holds {m.blocks_of(a)}, but it held {old} and must keep "
                   f"the first ceil({n} / {block_size}) = {keep} of them, in order")
            expect(int(m.seq_lens[a]) == n and int(m.num_blocks_held[a]) == keep,
                   f"{at}: sequence {a}'s length is {int(m.seq_lens[a])} holding "
                   f"{int(m.num_blocks_held[a])} blocks; it must be {n} holding {keep}")
            expect(bool((m.block_table[a, keep:] == PAD_BLOCK).all()),
                   f"{at}: sequence {a}'s table row is {m.block_table[a].tolist()}: every entry "
                   f"past its {keep} blocks must be PAD_BLOCK ({PAD_BLOCK})")
            others = [s for s in range(m.block_table.shape[0]) if s != a]
            expect(torch.equal(m.block_table[others], table0[others]) and
                   torch.equal(m.seq_lens[others], lens0[others]),
                   f"{at}: another sequence's table or length changed")
            refs = refs0.copy()
            for x in old[keep:]:
                refs[x] -= 1
            expect(m.refs.tolist() == refs.tolist(),
                   f"{at}: the reference counts are {m.refs.tolist()}, but each of the released "
                   f"blocks {old[keep:]} must lose exactly one, giving {refs.tolist()}")
            free = sorted(m.free_blocks.ids())
            expect(len(free) == len(set(free)),
                   f"{at}: the free set holds {free}: a block is in it twice")
            expect(set(free) == {x for x in range(num_blocks) if refs[x] == 0},
                   f"{at}: the free blocks are {free}, but the blocks no table holds are "
                   f"{[x for x in range(num_blocks) if refs[x] == 0]}")
        if b % 2:
            expect(cache.hashes.get(a) == names[:n // block_size],
                   f"{call}{where}: sequence {a}'s prefix-cache names are {cache.hashes.get(a)}; "
                   f"only its {n // block_size} full block(s) of kept tokens keep a name: "
                   f"{names[:n // block_size]}")
        expect({s: v for s, v in cache.hashes.items() if s != a} == other_names,
               f"{call}{where}: another sequence's prefix-cache names changed")
        lens[a] = n
