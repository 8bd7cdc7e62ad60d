"""The checks the tasks run: the project's kind of checks, against independent references.

Each check is a function of no arguments that raises `CheckFailed` with a sentence a learner
understands. Property checks draw their inputs with hypothesis (few examples, derandomized,
so a run is quick and repeatable); a failing input is shrunk and shown. Token checks run a
tiny random Llama 3 built here (no file is read) and compare exact greedy tokens.
"""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from .. import fragmentation, generate, prefix_cache, speculative
from ..beams import BeamSearch
from ..cache_manager import PAD_BLOCK, CacheManager, FreeBlockSet
from ..chunked_engine import ChunkedEngine
from ..chunked_prefill import ChunkedScheduler, ChunkedStep
from ..engine import Engine
from ..scheduler import Request
from ..errors import OutOfBlocksError, RequestError
from ..generation import generate_static
from ..kv_cache import ContiguousCache
from ..model import Llama, ModelArgs
from ..online_softmax import paged_attention_v1, paged_attention_v2
from ..paged_attention import flash_attn_with_kvcache
from ..paged_cache import PagedCache, generate_paged
from ..prefix_cache import block_hash
from ..sharing import SharedCacheManager, SharedPagedCache
from ..speculative import SpeculativeEngine
from .grader import CheckFailed, expect

SHRINK = True       # the mutation runs switch shrinking off: they only need to know "it failed"


def prop(max_examples: int = 25):
    """hypothesis settings for a check: few examples, the same ones every run."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else [])
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    phases=phases, print_blob=False, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))


# -- the tiny model and the ground truth ---------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0) -> Llama:
    """A random tiny Llama 3 (grouped-query attention), in float64 so that no two logits tie."""
    torch.manual_seed(seed)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16,
                     max_seq_len=96)
    model = Llama(args).to(torch.float64).eval()
    with torch.no_grad():
        model.output.weight.mul_(8.0)      # wider logits: tokens differ more between steps
    return model


def prompts_of(lengths, seed=1, vocab=96):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def contiguous_tokens(lengths: tuple, n: int, seed: int = 1):
    """Greedy tokens of the contiguous cache (stage 1): what every paged run must equal."""
    model, prompts = tiny_model(), prompts_of(lengths, seed)
    cache = ContiguousCache(model.args, len(prompts), model.args.max_seq_len, dtype=torch.float64)
    return generate_static(model, prompts, n, cache=cache, stop_tokens=[])


@functools.lru_cache(maxsize=None)
def no_cache_tokens(lengths: tuple, n: int, seed: int = 1):
    """Ground truth: every token from the no-cache forward over the whole sequence so far."""
    return no_cache_greedy(prompts_of(lengths, seed), n)


def no_cache_greedy(prompts, n: int):
    """`n` greedy tokens per prompt, each from the tiny model's no-cache forward over the whole
    sequence so far."""
    model, out = tiny_model(), []
    with torch.no_grad():
        for p in prompts:
            seq, new = list(p), []
            for _ in range(n):
                t = int(model(torch.tensor([seq]))[0, -1].argmax())
                new.append(t)
                seq.append(t)
            out.append(new)
    return out


def dense_attention(q, keys, values, causal=True):
    """One row's attention in float64, written plainly: q (Sq, Hq, D), keys/values (n, Hk, D),
    the newest Sq keys belonging to the queries. Returns (Sq, Hq, D); a query that sees no key
    gets zeros."""
    Sq, Hq, D = q.shape
    n, Hk = keys.shape[0], keys.shape[1]
    out = torch.zeros(Sq, Hq, D, dtype=torch.float64)
    for i in range(Sq):
        last = n - Sq + i if causal else n - 1
        if last < 0:
            continue
        for h in range(Hq):
            kv = h // (Hq // Hk)
            k, v = keys[:last + 1, kv].double(), values[:last + 1, kv].double()
            w = torch.softmax(k @ q[i, h].double() * D ** -0.5, dim=0)
            out[i, h] = w @ v
    return out


def close(a, b, tol=1e-5) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))


def expect_same_tokens(got, want, lengths, where: str, reference: str) -> None:
    """Each prompt's greedy tokens `got` (`where`) equal `want` (`reference`'s), or a sentence."""
    for i, (g, w) in enumerate(zip(got, want)):
        expect(g == w, f"prompt {i} ({lengths[i]} tokens) continued as {g} {where}, but "
                       f"{reference} gives {w}")


# -- stage 1 ---------------------------------------------------------------------------------------

def contiguous_cache_tokens():
    """The contiguous cache gives the no-cache forward's greedy tokens (prompts of 3, 9, 14)."""
    model, lengths, n = tiny_model(), (3, 9, 14), 6
    cache = ContiguousCache(model.args, 3, model.args.max_seq_len, dtype=torch.float64)
    got = generate_static(model, prompts_of(lengths), n, cache=cache, stop_tokens=[])
    want = no_cache_tokens(lengths, n)
    expect_same_tokens(got, want, lengths, "on the contiguous cache", "the model without a cache")


@prop(20)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(1, 3),
       st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.integers(0, 10**6))
def contiguous_attend_matches_dense(prompt_lens, steps, heads, seed):
    """Prefill rows of different lengths, then decode: every output matches dense float64
    attention over exactly the tokens each row stored (1, 2 or 4 query heads)."""
    g = torch.Generator().manual_seed(seed)
    (Hq, Hk), D, B = heads, 8, len(prompt_lens)
    args = ModelArgs(dim=Hq * D, n_layers=1, n_heads=Hq, n_kv_heads=Hk, vocab_size=8,
                     max_seq_len=16)
    cache = ContiguousCache(args, B + 1, 16, dtype=torch.float64)
    rows = list(range(1, B + 1))                     # row 0 stays empty: rows are not batch slots
    hist_k = [torch.zeros(0, Hk, D, dtype=torch.float64) for _ in rows]
    hist_v = [torch.zeros(0, Hk, D, dtype=torch.float64) for _ in rows]
    for b, n in enumerate(prompt_lens):              # each prompt on its own, as generation does
        q, k, v = (torch.randn(1, n, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hk, Hk))
        cache.prepare([rows[b]], n)
        out = cache.attend(0, q, k, v)
        hist_k[b], hist_v[b] = k[0], v[0]
        want = dense_attention(q[0], hist_k[b], hist_v[b])
        expect(close(out[0], want), f"a prompt of {n} tokens in row {rows[b]}: the attention "
                                    f"output differs from dense attention over its {n} keys")
    for t in range(steps):                            # decode every row together
        q, k, v = (torch.randn(B, 1, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hk, Hk))
        cache.prepare(rows, 1)
        out = cache.attend(0, q, k, v)
        for b in range(B):
            hist_k[b] = torch.cat([hist_k[b], k[b]])
            hist_v[b] = torch.cat([hist_v[b], v[b]])
            want = dense_attention(q[b], hist_k[b], hist_v[b])
            expect(close(out[b], want), f"decode step {t + 1}, row {rows[b]} with "
                                        f"{len(hist_k[b])} keys: the output differs from dense "
                                        f"attention over the keys it stored")
        for b in range(B):
            stored = cache.k_cache[0][rows[b], :len(hist_k[b])]
            expect(close(stored, hist_k[b], 0), f"row {rows[b]}'s first {len(hist_k[b])} slots "
                                                f"do not hold the keys written to it, in order")


# -- stage 2 ---------------------------------------------------------------------------------------

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


# -- stage 3 ---------------------------------------------------------------------------------------

@st.composite
def paged_calls(draw):
    """A random paged cache: rows with stored tokens in scattered blocks, new tokens to add."""
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    B = draw(st.integers(1, 3))
    Hk = draw(st.sampled_from([1, 2]))
    Hq = Hk * draw(st.sampled_from([1, 2]))
    stored = draw(st.lists(st.integers(0, 9), min_size=B, max_size=B))
    new = draw(st.integers(1, 4))
    equal = draw(st.booleans())
    if equal:
        stored = [stored[0]] * B
    seed = draw(st.integers(0, 10**6))
    return block_size, B, Hq, Hk, stored, new, seed


def _paged_case(block_size, B, Hq, Hk, stored, new, seed, D=4):
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + new) // block_size) for n in stored]
    width = max(need) + 1
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((B, width), PAD_BLOCK, dtype=torch.int32)
    it = iter(perm)
    for b in range(B):
        for j in range(need[b]):
            table[b, j] = next(it)
    k_cache = torch.full((num_blocks, block_size, Hk, D), float("nan"), dtype=torch.float64)
    v_cache = torch.full_like(k_cache, float("nan"))
    hist_k = [torch.randn(n, Hk, D, generator=g, dtype=torch.float64) for n in stored]
    hist_v = [torch.randn(n, Hk, D, generator=g, dtype=torch.float64) for n in stored]
    for b in range(B):                           # what the rows stored before: written by hand
        for p in range(stored[b]):
            blk, off = int(table[b, p // block_size]), p % block_size
            k_cache[blk, off], v_cache[blk, off] = hist_k[b][p], hist_v[b][p]
    q = torch.randn(B, new, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, new, Hk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, new, Hk, D, generator=g, dtype=torch.float64)
    return q, k, v, k_cache, v_cache, table, hist_k, hist_v


@prop(40)
@given(paged_calls())
def paged_attention_matches_dense(case):
    """`flash_attn_with_kvcache(..., backend="torch")` on a pool of scattered blocks (free slots
    full of NaN) writes each new k/v into the slot its block table names and returns dense
    float64 attention over each row's stored and new keys."""
    block_size, B, Hq, Hk, stored, new, seed = case
    q, k, v, k_cache, v_cache, table, hist_k, hist_v = _paged_case(*case)
    lens = torch.tensor(stored, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                  block_table=table, causal=True, backend="torch")
    what = (f"block_size={block_size}, rows storing {stored} tokens, {new} new each, "
            f"block_table={table.tolist()}")
    for b in range(B):
        for t in range(new):
            p = stored[b] + t
            blk, off = int(table[b, p // block_size]), p % block_size
            expect(torch.equal(k_cache[blk, off], k[b, t]) and torch.equal(v_cache[blk, off], v[b, t]),
                   f"{what}: new token {t} of row {b} (position {p}) should be written to block "
                   f"{blk}, offset {off}, and is not")
        keys, values = torch.cat([hist_k[b], k[b]]), torch.cat([hist_v[b], v[b]])
        want = dense_attention(q[b], keys, values)
        expect(close(out[b], want), f"{what}: row {b}'s output differs from dense attention "
                                    f"over its {stored[b] + new} keys")
    again = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + new,
                                    block_table=table, causal=True, backend="torch")
    expect(close(again, out), f"{what}: called again with no new k/v (k=None, v=None) over the "
                              f"{[n + new for n in stored]} stored keys, the output changed: "
                              f"with nothing to write, nothing is written")


class _CallPerLayer(PagedCache):
    """Stage 3's paged cache calling `flash_attn_with_kvcache` on each layer, with the tables
    and lengths its CacheManagers give (the grader's own harness: the call the lesson
    describes, with its write and its gather, whatever the cache does for speed)."""

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        super().prepare(seq_ids, num_new_tokens)
        self._step_ids, self._step_new = [int(s) for s in seq_ids], num_new_tokens

    def attend(self, layer, q, k, v):
        m = self.managers[layer]
        return flash_attn_with_kvcache(q, m.k_cache_paged, m.v_cache_paged, k, v,
                                       cache_seqlens=m.seq_lens_for(self._step_ids) - self._step_new,
                                       block_table=m.block_table_for(self._step_ids),
                                       causal=True, backend="torch")


def paged_call_tokens():
    """A paged cache that calls `flash_attn_with_kvcache` per layer gives the contiguous cache's
    greedy tokens (prompts of 3, 9, 14 with blocks of 4; and two prompts of 5 with blocks of 2)."""
    model = tiny_model()
    for lengths, bs in (((3, 9, 14), 4), ((5, 5), 2)):
        n = 6
        cache = _CallPerLayer(model.args, 64, bs, len(lengths), model.args.max_seq_len,
                              dtype=torch.float64, seed=3)
        got = generate_static(model, prompts_of(lengths), n, cache=cache, stop_tokens=[])
        want = contiguous_tokens(lengths, n)
        expect_same_tokens(got, want, lengths, f"on the paged cache (blocks of {bs})",
                           "the contiguous cache")


# -- stage 3b --------------------------------------------------------------------------------------

@prop(40)
@given(paged_calls(), st.booleans(), st.integers(1, 3), st.sampled_from([1.0, 1.0, 400.0]))
def kernel_walk_matches_dense(case, causal, blocks_per_partition, loudness):
    """paged_attention_v1 and v2 (partitions of 1-3 blocks) read each row's blocks in place
    (free slots hold NaN) and return dense float64 attention, causal or not; v1's trace holds,
    after each block, the running max of the scores so far and the running sum of
    exp(score - max)."""
    block_size, B, Hq, Hk, stored, new, seed = case
    q, k, v, k_cache, v_cache, table, hist_k, hist_v = _paged_case(*case)
    q = q * loudness                              # 400: scores in the thousands, exp overflows
    seqlens = torch.tensor(stored) + new
    for b in range(B):                            # the new keys, stored (the write is stage 3's)
        for t in range(new):
            p = stored[b] + t
            blk = int(table[b, p // block_size])
            k_cache[blk, p % block_size], v_cache[blk, p % block_size] = k[b, t], v[b, t]
    owned = torch.where(table >= 0, table, 0).long()
    what = (f"block_size={block_size}, keys per row {seqlens.tolist()}, {new} queries each, "
            f"causal={causal}, queries scaled by {loudness}, block_table={table.tolist()}")
    trace = []
    out1 = paged_attention_v1(q, k_cache, v_cache, owned, seqlens, causal=causal, trace=trace)
    out2 = paged_attention_v2(q, k_cache, v_cache, owned, seqlens, causal=causal,
                              partition_size=blocks_per_partition * block_size)
    for b in range(B):
        keys, values = torch.cat([hist_k[b], k[b]]), torch.cat([hist_v[b], v[b]])
        want = dense_attention(q[b], keys, values, causal)
        expect(close(out1[b], want), f"v1, {what}: row {b}'s output differs from dense attention")
        expect(close(out2[b], want), f"v2 with partitions of {blocks_per_partition} block(s), "
                                     f"{what}: row {b}'s output differs from dense attention")
    seen: dict = {}
    for s in trace:
        key = (s.b, s.kv_head)
        prev = seen.get(key, torch.full_like(s.m, float("-inf")))
        scores = torch.cat([seen.get(key + ("scores",), s.scores[:, :0]), s.scores], dim=1)
        seen[key + ("scores",)] = scores
        m = scores.max(dim=1).values
        shift = torch.where(m == float("-inf"), 0.0, m)
        l = torch.exp(scores - shift[:, None]).sum(dim=1)
        expect(torch.equal(s.m, torch.maximum(prev, m)) and close(s.l, l),
               f"v1, {what}: after block {s.j} of row {s.b}, head {s.kv_head}, the running max "
               f"or sum is not the max / sum of exp(score - max) over the keys seen so far")
        seen[key] = s.m
    for b in range(B):
        for h in range(Hk):
            js = [s.j for s in trace if (s.b, s.kv_head) == (b, h)]
            want_js = list(range(-(-int(seqlens[b]) // block_size)))
            expect(js == want_js, f"v1, {what}: with trace=[] the program of row {b}, head {h} "
                                  f"recorded blocks {js}; it walks blocks {want_js}, one Step each")
    if loudness == 1.0:                           # bf16 in, float32 inside, bf16 out
        half = paged_attention_v1(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), owned,
                                  seqlens, causal=causal)
        for b in range(B):
            keys, values = torch.cat([hist_k[b], k[b]]), torch.cat([hist_v[b], v[b]])
            want = dense_attention(q[b].bfloat16(), keys.bfloat16(), values.bfloat16(), causal)
            expect(half.dtype == torch.bfloat16 and close(half[b], want, 3e-2),
                   f"v1 in bfloat16, {what}: row {b}'s output is not dense attention (to "
                   f"bfloat16's precision), or not bfloat16")


# -- stage 4 ---------------------------------------------------------------------------------------

def _slot_model(stored, allocated, final):
    """Slot by slot: slot i of a request is a token state if i < stored, reservation if it will
    be filled later (i < final), internal otherwise."""
    t = r = i = 0
    for s, a, f in zip(stored, allocated, final):
        for slot in range(a):
            if slot < s:
                t += 1
            elif slot < f:
                r += 1
            else:
                i += 1
    return t, r, i


REQS = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 12)),
                min_size=1, max_size=5)


@prop(60)
@given(REQS)
def split_allocated_counts_slot_by_slot(reqs):
    """split_allocated gives the counts of a slot-by-slot classification of every request's
    slots, for 1-D inputs and for (R, k) arrays of k moments; impossible lengths (more stored
    than allocated or than final) raise RequestError."""
    stored, allocated, final = (list(x) for x in zip(*reqs))
    ok = all(s <= min(a, f) for s, a, f in reqs)
    what = f"stored={stored}, allocated={allocated}, final={final}"
    if not ok:
        try:
            fragmentation.split_allocated(stored, allocated, final)
        except RequestError:
            return
        expect(False, f"{what}: a request stores more than it holds or than its final length; "
                      f"split_allocated should raise RequestError")
    got = tuple(int(x) for x in fragmentation.split_allocated(stored, allocated, final))
    want = _slot_model(stored, allocated, final)
    expect(got == want, f"{what}: split_allocated gave (tokens, reservation, internal) = {got}, "
                        f"counting slot by slot gives {want}")
    two = fragmentation.split_allocated(np.array([stored, stored]).T, np.array([allocated, final]).T,
                          np.array([final, final]).T)
    want2 = [_slot_model(stored, allocated, final), _slot_model(stored, final, final)]
    got2 = [tuple(int(x[i]) for x in two) for i in range(2)]
    expect(got2 == want2, f"{what}: with (R, 2) arrays (two moments) split_allocated gave "
                          f"{got2}, expected {want2}")


@prop(60)
@example([1, 1], 0, 2, False)
@example([2, 1], 0, 2, False)
@given(st.lists(st.integers(1, 9), max_size=5), st.integers(0, 6),
       st.one_of(st.none(), st.integers(1, 12)), st.booleans())
def split_free_matches_the_definition(pieces, idle_extra, next_need, paged):
    """split_free: a free slot is external only when someone waits, all free memory together
    would hold them, and the slot lies in a piece too small for them; a paged pool has none."""
    free = sum(pieces) + idle_extra if not paged else sum(pieces)
    arg = None if paged else pieces
    got = tuple(fragmentation.split_free(free, arg, next_need))
    external = 0
    if not paged and next_need is not None and free >= next_need:
        external = sum(p for p in pieces if p < next_need)
    want = (external, free - external)
    expect(got == want, f"split_free(free={free}, pieces={arg}, next_need={next_need}) gave "
                        f"(external, idle) = {got}, expected {want}")


# -- stage 5 and 5b: the engine around the scheduler -----------------------------------------------

PROMPT_LENGTHS = (2, 5, 7, 9, 3, 6)
MOST_NEW = 7


@functools.lru_cache(maxsize=None)
def _reference_continuations():
    return contiguous_tokens(PROMPT_LENGTHS, MOST_NEW, seed=5)


@st.composite
def workloads(draw, budgets=(None,)):
    block_size = draw(st.sampled_from([2, 4]))
    reqs = draw(st.lists(st.tuples(st.integers(0, len(PROMPT_LENGTHS) - 1),
                                   st.integers(1, MOST_NEW), st.integers(0, 4)),
                         min_size=1, max_size=6))
    most = max(-(-(PROMPT_LENGTHS[i] + m - 1) // block_size) for i, m, _ in reqs)
    num_blocks = draw(st.integers(most, most + 4))
    preemption = draw(st.sampled_from(["recompute", "swap"]))
    max_num_seqs = draw(st.sampled_from([8, 8, 1, 2, 3]))
    return block_size, reqs, num_blocks, preemption, draw(st.sampled_from(budgets)), max_num_seqs


def _serve_and_watch(block_size, reqs, num_blocks, preemption, budget, max_num_seqs, step_check):
    """Run the engine on a workload, calling step_check(scheduler, before, out) on every
    schedule; then check every request's tokens against the contiguous cache's."""
    model, prompts = tiny_model(), prompts_of(PROMPT_LENGTHS, seed=5)
    options = dict(max_num_batched_tokens=budget) if budget else {}
    cls = ChunkedEngine if budget else Engine
    engine = cls(model, num_blocks, block_size, preemption, watermark=0.2,
                 max_num_seqs=max_num_seqs, **options)
    sched = engine.scheduler
    plain = type(sched).schedule

    def watched():
        held = engine.cache.managers[0].num_blocks_held
        before = (list(sched.running), list(sched.waiting), list(sched.swapped),
                  {id(r): engine.cache.blocks_to_grow(r.seq_id) for r in sched.running},
                  {id(r): int(held[r.seq_id]) for r in sched.running},
                  engine.cache.num_free_blocks)
        out = plain(sched)
        step_check(engine, before, out)
        return out

    sched.schedule = watched
    made = [engine.add_request(prompts[i], m, stop_tokens=[], arrival_step=a) for i, m, a in reqs]
    what = (f"a pool of {num_blocks} blocks of {block_size}, preemption={preemption!r}, "
            f"max_num_seqs={max_num_seqs}, requests (prompt length, max_new_tokens, arrival step) "
            f"{[(PROMPT_LENGTHS[i], m, a) for i, m, a in reqs]}"
            + (f", max_num_batched_tokens={budget}" if budget else ""))
    while engine.has_unfinished():
        expect(engine.step_count < 300, f"{what}: the engine made no progress in 300 steps")
        engine.step()
    ref = _reference_continuations()
    for r, (i, m, _) in zip(made, reqs):
        expect(r.output == ref[i][:m], f"{what}: request {r.req_id} generated {r.output}, the "
                                       f"contiguous cache gives {ref[i][:m]}")
    expect(engine.cache.num_free_blocks == num_blocks,
           f"{what}: after every request finished, only {engine.cache.num_free_blocks} of "
           f"{num_blocks} blocks are free")
    return what


def _fcfs_and_preempt_newest(engine, before, out):
    running, waiting, swapped, grow, held, free_before = before
    victims = [r for r, _ in out.preempted]
    sched = engine.scheduler
    what = (f"step {engine.step_count} (running {[r.req_id for r in running]}, waiting "
            f"{[r.req_id for r in waiting]}, {engine.cache.num_free_blocks} free blocks)")
    expect(victims == running[::-1][:len(victims)],
           f"{what}: preempted {[r.req_id for r in victims]}; the newest running request must "
           f"go first")
    kept = [r for r in out.decode if r in running]
    expect(kept == running[:len(running) - len(victims)],
           f"{what}: decoded {[r.req_id for r in kept]}; every running request not preempted "
           f"must decode, oldest first")
    expect(len(sched.running) <= sched.max_num_seqs,
           f"{what}: {len(sched.running)} requests run, more than max_num_seqs="
           f"{sched.max_num_seqs}")
    decode_need = sum(grow[id(r)] for r in kept)
    if victims:
        expect(not out.prefill and not out.swapped_in,
               f"{what}: a step that preempts must admit nobody, yet it admitted "
               f"{[r.req_id for r in out.prefill + out.swapped_in]}")
        last = victims[-1]
        freed_before_last = sum(held[id(v)] for v in victims[:-1])
        expect(decode_need + grow[id(last)] > free_before + freed_before_last,
               f"{what}: preempted {[r.req_id for r in victims]}, but without the last of them "
               f"the decodes' {decode_need + grow[id(last)]} new block(s) fit in the "
               f"{free_before + freed_before_last} free: preempt only when the pool is dry")
        return
    if not out.swapped_in:
        promised = decode_need + sum(sched.blocks_for(r.num_tokens) for r in out.prefill)
        alone = not kept and len(out.prefill) == 1
        expect(promised + (0 if alone or not out.prefill else sched.watermark_blocks)
               <= free_before,
               f"{what}: this step promises {promised} blocks (decodes and admitted prompts) "
               f"with {free_before} free and a watermark of {sched.watermark_blocks}: admit only "
               f"what fits with the watermark to spare (unless it runs alone)")
    expect(out.prefill == [r for r in waiting if r in out.prefill][:len(out.prefill)] and
           out.prefill == waiting[:len(out.prefill)],
           f"{what}: admitted {[r.req_id for r in out.prefill]}; admission is first come, "
           f"first served from the front of waiting")
    if out.swapped_in or sched.swapped or not sched.waiting or getattr(out, "num_tokens", None):
        return
    head = sched.waiting[0]
    committed = sum(grow[id(r)] for r in out.decode) + \
        sum(sched.blocks_for(r.num_tokens) for r in out.prefill)
    need = sched.blocks_for(head.num_tokens)
    free = engine.cache.num_free_blocks - committed
    alone = not sched.running
    fits = need <= free if alone else need + sched.watermark_blocks <= free
    rows = min(len(sched.free_rows), sched.max_num_seqs - len(sched.running))
    expect(not (fits and rows >= 1), f"{what}: request {head.req_id} needs {need} blocks, "
           f"{free} are free after this step's promises (watermark {sched.watermark_blocks}), "
           f"and it still waits: admit while the next request fits")


@prop(12)
@example((2, [(0, 7, 0), (0, 7, 0)], 4, "recompute", None, 8))     # two in lockstep, a dry pool
@example((2, [(0, 7, 0), (0, 7, 0), (4, 5, 1)], 5, "swap", None, 8))
@example((4, [(3, 7, 0), (1, 6, 0), (2, 7, 2)], 4, "recompute", None, 2))
@given(workloads())
def engine_is_fcfs_and_preempts_the_newest(work):
    """On random workloads and small pools, the engine with your scheduler gives the contiguous
    cache's tokens; each step decodes every running request oldest first, preempts only the
    newest, admits nobody in a step that preempts, admits from the front of waiting, and
    leaves nobody waiting whose blocks fit."""
    _serve_and_watch(*work, _fcfs_and_preempt_newest)


def _within_budget(engine, before, out):
    budget = engine.scheduler.max_num_batched_tokens
    total = sum(out.num_tokens.values())
    expect(total <= budget, f"step {engine.step_count} schedules {total} tokens, more than "
                            f"max_num_batched_tokens={budget}")
    for r in out.prefill:
        n = out.num_tokens[r]
        expect(n >= 1, f"step {engine.step_count}: request {r.req_id} runs a chunk of {n} tokens")
        expect(engine.scheduler.num_computed_tokens(r) + n <= r.num_tokens,
               f"step {engine.step_count}: request {r.req_id}'s chunk of {n} runs past its "
               f"{r.num_tokens} tokens")


@prop(12)
@example((2, [(0, 7, 0), (0, 7, 0)], 4, "recompute", 3, 8))
@example((2, [(3, 7, 0), (1, 6, 0), (2, 7, 1)], 8, "swap", 4, 8))
@given(workloads(budgets=(1, 3, 4, 7)))
def chunked_engine_keeps_the_budget(work):
    """Under a token budget the engine with your code gives the contiguous cache's tokens, and
    no step schedules more tokens than the budget or a chunk past its prompt."""
    _serve_and_watch(*work, _within_budget)


@prop(80)
@given(st.sampled_from([1, 2, 4]), st.integers(0, 9), st.integers(1, 12), st.integers(0, 8),
       st.integers(0, 3), st.booleans())
def admissible_is_the_largest_chunk_that_fits(block_size, held, want, promised, watermark,
                                              running):
    """`_admissible(held, want, out)` is the largest n <= want (0 if none) whose blocks,
    blocks_for(held + n), fit in the free blocks not yet promised with the watermark to spare
    (all of them when nothing runs): counted here by trying every n."""
    args = ModelArgs(dim=4, n_layers=1, n_heads=1, vocab_size=8, max_seq_len=64)
    cache = PagedCache(args, 8, block_size, 2, 64)
    sched = ChunkedScheduler(cache, max_num_batched_tokens=16)
    sched.watermark_blocks = watermark
    other = Request(99, [1], 1)
    sched.running = [other] if running else []
    out = ChunkedStep(new_blocks={other: min(promised, 8)})
    free = 8 - min(promised, 8)
    blocks = lambda n: -(-n // block_size)                                 # noqa: E731
    fits = lambda n: blocks(held + n) <= (free if not running else free - watermark)  # noqa: E731
    want_n = max([n for n in range(want + 1) if n == 0 or fits(n)])
    got = sched._admissible(held, want, out)
    expect(got == want_n, f"_admissible(held={held}, want={want}) with {free} free blocks of "
                          f"{block_size}, watermark {watermark}, "
                          f"{'a request running' if running else 'nothing running'}: gave "
                          f"{got}, the largest chunk that fits is {want_n}")


def chunks_fill_the_budget():
    """A lone 9-token prompt (and then a 7-token one beside a decoding request) in a roomy pool
    is prefilled in chunks as large as the budget allows: budget 4 gives 4, 4, 1."""
    model, prompts = tiny_model(), prompts_of(PROMPT_LENGTHS, seed=5)
    for budget, block_size in ((4, 4), (4, 2), (3, 4), (5, 2)):
        engine = ChunkedEngine(model, 32, block_size, max_num_batched_tokens=budget)
        r = engine.add_request(prompts[3], 3, stop_tokens=[])
        chunks = []
        while r.status != "finished":
            engine.step()
            chunks.append(engine.tokens_run.get(r, 0))
        want = [budget] * (9 // budget) + ([9 % budget] if 9 % budget else []) + [1, 1]
        expect(chunks == want, f"a lone 9-token prompt, budget {budget}, blocks of "
                               f"{block_size}: its steps ran {chunks} tokens, expected {want}")


# -- stage 6 ---------------------------------------------------------------------------------------

SHARE_OPS = st.lists(st.tuples(st.sampled_from(["reserve", "fork", "fork", "grow", "grow", "free"]),
                               st.integers(0, 4), st.integers(0, 4), st.integers(0, 5)),
                     min_size=1, max_size=14)


@prop(40)
@example(2, 8, 0, [("reserve", 0, 0, 3), ("fork", 0, 1, 4)])      # both write a shared block
@example(2, 8, 0, [("reserve", 0, 0, 3), ("fork", 0, 1, 3)])      # both write nothing
@example(2, 8, 0, [("reserve", 0, 0, 1), ("fork", 0, 1, 0), ("grow", 1, 1, 1)])
@example(2, 8, 0, [("reserve", 0, 0, 4), ("fork", 0, 1, 5)])      # a full shared last block
@example(3, 12, 1, [("reserve", 0, 0, 4), ("fork", 0, 1, 0), ("fork", 0, 2, 0),
                    ("grow", 1, 2, 2), ("grow", 0, 0, 1)])
@given(st.sampled_from([1, 2, 3]), st.integers(4, 14), st.integers(0, 99), SHARE_OPS)
def sharing_keeps_counts_and_isolation(block_size, num_blocks, seed, ops):
    """A SharedCacheManager under random reserve/fork/grow/free calls, where every write goes
    through the block table (as the model writes): each sequence reads back exactly its own
    tokens, however its blocks were shared; refs[b] is the number of tables holding b; a block
    is free exactly when no table holds it; running out raises OutOfBlocksError."""
    cm = SharedCacheManager(num_blocks, block_size, 1, 1, max_seqs=5, max_blocks_per_seq=num_blocks,
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
            except OutOfBlocksError:
                continue
            content[a] = []
            write(a, 0, n)
            log.append(f"reserve({a}, {n})")
        elif op == "fork" and a in content and b not in content:
            cm.fork(a, b)
            content[b] = list(content[a])
            log.append(f"fork({a}, {b})")
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


# -- stage 7 ---------------------------------------------------------------------------------------

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
        for speculative in ((None, None), ("ngram", k)):
            engine = SpeculativeEngine(model, blocks, bs, max_num_seqs=4, backend="torch",
                                       speculative=speculative[0],
                                       num_speculative_tokens=speculative[1], **extra)
            for p in _repetitive_prompts():
                engine.add_request(p, n, stop_tokens=[])
            got = [r.output for r in engine.run()]
            what = (f"blocks of {bs}, {blocks} in the pool, " + (f"{k} drafts a step" if
                    speculative[0] else "no speculation") + (", prefix caching" if extra else ""))
            expect(got == want, f"{what}: the engine's greedy tokens are {got}, but the no-cache "
                                f"forward gives {want}")
            expect(engine.cache.num_free_blocks == blocks,
                   f"{what}: when every request finished, {blocks - engine.cache.num_free_blocks} "
                   f"block(s) were still held")
            if speculative[0]:
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
