"""Stage 3: the paged KV cache the model runs on — stage 2's CacheManagers behind stage 1's
cache interface (stated once, in `kv_cache.py`'s docstring), attending with stage 3's
`flash_attn_with_kvcache` (`paged_attention.py`).

`prepare` takes blocks for the new tokens in every layer and notes what the step's attention
reads: `cache_seqlens`, `positions` and each layer's block table. `attend` is one call of
`flash_attn_with_kvcache` on the layer's pool, which writes the new k/v through the slot
mapping and attends. So `generation.generate_static` runs on it unchanged: `generate_paged`
below is stage 1's static batch on a paged cache. What changes is memory: a sequence holds
blocks for the tokens it has, not for `max_seq_len`, and a finished one returns them at once.
"""

from __future__ import annotations

import torch

from .cache_manager import CacheManager
from .checks import check_count, check_pool, check_request, check_sizes, check_step_ids, \
    check_step_room
from .errors import OutOfBlocksError
from .generation import generate_static
from .kv_cache import kv_bytes_per_token
from .paged_attention import flash_attn_with_kvcache
from .sizing import pool_blocks


class PagedCache:
    """One CacheManager per layer, driven in step: every layer holds the same tokens, each in
    blocks of its own pool, drawn from its own random free set (layer i with seed `seed + i`).
    `backend` is `flash_attn_with_kvcache`'s ("auto": flash-attn's kernel where it can, else
    PyTorch)."""

    STEP = ("cache_seqlens", "positions", "block_tables")   # what `attend` reads, set by prepare

    def __init__(self, args, num_blocks: int, block_size: int, max_seqs: int, max_seq_len: int,
                 device="cpu", dtype=torch.float32, seed: int = 0, backend: str = "auto"):
        self.args, self.dtype, self.backend = args, dtype, backend
        self.num_blocks, self.block_size, self.max_seq_len = num_blocks, block_size, max_seq_len
        check_sizes(num_blocks=num_blocks, block_size=block_size, max_seq_len=max_seq_len)
        max_blocks = min(num_blocks, -(-max_seq_len // block_size))   # no table outgrows the pool
        check_pool(num_blocks, block_size, args.n_kv_heads, args.head_dim, max_seqs, max_blocks,
                   device, dtype, kv_bytes_per_token, args.n_layers)  # all layers, before any
        self.managers = [self.new_manager(num_blocks, block_size, args.n_kv_heads, args.head_dim,
                                          max_seqs, max_blocks, device=device, dtype=dtype,
                                          seed=seed + layer) for layer in range(args.n_layers)]
        self.cache_seqlens = None         # (B,) int32, tokens stored before this step
        self.positions = None             # (B, T), the positions of this step's new tokens
        self.block_tables = None          # per layer, (B, W) int32: the step's block tables

    def new_manager(self, *args, **kwargs) -> CacheManager:
        """One layer's allocator (a later stage builds a richer one here)."""
        return CacheManager(*args, **kwargs)

    # -- the cache interface ---------------------------------------------------------------------
    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """Before a forward: new sequences reserve blocks, known ones grow — in every layer, or
        (RequestError, OutOfBlocksError) in none."""
        seq_ids, n, first = check_step_ids(self, seq_ids), check_count(num_new_tokens), \
            self.managers[0]
        new = [s for s in seq_ids if s not in first]
        old = [s for s in seq_ids if s in first]
        # Every layer holds the same tokens, so every layer needs the same number of blocks:
        # check once, up front, so a failure leaves all layers untouched.
        needed = len(new) * first.blocks_for(n) + (first.blocks_needed(old, n) if old else 0)
        check_step_room(self, needed, int(first.seq_lens[seq_ids].max()) + n)
        for m in self.managers:
            for s in new:
                m.reserve(s, n)
            if old:
                m.grow(old, n)
        self.set_step(seq_ids, n)

    def set_step(self, seq_ids, num_new_tokens: int) -> None:
        """What every layer's `attend` reads this step (the sequences hold their new tokens)."""
        first = self.managers[0]
        self.cache_seqlens = first.seq_lens_for(seq_ids) - num_new_tokens          # (B,) int32
        self.positions = self.cache_seqlens[:, None].long() + torch.arange(
            num_new_tokens, device=first.device)                                   # (B, T)
        self.block_tables = [m.block_table_for(seq_ids) for m in self.managers]    # (B, W) each

    def attend(self, layer: int, q, k, v):
        """Store the step's k/v (B, T, Hk, D) in the layer's blocks and attend q (B, T, Hq, D)
        over everything each row stored: lesson 03's call, on this layer's pool."""
        m = self.managers[layer]
        return flash_attn_with_kvcache(q, m.k_cache_paged, m.v_cache_paged, k, v,
                                       cache_seqlens=self.cache_seqlens,
                                       block_table=self.block_tables[layer], causal=True,
                                       backend=self.backend)               # (B, T, Hq, D)

    def free(self, seq_id: int) -> None:
        """A finished sequence returns every block, in every layer, at once."""
        for m in self.managers:
            m.free(seq_id)

    # -- questions -------------------------------------------------------------------------------
    def __contains__(self, seq_id) -> bool:
        return seq_id in self.managers[0]

    def blocks_to_grow(self, seq_id: int, num_new_tokens: int = 1) -> int:
        """Blocks per layer that one sequence's next `num_new_tokens` tokens take."""
        return self.managers[0].blocks_needed([seq_id], num_new_tokens)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks per layer (every layer holds the same tokens, so the same count)."""
        return self.managers[0].num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.managers[0].num_used_blocks

    def usage(self):
        """(used, reserved) slots per live sequence: tokens stored vs blocks held x block_size."""
        m = self.managers[0]
        ids = m.live_seq_ids()
        return ([int(m.seq_lens[s]) for s in ids],
                [int(m.num_blocks_held[s]) * self.block_size for s in ids])


@torch.inference_mode()
def generate_paged(model, prompts, max_new_tokens, block_size: int = 16,
                   num_blocks: int | None = None, kv_budget: int | None = None, seed: int = 0,
                   backend: str = "auto", max_seq_len: int | None = None,
                   cache_class=None, **options):
    """Stage 3 on its own: stage 1's static batch (`generate_static`) on a PagedCache.

    The pool has `num_blocks` blocks per layer, or as many as `kv_budget` bytes hold, or else
    exactly enough for every prompt at its full length. A static batch cannot wait or preempt
    (that is stage 5), so a pool too small for all of them at once is refused before any work.
    Other options (temperature, top_p, stop_tokens, callback...) are `generate_static`'s.
    `cache_class`: the cache to build (default PagedCache; `minipaged.fast` passes its own).
    """
    max_seq_len = max_seq_len or model.args.max_seq_len
    limits = check_request(model, prompts, max_new_tokens, options.get("temperature", 0.0),
                           options.get("top_p", 1.0), max_seq_len)
    lengths = [len(p) + m for p, m in zip(prompts, limits)]
    p = next(model.parameters())
    blocks = pool_blocks(model.args, p.dtype, block_size, num_blocks, kv_budget, lengths)
    worst = pool_blocks(model.args, p.dtype, block_size, lengths=lengths)
    if worst > blocks:
        raise OutOfBlocksError(
            f"these prompts may need {worst} blocks per layer at once but the pool has "
            f"{blocks}: a static batch cannot wait for blocks. Give the pool more memory, or "
            f"serve them with stage 5's engine (minipaged.generate(..., cache='paged')), which "
            f"admits and preempts.")
    cache = (cache_class or PagedCache)(model.args, blocks, block_size, len(prompts),
                                        max_seq_len, device=p.device, dtype=p.dtype, seed=seed,
                                        backend=backend)
    return generate_static(model, prompts, limits, cache=cache, seed=seed,
                           max_seq_len=max_seq_len, **options)
