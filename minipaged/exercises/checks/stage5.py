"""Stages 5 and 5b's checks: the scheduler and chunked prefill, inside the engine."""

from __future__ import annotations

import functools

from hypothesis import example, given
from hypothesis import strategies as st

from ...chunked_engine import ChunkedEngine
from ...chunked_prefill import ChunkedScheduler, ChunkedStep
from ...engine import Engine
from ...scheduler import Request
from ...model import ModelArgs
from ...paged_cache import PagedCache
from ..grader import expect
from .common import contiguous_tokens, prompts_of, prop, tiny_model


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
        if r in before[0]:                         # a running request's next chunk
            need = engine.cache.blocks_to_grow(r.seq_id, n)
            expect(out.new_blocks.get(r) == need,
                   f"step {engine.step_count}: request {r.req_id}'s chunk of {n} tokens is booked "
                   f"as {out.new_blocks.get(r)} new block(s), but it needs {need}: the free "
                   f"blocks left for the rest of the step are then wrong")


@prop(12)
@example((2, [(0, 7, 0), (0, 7, 0)], 4, "recompute", 3, 8))
@example((2, [(3, 7, 0), (1, 6, 0), (2, 7, 1)], 8, "swap", 4, 8))
@example((2, [(2, 3, 2), (5, 1, 2), (4, 1, 0)], 7, "recompute", 3, 3))  # a chunk past the room
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
