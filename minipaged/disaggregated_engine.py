"""Stage 9b: disaggregation in a program that runs on (the server) — the decode engine in the
caller's process, the prefill engine in a process of its own, started and ended with it.

    engine = DisaggregatedEngine(model, num_blocks, block_size)   # starts the prefill process
    engine.add_request(prompt, 20)   # the prompt goes to the prefill engine first
    engine.step()                    # load the blocks that were announced, then one step here
    engine.close()                   # the prefill process ends

It is the stages' engine to its caller (the server's loop steps it, draws its pool, aborts its
requests), with one difference: a request added waits in `pending` until the prefill engine has
announced its blocks and they are loaded here (the decode side's half of `disaggregated.py`);
then it arrives, and its prefill here computes only the prompt's last block. If the prefill
process dies, the requests waiting on it are failed with one DisaggregationError naming it (the
requests already here decode on), and every later `add_request` is refused with it.
"""

from __future__ import annotations

import queue
import signal

import torch

from .disaggregated import (TIMEOUT, DecodeConnector, DisaggregationError, PrefillConnector,
                            PrefillEngine)
from .disaggregated_run import prefill_loop
from .errors import TensorParallelError
from .ranks import start_followers
from .speculative import SpeculativeEngine

NOT_YET = 2**62          # the arrival step of a request whose blocks have not been loaded yet


class DisaggregatedEngine(SpeculativeEngine):
    """The decode engine (prefix caching on: it is how it finds the blocks it loaded), with a
    prefill engine of the same pool size in another process. `max_num_batched_tokens` is the
    prefill engine's token budget (chunked prefill); the decode engine runs whole steps."""

    def __init__(self, model, num_blocks=None, block_size: int = 16,
                 preemption: str = "recompute", *, max_num_batched_tokens=None,
                 timeout: float = TIMEOUT, **options):
        options.pop("prefix_caching", None)
        super().__init__(model, num_blocks, block_size, preemption, prefix_caching=True,
                         **options)
        prefill_options = dict(num_blocks=self.cache.num_blocks, block_size=block_size,
                               max_num_seqs=self.scheduler.max_num_seqs,
                               max_seq_len=self.max_seq_len,
                               max_num_batched_tokens=max_num_batched_tokens)
        ctx = torch.multiprocessing.get_context("spawn")
        pools, self.announcements, self.acks = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.followers = start_followers(
            _prefill_side, 2, [(model, prefill_options, (pools, self.announcements, self.acks),
                                timeout)], self.device, timeout=timeout, group=False)
        self.waiting_for_blocks: dict[int, object] = {}    # req_id -> its request
        self.dead: str | None = None                       # why the prefill engine is gone
        try:
            self.connector = DecodeConnector(self, self._receive_pools(pools, timeout))
        except BaseException:
            self.close()
            raise

    def _receive_pools(self, pools, timeout: float):
        for _ in range(int(timeout / 0.1) + 1):
            self.check()
            try:
                return pools.get(timeout=0.1)
            except queue.Empty:
                pass
        raise DisaggregationError(f"disaggregated: the prefill engine did not start within "
                                  f"{timeout:g} s")

    def check(self) -> None:
        """Raise one DisaggregationError naming the prefill engine if it has died."""
        if self.dead is None:
            try:
                self.followers.check()
            except TensorParallelError as e:   # the group's words: the prefill engine is rank 1
                self.dead = str(e).replace("tensor parallel: ", "disaggregated: ").replace(
                    "rank 1 of 2", "the prefill engine").replace("program", "server")
        if self.dead is not None:
            raise DisaggregationError(self.dead)

    def add_request(self, prompt, max_new_tokens: int, *args, **kwargs):
        """Stage 6's `add_request`; the request then waits for its blocks, which the prefill
        engine computes (refused, changing nothing, if that engine has died)."""
        self.check()
        req = super().add_request(prompt, max_new_tokens, *args, **kwargs)
        if req in self.pending:
            req.arrival_step = NOT_YET
            self.waiting_for_blocks[req.req_id] = req
            try:
                self.followers.send((req.req_id, list(req.prompt)))
            except TensorParallelError:          # it died just now: the request changes nothing
                self.abort(req)
                self.release(self.requests[self.requests.index(req):])
                self.check()
        return req

    def step(self):
        """Load the blocks announced since the last step (those requests arrive now), then one
        step of the stages' engine, if anything is there to run."""
        arrived = self._load_announced()
        if not arrived and not self.scheduler.has_unfinished() and \
                not any(r.arrival_step <= self.step_count for r in self.pending):
            self.tokens_run = {}
            return []                          # nothing to run yet: do not count empty steps
        return super().step()

    def _load_announced(self) -> int:
        try:
            self.check()
        except DisaggregationError as e:       # fail the requests that waited on it, only them
            stranded = [r for r in self.waiting_for_blocks.values() if r.status != "finished"]
            self.waiting_for_blocks.clear()
            if stranded:
                e.requests = stranded
                raise
            return 0
        idle = not self.scheduler.has_unfinished()
        arrived = 0
        try:
            message = self.announcements.get(timeout=0.01) if idle else \
                self.announcements.get_nowait()
            while True:
                key, ids, deadline = message
                req = self.waiting_for_blocks.pop(key, None)
                if req is not None and req.status != "finished":      # (not aborted meanwhile)
                    self.connector.start_load_kv(key, req.prompt, ids, deadline)
                    req.arrival_step = self.step_count
                    arrived += 1
                self.acks.put(key)
                message = self.announcements.get_nowait()
        except queue.Empty:
            return arrived

    def close(self) -> None:
        """End the prefill process (again: nothing)."""
        self.followers.close()


def _prefill_side(rank, world_size, device, inbox, model, options, links, timeout) -> None:
    """The prefill process: prefill each prompt the decode side sends, hold its blocks in
    shared memory until the decode side has read them (or `timeout`), until None arrives.
    Ctrl-C at the terminal reaches it too; only the server acts on it, and ends this."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pools, announcements, acks = links
    engine = PrefillEngine(model, **options, seed=1)     # another free set: other block ids
    engine.connector = PrefillConnector(engine.cache, announcements, timeout)
    for m in engine.cache.managers:
        m.k_cache_paged.share_memory_(), m.v_cache_paged.share_memory_()
    pools.put([(m.k_cache_paged, m.v_cache_paged) for m in engine.cache.managers])
    prefill_loop(engine, inbox, acks, drain=False)
