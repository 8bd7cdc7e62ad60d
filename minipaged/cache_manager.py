"""Stage 2: the block allocator behind PagedAttention — one CacheManager per layer.

A layer's KV memory is a pool of `num_blocks` physical blocks of `block_size` token slots each.
A sequence owns a list of blocks, its block table: logical block j (tokens j*block_size ...
(j+1)*block_size - 1) lives in physical block block_table[j], anywhere in the pool. Blocks are
taken from a random free set when a sequence first needs them and all go back when it ends, so
the only memory a sequence wastes is the unfilled tail of its last block.

Stage 6 lets sequences share blocks. Every block has a reference count: the number of block
tables that hold it. `fork` gives a child its parent's table (every count +1); `free` takes 1
off, and a block is free again only at zero. Before a token is written into a block whose count
is above one, the writer gets a private copy (copy-on-write), so nobody else sees the write.
With `prefix_caching=True`, full blocks are named by a chained hash of their tokens
(`prefix_cache.py`); a named block whose count reaches zero keeps its K/V in a cached-free
queue, where a later prompt that starts with the same tokens finds it and skips its prefill.

Bookkeeping lives on the CPU in preallocated int32 tensors (`block_table`, `seq_lens`). They are
read and written through numpy views of the same memory, as vLLM v1's BlockTable does: a numpy
call on a 64-element array costs about a microsecond, a torch call several, and this code runs
for every layer on every decode step.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .errors import OutOfBlocksError, RequestError
from .prefix_cache import PrefixCache

PAD_BLOCK = -1   # what block tables hold past a sequence's last block: "no block here"


# -- the free-block set ----------------------------------------------------------------------

class FreeBlockSet:
    """Free physical block ids; `take` removes random ones in O(1) each, reproducibly for a seed.

    A list plus swap-with-last removal: pick a random index, move the last id into its place,
    pop. The seed code's `random.choice(list(free_blocks))` copied the whole set on every pick.
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


# -- the cache manager -------------------------------------------------------------------------

class CacheManager:
    """One layer's paged KV cache: the physical pool, its free blocks, a block table per sequence.

    Sequence ids are rows of the tables, 0 <= seq_id < max_seqs. Every method that allocates
    either succeeds completely or raises before changing anything (tables, lengths, free set,
    even the random generator's state). `refs[b]` counts the tables holding block b.
    """

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 max_seqs: int, max_blocks_per_seq: int, device="cpu", dtype=torch.float32,
                 seed: int = 0, prefix_caching: bool = False):
        for name, value in [("num_blocks", num_blocks), ("block_size", block_size),
                            ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("max_seqs", max_seqs), ("max_blocks_per_seq", max_blocks_per_seq)]:
            if int(value) != value or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_seqs, self.max_blocks_per_seq = max_seqs, max_blocks_per_seq
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k_cache_paged = torch.zeros(shape, device=device, dtype=dtype)   # (N, bs, Hk, D)
        self.v_cache_paged = torch.zeros(shape, device=device, dtype=dtype)
        self.free_blocks = FreeBlockSet(num_blocks, seed)
        # Bookkeeping tensors, with numpy views (`_table`, ...) that share their memory.
        self.block_table = torch.full((max_seqs, max_blocks_per_seq), PAD_BLOCK, dtype=torch.int32)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32)     # tokens stored, per row
        self.num_blocks_held = torch.zeros(max_seqs, dtype=torch.int32)
        self._table = self.block_table.numpy()                       # (max_seqs, max_blocks)
        self._lens = self.seq_lens.numpy()                           # (max_seqs,)
        self._held = self.num_blocks_held.numpy()                    # (max_seqs,)
        self._live: set[int] = set()                                 # seq ids that exist now
        self.refs = np.zeros(num_blocks, dtype=np.int32)             # (N,) tables holding each
        self.prefix = PrefixCache() if prefix_caching else None      # None: prefix caching off

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: really free ones plus cached-free ones (evictable)."""
        return len(self.free_blocks) + self.num_cached_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.prefix) if self.prefix is not None else 0

    def __contains__(self, seq_id) -> bool:
        """`seq_id in cm`: does that sequence hold blocks here?"""
        return int(seq_id) in self._live

    def live_seq_ids(self) -> list[int]:
        return sorted(self._live)

    def blocks_of(self, seq_id: int) -> list[int]:
        """A sequence's physical blocks in logical order: its block table without the padding."""
        s = self._one(seq_id)
        return self._table[s, : self._held[s]].tolist()

    # -- allocation -----------------------------------------------------------------------------
    def reserve(self, seq_id: int, num_tokens: int, prefix_blocks=()) -> list[int]:
        """Start sequence `seq_id` with blocks for `num_tokens` tokens (a prompt); return them.

        `prefix_blocks` (from `match_prefix`) become its first blocks, shared, not taken: their
        tokens are already in the cache, so only the rest of the prompt needs a prefill.
        """
        s = int(seq_id)
        if not 0 <= s < self.max_seqs:
            raise RequestError(f"sequence id {seq_id} is outside [0, {self.max_seqs})")
        if s in self._live:
            raise RequestError(f"sequence {s} already holds blocks; free it before reusing its id")
        n = self._count(num_tokens)
        k = -(-n // self.block_size)                                 # ceil(n / block_size)
        shared = [int(b) for b in prefix_blocks]
        if len(shared) > k or (shared and self.prefix is None):
            raise RequestError(f"{len(shared)} prefix blocks cannot start a sequence of {n} "
                               f"tokens ({k} blocks), nor without prefix caching")
        reviving = [b for b in shared if self.refs[b] == 0]          # cached-free hits
        self._check_room([s], [k], k - len(shared), reserved=len(reviving))
        for b in reviving:
            self.prefix.revive(b)
        blocks = shared + self._take(k - len(shared))
        self._table[s, :k] = blocks
        self.refs[blocks] += 1
        self._held[s], self._lens[s] = k, n
        self._live.add(s)
        return blocks

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as a copy of `parent`'s table: every block shared, count +1, no copy."""
        p, c = self._one(parent), int(child)
        if not 0 <= c < self.max_seqs or c in self._live:
            raise RequestError(f"cannot fork into sequence {child}: it must be a free id in "
                               f"[0, {self.max_seqs})")
        k = int(self._held[p])
        self._table[c, :k] = self._table[p, :k]
        self.refs[self._table[p, :k]] += 1
        self._held[c], self._lens[c] = k, self._lens[p]
        self._live.add(c)

    def grow(self, seq_ids, num_new_tokens: int) -> int:
        """Each listed sequence gains `num_new_tokens` tokens: all do, or none if blocks run out.

        A sequence takes new blocks only when its last block is full. The work past a few array
        operations is proportional to the sequences that cross a block boundary. Returns the
        number of blocks taken.
        """
        rows = self._rows(seq_ids, unique=True)                      # (B,)
        n = self._count(num_new_tokens)
        cow, seqs, start, end, total = self._plan_growth(rows, n)
        if cow or seqs:
            self._check_room(seqs or [int(rows[0])], end or [0], total)
        if cow:
            self._copy_on_write(cow)
        if seqs:                              # from here on, Python over the C crossing rows
            blocks = iter(self._take(total - len(cow)))
            for s, h, e in zip(seqs, start, end):
                for j in range(h, e):                                # logical block j of s
                    b = next(blocks)
                    self._table[s, j] = b
                    self.refs[b] = 1
                self._held[s] = e
        self._lens[rows] += n
        return total

    def blocks_needed(self, seq_ids, num_new_tokens: int) -> int:
        """New blocks `grow(seq_ids, num_new_tokens)` would take, copies-on-write included."""
        return self._plan_growth(self._rows(seq_ids, unique=True), self._count(num_new_tokens))[4]

    def _plan_growth(self, rows, n):
        """Which rows write into a shared partial block (copy-on-write: (row, block) pairs), and
        which cross into new blocks (their ids, blocks held, blocks needed); the total."""
        new_lens = self._lens[rows] + n                              # (B,)
        held = self._held[rows]                                      # (B,)
        cow = []
        if n and self.refs.max(initial=0) > 1:    # only a shared partial last block is written
            last = self._table[rows, np.maximum(held - 1, 0)]        # (B,)
            partial = (self._lens[rows] % self.block_size != 0) & (self.refs[last] > 1)
            left = {}                             # tables still holding each block, as we go
            for r, b in zip(rows[partial].tolist(), last[partial].tolist()):
                left[b] = left.get(b, int(self.refs[b]))
                if left[b] > 1:                   # someone else still reads it: copy
                    cow.append((r, b))
                    left[b] -= 1                  # the last writer keeps the original
        crossing = (new_lens > held * self.block_size).nonzero()[0]  # (C,) rows needing blocks
        seqs = rows[crossing].tolist()
        start = held[crossing].tolist()                              # blocks they hold now
        end = [-(-length // self.block_size) for length in new_lens[crossing].tolist()]
        return cow, seqs, start, end, sum(end) - sum(start) + len(cow)

    def _copy_on_write(self, cow) -> None:
        """Give each (row, block) its own copy of the block's K/V before it writes there."""
        fresh = self._take(len(cow))
        for (s, old), new in zip(cow, fresh):
            self.k_cache_paged[new] = self.k_cache_paged[old]       # (bs, Hk, D)
            self.v_cache_paged[new] = self.v_cache_paged[old]
            self._table[s, int(self._held[s]) - 1] = new
            self.refs[old] -= 1                   # still >= 1: another table holds it
            self.refs[new] = 1

    def free(self, seq_id: int) -> list[int]:
        """End a sequence: each of its blocks loses one reference; those at zero go back to
        the free set, or, if named by a hash, to the cached-free queue. Returns its blocks."""
        s = self._one(seq_id)
        blocks = self._table[s, : self._held[s]].tolist()
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0 and not (self.prefix is not None and self.prefix.release(b)):
                self.free_blocks.put([b])
        self._table[s, : self._held[s]] = PAD_BLOCK
        self._held[s], self._lens[s] = 0, 0
        self._live.discard(s)
        return blocks

    def _take(self, k: int) -> list[int]:
        """k blocks to write into: really free ones first, then the least recently freed cached
        blocks (evicted: their hashes are forgotten). The caller checked that k fit."""
        fresh = self.free_blocks.take(min(k, len(self.free_blocks)))
        return fresh + (self.prefix.evict(k - len(fresh)) if k > len(fresh) else [])

    # -- prefix caching -------------------------------------------------------------------------
    def match_prefix(self, hashes) -> list[int]:
        """Blocks already holding the leading full blocks named by `hashes` (none: caching off)."""
        return self.prefix.match(hashes) if self.prefix is not None else []

    def name_block(self, seq_id: int, j: int, h: bytes) -> None:
        """Logical block j of a sequence is full: name its physical block `h` for later hits."""
        s = self._one(seq_id)
        full = (j + 1) * self.block_size <= self._lens[s]
        if self.prefix is not None and j < self._held[s] and full:
            self.prefix.name(int(self._table[s, j]), h)

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

    @staticmethod
    def _count(num_tokens) -> int:
        if int(num_tokens) != num_tokens or num_tokens < 0:
            raise RequestError(f"a token count must be a non-negative integer, got {num_tokens!r}")
        return int(num_tokens)

    def _check_room(self, seqs, blocks_after, total: int, reserved: int = 0) -> None:
        """Raise, before anything changes, if a table row or the free set is too small
        (`reserved`: free-looking blocks that this very call is about to take as prefix hits)."""
        if max(blocks_after) > self.max_blocks_per_seq:
            too_long = [s for s, k in zip(seqs, blocks_after) if k > self.max_blocks_per_seq]
            raise RequestError(
                f"sequence(s) {too_long} would need more than max_blocks_per_seq="
                f"{self.max_blocks_per_seq} blocks ({self.max_blocks_per_seq * self.block_size} "
                f"tokens); end them sooner or build the CacheManager with a longer table")
        if total > self.num_free_blocks - reserved:
            raise OutOfBlocksError(
                f"out of KV blocks: this step needs {total} new block(s) but only "
                f"{self.num_free_blocks - reserved} of {self.num_blocks} are free; finish or "
                f"preempt a sequence, or size the pool from a larger KV budget. Nothing was allocated.")
