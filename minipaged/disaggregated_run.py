"""Stage 9b: running it — the two engines' loops, in one process (threads) or two (`run_ranks`).

    generate(model, prompts, max_new_tokens, cache="paged", disaggregated=True)

`disaggregated.py` holds the idea — what each side does with a request's blocks (hold,
announce, skip, allocate, remap, copy, free); this module holds the loops that drive it: the
prefill side's (`prefill_loop`: prefill what arrives, hold, free on acknowledgement or at the
deadline), the decode side's step (`decode_tick`: load what was announced, then decode), and
the two ways to run them (`serve_in_one_process`, for the notebook and the tests;
`serve_disaggregated`, two processes, either failing or dying ending the call with one error).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import torch

from .disaggregated import (TIMEOUT, DecodeConnector, DisaggregationError, Faults,
                            PrefillConnector, PrefillEngine, leaked_blocks)
from .errors import RequestError, TensorParallelError
from .generation import row_generator
from .ranks import run_ranks
from .sizing import pool_blocks
from .speculative import SpeculativeEngine


# -- the two loops -------------------------------------------------------------------------------
@dataclass
class Job:
    """The request both sides serve: prompts, limits, sampling, and the engines' options."""
    prompts: list
    limits: list
    temperature: float
    top_p: float
    stop: list
    seed: int
    n: int
    options: dict


def build_engine(cls, model, job: Job, prefill: bool):
    """One side's engine. Its pool holds every prompt at full length unless sized; the prefill
    side gets the token budget (chunked prefill), the decode side always caches prefixes (it is
    how it finds the blocks it loaded)."""
    o = dict(job.options)
    block_size = o.pop("block_size", 16)
    num_blocks, kv_budget = o.pop("num_blocks", None), o.pop("kv_budget", None)
    preemption = o.pop("preemption", "recompute")
    if num_blocks is None and kv_budget is None:
        lengths = [len(p) + m for p, m in zip(job.prompts, job.limits) for _ in range(job.n)]
        num_blocks = pool_blocks(model.args, next(model.parameters()).dtype, block_size,
                                 lengths=lengths)
    o.setdefault("max_num_seqs", len(job.prompts) * job.n)
    if prefill:
        o.pop("speculative", None), o.pop("num_speculative_tokens", None)
    else:
        o["prefix_caching"] = True
        o.pop("max_num_batched_tokens", None)
    seed = job.seed if prefill else job.seed + 7919   # another free set: other block ids
    return cls(model, num_blocks, block_size, preemption, kv_budget=kv_budget, seed=seed, **o)


def prefill_loop(engine: PrefillEngine, inbox, acks, tick=None, drain: bool = True) -> dict:
    """Prefill each prompt that arrives in `inbox` as (key, prompt) — one token each, thrown
    away: the decode side samples — until None arrives there, holding each prompt's blocks
    until `acks` brings its key or its deadline passes; then finish (`drain=False`, a server
    stopping: at once). `tick` (one process): run the decode side between steps."""
    conn, got, more = engine.connector, set(), True
    while more or (drain and (engine.has_unfinished() or conn.held)):
        idle = not engine.has_unfinished() and tick is None
        more = more and take_prompts(engine, inbox, wait=0.005 if idle else 0.0)
        if engine.has_unfinished():
            engine.release(engine.step())            # a server runs for weeks: forget them
        if tick:
            tick()
        try:
            while True:
                got.add(acks.get_nowait())
        except queue.Empty:
            pass
        got -= set(conn.get_finished(got))
        if not more and not engine.has_unfinished() and not tick:
            time.sleep(0.005)                         # only held blocks left: wait for acks
    return {"leaked": leaked_blocks(engine.cache), "freed_by_ack": conn.freed_by_ack,
            "freed_by_timeout": conn.freed_by_timeout}


def take_prompts(engine: PrefillEngine, inbox, wait: float) -> bool:
    """Add the prompts waiting in `inbox` (waiting up to `wait` seconds for the first); False
    once None has come: no more will."""
    try:
        message = inbox.get(timeout=wait) if wait else inbox.get_nowait()
        while message is not None:
            key, prompt = message
            engine.keys[engine.add_request(prompt, 1, stop_tokens=[]).req_id] = key
            message = inbox.get_nowait()
        return False
    except queue.Empty:
        return True


def prompts_inbox(prompts) -> queue.Queue:
    """Every prompt of a batch, keyed by its index, then None: what `prefill_loop` reads."""
    inbox = queue.Queue()
    for key, p in enumerate(prompts):
        inbox.put((key, p))
    inbox.put(None)
    return inbox


def decode_tick(engine, job: Job, inbox, acks, groups: dict) -> None:
    """Load what arrived and add it, then run one step if anything runs."""
    conn = engine.connector
    try:
        while True:
            key, ids, deadline = inbox.get_nowait()
            prompt, n = job.prompts[key], job.n
            conn.start_load_kv(key, prompt, ids, deadline)
            acks.put(key)                        # loaded or not, the held blocks may go
            gens = [row_generator(job.seed, key * n + j) if job.temperature > 0 else None
                    for j in range(n)]
            first = engine.next_req_id
            engine.add_request(prompt, job.limits[key], job.temperature, job.top_p,
                               stop_tokens=job.stop, n=n, generators=gens)
            groups[key] = [r for r in engine.requests if first <= r.req_id < first + n]
    except queue.Empty:
        pass
    if engine.has_unfinished():
        engine.step()


def decode_report(engine, groups, num_prompts, n) -> dict:
    return {"outputs": [r.output for i in range(num_prompts) for r in groups[i]],   # flat
            "transfer": engine.connector.stats, "leaked": leaked_blocks(engine.cache),
            "preemptions": engine.stats.preemptions, "cached_tokens": engine.stats.cached_tokens}


def serve_in_one_process(model, job: Job, faults: Faults | None = None, timeout: float = TIMEOUT,
                         record: bool = False) -> dict:
    """Both engines in this process, taking turns (for tests and drawings: the same connector,
    the same loops, without the processes)."""
    if faults is not None and faults.die:
        raise RequestError("Faults(die=...) kills the decode process: only serve_disaggregated "
                           "runs it in a process of its own")
    announcements, acks = queue.Queue(), queue.Queue()
    p = build_engine(PrefillEngine, model, job, prefill=True)
    p.connector = PrefillConnector(p.cache, announcements, timeout)
    d = build_engine(SpeculativeEngine, model, job, prefill=False)
    d.connector = DecodeConnector(d, [(m.k_cache_paged, m.v_cache_paged) for m in p.cache.managers],
                                  faults, record)
    groups = {}
    prefill = prefill_loop(p, prompts_inbox(job.prompts), acks,
                           tick=lambda: decode_tick(d, job, announcements, acks, groups))
    while d.has_unfinished() or not announcements.empty():
        decode_tick(d, job, announcements, acks, groups)
    return {"prefill": prefill, "decode": decode_report(d, groups, len(job.prompts), job.n),
            "engines": (p, d)}


# -- two processes -------------------------------------------------------------------------------
def serve_disaggregated(model, job: Job, faults: Faults | None = None,
                        timeout: float = TIMEOUT) -> dict:
    """The prefill engine in one process, the decode engine in another; their reports, as
    `serve_in_one_process`'s. If either fails or dies, one DisaggregationError names it: a dead
    prefill engine ends the decode engine at once; a dead decode engine leaves the prefill
    engine `timeout` seconds to free what it holds, and its report is the error's `prefill`."""
    ctx = torch.multiprocessing.get_context("spawn")
    links = (ctx.Queue(), ctx.Queue(), ctx.Queue())           # pools, announcements, acks
    try:
        prefill, decode = run_ranks(_side, 2, (model, job, links, faults, timeout),
                                    timeout=timeout, grace={1: timeout + 5.0})
    except TensorParallelError as e:
        said, prefill = side_names(str(e)), e.results.get(0)
        if prefill is not None:                    # the decode engine died; the prefill ended
            said = (f"{said.split(';')[0]}; the prefill engine then freed what it held and "
                    f"ended ({prefill['leaked']} blocks left in use)")
        error = DisaggregationError(said)
        error.prefill = prefill
        raise error from None
    return {"prefill": prefill, "decode": decode}


def side_names(said: str) -> str:
    """stage 9's error line, its ranks named as the two sides."""
    said = said.replace("tensor parallel: ", "").replace("rank 0 of 2", "the prefill engine")
    said = said.replace("the other ranks were stopped", "the other engine was stopped")
    return "disaggregated: " + said.replace("rank 1 of 2", "the decode engine").replace(
        "every rank was stopped", "both were stopped")


def _side(rank, world_size, device, model, job, links, faults, timeout) -> dict:
    """Rank 0 prefills, rank 1 decodes."""
    pools, announcements, acks = links
    if rank == 0:
        engine = build_engine(PrefillEngine, model, job, prefill=True)
        engine.connector = PrefillConnector(engine.cache, announcements, timeout)
        for m in engine.cache.managers:           # the decode side reads these, by block id
            m.k_cache_paged.share_memory_(), m.v_cache_paged.share_memory_()
        pools.put([(m.k_cache_paged, m.v_cache_paged) for m in engine.cache.managers])
        return prefill_loop(engine, prompts_inbox(job.prompts), acks)
    engine = build_engine(SpeculativeEngine, model, job, prefill=False)
    engine.connector = DecodeConnector(engine, pools.get(timeout=timeout), faults)
    groups, quiet_since = {}, time.monotonic()
    while len(groups) < len(job.prompts) or engine.has_unfinished():
        before = len(groups)
        decode_tick(engine, job, announcements, acks, groups)
        if len(groups) > before or engine.has_unfinished():
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > timeout:
            raise DisaggregationError(f"disaggregated: the prefill engine announced nothing for "
                                      f"{timeout:g} s")
        else:
            time.sleep(0.002)
    return decode_report(engine, groups, len(job.prompts), job.n)
