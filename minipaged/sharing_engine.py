"""Stage 6: the engine on shared blocks — parallel samples forked after one prefill, and prefills
that start after a prefix-cache hit.

Stage 5's engine (with stage 5b's token budget) gives every request blocks of its own. This one
runs on a SharedPagedCache (`sharing.py`):

  * `add_request(..., n=K)` asks for K samples of one prompt. The K requests wait and are
    admitted as one group; the first is prefilled, the other K-1 fork its blocks, and each draws
    its first token from the same logits with its own generator. From then on they are ordinary
    requests that pay only for the blocks they write (copy-on-write on the shared last block);
    preempting one frees only its own references.
  * With `prefix_caching=True`, a prefill starts from the cached blocks of the longest prefix
    seen before and runs the model only over the rest (`EngineStats.cached_tokens`); every block
    that fills, by prefill or decode, is named for later prompts.

Under a token budget (`max_num_batched_tokens`) the prompt runs in chunks: an admitted request
starts holding its cached prefix blocks, its first chunk starts after them, and its samples are
forked after its last chunk.

`minipaged.Engine` is this class: the engine with every stage's options.
"""

from __future__ import annotations

import torch

from .checks import check_flag, whole
from .chunked_engine import ChunkedEngine
from .chunked_prefill import ChunkedScheduler
from .errors import RequestError
from .scheduler import Request
from .sharing import SharedPagedCache


class SharingScheduler(ChunkedScheduler):
    """Stage 5b's scheduler, admitting a request together with its parallel samples, and under a
    budget starting it after the prompt's blocks the prefix cache holds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.siblings: dict[int, list[Request]] = {}   # req_id -> samples forked after its prefill

    def group(self, req: Request) -> list[Request]:
        return [req] + self.siblings.get(req.req_id, [])

    def cached_prefix(self, req: Request) -> int:
        return len(self.cache.prefix_hits(req.prompt + req.output)[0]) * self.block_size

    def _begin(self, req: Request) -> int:
        """The sequence starts with its cached prefix blocks (shared, not computed); its first
        chunk comes after them."""
        return self.cache.start(req.seq_id, req.prompt + req.output, 0)


class SharingEngine(ChunkedEngine):
    """Stage 5b's engine on shared blocks. `prefix_caching` is off unless asked for."""

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16,
                 preemption: str = "recompute", *, prefix_caching: bool = False, **options):
        check_flag("prefix_caching", prefix_caching)
        self.prefix_caching = prefix_caching
        super().__init__(model, num_blocks, block_size, preemption, **options)

    def new_cache(self, *args, **kwargs) -> SharedPagedCache:
        return SharedPagedCache(*args, prefix_caching=self.prefix_caching, **kwargs)

    def new_scheduler(self, *args) -> SharingScheduler:
        return SharingScheduler(*args, max_num_batched_tokens=self.max_num_batched_tokens)

    def add_request(self, prompt, max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, generator=None, stop_tokens=None,
                    arrival_step: int = 0, n: int = 1, generators=None,
                    logprobs: int | None = None) -> Request:
        """Stage 5's `add_request`; n > 1 asks for n samples sharing the prompt's blocks, added
        one after the other (returned: the first). `generators` gives each its own stream (else
        `generator` for the first and none for the rest, which only makes sense greedy)."""
        if not whole(n) or n < 1 or (generators is not None and (
                not isinstance(generators, (list, tuple)) or len(generators) != n
                or not all(g is None or isinstance(g, torch.Generator) for g in generators))):
            raise RequestError(f"n must be a positive integer with one generator (a "
                               f"torch.Generator or None) per sample, not n={n!r}")
        if n > self.scheduler.max_num_seqs:
            raise RequestError(f"n={n} samples need {n} sequences at once, but the engine runs "
                               f"at most {self.scheduler.max_num_seqs}; raise max_num_seqs")
        gens = list(generators) if generators is not None else [generator] + [None] * (n - 1)
        req = super().add_request(prompt, max_new_tokens, temperature, top_p, gens[0],
                                  stop_tokens, arrival_step, logprobs)
        siblings = []
        for g in gens[1:]:                         # forked from req after its prefill
            sib = Request(self.next_req_id, list(req.prompt), req.max_new_tokens, temperature,
                          top_p, g, req.stop_tokens, req.arrival_step, status=req.status,
                          finish_step=req.finish_step, logprobs=req.logprobs)
            self.requests.append(sib)
            self.next_req_id += 1
            siblings.append(sib)
        if siblings and req.status != "finished":
            self.scheduler.siblings[req.req_id] = siblings
        return req

    def _start(self, r: Request, ids) -> int:
        skipped = self.cache.start(r.seq_id, ids)  # a prefix-cache hit skips its blocks
        self.stats.cached_tokens += skipped
        return skipped

    def _prefill(self, r: Request):
        logits = super()._prefill(r)
        self.cache.name_blocks(r.seq_id, r.prompt + r.output)   # at once: the next prefill may hit
        return logits

    def _first_tokens(self, r: Request, logits):
        """Fork r's samples from its blocks, then each draws a first token from r's logits."""
        group = [r] + self.scheduler.siblings.pop(r.req_id, [])  # forked once; a recompute is alone
        for sib in group[1:]:
            self.cache.fork(r.seq_id, sib.seq_id)
        return list(zip(group, self._sample(group, logits.expand(len(group), -1))))

    def _after_model(self, plan) -> None:
        if self.prefix_caching:                    # name the blocks this step filled
            for r in plan.decode:
                self.cache.name_blocks(r.seq_id, r.prompt, r.output)
            for r in plan.prefill:                 # a chunk: only what the cache holds so far
                held = self.scheduler.num_computed_tokens(r)
                self.cache.name_blocks(r.seq_id, (r.prompt + r.output)[:held])
