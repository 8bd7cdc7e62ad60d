"""Stage 5: the engine — continuous batching around the scheduler, one step at a time.

    engine = Engine(model, num_blocks=64, block_size=16, preemption="swap")
    engine.add_request(prompt_ids, max_new_tokens=50, arrival_step=3)
    while engine.has_unfinished():
        done = engine.step()            # the requests that finished in this step

A step asks the scheduler what to run, then makes the model calls: one batched decode call for
every running request (one token each), and one prefill call per newly admitted request (its
prompt, plus what it had generated before a recompute). Then it samples, appends, and hands
finished requests back to the scheduler, which frees their blocks at once — so the next step
can admit someone new in their place. That is continuous (iteration-level) batching: the batch
changes every step, instead of waiting for its slowest member.

`minipaged.generate(..., cache="paged")` serves its prompts on an engine (stage 6's, which extends
this one); `python -m minipaged.benchmarks.serving` measures what paging and continuous batching
buy against static batches on stage 1's contiguous cache and on paged blocks.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .backends import available_backends
from .checks import check_request, check_flag, check_stop_tokens, check_whole
from .errors import RequestError, UsageError
from .generation import sample
from .sampling import token_logprobs
from .kv_budget import bytes_per_block
from .kv_formats import check_kv_dtype, stored_layout
from .paged_cache import PagedCache
from .scheduler import Request, Scheduler
from .simulator import WATERMARK
from .sizing import pool_blocks
from .swap import SwapSpace


def check_pool_options(num_blocks=None, kv_budget=None, watermark=WATERMARK, seed=0,
                       backend="auto") -> None:
    """A pool's settings, before any memory is taken: a budget is a finite number of bytes, the
    watermark a fraction of the pool in [0, 1), the seed an integer, the backend one that exists
    (num_blocks and block_size: `pool_blocks`)."""
    if kv_budget is not None and (isinstance(kv_budget, bool) or not isinstance(
            kv_budget, numbers.Real) or not math.isfinite(kv_budget)):
        raise RequestError(f"kv_budget is a number of bytes (e.g. 4 * 2**20), not {kv_budget!r}")
    if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or \
            not 0 <= watermark < 1:
        raise RequestError(f"watermark is the fraction of the pool kept free when admitting, in "
                           f"[0, 1) (default {WATERMARK}), not {watermark!r}")
    check_whole("seed", seed)
    if backend not in available_backends():
        raise UsageError(f"backend must be one of {', '.join(map(repr, available_backends()))}, "
                         f"not {backend!r}")


@dataclass
class EngineStats:
    """What a run cost, for the benchmark and the lesson."""
    steps: int = 0
    busy_steps: int = 0               # steps that ran the model
    generated_tokens: int = 0
    prefill_tokens: int = 0           # tokens run through prefill, recomputed ones included
    recomputed_tokens: int = 0        # ...of which had been computed before a recompute
    cached_tokens: int = 0            # prompt tokens already in the cache, not prefilled (stage 6)
    peak_used_blocks: int = 0         # most blocks per layer held at once (after a step's model)
    used_blocks_sum: int = 0          # sum over busy steps of blocks per layer held
    preemptions: int = 0
    swapped_blocks: int = 0           # blocks per layer copied out or in
    swap_bytes: int = 0               # bytes copied to or from the CPU pool, all layers
    running_sum: int = 0              # sum over busy steps of requests holding blocks
    running_max: int = 0
    max_step_tokens: int = 0          # most tokens one step ran through the model
    seconds: float = 0.0

    @property
    def mean_running(self) -> float:
        return self.running_sum / max(1, self.busy_steps)

    @property
    def mean_used_blocks(self) -> float:
        return self.used_blocks_sum / max(1, self.busy_steps)


@dataclass
class StepRecord:
    """One step, as the drawings need it: each live request's state and blocks in the pool."""
    step: int
    states: dict = field(default_factory=dict)     # req_id -> waiting/preempted/running/swapped
    blocks: dict = field(default_factory=dict)     # req_id -> blocks held (per layer) in the pool
    preempted: list = field(default_factory=list)  # (req_id, "recompute" | "swap")
    num_free_blocks: int = 0
    decoded: list = field(default_factory=list)    # req_ids that ran one decode token
    prefilled: dict = field(default_factory=dict)  # req_id -> prompt tokens it ran


class Engine:
    """Requests in, tokens out: a PagedCache, a Scheduler, and the model between them.

    The pool has `num_blocks` blocks per layer, or as many as `kv_budget` bytes hold. With
    preemption="swap", a CPU pool of `num_cpu_blocks` blocks per layer (default: as many as the
    KV pool) holds the K/V of swapped-out requests.
    """

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16,
                 preemption: str = "recompute", *, kv_budget: int | None = None,
                 max_num_seqs: int = 256, max_seq_len: int | None = None,
                 num_cpu_blocks: int | None = None, watermark: float = WATERMARK,
                 static_batches: bool = False, seed: int = 0, backend: str = "auto",
                 record: bool = False, kv_dtype: str | None = None):
        self.model = model
        a, p = model.args, next(model.parameters())
        if num_blocks is None and kv_budget is None:
            raise RequestError("give the engine's pool a size: num_blocks, or a kv_budget in bytes")
        check_pool_options(num_blocks, kv_budget, watermark, seed, backend)
        check_flag("static_batches", static_batches)
        check_flag("record", record)
        check_kv_dtype(kv_dtype, backend)
        num_blocks = pool_blocks(a, p.dtype, block_size, num_blocks, kv_budget, kv_dtype=kv_dtype)
        if num_cpu_blocks is None:     # swap space as large as the pool (vLLM sizes it in GiB)
            num_cpu_blocks = num_blocks if preemption == "swap" else 0
        self.max_seq_len = max_seq_len or a.max_seq_len
        self.cache = self.new_cache(a, num_blocks, block_size, max_num_seqs, self.max_seq_len,
                                    device=p.device, dtype=p.dtype, seed=seed, backend=backend,
                                    kv_dtype=kv_dtype)
        self.swap = self.new_swap(self.cache, num_cpu_blocks) if num_cpu_blocks else None
        self.scheduler = self.new_scheduler(self.cache, preemption, watermark, max_num_seqs,
                                            static_batches, self.swap)
        self.device = p.device
        self.block_bytes = bytes_per_block(block_size, a.n_kv_heads,
                                           *stored_layout(a.head_dim, p.dtype, kv_dtype),
                                           a.n_layers)
        self.requests: list[Request] = []          # every request, in the order added
        self.next_req_id = 0                       # (a server `release`s answered ones)
        self.pending: list[Request] = []           # added, not arrived yet
        self.step_count = 0
        self.stats = EngineStats()
        self.history: list[StepRecord] | None = [] if record else None
        self.callback = None      # callback(event, req_id, token, cache), as generate_static's
        self.tokens_run: dict[Request, int] = {}  # tokens each request ran in the current step

    def new_cache(self, *args, **kwargs) -> PagedCache:
        """The engine's KV cache (a later stage builds a richer one here)."""
        return PagedCache(*args, **kwargs)

    def new_scheduler(self, *args) -> Scheduler:
        """The engine's scheduler (a later stage builds a richer one here)."""
        return Scheduler(*args)

    def new_swap(self, *args) -> SwapSpace:
        """The engine's CPU swap pool (a later stage builds a richer one here)."""
        return SwapSpace(*args)

    # -- requests in -----------------------------------------------------------------------------
    def add_request(self, prompt, max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, generator=None, stop_tokens=None,
                    arrival_step: int = 0, logprobs: int | None = None) -> Request:
        """Queue a prompt (token ids). It joins `waiting` at `arrival_step` (0: now). A request
        that is malformed, or that the pool could never hold, is refused here (RequestError).
        `logprobs=k` keeps each sampled token's log-probability and its k likeliest rivals in
        `req.token_logprobs` (computed only for requests that ask)."""
        check_request(self.model, [prompt], max_new_tokens, temperature, top_p, self.max_seq_len)
        stop = check_stop_tokens(self.model, stop_tokens)
        arrival_step = check_whole("arrival_step", arrival_step)
        if logprobs is not None:
            logprobs = check_whole("logprobs", logprobs)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise RequestError(f"generator must be a torch.Generator (or None), not {generator!r}")
        req = Request(self.next_req_id, list(prompt), int(max_new_tokens), temperature, top_p,
                      generator, stop, max(arrival_step, self.step_count), logprobs=logprobs)
        self.scheduler.check(req)
        self.requests.append(req)
        self.next_req_id += 1
        if req.max_new_tokens == 0:                # nothing to do
            req.status, req.finish_step = "finished", self.step_count
        else:
            self.pending.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self.scheduler.has_unfinished()

    def abort(self, req: Request) -> None:
        """End a request before it finishes (its client went away). Call it between steps: it
        leaves whichever queue holds it and its blocks go back, in the KV pool or the CPU swap
        pool. Samples of it not forked yet (stage 6, `n`) go with it."""
        if req.status == "finished":
            return
        s = self.scheduler
        for queue in (self.pending, s.waiting, s.running, s.swapped):
            if req in queue:
                queue.remove(req)
        # what later stages keep about a request part-way (5b: a prompt in chunks and the group
        # waiting for it; 6: its samples not forked yet)
        getattr(s, "prefilling", set()).discard(req)
        unforked = getattr(s, "followers", {}).pop(req, []) + \
            getattr(s, "siblings", {}).pop(req.req_id, [])
        if req.seq_id is not None:
            if req.status == "swapped":
                for m in self.swap.cpu_managers:
                    m.free(req.seq_id)
            elif req.seq_id in self.cache:            # a row may be held before any block
                self.cache.free(req.seq_id)
            s.free_rows.append(req.seq_id)
            req.seq_id = None
        req.status, req.finish_step = "finished", self.step_count
        for sib in dict.fromkeys(unforked):
            self.abort(sib)

    def release(self, reqs) -> None:
        """Forget finished requests (`requests` keeps every request otherwise): a server that
        runs for weeks releases each one once its answer is delivered."""
        gone = {id(r) for r in reqs if r.status == "finished"}
        if gone:
            self.requests = [r for r in self.requests if id(r) not in gone]

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule, run the model once for the decodes and once per prefill, sample. Returns
        the requests that finished in this step."""
        start = time.perf_counter()
        arrived = [r for r in self.pending if r.arrival_step <= self.step_count]
        if arrived:
            self.pending = [r for r in self.pending if r.arrival_step > self.step_count]
            for r in arrived:
                self.scheduler.add(r)
        plan = self.scheduler.schedule()
        self._count_preemptions(plan)
        self.tokens_run = {}
        sampled = self._run_model(plan)             # (request, token, event)
        self._after_model(plan)
        used = self.cache.num_used_blocks
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, used)
        if plan.decode or plan.prefill:
            self.stats.used_blocks_sum += used

        if self.history is not None:
            self._record(plan)
        finished = []
        for r, t, event in sampled:
            if self.callback:
                self.callback(event, r.req_id, t, self.cache)
            if t not in r.stop_tokens:
                r.output.append(t)
                self.stats.generated_tokens += 1
            if t in r.stop_tokens or len(r.output) >= r.max_new_tokens:
                self.scheduler.finish(r)
                r.finish_step = self.step_count
                finished.append(r)
        self.step_count += 1
        self._count_step(plan, time.perf_counter() - start)
        return finished

    def _run_model(self, plan) -> list:
        """The model calls of a step: one batched decode call for every running request, then
        one prefill call per admitted request. Returns (request, token, event) triples."""
        sampled = []
        if plan.decode:
            self.cache.prepare([r.seq_id for r in plan.decode], 1)
            tokens = torch.tensor([[r.output[-1]] for r in plan.decode],
                                  device=self.device)                            # (B, 1)
            logits = self.model(tokens, cache=self.cache)[:, -1]                 # (B, V)
            self.tokens_run.update(dict.fromkeys(plan.decode, 1))
            sampled += [(r, t, "decode") for r, t in
                        zip(plan.decode, self._sample(plan.decode, logits))]
        for r in plan.prefill:
            logits = self._prefill(r)                                            # (1, V)
            sampled += [(g, t, "prefill") for g, t in self._first_tokens(r, logits)]
        return sampled

    def _prefill(self, r: Request):
        """Run one admitted request's prompt (after a recompute: everything it had) through
        the model; the logits of its last token, (1, V)."""
        ids = r.prompt + r.output
        skipped = self._start(r, ids)
        logits = self.model(torch.tensor([ids[skipped:]], device=self.device),
                            cache=self.cache, last_only=True)[:, -1]             # (1, V)
        self.tokens_run[r] = len(ids) - skipped
        self.stats.prefill_tokens += len(ids) - skipped
        self.stats.recomputed_tokens += len(ids) - 1 if r.output else 0
        return logits

    def _start(self, r: Request, ids) -> int:
        """Make room for a prefill of `ids`; returns how many of them the cache already holds
        and the model may skip (none here)."""
        self.cache.prepare([r.seq_id], len(ids))
        return 0

    def _first_tokens(self, r: Request, logits):
        """(request, token) pairs sampled from a prefill's logits: here, r's first token."""
        return list(zip([r], self._sample([r], logits)))

    def _after_model(self, plan) -> None:
        """Anything a step does once the model has run (nothing here)."""

    def _sample(self, reqs, logits) -> list[int]:
        """One token per row of (B, V) logits: one argmax for the batch, and a draw from each
        sampling request's own generator (and its logprobs, if it asked)."""
        tokens = logits.argmax(-1).tolist()
        for i, r in enumerate(reqs):
            if r.temperature > 0:
                tokens[i] = sample(logits[i], r.temperature, r.top_p, r.generator)
            if r.logprobs is not None:
                r.token_logprobs.append(token_logprobs(logits[i], tokens[i], r.logprobs))
        return tokens

    # -- a whole trace ---------------------------------------------------------------------------
    def run(self, progress: bool = False, description: str = "serving") -> list[Request]:
        """Step until every request has finished; returns them in the order they were added."""
        if not progress:
            while self.has_unfinished():
                self.step()
            return self.requests
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[queues]}"), TimeElapsedColumn()]
        with Progress(*columns, transient=True) as bar:
            task = bar.add_task(description, total=len(self.requests), queues="")
            while self.has_unfinished():
                self.step()
                s = self.scheduler
                bar.update(task, completed=sum(r.status == "finished" for r in self.requests),
                           queues=f"running {len(s.running)} · waiting {len(s.waiting)} · "
                                  f"swapped {len(s.swapped)} · preempted {self.stats.preemptions}")
        return self.requests

    # -- bookkeeping -----------------------------------------------------------------------------
    def _count_preemptions(self, plan) -> None:
        st = self.stats
        st.preemptions += len(plan.preempted)
        moved = [(r, self.swap.cpu_managers[0]) for r, mode in plan.preempted if mode == "swap"]
        moved += [(r, self.cache.managers[0]) for r in plan.swapped_in]
        for r, pool in moved:                        # the blocks of its cached tokens, now there
            n = len(pool.blocks_of(r.seq_id))
            st.swapped_blocks += n
            st.swap_bytes += n * self.block_bytes

    def _count_step(self, plan, seconds) -> None:
        st = self.stats
        st.steps += 1
        st.seconds += seconds
        n = len(plan.decode) + len(plan.prefill)     # requests that ran: the batch
        st.max_step_tokens = max(st.max_step_tokens, sum(self.tokens_run.values()))
        if n:
            st.busy_steps += 1
            st.running_sum += n
            st.running_max = max(st.running_max, n)

    def _record(self, plan) -> None:
        """Snapshot after the model ran, before finished requests give their blocks back."""
        rec = StepRecord(self.step_count, num_free_blocks=self.cache.num_free_blocks,
                         preempted=[(r.req_id, mode) for r, mode in plan.preempted],
                         decoded=[r.req_id for r in plan.decode],
                         prefilled={r.req_id: self.tokens_run[r] for r in plan.prefill})
        first = self.cache.managers[0]
        for r in self.requests:
            if r.status in ("pending", "finished"):
                continue
            state = "preempted" if r.status == "waiting" and r.num_preemptions else r.status
            rec.states[r.req_id] = state
            if r.status == "running":
                rec.blocks[r.req_id] = int(first.num_blocks_held[r.seq_id])
        self.history.append(rec)
