"""Stage 5b: chunked prefill — a budget of tokens per step, spent on decodes first, then on
chunks of prompts.

Stage 5's engine runs, every step, one token for each running request and then the whole prompt
of each request it admits, so a 2,000-token prompt stalls every running conversation for as long
as its prefill takes. vLLM v1's scheduler has no prefill and decode phases. A request has tokens
already computed (their K/V are in the cache) and tokens still to compute, and a step spends at
most `max_num_batched_tokens` tokens:

    1. one token for every running request that is decoding, oldest first — stage 5's loop,
       where a dry pool preempts the newest running request;
    2. a chunk for the running request whose prompt is only partly computed (there is at most
       one: a chunk that does not end its prompt uses the rest of the budget or of the blocks);
    3. swapped requests come back, then waiting ones are admitted (stage 5's rules), each with a
       first chunk as large as the rest of the budget and the free blocks allow.

A chunk is the next n tokens of prompt + output. The chunk that reaches the last token makes the
request sample, and from then on it decodes. Its blocks come chunk by chunk. How far a request
has got is not a field of its own: it is the number of tokens the cache holds for it
(`num_computed_tokens`), so a recompute, which frees the blocks, starts it over, and a swap,
which keeps them, resumes it where it stopped.

The scheduler never runs the model; `chunked_engine.py` runs a step's decodes and chunks in one
call. Without a budget (`max_num_batched_tokens=None`) this is stage 5's scheduler, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import RequestError
from .simulator import admits
from .scheduler import Request, ScheduledStep, Scheduler


@dataclass
class ChunkedStep(ScheduledStep):
    """One step under a token budget. `prefill` lists the requests that run a chunk of their
    prompt; `num_tokens` how many tokens each scheduled request runs (a decode: 1)."""
    num_tokens: dict = field(default_factory=dict)    # request -> tokens it runs this step
    new_blocks: dict = field(default_factory=dict)    # request -> free blocks promised to it
    cached_tokens: int = 0       # prompt tokens found in the cache at admission (stage 6)
    lost_tokens: int = 0         # computed tokens that recompute preemptions threw away

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())


class ChunkedScheduler(Scheduler):
    """Stage 5's scheduler, spending at most `max_num_batched_tokens` tokens per step (None: no
    budget, stage 5's whole prefills)."""

    def __init__(self, *args, max_num_batched_tokens: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        budget = max_num_batched_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 1):
            raise RequestError(f"max_num_batched_tokens is the most tokens one step may run: a "
                               f"positive integer (or None for no budget), not {budget!r}")
        self.max_num_batched_tokens = budget
        self.prefilling: set[Request] = set()     # holding blocks, prompt not all computed yet
        self.followers: dict[Request, list[Request]] = {}  # a group's other members, rows kept
        #                                                    until its leader's last chunk

    def num_computed_tokens(self, req: Request) -> int:
        """Tokens of `req` whose K/V the cache holds: in the KV pool, or in the CPU pool while
        it is swapped out."""
        if req.seq_id is None:
            return 0
        pool = self.swap.cpu_managers[0] if req.status == "swapped" else self.cache.managers[0]
        return int(pool.seq_lens[req.seq_id])

    def cached_prefix(self, req: Request) -> int:
        """Prompt tokens the cache could give `req` at admission without computing them: none
        here (stage 6's prefix cache finds some)."""
        return 0

    def _begin(self, req: Request) -> int:
        """Start an admitted request's sequence in the cache before its first chunk; returns the
        tokens it starts with (here none: the first chunk's `prepare` starts it)."""
        return 0

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        if self.max_num_batched_tokens is None:
            return super().schedule()
        out = ChunkedStep()
        self._schedule_decode_tokens(out)
        self._schedule_prompt_chunks(out)
        if not out.preempted:         # memory is tight: nobody comes back or starts this step
            self._swap_in_chunks(out)
            if not self.swapped and not (self.static_batches and self.running):
                self._admit_chunks(out)
        self._end_prefills(out)
        return out

    def _schedule_decode_tokens(self, out: ChunkedStep) -> None:
        """1. One token for each running request that is decoding, oldest first, while the
        budget lasts. A dry pool preempts the newest running request, as in stage 5."""
        i = 0
        while i < len(self.running) and self._budget_left(out) > 0:
            req = self.running[i]
            if req in self.prefilling:
                i += 1
                continue
            need = self.cache.blocks_to_grow(req.seq_id)       # 0, or 1 at a block boundary
            while need > self._free(out) and req.status == "running":
                self._preempt(self.running[-1], out)
            if req.status != "running":
                break                 # it was the newest itself
            self._schedule(out, req, 1, need)
            out.decode.append(req)
            i += 1

    def _schedule_prompt_chunks(self, out: ChunkedStep) -> None:
        """2. A chunk for the running request still prefilling: as many of its tokens as the
        budget leaves and its last block and the free blocks hold. There is at most one, and it
        is the newest running request: a chunk that does not end its prompt uses up the budget
        or the free blocks, so nobody can join after it. Having nobody newer to preempt, it
        waits when nothing fits (the decodes, older, run and finish or preempt it)."""
        for req in [r for r in self.running if r in self.prefilling]:
            want = min(self._budget_left(out), req.num_tokens - self.num_computed_tokens(req))
            n = self._growable(req, want, out)
            if n:
                self._schedule(out, req, n, self.cache.blocks_to_grow(req.seq_id, n))
                out.prefill.append(req)

    def _swap_in_chunks(self, out: ChunkedStep) -> None:
        """3. Swapped requests come back first, oldest first, if their blocks fit with the
        watermark to spare: a decoding one for its next token, one still prefilling for a
        chunk."""
        while self.swapped and self._budget_left(out) > 0:
            req = self.swapped[0]
            computed = self.num_computed_tokens(req)
            want = 1 if req not in self.prefilling else \
                min(self._budget_left(out), req.num_tokens - computed)
            n = self._admissible(computed, want, out)
            if not n:
                break
            self._bring_back(out)
            self._schedule(out, req, n, self.blocks_for(computed + n) - self.blocks_for(computed))
            (out.prefill if req in self.prefilling else out.decode).append(req)

    def _admit_chunks(self, out: ChunkedStep) -> None:
        """4. Then waiting requests, in order, each with a first chunk as large as the rest of
        the budget and the free blocks (with the watermark) allow. Its group's other members get
        their rows now and join when its last chunk runs (stage 6 forks them then)."""
        while self.waiting and self._budget_left(out) > 0:
            req = self.waiting[0]
            group = self.group(req)
            kept = sum(len(f) for f in self.followers.values())
            if len(group) > min(len(self.free_rows),
                                self.max_num_seqs - len(self.running) - kept):
                break
            cached = self.cached_prefix(req)
            want = min(self._budget_left(out), req.num_tokens - cached)
            n = self._admissible(cached, want, out)
            if not n:
                break                 # first come, first served: nobody overtakes it
            self.waiting.popleft()
            for r in group:
                r.seq_id = self.free_rows.pop()
            req.status = "running"
            self.running.append(req)
            self.prefilling.add(req)
            if len(group) > 1:
                self.followers[req] = group[1:]
            out.cached_tokens += self._begin(req)
            # counted as if no block were shared: a prefix hit only makes it cheaper
            self._schedule(out, req, n, self.blocks_for(cached + n))
            out.prefill.append(req)

    def _end_prefills(self, out: ChunkedStep) -> None:
        """A chunk that reaches a request's last token ends its prefill: it samples this step
        and decodes from the next one, and its group's other members join it."""
        for req in out.prefill:
            if self.num_computed_tokens(req) + out.num_tokens[req] == req.num_tokens:
                self.prefilling.discard(req)
                for r in self.followers.pop(req, []):
                    r.status = "running"
                    self.running.append(r)

    # -- helpers ---------------------------------------------------------------------------------
    def _budget_left(self, out: ChunkedStep) -> int:
        """Tokens of max_num_batched_tokens this step has not scheduled yet."""
        return self.max_num_batched_tokens - out.total_tokens

    def _free(self, out: ChunkedStep) -> int:
        """Free blocks not yet promised to a request of this step."""
        return self.cache.num_free_blocks - sum(out.new_blocks.values())

    def _schedule(self, out: ChunkedStep, req: Request, n: int, blocks: int) -> None:
        """Book `n` of req's tokens and the `blocks` new blocks they take into this step."""
        out.num_tokens[req] = n
        out.new_blocks[req] = blocks

    def _growable(self, req: Request, want: int, out: ChunkedStep) -> int:
        """The most of `want` tokens a running request can add: the rest of its last block plus
        the free blocks (no watermark: it grows, as stage 5's decodes do)."""
        first = self.cache.managers[0]
        room = int(first.num_blocks_held[req.seq_id]) * self.block_size - \
            self.num_computed_tokens(req) + self._free(out) * self.block_size
        return max(0, min(want, room))

    def _admissible(self, held: int, want: int, out: ChunkedStep) -> int:
        """The most of `want` tokens that a request holding `held` tokens may start (or come
        back) with: stage 2's rule (`admits`) for the blocks of held + n tokens, which leaves the
        watermark free unless nothing runs. Dropped a block at a time until it fits."""
        n = want
        while n > 0 and not admits(self.blocks_for(held + n), self._free(out),
                                   self.watermark_blocks, alone=not self.running):
            n = (self.blocks_for(held + n) - 1) * self.block_size - held
        return max(n, 0)

    def _preempt(self, req: Request, out: ScheduledStep) -> None:
        """Stage 5's preemption (of a request not scheduled yet this step). A recompute throws
        its computed tokens away: it starts over, and the rows kept for its group return."""
        if self.max_num_batched_tokens is None:
            return super()._preempt(req, out)
        computed = self.num_computed_tokens(req)
        super()._preempt(req, out)
        if out.preempted[-1][1] == "recompute":
            self.prefilling.discard(req)
            out.lost_tokens += computed
            for r in self.followers.pop(req, []):
                self.free_rows.append(r.seq_id)
                r.seq_id = None
