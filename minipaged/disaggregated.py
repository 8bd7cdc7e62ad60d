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
after vLLM's `KVConnectorBase_V1` methods where they mean the same thing. The loops that drive
them, in one process or two, are `disaggregated_run.py`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from .errors import MiniPagedError, RequestError
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
