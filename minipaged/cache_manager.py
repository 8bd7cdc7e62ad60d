"""Stage 2: the block allocator behind PagedAttention — one CacheManager per layer.

Stage 1 reserved `max_seq_len` slots per sequence up front. Here a layer's KV memory is a pool
of `num_blocks` physical blocks of `block_size` token slots each, and a sequence owns a list of
blocks, its block table: logical block j (tokens j*block_size ... (j+1)*block_size - 1) lives in
physical block block_table[j], anywhere in the pool. Blocks are taken from a random free set
when a sequence first needs them and all go back when it ends, so the only memory a sequence
wastes is the unfilled tail of its last block.

The allocator handles integers only: the K/V tensors of the pool sit beside it
(`k_cache_paged`, `v_cache_paged`) and are read by stage 3's attention. Bookkeeping lives on the
CPU in preallocated int32 tensors (`block_table`, `seq_lens`, `num_blocks_held`), read and
written through numpy views of the same memory, as vLLM v1's BlockTable does: a numpy call on a
64-element array costs about a microsecond, a torch call several, and this code runs for every
layer on every decode step.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .errors import OutOfBlocksError, RequestError
from .kv_cache import check_memory, check_sizes, kv_bytes_per_token

PAD_BLOCK = -1   # what block tables hold past a sequence's last block: "no block here"


class FreeBlockSet:
    """Free physical block ids; `take` removes random ones in O(1) each, reproducibly for a seed.

    A list plus swap-with-last removal: pick a random index, move the last id into its place,
    pop. `random.choice(list(free))` would copy the whole set on every pick.
    """

    def __init__(self, num_blocks: int, seed: int = 0):
        self._ids = list(range(num_blocks))
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._ids)

    def take(self, k: int) -> list[int]:
        """Remove and return k random free block ids (the caller checked that k fit)."""
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


def _bookkeeping(tensor, name: str, shape) -> torch.Tensor:
    """`tensor` if it is an int32 CPU tensor of `shape` (a caller's), a new one if None."""
    if tensor is None:
        return torch.empty(shape, dtype=torch.int32)
    if tuple(tensor.shape) != shape or tensor.dtype != torch.int32 or tensor.device.type != "cpu":
        raise RequestError(f"{name} must be an int32 CPU tensor of shape {shape}")
    return tensor


class CacheManager:
    """One layer's paged KV cache: the physical pool, its free blocks, a block table per sequence.

    Sequence ids are rows of the tables, 0 <= seq_id < max_seqs. Every method that allocates
    either succeeds completely or raises before changing anything (tables, lengths, free set,
    even the random generator's state).
    """

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 max_seqs: int, max_blocks_per_seq: int, device="cpu", dtype=torch.float32,
                 seed: int = 0, block_table: torch.Tensor | None = None,
                 seq_lens: torch.Tensor | None = None):
        """`block_table`, `seq_lens`: int32 CPU tensors of shape (max_seqs, max_blocks_per_seq)
        and (max_seqs,) to keep the block table and the lengths in (default: new ones); a
        caller that drives several managers in step can give each a slice of one larger tensor,
        to read all their tables, or advance all their lengths, in one go."""
        check_memory(self.pool_bytes(num_blocks, block_size, n_kv_heads, head_dim, max_seqs,
                                     max_blocks_per_seq, dtype), device,
                     f"a pool of {num_blocks:,} blocks of {block_size:,} tokens",
                     block_size * kv_bytes_per_token(n_kv_heads, head_dim, dtype),
                     f"blocks of {block_size:,} tokens")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_seqs, self.max_blocks_per_seq = max_seqs, max_blocks_per_seq
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k_cache_paged = torch.zeros(shape, device=device, dtype=dtype)   # (N, bs, Hk, D)
        self.v_cache_paged = torch.zeros(shape, device=device, dtype=dtype)
        self.free_blocks = FreeBlockSet(num_blocks, seed)
        # Bookkeeping tensors, with numpy views (`_table`, ...) that share their memory.
        self.block_table = _bookkeeping(block_table, "block_table", (max_seqs, max_blocks_per_seq))
        self.block_table.fill_(PAD_BLOCK)                            # (max_seqs, max_blocks)
        self.seq_lens = _bookkeeping(seq_lens, "seq_lens", (max_seqs,)).zero_()  # tokens stored
        self.num_blocks_held = torch.zeros(max_seqs, dtype=torch.int32)
        self._table = self.block_table.numpy()                       # (max_seqs, max_blocks)
        self._lens = self.seq_lens.numpy()                           # (max_seqs,)
        self._held = self.num_blocks_held.numpy()                    # (max_seqs,)
        self._live: set[int] = set()                                 # seq ids that exist now

    @staticmethod
    def pool_bytes(num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                   max_seqs: int, max_blocks_per_seq: int, dtype=torch.float32) -> int:
        """Bytes one layer's pool is about to take: its K and V blocks and its block table.
        RequestError first if a size is not a positive integer."""
        check_sizes(num_blocks=num_blocks, block_size=block_size, n_kv_heads=n_kv_heads,
                    head_dim=head_dim, max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq)
        return num_blocks * block_size * kv_bytes_per_token(n_kv_heads, head_dim, dtype) + \
            max_seqs * max_blocks_per_seq * 4                    # int32 block table

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def __contains__(self, seq_id) -> bool:
        """`seq_id in cm`: does that sequence hold blocks here?"""
        return int(seq_id) in self._live

    def live_seq_ids(self) -> list[int]:
        return sorted(self._live)

    def blocks_of(self, seq_id: int) -> list[int]:
        """A sequence's physical blocks in logical order: its block table without the padding."""
        s = self._one(seq_id)
        return self._table[s, : self._held[s]].tolist()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` tokens fill: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------------
    def reserve(self, seq_id: int, num_tokens: int) -> list[int]:
        """Start sequence `seq_id` with blocks for `num_tokens` tokens (a prompt); return them."""
        s = self._new(seq_id)
        n = self._count(num_tokens)
        k = self.blocks_for(n)
        self._check_room([s], [k], k)
        blocks = self._take(k)
        self._table[s, :k] = blocks
        self._held[s], self._lens[s] = k, n
        self._live.add(s)
        return blocks

    def grow(self, seq_ids, num_new_tokens: int) -> int:
        """Each listed sequence gains `num_new_tokens` tokens: all do, or none if blocks run out.

        A sequence takes new blocks only when its last block is full. The work past a few array
        operations is proportional to the sequences that cross a block boundary. Returns the
        number of blocks taken.
        """
        rows = self._rows(seq_ids, unique=True)                      # (B,)
        n = self._count(num_new_tokens)
        seqs, held, needed = self._crossing(rows, n)
        total = sum(needed) - sum(held)
        if seqs:
            self._check_room(seqs, needed, total)
            self._add_blocks(seqs, held, needed)
        self._lens[rows] += n
        return total

    def blocks_needed(self, seq_ids, num_new_tokens: int) -> int:
        """New blocks `grow(seq_ids, num_new_tokens)` would take."""
        _, held, needed = self._crossing(self._rows(seq_ids, unique=True),
                                         self._count(num_new_tokens))
        return sum(needed) - sum(held)

    def _crossing(self, rows, n):
        """The rows whose last block cannot hold n more tokens: their ids, the blocks each holds
        now, the blocks each needs after the step (three lists)."""
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
        s = self._one(seq_id)
        blocks = self._table[s, : self._held[s]].tolist()
        self._release(blocks)
        self._table[s, : self._held[s]] = PAD_BLOCK
        self._held[s], self._lens[s] = 0, 0
        self._live.discard(s)
        return blocks

    def _take(self, k: int) -> list[int]:
        """k blocks to write into (the caller checked that k fit)."""
        return self.free_blocks.take(k)

    def _release(self, blocks) -> None:
        """Blocks a sequence no longer holds."""
        self.free_blocks.put(blocks)

    # -- what attention reads ---------------------------------------------------------------------
    def block_table_for(self, seq_ids) -> torch.Tensor:
        """int32 (B, W): row b is sequence seq_ids[b]'s block table, padded with PAD_BLOCK (-1).

        W is the most blocks any of these sequences holds (at least 1, so the shape stays valid
        for kernels). A kernel reads only the first ceil(seq_len / block_size) entries of a row.
        """
        rows = self._rows(seq_ids)                                   # (B,)
        width = max(1, int(self._held[rows].max()))
        table = torch.from_numpy(self._table[rows, :width])          # (B, W), a fresh copy
        return table if self._on_cpu else table.to(self.device)

    def seq_lens_for(self, seq_ids) -> torch.Tensor:
        """int32 (B,): tokens stored for each listed sequence (flash-attn's cache_seqlens)."""
        lens = torch.from_numpy(self._lens[self._rows(seq_ids)])     # (B,), a fresh copy
        return lens if self._on_cpu else lens.to(self.device)

    def pool_usage(self):
        """Per physical block: owning seq id (-1: free) and tokens filled. For drawings, stats."""
        owner = np.full(self.num_blocks, -1, dtype=np.int64)
        filled = np.zeros(self.num_blocks, dtype=np.int64)
        for s in self._live:
            k = int(self._held[s])
            blocks = self._table[s, :k]
            owner[blocks] = s
            filled[blocks] = self.block_size
            if k:
                filled[blocks[-1]] = int(self._lens[s]) - (k - 1) * self.block_size
        return owner, filled

    # -- checks ---------------------------------------------------------------------------------
    def _rows(self, seq_ids, unique: bool = False) -> np.ndarray:
        """Sequence ids (list, tuple, tensor or array) -> integer numpy rows, all of them live."""
        if isinstance(seq_ids, torch.Tensor):
            rows = seq_ids.cpu().numpy()
        else:
            rows = np.asarray(seq_ids, dtype=np.int64)
        ids = rows.tolist()
        if not self._live.issuperset(ids) or not ids or (unique and len(set(ids)) != len(ids)):
            if not ids:
                raise RequestError("no sequence ids given")
            unknown = sorted(set(ids) - self._live)
            if unknown:
                raise RequestError(f"sequences {unknown} hold no blocks here: reserve them first "
                                   f"(or they have already been freed)")
            raise RequestError(f"a sequence id appears twice in {ids}; list each sequence once")
        return rows

    def _one(self, seq_id) -> int:
        s = int(seq_id)
        if s not in self._live:
            raise RequestError(f"sequence {seq_id} holds no blocks here: reserve it first "
                               f"(or it has already been freed)")
        return s

    def _new(self, seq_id) -> int:
        """A sequence id that may start now: inside the table and holding nothing."""
        s = int(seq_id)
        if not 0 <= s < self.max_seqs:
            raise RequestError(f"sequence id {seq_id} is outside [0, {self.max_seqs})")
        if s in self._live:
            raise RequestError(f"sequence {s} already holds blocks; free it before reusing its id")
        return s

    @staticmethod
    def _count(num_tokens) -> int:
        if int(num_tokens) != num_tokens or num_tokens < 0:
            raise RequestError(f"a token count must be a non-negative integer, got {num_tokens!r}")
        return int(num_tokens)

    def _check_room(self, seqs, blocks_after, total: int, unavailable: int = 0) -> None:
        """Raise, before anything changes, if a table row or the free blocks are too few
        (`unavailable`: free blocks that this very call will not take from the free set)."""
        if max(blocks_after) > self.max_blocks_per_seq:
            too_long = [s for s, k in zip(seqs, blocks_after) if k > self.max_blocks_per_seq]
            raise RequestError(
                f"sequence(s) {too_long} would need more than max_blocks_per_seq="
                f"{self.max_blocks_per_seq} blocks ({self.max_blocks_per_seq * self.block_size} "
                f"tokens); end them sooner or build the CacheManager with a longer table")
        free = self.num_free_blocks - unavailable
        if total > free:
            raise OutOfBlocksError(
                f"out of KV blocks: this step needs {total} new block(s) but only {free} of "
                f"{self.num_blocks} are free; finish or preempt a sequence, or size the pool "
                f"from a larger KV budget. Nothing was allocated.")
