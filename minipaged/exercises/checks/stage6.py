"""Stages 6 and 6b's checks: shared blocks, copy-on-write, the hash chain, beams."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ... import generate, prefix_cache
from ...beams import BeamSearch
from ...errors import OutOfBlocksError, RequestError
from ...prefix_cache import block_hash
from ...sharing import SharedCacheManager
from ..grader import expect
from .common import prompts_of, prop, tiny_model


SHARE_OPS = st.lists(st.tuples(st.sampled_from(["reserve", "fork", "fork", "grow", "grow", "free"]),
                               st.integers(0, 4), st.integers(0, 4), st.integers(0, 5)),
                     min_size=1, max_size=14)


def _sharing_state(cm):
    return (cm.block_table.clone(), cm.refs.copy(), cm.seq_lens.clone(),
            sorted(cm.free_blocks.ids()), cm.live_seq_ids(), cm.k_cache_paged.clone())


def _same_sharing(a, b) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and torch.equal(a[2], b[2]) and \
        a[3:5] == b[3:5] and torch.equal(a[5], b[5])


def _refused(cm, call, at: str, why: str, changed: str) -> None:
    """`call` (described by `at`) must raise RequestError, because `why`, and change nothing:
    else the failure says `changed`."""
    before = _sharing_state(cm)
    try:
        call()
        raised = False
    except RequestError:
        raised = True
    expect(raised, f"{at} returned normally, but {why}: it must raise RequestError and change "
                   f"nothing")
    expect(_same_sharing(before, _sharing_state(cm)), f"{at} raised RequestError {changed}")


@prop(40)
@example(2, 8, 0, [("reserve", 0, 0, 3), ("fork", 0, 1, 4)])      # both write a shared block
@example(2, 8, 0, [("reserve", 0, 0, 3), ("fork", 0, 1, 3)])      # both write nothing
@example(2, 8, 0, [("reserve", 0, 0, 1), ("fork", 0, 1, 0), ("grow", 1, 1, 1)])
@example(2, 8, 0, [("reserve", 0, 0, 4), ("fork", 0, 1, 5)])      # a full shared last block
@example(2, 8, 0, [("fork", 0, 1, 0), ("reserve", 0, 0, 3), ("reserve", 1, 0, 1),
                   ("fork", 0, 1, 0)])                              # refused: parent, child
@example(2, 8, 3, [("reserve", 0, 0, 3), ("fork", 0, 1, 0), ("grow", 0, 1, 6)])  # past a row
@example(3, 12, 1, [("reserve", 0, 0, 4), ("fork", 0, 1, 0), ("fork", 0, 2, 0),
                    ("grow", 1, 2, 2), ("grow", 0, 0, 1)])
@given(st.sampled_from([1, 2, 3]), st.integers(4, 14), st.integers(0, 99), SHARE_OPS)
def sharing_keeps_counts_and_isolation(block_size, num_blocks, seed, ops):
    """A SharedCacheManager under random reserve/fork/grow/free calls, where every write goes
    through the block table (as the model writes): each sequence reads back exactly its own
    tokens, however its blocks were shared; refs[b] is the number of tables holding b; a block
    is free exactly when no table holds it; running out raises OutOfBlocksError; a fork from a
    sequence that is not live, or onto one that is, and a grow past a row (rows are shorter
    than the pool for one seed in three) raise RequestError and change nothing."""
    row = num_blocks if seed % 3 else max(2, num_blocks // 2)    # rows shorter than the pool too
    cm = SharedCacheManager(num_blocks, block_size, 1, 1, max_seqs=5, max_blocks_per_seq=row,
                            seed=seed)
    content: dict[int, list[float]] = {}
    counter = iter(range(1, 10**6))
    log = []

    def write(s, start, n):
        vals = [float(next(counter)) for _ in range(n)]
        table = cm.blocks_of(s)
        for t, val in enumerate(vals):
            p = start + t
            cm.k_cache_paged[table[p // block_size], p % block_size, 0, 0] = val
        content[s] = content[s][:start] + vals

    for op, a, b, n in ops:
        if op == "fork" and a in content and b not in content and n >= 3:
            op, n = "fork+grow", n - 3             # a fork, then both write at once
        if op == "reserve" and a not in content:
            try:
                cm.reserve(a, n)
            except (OutOfBlocksError, RequestError):    # too few blocks, or a row too short
                continue
            content[a] = []
            write(a, 0, n)
            log.append(f"reserve({a}, {n})")
        elif op == "fork" and a in content and b not in content:
            cm.fork(a, b)
            content[b] = list(content[a])
            log.append(f"fork({a}, {b})")
        elif op == "fork":                        # a parent not live, or a child live already
            why = f"sequence {a} is not live" if a not in content else f"sequence {b} is live"
            _refused(cm, lambda: cm.fork(a, b), f"after {', '.join(log) or 'nothing'}: "
                     f"fork({a}, {b})", why, f"({why}) but changed the tables or the counts first")
        elif op in ("grow", "fork+grow") and a in content:
            if op == "fork+grow":
                cm.fork(a, b)
                content[b] = list(content[a])
                log.append(f"fork({a}, {b})")
                seqs = [a, b]
            else:
                seqs = [a] + ([b] if b in content and b != a else [])
            # the model: new blocks where a sequence outgrows its last block, plus a copy for
            # every writer into a shared partial last block but the last of its holders
            new = sum(-(-(len(content[x]) + n) // block_size) - -(-len(content[x]) // block_size)
                      for x in seqs)
            writers: dict = {}
            for x in seqs:
                if n and len(content[x]) % block_size:
                    last = cm.blocks_of(x)[-1]
                    writers[last] = writers.get(last, 0) + 1
            copies = sum(w - (w == int(cm.refs[blk])) for blk, w in writers.items())
            if any(-(-(len(content[x]) + n) // block_size) > row for x in seqs):
                _refused(cm, lambda: cm.grow(seqs, n), f"after {', '.join(log)}: "
                         f"grow({seqs}, {n}) with rows of {row} blocks",
                         "a sequence would outgrow its row", "but changed the tables, the "
                         "counts or a block's contents first (a copy-on-write made before the "
                         "refusal?)")
                continue
            try:
                got = cm.grow(seqs, n)
            except OutOfBlocksError:
                expect(new + copies > cm.num_free_blocks,
                       f"after {', '.join(log)}: grow({seqs}, {n}) ran out of blocks, but it "
                       f"needs {new} new and {copies} copies with {cm.num_free_blocks} free")
                continue
            expect(got == new + copies,
                   f"after {', '.join(log)}: grow({seqs}, {n}) took {got} blocks; it needs "
                   f"{new} new block(s) and {copies} copy(ies)-on-write (a copy for each writer "
                   f"into a shared partial last block, except the last table still holding it)")
            for s in seqs:
                write(s, len(content[s]), n)
            log.append(f"grow({seqs}, {n})")
        elif op == "free" and a in content:
            cm.free(a)
            del content[a]
            log.append(f"free({a})")
        else:
            continue
        when = f"after {', '.join(log)} (blocks of {block_size}, {num_blocks} in the pool)"
        holders = np.zeros(num_blocks, dtype=int)
        for s, vals in content.items():
            table = cm.blocks_of(s)
            expect(len(table) == -(-len(vals) // block_size),
                   f"{when}: sequence {s} has {len(vals)} tokens but holds {len(table)} blocks")
            got = [float(cm.k_cache_paged[table[p // block_size], p % block_size, 0, 0])
                   for p in range(len(vals))]
            expect(got == vals, f"{when}: sequence {s} reads back {got} through its block table "
                                f"but wrote {vals}: a write leaked into a shared block")
            holders[table] += 1
        expect(cm.refs.tolist() == holders.tolist(),
               f"{when}: refs is {cm.refs.tolist()} but the tables hold each block "
               f"{holders.tolist()} times")
        free = set(cm.free_blocks.ids())
        expect(free == {x for x in range(num_blocks) if holders[x] == 0},
               f"{when}: the free blocks are {sorted(free)}, but the blocks no table holds are "
               f"{[x for x in range(num_blocks) if holders[x] == 0]}")


def sampling_shares_blocks_and_keeps_tokens():
    """n=3 samples per prompt on the paged cache (shared prompt blocks, copy-on-write) give
    the contiguous cache's samples; so does prefix caching on prompts that share a prefix."""
    model = tiny_model()
    prompts = prompts_of((5, 9), seed=7)
    for bs in (2, 4):
        got = generate(model, prompts, 5, cache="paged", block_size=bs, temperature=1.0, n=3,
                       stop_tokens=[], seed=3, backend="torch")
        want = generate(model, prompts, 5, cache="contiguous", temperature=1.0, n=3,
                        stop_tokens=[], seed=3)
        expect(got == want, f"3 samples of prompts of 5 and 9 tokens, blocks of {bs}: the paged "
                            f"cache gave {got}, the contiguous cache {want}")
    shared = [prompts[1] + [1, 2], prompts[1] + [3], prompts[1][:6] + [4, 5, 6]]
    got = generate(model, shared, 4, cache="paged", block_size=2, prefix_caching=True,
                   max_num_seqs=1, stop_tokens=[], backend="torch")
    want = generate(model, shared, 4, cache="contiguous", stop_tokens=[])
    expect(got == want, f"prompts sharing a prefix, with prefix caching (blocks of 2): the paged "
                        f"cache gave {got}, the contiguous cache {want}")


@prop(60)
@given(st.lists(st.integers(0, 3), max_size=14), st.integers(1, 4), st.integers(0, 4),
       st.integers(0, 13))
def hash_chain_properties(tokens, block_size, start, change):
    """block_hashes names each full block (none for a partial one) by block_hash of its parent's
    name and its tokens; a call from block `start` with the parent's name continues the chain;
    changing one token renames its block and every later one, and none before it."""
    full = len(tokens) // block_size
    got = prefix_cache.block_hashes(tokens, block_size)
    want, parent = [], None
    for j in range(full):
        parent = block_hash(parent, tokens[j * block_size:(j + 1) * block_size])
        want.append(parent)
    what = f"tokens={tokens}, block_size={block_size}"
    expect(len(got) == full, f"{what}: {len(got)} hashes for {full} full block(s)")
    expect(got == want, f"{what}: block j's hash must be block_hash(hash of block j-1, its tokens)")
    start = min(start, full)
    tail = prefix_cache.block_hashes(tokens, block_size, want[start - 1] if start else None, start)
    expect(tail == want[start:], f"{what}: block_hashes from block {start} with block "
                                 f"{start - 1}'s hash as parent must continue the chain")
    if tokens:
        i = change % len(tokens)
        other = list(tokens)
        other[i] += 1
        changed = prefix_cache.block_hashes(other, block_size)
        j = i // block_size
        expect(changed[:j] == got[:j] and all(x != y for x, y in zip(changed[j:], got[j:])),
               f"{what}: changing token {i} must rename block {j} and all after it, and "
               f"keep the names before it")


# -- stage 6b --------------------------------------------------------------------------------------

def _brute_force_beams(model, prompt, width, steps):
    """Beam search written plainly on the no-cache forward: every step, each beam's whole
    sequence is run again; the best `width` of all (beam, token) sums survive (ties: earlier
    beam, lower token)."""
    beams = [([], 0.0)]
    with torch.no_grad():
        for _ in range(steps):
            cands = []
            for bi, (toks, lp) in enumerate(beams):
                logp = torch.log_softmax(model(torch.tensor([prompt + toks]))[0, -1].double(), -1)
                cands += [(lp + float(logp[t]), bi, t) for t in range(logp.shape[0])]
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            beams = [(beams[bi][0] + [t], s) for s, bi, t in cands[:width]]
    return [(toks, s / steps) for toks, s in beams]


def beams_fork_prune_and_match():
    """Beam search on the paged cache (blocks of 1 and 2: every step forks and copies-on-write)
    returns the plainly written no-cache beam search's beams and scores, and when it ends every
    block is back in the pool."""
    model = tiny_model()
    for width, bs, plen in ((3, 2, 5), (4, 1, 3), (2, 2, 4)):
        prompt = prompts_of((plen,), seed=11)[0]
        search = BeamSearch(model, prompt, width, 5, cache="paged", block_size=bs,
                            stop_tokens=[], backend="torch")
        got = search.run()
        want = _brute_force_beams(model, prompt, width, 5)
        what = f"beam_width={width}, blocks of {bs}, a prompt of {plen} tokens, 5 new tokens"
        expect([t for t, _ in got] == [t for t, _ in want],
               f"{what}: the beams are {[t for t, _ in got]}, the no-cache search gives "
               f"{[t for t, _ in want]}")
        expect(all(math.isclose(a, b, rel_tol=1e-9) for (_, a), (_, b) in zip(got, want)),
               f"{what}: scores {[s for _, s in got]}, expected {[s for _, s in want]}")
        for step in search.history:
            live = [p for p, st_ in zip(step.parents, step.status) if st_ == "live"]
            forks = sum(max(0, live.count(p) - 1) for p in set(live))
            expect(len(step.forks) == forks,
                   f"{what}: a step whose live survivors have parents {live} forks {forks} "
                   f"time(s) (a parent's second child and after), but step.forks is {step.forks}")
            expect(all(a != b and a in step.seq_ids and b in step.seq_ids for a, b in step.forks),
                   f"{what}: step.forks is {step.forks} for survivors in rows {step.seq_ids}: "
                   f"each fork is (the parent's row, the new child's row), two rows that both "
                   f"continue")
        contiguous = BeamSearch(model, prompt, width, 5, cache="contiguous", stop_tokens=[]).run()
        expect([t for t, _ in contiguous] == [t for t, _ in want],
               f"{what}: on the contiguous cache the beams are {[t for t, _ in contiguous]}, "
               f"the no-cache search gives {[t for t, _ in want]}")
        freed = sum(len(s.freed) for s in search.history)
        forked = sum(len(s.forks) for s in search.history)
        expect(freed == 1 + forked, f"{what}: {freed} rows were freed over the search "
                                    f"(step.freed) but 1 + {forked} forks were started: every "
                                    f"row is freed once")
        m = search.cache.managers[0]
        expect(m.num_free_blocks == m.num_blocks and int(m.refs.sum()) == 0,
               f"{what}: after the search {m.num_blocks - m.num_free_blocks} blocks are still "
               f"held (refs {m.refs.tolist()}): every pruned or finished beam must free its blocks")
