"""The server's engine loop: one thread owns the engine, and requests join and leave it only
between two steps.

HTTP handlers never touch the engine, and never wait for a step. They hand the loop a job (add
these samples, abort that request, take a picture of the pool) and await its answer; the loop
runs the jobs at the next step boundary, steps the engine once, and posts each request's new
tokens back to the handler's asyncio queue. So the engine stays what stage 5 made it — a
single-threaded `step()` — and a request that arrives while a step runs simply joins the next
one. A step that raises fails the requests it ran (their clients get the error) and the loop
goes on; a request leaves the engine once its last token is delivered. If the loop itself
raises, outside a step, it stops: every request waiting on it ends with the error, and from
then on /health and every new request answer 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import MiniPagedError, RequestError
from ..generation import row_generator

log = logging.getLogger("minipaged.serve")


class QueueFullError(MiniPagedError):
    """The waiting queue is at its bound: the server answers 503 instead of queueing more."""
    code, kind = "queue_full", "server_overloaded"     # the 503's OpenAI error fields


class EngineStoppedError(QueueFullError):
    """The loop has stopped (a shutdown, or an error outside a step) and takes no more work:
    the server answers 503 too."""
    code, kind = "engine_stopped", "server_error"


@dataclass(eq=False)
class Ticket:
    """One client request: its `n` samples in the engine, and where their tokens go."""
    samples: list                      # the engine's Request objects, sample order
    queue: asyncio.Queue               # (index, new tokens, finish_reason or None, their
                                       # token_logprobs or None) events
    aio: asyncio.AbstractEventLoop
    sent: list = field(default_factory=list)     # tokens already posted, per sample
    done: list = field(default_factory=list)     # finished, per sample
    error: str | None = None           # why the engine failed it (finish_reason "error")
    name: str = ""                     # the id its client sees (cmpl-…, chatcmpl-…)

    @property
    def prompt_tokens(self) -> int:
        return len(self.samples[0].prompt)


class EngineLoop:
    """Owns `engine` in a thread of its own. `max_waiting` bounds the requests that may wait
    beyond those the next step can start (past it, `submit` refuses with QueueFullError)."""

    def __init__(self, engine, max_waiting: int = 64):
        self.engine = engine
        self.max_waiting = max_waiting
        self.lock = threading.Condition()     # guards inbox and stopping; never held in a step
        self.inbox: list = []                 # jobs for the next step boundary
        self.tickets: list[Ticket] = []       # requests with samples still in the engine
        self.stopping = False
        self.died: str | None = None          # why the loop stopped by itself, if it did
        self.current_jobs: list = []          # the jobs taken from the inbox, not yet run
        self.refused = 0                      # requests answered 503 (queue full)
        self.aborted_ids: set[int] = set()    # req_ids ended by an abort
        self.aborted = 0                      # samples ended early (client gone, stop string)
        self.failed = 0                       # samples ended by a step that raised
        self.last_step_tokens = 0             # tokens the last step ran through the model
        self.version = 0                      # counts the loop's changes to the engine
        self.trace = deque(maxlen=4096)       # (version, blocks used, cached free) after each
        self.counters = counters(engine, self)   # what /metrics prints, after the last change
        self.thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Abort whatever is left and end the thread (Ctrl-C, SIGTERM)."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join()

    # -- called from the HTTP side ----------------------------------------------------------------
    def submit(self, prompt, max_tokens: int, temperature: float, top_p: float, n: int,
               seed: int | None, stop_tokens, logprobs: int | None = None, name: str = ""
               ) -> concurrent.futures.Future:
        """Ask for `n` samples of `prompt` (with each token's logprobs and `logprobs` rivals,
        if not None), under the id its client sees (`name`); the future gives a Ticket, or the engine's RequestError (the request
        changed nothing), or QueueFullError."""
        aio, queue = asyncio.get_running_loop(), asyncio.Queue()
        seed = random.randrange(2**63) if seed is None else seed

        def add():
            e = self.engine
            if self.waiting_beyond_next_step() >= self.max_waiting:
                self.refused += 1
                raise QueueFullError(f"{self.max_waiting} requests are already waiting for the "
                                     f"engine; try again shortly")
            gens = [row_generator(seed, j) if temperature > 0 else None for j in range(n)]
            e.add_request(prompt, max_tokens, temperature, top_p, stop_tokens=stop_tokens,
                          n=n, generators=gens, logprobs=logprobs)
            t = Ticket(e.requests[-n:], queue, aio, [0] * n, [False] * n, name=name)
            self.tickets.append(t)
            return t
        return self.ask(add)

    def waiting_beyond_next_step(self) -> int:
        """Requests that will still wait after the next step has started all it has rows for
        (a bound that does not depend on when, between two steps, requests arrive)."""
        e, s = self.engine, self.engine.scheduler
        free_rows = s.max_num_seqs - len(s.running) - len(s.swapped)
        return max(0, len(e.pending) + len(s.waiting) - free_rows)

    def abort(self, ticket: Ticket, index: int | None = None) -> None:
        """Give up a request (every sample, or sample `index`) at the next step boundary."""
        def job():
            picked = ticket.samples if index is None else [ticket.samples[index]]
            for r in picked:              # the first sample first: it takes its unforked ones
                if r.status != "finished":
                    self.engine.abort(r)
                    self.aborted += 1
                    self.aborted_ids.add(r.req_id)
        self.ask(job)

    def abort_all(self) -> None:
        """Give up every request in flight at the next step boundary (the end of a shutdown's
        drain): each answer ends with finish_reason "abort", as vLLM's do."""
        def job():
            for t in self.tickets:
                self.abort(t)
        self.ask(job)

    def ask(self, job) -> concurrent.futures.Future:
        """Run `job()` in the loop's thread at the next step boundary (at once if the loop is
        idle); the future gives what it returns, or the error it raised."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.stopping:
                fut.set_exception(self._stopped_error())
            else:
                self.inbox.append((job, fut))
                self.lock.notify()
        return fut

    def snapshot(self) -> dict:
        """The pool and the queues, consistent (taken between two steps). Blocks the calling
        thread for up to a step: from the event loop, await `ask(...)` instead."""
        if not self.thread.is_alive():
            return pool_state(self.engine, self)
        return self.ask(lambda: pool_state(self.engine, self)).result()

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        """The thread's body: the loop, until stopped. If anything outside a step raises (a
        step's own errors are its requests'), the loop stops and fails every waiting request."""
        try:
            self._serve()
        except Exception as e:
            log.exception("the engine loop failed outside a step; it stops, and every request "
                          "waiting on it is ended with an error")
            self._die(f"the server's engine loop failed ({type(e).__name__}: {e}); restart the "
                      f"server")

    def _serve(self) -> None:
        """Jobs, then one engine step, then each request's new tokens out; until stopped."""
        while True:
            with self.lock:
                while not (self.inbox or self.stopping or self.engine.has_unfinished()):
                    self.lock.wait()
                if self.stopping:
                    self._abort_all()
                    return
                self.current_jobs, self.inbox = self.inbox, []
            self._run_jobs(self.current_jobs)
            stepped = self.engine.has_unfinished()
            if stepped:
                self._step()
            self._deliver()
            if stepped:
                self._published()

    def _step(self) -> None:
        """One engine step. If it raises, the requests it ran are failed, and only they (all
        that wait, if it raised before running any: else the loop would retry it forever)."""
        try:
            with torch.inference_mode():
                self.engine.step()
            self.last_step_tokens = sum(self.engine.tokens_run.values())
        except Exception as e:               # a bug, or a value the checks let through
            log.exception("an engine step failed; its requests are ended with an error")
            s = self.engine.scheduler
            why = f"the engine failed on this request ({type(e).__name__}: {e})"
            ran = list(getattr(e, "requests", ())) or \
                list(s.running) + list(getattr(s, "prefilling", ()))   # (9b: the error names them)
            if not ran:                       # it failed before running any: all would wait on it
                ran = list(self.engine.pending) + list(s.waiting) + list(s.swapped)
            for r in ran:
                self._fail(r, why)

    def _fail(self, r, why: str) -> None:
        for t in self.tickets:
            if r in t.samples:
                t.error = why
        if r.status != "finished":
            self.failed += 1
        try:
            self.engine.abort(r)
        except Exception:                     # its state is beyond repair: at least end it
            log.exception("could not free request %d's blocks", r.req_id)
            r.status = "finished"

    def _run_jobs(self, jobs) -> None:
        """Run the jobs posted since the last step, each one's change published as it is made
        (so a picture of the pool taken by a job is the state of the last version)."""
        while jobs:
            job, fut = jobs.pop(0)
            try:
                fut.set_result(job())
            except (MiniPagedError, ValueError, TypeError) as e:
                fut.set_exception(e if isinstance(e, MiniPagedError) else RequestError(str(e)))
            except Exception as e:            # a bug in a job: its caller answers 500
                log.exception("a job of the engine loop failed")
                fut.set_exception(e)
            self._published()

    def _deliver(self) -> None:
        """Post every sample's new tokens (and its end) to the handler waiting on it; a request
        whose samples have all been delivered leaves the engine."""
        live, gone = [], []
        for t in self.tickets:
            for i, r in enumerate(t.samples):
                if t.done[i]:
                    continue
                new = r.output[t.sent[i]:]
                lps = r.token_logprobs[t.sent[i]:len(r.output)] if r.logprobs is not None \
                    else None                 # (a stop token's entry, last, is not sent)
                t.sent[i] = len(r.output)
                reason = None
                if r.status == "finished":
                    t.done[i] = True
                    reason = "error" if t.error else "abort" if r.req_id in self.aborted_ids \
                        else "length" if len(r.output) >= r.max_new_tokens else "stop"
                    self.aborted_ids.discard(r.req_id)
                if new or reason:
                    try:
                        t.aio.call_soon_threadsafe(t.queue.put_nowait, (i, new, reason, lps))
                    except RuntimeError:      # its event loop has closed (shutdown)
                        pass
            (gone if all(t.done) else live).append(t)
        self.tickets = live
        self.engine.release([r for t in gone for r in t.samples])

    def _published(self) -> None:
        self.version += 1
        self.counters = counters(self.engine, self)
        self.trace.append((self.version, self.counters["used"], self.counters["cached_free"]))

    def _stopped_error(self) -> EngineStoppedError:
        return EngineStoppedError(self.died or "the server is shutting down")

    def _die(self, why: str) -> None:
        """The loop cannot go on: take no more work (so /health and new requests answer 503),
        refuse the jobs not run, and end each waiting sample with finish_reason "error" (its
        client gets `why`). The engine is left as it is: nothing will step it again."""
        with self.lock:
            self.died, self.stopping = why, True
            jobs, self.inbox, self.current_jobs = self.current_jobs + self.inbox, [], []
        for job, fut in jobs:
            if not fut.done():
                fut.set_exception(self._stopped_error())
        for t in self.tickets:
            t.error = why
            for i, done in enumerate(t.done):
                if not done:
                    t.done[i] = True
                    self.failed += 1
                    try:
                        t.aio.call_soon_threadsafe(t.queue.put_nowait, (i, [], "error", None))
                    except RuntimeError:      # its event loop has closed (shutdown)
                        pass
        self.tickets = []

    def _abort_all(self) -> None:
        for job, fut in self.inbox:
            fut.set_exception(self._stopped_error())
        self.inbox = []
        for t in self.tickets:
            for r in t.samples:
                if r.status != "finished":
                    self.engine.abort(r)
        self._deliver()


def counters(engine, loop) -> dict:
    """The figures `/metrics` prints: taken by the loop after each change, read at any time."""
    cache, s, st = engine.cache, engine.scheduler, engine.stats
    prefix = getattr(cache.managers[0], "prefix", None)
    return {
        "version": loop.version, "step": engine.step_count, "num_blocks": cache.num_blocks,
        "block_size": cache.block_size, "used": cache.num_used_blocks,
        "cached_free": len(prefix) if prefix is not None else 0,
        "running": len(s.running), "waiting": len(s.waiting) + len(engine.pending),
        "swapped": len(s.swapped), "step_tokens": loop.last_step_tokens,
        "preemptions": st.preemptions, "cached_tokens": st.cached_tokens,
        "generated_tokens": st.generated_tokens, "steps": st.steps,
        "refused": loop.refused, "aborted": loop.aborted, "failed": loop.failed,
        **transfer_counters(engine),
    }


def transfer_counters(engine) -> dict:
    """A disaggregated engine's loads (stage 9b's `TransferStats`); nothing for the others."""
    t = getattr(getattr(engine, "connector", None), "stats", None)
    if t is None:
        return {}
    return {"blocks_sent": t.blocks_sent, "bytes_sent": t.bytes_sent,
            "blocks_skipped": t.blocks_skipped, "loads_failed": t.loads_failed,
            "transfer_seconds": round(t.seconds, 6)}


def pool_state(engine, loop) -> dict:
    """`counters`, with layer 0's pool block by block (every layer holds the same tokens) and
    the queues' req_ids, and the id each req_id's client sees: what the live page draws. Taken
    in the loop's thread."""
    cache, s = engine.cache, engine.scheduler
    m = cache.managers[0]
    owner = [-1] * cache.num_blocks                  # -1 free, -2 cached free, else a req_id
    refs = getattr(m, "refs", None)
    prefix = getattr(m, "prefix", None)
    if prefix is not None:
        for b in prefix.cached_free:
            owner[b] = -2
    for r in s.running:
        if r.seq_id is not None and r.seq_id in cache:
            for b in m.blocks_of(r.seq_id):
                if owner[b] < 0:
                    owner[b] = r.req_id
    shared = [b for b in range(cache.num_blocks) if refs is not None and refs[b] > 1]
    return {**counters(engine, loop), "owner": owner, "shared": shared,
            "running": [r.req_id for r in s.running],
            "waiting": [r.req_id for r in s.waiting] + [r.req_id for r in engine.pending],
            "swapped": [r.req_id for r in s.swapped],
            "names": {r.req_id: t.name for t in loop.tickets for r in t.samples}}


def block_tables(engine, loop, name: str) -> dict | None:
    """The request its client knows as `name`: each sample's block table in every layer (the
    blocks it holds, in token order; empty while it waits or is swapped out). None if no
    request in flight has that name. Taken in the loop's thread."""
    cache = engine.cache
    for t in loop.tickets:
        if t.name == name:
            held = [r.seq_id is not None and r.seq_id in cache for r in t.samples]
            return {"id": name, "block_size": cache.block_size, "samples": [
                {"index": i, "req_id": r.req_id, "status": r.status,
                 "layers": [m.blocks_of(r.seq_id) if h else [] for m in cache.managers]}
                for i, (r, h) in enumerate(zip(t.samples, held))]}
    return None
