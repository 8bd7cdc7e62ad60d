"""Stage 3: the paged KV cache the model runs on — stage 2's CacheManagers behind stage 1's cache
interface (stated once, in `kv_cache.py`), attending with `flash_attn_with_kvcache`. A sequence
holds blocks for the tokens it has, not for `max_seq_len`, and a finished one returns them at
once; `paged_generation.generate_paged` runs stage 1's static batch on this cache.
"""

from __future__ import annotations

import torch

from .cache_manager import CacheManager
from .cache_queries import PagedCacheQueries   # what later stages ask: not the idea
from .cache_checks import check_paged_cache, check_pool, check_step, check_step_room
from .kv_cache import kv_bytes_per_token
from .kv_formats import attend_in_format, stored_layout
from .paged_attention import flash_attn_with_kvcache


class PagedCache(PagedCacheQueries):
    """One CacheManager per layer, driven in step: every layer holds the same tokens, in blocks
    of its own pool drawn from its own random free set (layer i with seed `seed + i`)."""

    def __init__(self, args, num_blocks: int, block_size: int, max_seqs: int, max_seq_len: int,
                 device="cpu", dtype=torch.float32, seed: int = 0, backend: str = "auto",
                 kv_dtype: str | None = None):
        self.args, self.dtype, self.backend = args, dtype, backend
        self.kv_dtype = check_paged_cache(num_blocks, block_size, max_seq_len, kv_dtype, backend)
        self.num_blocks, self.block_size, self.max_seq_len = num_blocks, block_size, max_seq_len
        max_blocks = min(num_blocks, -(-max_seq_len // block_size))   # no table outgrows the pool
        slot, store = stored_layout(args.head_dim, dtype, kv_dtype)   # what a slot stores
        check_pool(num_blocks, block_size, args.n_kv_heads, slot, max_seqs, max_blocks,
                   device, store, kv_bytes_per_token, args.n_layers)  # all layers, before any
        self.managers = [self.new_manager(num_blocks, block_size, args.n_kv_heads, slot,
                                          max_seqs, max_blocks, device=device, dtype=store,
                                          seed=seed + layer) for layer in range(args.n_layers)]
        self.cache_seqlens = None         # (B,) int32, tokens stored before this step
        self.positions = None             # (B, T), the positions of this step's new tokens
        self.block_tables = None          # per layer, (B, W) int32: the step's block tables

    def new_manager(self, *args, **kwargs) -> CacheManager:
        """One layer's allocator (a later stage builds a richer one here)."""
        return CacheManager(*args, **kwargs)

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """New sequences reserve blocks, known ones grow: in every layer, or in none (an error)."""
        seq_ids, n = check_step(self, seq_ids, num_new_tokens)
        first = self.managers[0]
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
        """Store the step's k/v (B, T, Hk, D) in the layer's blocks, attend q (B, T, Hq, D)."""
        if self.kv_dtype is not None:        # e.g. stage 4b's int8 blocks (`kv_formats.py`)
            return attend_in_format(self, layer, q, k, v)
        m = self.managers[layer]
        return flash_attn_with_kvcache(q, m.k_cache_paged, m.v_cache_paged, k, v,
                                       cache_seqlens=self.cache_seqlens,
                                       block_table=self.block_tables[layer], causal=True,
                                       backend=self.backend)               # (B, T, Hq, D)

    def free(self, seq_id: int) -> None:
        """A finished sequence returns every block, in every layer, at once."""
        for m in self.managers:
            m.free(seq_id)
