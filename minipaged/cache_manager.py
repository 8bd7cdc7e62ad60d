"""Stage 2: the block allocator behind PagedAttention — one CacheManager per layer.

A layer's KV memory is a pool of `num_blocks` physical blocks of `block_size` token slots. A
sequence owns a block table: logical block j (tokens j*block_size ... (j+1)*block_size - 1) lives
in physical block block_table[j], anywhere in the pool. Blocks come from a random free set when
a sequence first needs them and all go back when it ends, so a sequence wastes at most the
unfilled tail of its last block. The allocator handles integers only; the K/V pool beside it
(`k_cache_paged`, `v_cache_paged`) is what stage 3's attention reads.
"""

from __future__ import annotations

import random

import torch

from .cache_queries import ManagerQueries   # what drawings and later stages ask: not the idea
from .cache_checks import check_live, check_new, check_one, check_pool, check_room
from .checks import check_count
from .kv_cache import kv_bytes_per_token

PAD_BLOCK = -1   # what block tables hold past a sequence's last block: "no block here"


class FreeBlockSet:
    """Free physical block ids; `take` removes random ones, reproducibly for a seed, in O(1)
    each (swap the pick with the last id, pop), where `random.choice(list(free))` copies the set."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self._ids = list(range(num_blocks))
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._ids)

    def take(self, k: int) -> list[int]:
        """Remove and return k random free block ids (the caller checked that k fit). Each pick
        is a uniform index i into the free list (int(rng.random() * len), or rng.randrange(len)),
        whose id swaps places with the last id and is popped: O(1), and a seed replays."""
        ids, out, rand = self._ids, [], self._rng.random
        for _ in range(k):
            i = int(rand() * len(ids))          # uniform over the free ids (randrange, but faster)
            ids[i], ids[-1] = ids[-1], ids[i]
            out.append(ids.pop())
        return out

    def put(self, blocks) -> None:
        self._ids.extend(blocks)

    def ids(self) -> list[int]:
        return sorted(self._ids)


class CacheManager(ManagerQueries):
    """One layer's pool, its free blocks and a block table per sequence (seq ids are the
    tables' rows). Allocation succeeds completely or raises before changing anything."""

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 max_seqs: int, max_blocks_per_seq: int, device="cpu", dtype=torch.float32,
                 seed: int = 0):
        check_pool(num_blocks, block_size, n_kv_heads, head_dim, max_seqs, max_blocks_per_seq,
                   device, dtype, kv_bytes_per_token)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_seqs, self.max_blocks_per_seq = max_seqs, max_blocks_per_seq
        self.device = torch.device(device)
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k_cache_paged = torch.zeros(shape, device=device, dtype=dtype)   # (N, bs, Hk, D)
        self.v_cache_paged = torch.zeros(shape, device=device, dtype=dtype)
        self.free_blocks = FreeBlockSet(num_blocks, seed)
        self.block_table = torch.full((max_seqs, max_blocks_per_seq), PAD_BLOCK,
                                      dtype=torch.int32)                 # (max_seqs, max_blocks)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32)         # (max_seqs,) tokens
        self.num_blocks_held = torch.zeros(max_seqs, dtype=torch.int32)  # (max_seqs,) blocks
        self._table, self._lens = self.block_table.numpy(), self.seq_lens.numpy()  # same memory
        self._held = self.num_blocks_held.numpy()
        self._live: set[int] = set()                                 # seq ids that exist now

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` tokens fill: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def reserve(self, seq_id: int, num_tokens: int) -> list[int]:
        """Start sequence `seq_id` with blocks for `num_tokens` tokens (a prompt); return them."""
        s, n = check_new(self, seq_id), check_count(num_tokens)
        k = self.blocks_for(n)
        check_room(self, [s], [k], k)
        blocks = self._take(k)
        self._table[s, :k] = blocks
        self._held[s], self._lens[s] = k, n
        self._live.add(s)
        return blocks

    def grow(self, seq_ids, num_new_tokens: int) -> int:
        """Each listed sequence gains `num_new_tokens` tokens (all, or none if blocks run out),
        taking blocks only where its last block fills up. Returns the blocks taken."""
        rows, n = check_live(self, seq_ids, unique=True), check_count(num_new_tokens)   # (B,)
        seqs, held, needed = self._crossing(rows, n)
        total = sum(needed) - sum(held)
        if seqs:
            check_room(self, seqs, needed, total)
            self._add_blocks(seqs, held, needed)
        self._lens[rows] += n
        return total

    def _crossing(self, rows, n):
        """The rows whose last block cannot hold n more: ids, blocks held, blocks needed."""
        new_lens = self._lens[rows] + n                              # (B,)
        held = self._held[rows]                                      # (B,)
        crossing = (new_lens > held * self.block_size).nonzero()[0]  # (C,)
        needed = [self.blocks_for(length) for length in new_lens[crossing].tolist()]
        return rows[crossing].tolist(), held[crossing].tolist(), needed

    def _add_blocks(self, seqs, held, needed) -> None:
        """Give each crossing row the blocks it lacks, at the end of its table."""
        blocks = iter(self._take(sum(needed) - sum(held)))
        for s, h, e in zip(seqs, held, needed):     # Python only over the crossing rows
            for j in range(h, e):                   # logical block j of sequence s
                self._table[s, j] = next(blocks)
            self._held[s] = e

    def free(self, seq_id: int) -> list[int]:
        """End a sequence: every one of its blocks goes back to the free set. Returns them."""
        s = check_one(self, seq_id)
        blocks = self._table[s, : self._held[s]].tolist()
        self._release(blocks)
        self._table[s, : self._held[s]] = PAD_BLOCK
        self._held[s], self._lens[s] = 0, 0
        self._live.discard(s)
        return blocks

    def _take(self, k: int) -> list[int]:          # (stage 6 overrides these two)
        """k blocks out of the free set (stage 6 also counts a reference on each)."""
        return self.free_blocks.take(k)

    def _release(self, blocks) -> None:
        """Blocks back to the free set (stage 6 lowers a count and frees a block at zero)."""
        self.free_blocks.put(blocks)

    def block_table_for(self, seq_ids) -> torch.Tensor:
        """int32 (B, W): the sequences' block tables, W the most blocks any holds (at least 1)."""
        rows = check_live(self, seq_ids)                             # (B,)
        width = max(1, int(self._held[rows].max()))
        return torch.from_numpy(self._table[rows, :width]).to(self.device)   # (B, W), a copy

    def seq_lens_for(self, seq_ids) -> torch.Tensor:
        """int32 (B,): tokens stored for each listed sequence (flash-attn's cache_seqlens)."""
        return torch.from_numpy(self._lens[check_live(self, seq_ids)]).to(self.device)  # a copy
