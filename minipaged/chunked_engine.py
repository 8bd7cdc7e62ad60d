"""Stage 5b: one model call per step — decodes and prompt chunks of several requests packed into
one row of tokens.

Stage 5's engine makes one call for the decodes, (B, 1), and one per prefill, (1, T): the model
takes rectangular batches, each row at its own position. A step of the budgeted scheduler
(`chunked_prefill.py`) holds rows of different lengths: a token for each decode, n tokens for
each chunk. Two ways to run them in one call:

  * padded: B rows, every row padded to the longest chunk — (B, T_max). Simple, but a decode
    row padded to a 256-token chunk runs 255 tokens of padding through every matrix of the
    model. On a GPU spare compute hides some of that; on a CPU it is all paid for.
  * packed (what flash-attn's varlen kernels and vLLM do): all N tokens of the step in one row,
    (1, N), each sequence a segment of it. The matrices see exactly the step's tokens.

`PackedBatch` is the packed way, behind the cache interface the model already calls: its
`positions` give each token its place in its own sequence, and its `attend` splits the row into
segments — all decodes as one (B, 1) batch, each chunk as (1, n) — and attends for each with the
cache's own `attend`, on the bookkeeping the cache did for that segment (`PagedCache.STEP`),
causal from the segment's cached tokens on (query i of a chunk sees the cached tokens and the
chunk's tokens up to i). The model
returns logits only at the tokens that sample: the decodes and the last token of each chunk
that ends a prompt (`logits_indices`).

`ChunkedEngine(..., max_num_batched_tokens=N)` is stage 5's engine on that scheduler and that
call; without a budget it is stage 5's engine, unchanged.
"""

from __future__ import annotations

import torch

from .chunked_prefill import ChunkedScheduler
from .engine import Engine


class PackedBatch:
    """One step's tokens, several sequences' worth, packed into one row, for a PagedCache.

    `add(seq_ids, n)` gives each listed sequence blocks for n more tokens (`cache.prepare`) and
    appends them as one segment: len(seq_ids) * n tokens, sequence by sequence.
    """

    def __init__(self, cache):
        self.cache = cache
        self.segments = []       # (sequences, tokens each, what the cache's attend reads for them)
        self._positions = []     # per segment, (sequences, tokens each)

    def add(self, seq_ids, num_new_tokens: int) -> None:
        c = self.cache
        c.prepare(seq_ids, num_new_tokens)
        self.segments.append((len(seq_ids), num_new_tokens, {a: getattr(c, a) for a in c.STEP}))
        self._positions.append(c.positions)

    @property
    def positions(self):
        """(1, N): each token's position in its own sequence."""
        return torch.cat([p.reshape(1, -1) for p in self._positions], 1)

    def attend(self, layer: int, q, k, v):
        """q (1, N, Hq, D), k and v (1, N, Hk, D): each segment writes its new k/v into its
        sequences' blocks and attends over them, causal, bottom-right aligned."""
        out, start = [], 0
        for rows, n, step in self.segments:
            end = start + rows * n
            q_s, k_s, v_s = (x[0, start:end].view(rows, n, *x.shape[2:]) for x in (q, k, v))
            vars(self.cache).update(step)        # the cache attends as for this segment alone
            y = self.cache.attend(layer, q_s, k_s, v_s)                   # (rows, n, Hq, D)
            out.append(y.reshape(1, end - start, *y.shape[2:]))
            start = end
        return torch.cat(out, 1)                                          # (1, N, Hq, D)


class ChunkedEngine(Engine):
    """Stage 5's engine under a token budget: no step runs more than `max_num_batched_tokens`
    tokens, decodes and prompt chunks together in one model call. None: stage 5's steps."""

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16,
                 preemption: str = "recompute", *, max_num_batched_tokens: int | None = None,
                 **options):
        self.max_num_batched_tokens = max_num_batched_tokens
        super().__init__(model, num_blocks, block_size, preemption, **options)

    def new_scheduler(self, *args) -> ChunkedScheduler:
        return ChunkedScheduler(*args, max_num_batched_tokens=self.max_num_batched_tokens)

    def _run_model(self, plan) -> list:
        """Stage 5's calls without a budget; with one, a single call over a PackedBatch: the
        decodes first (one segment), then each chunk. A chunk that reaches its request's last
        token samples (a first token, or the next one after a recompute); the others only fill
        the cache."""
        if self.max_num_batched_tokens is None:
            return super()._run_model(plan)
        self.stats.cached_tokens += plan.cached_tokens
        self.stats.recomputed_tokens += plan.lost_tokens
        if not plan.num_tokens:
            return []
        batch, tokens, sampling, ending = PackedBatch(self.cache), [], [], []
        if plan.decode:
            batch.add([r.seq_id for r in plan.decode], 1)
            tokens += [r.output[-1] for r in plan.decode]
            sampling += range(len(plan.decode))
        for r in plan.prefill:
            ids, n = r.prompt + r.output, plan.num_tokens[r]
            start = self.scheduler.num_computed_tokens(r)
            batch.add([r.seq_id], n)
            tokens += ids[start:start + n]
            if start + n == len(ids):
                ending.append(r)
                sampling.append(len(tokens) - 1)
            self.stats.prefill_tokens += n
        self.tokens_run.update(plan.num_tokens)
        logits = self.model(torch.tensor([tokens], device=self.device), cache=batch,
                            logits_indices=torch.tensor(sampling, dtype=torch.long,
                                                          device=self.device))[0]  # (K, V)
        d = len(plan.decode)
        sampled = [(r, t, "decode") for r, t in zip(plan.decode, self._sample(plan.decode,
                                                                              logits[:d]))]
        for r, row in zip(ending, logits[d:]):
            sampled += [(g, t, "prefill") for g, t in self._first_tokens(r, row[None])]
        return sampled
