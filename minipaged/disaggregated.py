"""Stage 9b: prefill here, decode there — a request's KV blocks move from one engine to another.

    generate(model, prompts, max_new_tokens, cache="paged", disaggregated=True)

Two engines in two processes. The prefill engine runs each prompt once (its blocks fill) and
then, instead of freeing them, holds them (a delayed free) and announces their block ids. The
decode engine reads them: it finds how many leading blocks its own prefix cache already holds
(those are not moved), allocates its own blocks for the rest (its free set hands out other
ids), pairs remote id -> local id (the remap), copies layer by layer, names the blocks in its
prefix cache, and only then adds the request: its prefill finds the prompt cached and computes
only the last block, whose logits give the first token. The decode side acknowledges, and the
prefill side frees the held blocks — or frees them after `timeout` seconds without an answer:
the deadline, which the announcement carries, so that the decode side gives up reading (and
recomputes the prompt) before the blocks may be reused.

The copy is a read of the prefill side's pool through shared memory, by block id (NIXL, which
vLLM's P/D connector uses, reads a remote pool by block id over RDMA the same way); the small
messages (an announcement, an acknowledgement) go through queues. The two halves are named
after vLLM's `KVConnectorBase_V1` methods where they mean the same thing.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from .errors import MiniPagedError, RequestError, TensorParallelError
from .generation import row_generator
from .ranks import run_ranks
from .sizing import pool_blocks
from .speculative import SpeculativeEngine

TIMEOUT = 30.0           # seconds the prefill side holds a request's blocks without an answer
LOAD_MARGIN = 0.1        # the decode side gives up reading this many seconds before that


class DisaggregationError(MiniPagedError):
    """The prefill or the decode engine failed or died; the other one was stopped."""


@dataclass
class TransferStats:
    """What moving the KV cost, counted on the decode side (blocks: logical blocks, all layers)."""
    blocks_sent: int = 0         # copied from the prefill side's pool
    bytes_sent: int = 0          # K and V of every layer
    blocks_skipped: int = 0      # the decode side's prefix cache held them already: not copied
    loads_failed: int = 0        # a transfer that failed: the decode side recomputes the prompt
    loads_timed_out: int = 0     # ... of them, reads that did not finish before the deadline
    seconds: float = 0.0         # spent copying

    @property
    def seconds_per_block(self) -> float:
        return self.seconds / max(1, self.blocks_sent)


@dataclass
class Move:
    """One layer's move of one request, as recorded for drawings: both tables, the range."""
    key: int
    layer: int
    remote: list        # the prefill side's block ids, logical block j at j
    local: list         # the decode side's
    first: int          # blocks before it were skipped: the decode side held them
    end: int            # blocks from it on are computed on the decode side

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return remap(self.remote, self.local, self.first, self.end)


def remap(remote_table, local_table, first: int, end: int) -> list[tuple[int, int]]:
    """The move of one layer as (remote block id, local block id) pairs: logical blocks
    first..end-1 of the request, on each side's own table (blocks before `first` are skipped)."""
    if not 0 <= first <= end <= min(len(remote_table), len(local_table)):
        raise RequestError(f"remap needs 0 <= first <= end <= the length of both tables, not "
                           f"first={first}, end={end} with tables of {len(remote_table)} and "
                           f"{len(local_table)} blocks")
    return [(remote_table[j], local_table[j]) for j in range(first, end)]


def leaked_blocks(cache) -> int:
    """Blocks of layer 0 neither free nor cached-free (0 when every request let go of its own)."""
    m = cache.managers[0]
    return m.num_blocks - m.num_free_blocks


# -- the prefill side ----------------------------------------------------------------------------
class PrefillConnector:
    """The prefill side's half: hold a prefilled request's blocks, announce them, free them on
    the decode side's acknowledgement or after `timeout` seconds."""

    def __init__(self, cache, outbox, timeout: float = TIMEOUT, clock=time.monotonic):
        self.cache, self.outbox, self.timeout, self.clock = cache, outbox, timeout, clock
        self.held: dict[int, tuple[list[list[int]], float]] = {}   # key -> (ids per layer, deadline)
        self.freed_by_ack = self.freed_by_timeout = 0

    def request_finished(self, key: int, seq_id: int) -> bool:
        """The prompt is in the cache: take one more reference on each of its blocks (as a fork
        would, without a table row), so finishing the request frees nothing, and announce them
        with their deadline. True: the free is delayed (vLLM's `request_finished` says so too)."""
        ids = [m.blocks_of(seq_id) for m in self.cache.managers]
        for m, blocks in zip(self.cache.managers, ids):
            m.hold(blocks)
        deadline = self.clock() + self.timeout
        self.held[key] = (ids, deadline)
        self.outbox.put((key, ids, deadline))
        return True

    def get_finished(self, acks) -> list[int]:
        """Free the blocks of every acknowledged request and of every one held past its
        deadline; returns their keys."""
        now, done = self.clock(), []
        for key in list(self.held):
            ids, deadline = self.held[key]
            if key in acks or now >= deadline:
                for m, blocks in zip(self.cache.managers, ids):
                    m.let_go(blocks)             # one reference less: free, or cached-free
                del self.held[key]
                done.append(key)
                if key in acks:
                    self.freed_by_ack += 1
                else:
                    self.freed_by_timeout += 1
        return done


class PrefillEngine(SpeculativeEngine):
    """The stages' engine, giving each prompt's blocks to its connector when its prefill ends
    (under the key the decode side knows the request by: `keys`, req_id -> key)."""

    connector: PrefillConnector

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keys: dict[int, int] = {}

    def _first_tokens(self, r, logits):
        self.connector.request_finished(self.keys.pop(r.req_id, r.req_id), r.seq_id)
        return super()._first_tokens(r, logits)


# -- the decode side -----------------------------------------------------------------------------
@dataclass
class Faults:
    """Faults to inject on the decode side, by request key (tests and the lesson's runs)."""
    fail: set = field(default_factory=set)     # the load breaks after layer 0
    hang: set = field(default_factory=set)     # the read of layer 1 never returns
    die: set = field(default_factory=set)      # the decode process is killed (SIGKILL) as the
                                               # announcement arrives: two processes only


class LayerReads(threading.Thread):
    """One request's blocks read out of the remote pool, layer by layer, in a thread beside the
    engine (NIXL's reads run beside vLLM's engine the same way): `ready[layer]` is set once that
    layer's blocks are copied out into `staged`. `cancel` stops it between two layers."""

    def __init__(self, remote, ids_per_layer, hang: bool = False):
        super().__init__(daemon=True, name="kv-reads")
        self.remote, self.ids, self.hang = remote, ids_per_layer, hang
        self.staged = [None] * len(ids_per_layer)
        self.ready = [threading.Event() for _ in ids_per_layer]
        self.cancel = threading.Event()

    def run(self) -> None:
        for layer, ((k, v), ids) in enumerate(zip(self.remote, self.ids)):
            if self.hang and layer == 1:
                self.cancel.wait()                # an injected read that never returns
            if self.cancel.is_set():
                return
            src = torch.tensor(ids, dtype=torch.long)
            self.staged[layer] = (k[src], v[src])     # (k, bs, Hk, D) each: copies, not views
            self.ready[layer].set()


class DecodeConnector:
    """The decode side's half: load a request's blocks from the prefill side's pool (`remote`:
    per layer, its (k, v) block tensors) into blocks of its own engine's pool."""

    def __init__(self, engine, remote, faults: Faults | None = None, record: bool = False):
        self.engine, self.remote = engine, remote
        self.stats = TransferStats()
        self.moves = [] if record else None       # every layer's Move of every request, to draw
        self.faults = faults or Faults()
        self.reads: LayerReads | None = None      # the reads of the load in progress
        self.deadline = 0.0                       # ... and when the decode side gives up on them

    def get_num_new_matched_tokens(self, prompt) -> tuple[int, int]:
        """(blocks the local prefix cache holds, blocks a prefill here may skip): the remote
        side supplies the blocks between. The block of the last token is never among them:
        its logits are needed, so the decode side computes it."""
        cache = self.engine.cache
        return len(cache.prefix_hits(prompt)[0]), (len(prompt) - 1) // cache.block_size

    def start_load_kv(self, key: int, prompt, remote_ids, deadline: float) -> bool:
        """Start reading the prompt's loadable blocks, allocate local blocks for them (a spare
        row of the engine's cache holds them for the while), write them layer by layer as they
        arrive, name them all in the prefix cache, let go of the row. A read not done by
        `deadline` (when the prefill side may free its blocks) is given up. False (nothing
        kept): the prompt is recomputed."""
        if key in self.faults.die:
            os.kill(os.getpid(), signal.SIGKILL)
        have, end = self.get_num_new_matched_tokens(prompt)
        self.stats.blocks_skipped += have
        if end <= have:
            return True
        engine, cache = self.engine, self.engine.cache
        rows = engine.scheduler.free_rows
        if not rows:
            self.stats.loads_failed += 1
            return False
        self.reads = LayerReads(self.remote, [ids[have:end] for ids in remote_ids],
                                hang=key in self.faults.hang)
        self.deadline = deadline - LOAD_MARGIN
        self.reads.start()
        row, ok = rows.pop(), False
        try:
            cache.start(row, prompt, (end - have) * cache.block_size)
            for layer, m in enumerate(cache.managers):
                pairs = remap(remote_ids[layer], m.blocks_of(row), have, end)
                self.wait_for_layer_load(layer, pairs)
                if self.moves is not None:
                    self.moves.append(Move(key, layer, list(remote_ids[layer]),
                                           m.blocks_of(row), have, end))
                if key in self.faults.fail:
                    raise OSError(f"injected failure loading request {key}")
            cache.name_blocks(row, prompt[:end * cache.block_size])
            self.stats.blocks_sent += end - have
            ok = True
        except TimeoutError:                         # the read hangs: give it up, recompute
            self.stats.loads_failed += 1
            self.stats.loads_timed_out += 1
        except (MiniPagedError, OSError):           # no room, or the copy broke: recompute
            self.stats.loads_failed += 1
        finally:
            self.reads.cancel.set()
            if row in cache:
                cache.free(row)                      # named blocks stay, cached-free
            rows.append(row)
        return ok

    def wait_for_layer_load(self, layer: int, pairs) -> None:
        """Wait for one layer's blocks to be read (until the deadline: else TimeoutError), then
        write them: remote pool[remote id] -> local pool[local id]."""
        start, left = time.perf_counter(), self.deadline - time.monotonic()
        if left <= 0 or not self.reads.ready[layer].wait(left):     # (read late: maybe freed)
            raise TimeoutError(f"layer {layer}'s blocks were not read before the deadline")
        m, (k, v) = self.engine.cache.managers[layer], self.reads.staged[layer]
        dst = torch.tensor([loc for _, loc in pairs], dtype=torch.long, device=m.device)
        m.k_cache_paged[dst] = k.to(m.device)                            # (k, bs, Hk, D)
        m.v_cache_paged[dst] = v.to(m.device)
        self.stats.bytes_sent += 2 * k[0].numel() * k.element_size() * len(pairs)
        self.stats.seconds += time.perf_counter() - start


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
