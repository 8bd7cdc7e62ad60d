"""Stage 3: the paged KV cache the model runs on — stage 2's CacheManagers behind stage 1's
cache interface, attending as `flash_attn_with_kvcache` does (`paged_attention.py`).

The model calls the same three things it called on the contiguous cache:

    cache.prepare(seq_ids, num_new_tokens)   # blocks for the new tokens, in every layer
    cache.positions                           # (B, T): cache_seqlens[b] + t, the tokens' places
    cache.attend(layer, q, k, v)              # write k/v into the layer's blocks, attend

so `generation.generate_static` runs on it unchanged: `generate_paged` below is stage 1's static
batch on a paged cache. The bookkeeping of a step (the lengths, the positions, every layer's
block table and where its new tokens go) is done once in `prepare`, for all layers at once;
each layer's `attend` only writes and reads. What changes is memory: a sequence holds blocks for the tokens it has,
not for `max_seq_len`, and a finished one returns them at once.
"""

from __future__ import annotations

import torch

from .cache_manager import CacheManager
from .errors import OutOfBlocksError, RequestError
from .generation import check_request, generate_static
from .kv_budget import pool_blocks
from .kv_cache import check_memory, check_sizes, kv_bytes_per_token
from .paged_attention import attend_step, pick_backend, plan_step


class PagedCache:
    """One CacheManager per layer, driven in step: every layer holds the same tokens, each in
    blocks of its own pool, drawn from its own random free set (layer i with seed `seed + i`).

    `prepare` takes blocks as sequences grow (all layers or none) and works out, once for all
    layers, where the step's tokens go; `attend` writes them and attends on the layer's pool
    through its block table, as `flash_attn_with_kvcache` does; `free` returns every block of a
    finished sequence the moment it stops, while the others continue.
    """

    def __init__(self, args, num_blocks: int, block_size: int, max_seqs: int, max_seq_len: int,
                 device="cpu", dtype=torch.float32, seed: int = 0, backend: str = "auto"):
        self.args, self.dtype = args, dtype
        self.block_size, self.max_seq_len, self.backend = block_size, max_seq_len, backend
        self.num_blocks = num_blocks
        check_sizes(num_blocks=num_blocks, block_size=block_size, max_seq_len=max_seq_len)
        max_blocks = min(num_blocks, -(-max_seq_len // block_size))   # no table outgrows the pool
        per_layer = CacheManager.pool_bytes(num_blocks, block_size, args.n_kv_heads, args.head_dim,
                                            max_seqs, max_blocks, dtype)
        check_memory(args.n_layers * per_layer, device,                # all layers, before any
                     f"a KV pool of {num_blocks:,} blocks of {block_size:,} tokens in each of "
                     f"{args.n_layers} layers, block tables for {max_seqs:,} sequences included",
                     block_size * kv_bytes_per_token(args.n_kv_heads, args.head_dim, dtype,
                                                     args.n_layers),
                     f"blocks of {block_size:,} tokens per layer")
        # Every layer's block table and lengths, stacked: layer i's manager keeps its own in
        # row i, so a step reads the tables of all layers with one indexing (`set_step`), and
        # advances all their lengths with one addition (`prepare`).
        self.block_table = torch.empty((args.n_layers, max_seqs, max_blocks), dtype=torch.int32)
        self.seq_lens = torch.zeros((args.n_layers, max_seqs), dtype=torch.int32)
        self._tables, self._lens = self.block_table.numpy(), self.seq_lens.numpy()  # same memory
        self.managers = [self.new_manager(num_blocks, block_size, args.n_kv_heads, args.head_dim,
                                          max_seqs, max_blocks, device=device, dtype=dtype,
                                          seed=seed + layer, block_table=self.block_table[layer],
                                          seq_lens=self.seq_lens[layer])
                         for layer in range(args.n_layers)]
        self.cache_seqlens = None         # (B,) int32, tokens stored before this step
        self.positions = None             # (B, T), the positions of this step's new tokens
        self.block_tables = None          # (n_layers, B, max_blocks_used) int32: the step's
        self.step = None                  # the PagedStep every layer's attend reads
        self._implementation = None       # the backend serving this step, once chosen

    def new_manager(self, *args, **kwargs) -> CacheManager:
        """One layer's allocator (a later stage builds a richer one here)."""
        return CacheManager(*args, **kwargs)

    # -- the cache interface ---------------------------------------------------------------------
    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """Before a forward: new sequences reserve blocks, known ones grow — in every layer, or
        (RequestError, OutOfBlocksError) in none. Then build each layer's block table."""
        seq_ids = [int(s) for s in seq_ids]
        first = self.managers[0]
        if not seq_ids or len(set(seq_ids)) < len(seq_ids) or \
                not all(0 <= s < first.max_seqs for s in seq_ids):
            raise RequestError(f"sequence ids must be distinct and lie in [0, {first.max_seqs}); "
                               f"got {seq_ids}")
        new = [s for s in seq_ids if s not in first]
        old = [s for s in seq_ids if s in first]
        # Every layer holds the same tokens, so every layer needs the same number of blocks:
        # check once, up front, so a failure leaves all layers untouched.
        longest = int(self._lens[0, seq_ids].max()) + num_new_tokens
        needed = len(new) * first.blocks_for(num_new_tokens) + \
            (first.blocks_needed(old, num_new_tokens) if old else 0)
        self.check_room(needed, longest)
        if needed or new:
            for m in self.managers:
                for s in new:
                    m.reserve(s, num_new_tokens)
                if old:
                    m.grow(old, num_new_tokens)
        else:
            # Most decode steps: no sequence fills its last block, so no block changes hands
            # in any layer, and growing is only the lengths advancing: all layers' at once.
            self._lens[:, seq_ids] += num_new_tokens
        self.set_step(seq_ids, num_new_tokens)

    def set_step(self, seq_ids, num_new_tokens: int) -> None:
        """What every layer's `attend` reads this step: the lengths before it, the tables, and
        from them (`plan_step`, once for all layers) where each layer writes the new tokens and
        which blocks it reads."""
        device = self.managers[0].device
        lens = self._lens[0, seq_ids]                                                # (B,)
        width = max(1, -(-int(lens.max()) // self.block_size))   # blocks the longest row holds
        self.step = plan_step(torch.from_numpy(self._tables[:, seq_ids, :width]),
                              torch.from_numpy(lens - num_new_tokens), num_new_tokens,
                              self.block_size, device)
        self.cache_seqlens, self.positions = self.step.cache_seqlens, self.step.positions
        self.block_tables = self.step.block_tables
        self._implementation = None

    def check_room(self, needed: int, longest: int) -> None:
        """Raise before anything changes if a step needs more blocks per layer than are free, or
        would make a sequence longer than `max_seq_len`."""
        if longest > self.max_seq_len:
            raise RequestError(f"a sequence would reach {longest} tokens, past this cache's "
                               f"max_seq_len={self.max_seq_len}; end it sooner or build a "
                               f"larger cache. Nothing was allocated.")
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"out of KV blocks: this step needs {needed} new block(s) per layer but only "
                f"{self.num_free_blocks} of {self.num_blocks} are free; finish a sequence or "
                f"give the pool more memory. Nothing was allocated.")

    def attend(self, layer: int, q, k, v):
        """`flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
        causal=True)` on the layer's pool, with the bookkeeping `set_step` did for this step."""
        m = self.managers[layer]
        return attend_step(q, k, v, m.k_cache_paged, m.v_cache_paged, self.step, layer,
                           self.implementation(q, layer))

    def implementation(self, q, layer: int) -> str:
        """The implementation of `backend` that serves this step (`pick_backend`): chosen at the
        step's first attend, the same for every layer after it."""
        if self._implementation is None:
            self._implementation = pick_backend(self.backend, q, self.managers[layer].k_cache_paged,
                                                self.step.block_tables[layer])
        return self._implementation

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
                   backend: str = "auto", max_seq_len: int | None = None, **options):
    """Stage 3 on its own: stage 1's static batch (`generate_static`) on a PagedCache.

    The pool has `num_blocks` blocks per layer, or as many as `kv_budget` bytes hold, or else
    exactly enough for every prompt at its full length. A static batch cannot wait or preempt
    (that is stage 5), so a pool too small for all of them at once is refused before any work.
    Other options (temperature, top_p, stop_tokens, callback...) are `generate_static`'s.
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
    cache = PagedCache(model.args, blocks, block_size, len(prompts), max_seq_len,
                       device=p.device, dtype=p.dtype, seed=seed, backend=backend)
    return generate_static(model, prompts, limits, cache=cache, seed=seed,
                           max_seq_len=max_seq_len, **options)
