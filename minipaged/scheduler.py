"""Stage 5: the scheduler — who runs this step, who waits, and who gives up their blocks.

A paged cache hands out blocks as sequences grow, so a batch no longer has to reserve its
worst case up front. The price: the pool can run dry in the middle of a step. The scheduler
keeps requests in three queues, with vLLM's names, and serves them first come, first served:

    waiting  — arrived, holding no blocks (new, or preempted by recompute)
    running  — holding blocks in the KV pool; one decode step each per engine step
    swapped  — preempted by swap: their blocks sit in the CPU pool until there is room again

Every step, `schedule` first finds a slot for the next token of every running request, oldest
first. When the pool is dry it preempts the most recently admitted running request — by
recompute (free its blocks; it goes back to the front of `waiting` with the tokens it has
generated appended to its prompt, to be prefilled again) or by swap (its blocks are copied to
the CPU pool, `swap.py`, and freed). Only in a step with no preemption does it then swap
requests back in and admit waiting ones, as long as their blocks fit with the watermark of
stage 4 (`simulator.admits`) to spare.

The scheduler never runs the model: it moves requests between queues and blocks between
pools, and returns which requests the engine (`engine.py`) prefills and which it decodes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .errors import RequestError
from .simulator import WATERMARK, admits, watermark_blocks

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(eq=False)
class Request:
    """One prompt on its way through the engine, with everything needed to resume it."""
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    generator: object = None              # its own torch.Generator: sampling survives preemption
    stop_tokens: frozenset = frozenset()
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)
    status: str = "pending"               # not arrived yet; then waiting, running, swapped, finished
    seq_id: int | None = None             # its row in the cache while it holds blocks
    num_preemptions: int = 0
    finish_step: int | None = None
    logprobs: int | None = None           # asked for: keep each token's log-probability and
    token_logprobs: list = field(default_factory=list)   # its top `logprobs` rivals (`sampling`)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens. While running, the cache holds all but the newest one:
        that token is fed to the model by the next decode step."""
        return len(self.prompt) + len(self.output)


@dataclass
class ScheduledStep:
    """What one call to `schedule` decided; the engine runs `prefill` and `decode`."""
    decode: list[Request] = field(default_factory=list)      # one new token each
    prefill: list[Request] = field(default_factory=list)     # prompt (+ earlier output) each
    preempted: list[tuple[Request, str]] = field(default_factory=list)   # (request, mode)
    swapped_in: list[Request] = field(default_factory=list)


class Scheduler:
    """First come, first served over a PagedCache, preempting the newest request when blocks
    run out. `static_batches=True` admits new requests only when nothing runs: a batch is
    formed, served to its end, and only then the next one starts (the baseline that continuous
    batching beats). Preemption by swap needs a `SwapSpace`."""

    def __init__(self, cache, preemption: str = "recompute", watermark: float = WATERMARK,
                 max_num_seqs: int | None = None, static_batches: bool = False, swap=None):
        if preemption not in PREEMPTION_MODES:
            raise RequestError(f"preemption must be 'recompute' or 'swap', not {preemption!r}")
        if preemption == "swap" and swap is None:
            raise RequestError("preemption='swap' needs a CPU swap pool: give the engine "
                               "num_cpu_blocks > 0")
        self.cache, self.swap, self.static_batches = cache, swap, static_batches
        self.preemption = preemption
        self.block_size, self.num_blocks = cache.block_size, cache.num_blocks
        self.watermark_blocks = watermark_blocks(self.num_blocks, watermark)
        rows = cache.managers[0].max_seqs
        self.max_num_seqs = min(rows, max_num_seqs or rows)
        self.free_rows = list(range(rows - 1, -1, -1))          # cache rows (seq ids) to hand out
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []                        # in admission order
        self.swapped: deque[Request] = deque()                  # oldest first

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` tokens fill: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)                # ceil

    def check(self, req: Request) -> None:
        """Refuse, up front, a request that could not fit in the pool even alone: left in the
        queue it would wait forever (or be preempted forever)."""
        most = self.blocks_for(len(req.prompt) + max(req.max_new_tokens, 1) - 1)
        if most > self.num_blocks:
            raise RequestError(
                f"request {req.req_id} may need {most} blocks of {self.block_size} tokens "
                f"({len(req.prompt)} prompt + {req.max_new_tokens} new tokens), but the pool has "
                f"only {self.num_blocks} per layer: it could never run. Give the pool more blocks "
                f"or ask for fewer tokens.")

    def add(self, req: Request) -> None:
        """Queue an arrived request at the back of `waiting`."""
        self.check(req)
        req.status = "waiting"
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def group(self, req: Request) -> list[Request]:
        """The requests admitted together with `req`, itself first (here: itself alone)."""
        return [req]

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        out = ScheduledStep()
        committed = self._schedule_decodes(out)
        if out.preempted:             # memory is tight: admit nobody this step (as vLLM does)
            return out
        committed = self._swap_in(out, committed)
        if not self.swapped and not (self.static_batches and self.running):
            self._admit(out, committed)
        return out

    def _schedule_decodes(self, out: ScheduledStep) -> int:
        """1. Every running request gets a slot for one more token, oldest first; when the pool
        is dry, the newest running request gives its blocks up (possibly the one asking).
        Returns the free blocks promised to this step."""
        committed = 0
        while len(out.decode) < len(self.running):
            req = self.running[len(out.decode)]
            need = self.cache.blocks_to_grow(req.seq_id)       # 0, or 1 at a block boundary
            while need > self.cache.num_free_blocks - committed and req.status == "running":
                self._preempt(self.running[-1], out)
            if req.status != "running":
                break                 # it was the newest itself: nothing left to decode
            out.decode.append(req)
            committed += need
        return committed

    def _swap_in(self, out: ScheduledStep, committed: int) -> int:
        """2. Swapped requests come back first, oldest first (as in vLLM v0)."""
        while self.swapped:
            req = self.swapped[0]
            held = self.blocks_for(req.num_tokens - 1)
            need = self.blocks_for(req.num_tokens)             # its blocks + this step's token
            if not self._fits(need, committed):
                break
            self._bring_back(out)
            out.decode.append(req)
            committed += need - held
        return committed

    def _bring_back(self, out: ScheduledStep) -> Request:
        """The oldest swapped request's blocks are copied back into the KV pool; it runs again."""
        req = self.swapped[0]
        self.swap.swap_in(req.seq_id)
        self.swapped.popleft()
        req.status = "running"
        self.running.append(req)
        out.swapped_in.append(req)
        return req

    def _admit(self, out: ScheduledStep, committed: int) -> None:
        """3. Then new (or recomputed) requests, in order, while their prompts fit."""
        while self.waiting:
            req = self.waiting[0]
            group = self.group(req)                            # admitted whole
            need = self.blocks_for(req.num_tokens)             # prompt + any earlier output
            if len(group) > min(len(self.free_rows), self.max_num_seqs - len(self.running)) or \
                    not self._fits(need, committed):
                break                 # first come, first served: nobody overtakes it
            self.waiting.popleft()
            for r in group:                                    # a group shares req's blocks later
                r.seq_id, r.status = self.free_rows.pop(), "running"
                self.running.append(r)
            out.prefill.append(req)
            committed += need

    def _fits(self, need: int, committed: int) -> bool:
        """Room for `need` more blocks, keeping the watermark free unless nothing runs."""
        return admits(need, self.cache.num_free_blocks - committed, self.watermark_blocks,
                      alone=not self.running)

    def _preempt(self, req: Request, out: ScheduledStep) -> None:
        """Take a running request's blocks away: to the CPU pool (swap) or nowhere (recompute).
        If the CPU pool is full, swap falls back to recompute."""
        self.running.remove(req)
        req.num_preemptions += 1
        if self.preemption == "swap" and self.swap.can_swap_out(req.seq_id):
            self.swap.swap_out(req.seq_id)
            req.status = "swapped"
            self.swapped.appendleft(req)    # victims go newest first: the oldest ends up in front
            out.preempted.append((req, "swap"))
        else:
            self._release(req)
            req.status = "waiting"
            self.waiting.appendleft(req)    # first in line: its prompt is now prompt + output
            out.preempted.append((req, "recompute"))

    def finish(self, req: Request) -> None:
        """A request is done: every block goes back to the pool at once."""
        self.running.remove(req)
        self._release(req)
        req.status = "finished"

    def _release(self, req: Request) -> None:
        self.cache.free(req.seq_id)
        self.free_rows.append(req.seq_id)
        req.seq_id = None
