"""Stage 6: sharing blocks — reference counts, copy-on-write, and the prefix cache.

Stage 2's allocator gives every block to exactly one sequence. Here several block tables may
hold the same block. Every block has a reference count: the number of tables that hold it.

    fork(parent, child)   the child gets the parent's table: every count +1, nothing copied
    free(seq)             every count -1; a block is free again only at zero
    grow(seqs, n)         a sequence about to write into a block whose count is above one first
                          gets a private copy of it (copy-on-write), so nobody else sees the write

With `prefix_caching=True`, full blocks are also named by a chained hash of their tokens
(`prefix_cache.py`). A named block whose count reaches zero keeps its K/V in a cached-free
queue: it counts as free (an allocation may evict it), but until then a later prompt that starts
with the same tokens finds it (`match_prefix`) and starts its table with it instead of
prefilling those tokens again.

`SharedCacheManager` is one layer's allocator (a CacheManager subclass); `SharedPagedCache`
drives one per layer, as stage 3's PagedCache drives CacheManagers.
"""

from __future__ import annotations

import numbers

import numpy as np

from .cache_manager import CacheManager
from .cache_checks import check_live, check_new, check_one, check_room, check_step_room
from .checks import check_count, check_tokens
from .errors import RequestError
from .paged_cache import PagedCache
from .prefix_cache import PrefixCache, block_hashes


class SharedCacheManager(CacheManager):
    """A CacheManager whose blocks may be held by several tables: `refs[b]` counts them."""

    def __init__(self, *args, prefix_caching: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.refs = np.zeros(self.num_blocks, dtype=np.int32)        # (N,) tables holding each
        self.prefix = PrefixCache() if prefix_caching else None      # None: prefix caching off

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: really free ones plus cached-free ones (evictable)."""
        return len(self.free_blocks) + self.num_cached_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.prefix) if self.prefix is not None else 0

    # -- allocation -----------------------------------------------------------------------------
    def reserve(self, seq_id: int, num_tokens: int, prefix_blocks=()) -> list[int]:
        """Start a sequence of `num_tokens` tokens. `prefix_blocks` (from `match_prefix`) become
        its first blocks, shared, not taken: their tokens are already in the cache, so only the
        rest of the prompt needs a prefill."""
        if not len(prefix_blocks):
            return super().reserve(seq_id, num_tokens)
        s, n = check_new(self, seq_id), check_count(num_tokens)
        k = self.blocks_for(n)
        shared = self._check_prefix(prefix_blocks)
        if len(shared) * self.block_size > n:      # a named block is full: all its tokens are ours
            raise RequestError(f"{len(shared)} full prefix blocks hold "
                               f"{len(shared) * self.block_size} tokens, more than the "
                               f"{n} of this sequence; share only the blocks its prompt fills")
        reviving = [b for b in shared if self.refs[b] == 0]          # cached-free hits
        # the revived blocks count as free now, but this call takes them as hits
        check_room(self, [s], [k], k - len(shared) + len(reviving))
        for b in reviving:
            self.prefix.revive(b)
        self.refs[shared] += 1
        blocks = shared + self._take(k - len(shared))
        self._table[s, :k] = blocks
        self._held[s], self._lens[s] = k, n
        self._live.add(s)
        return blocks

    def _check_prefix(self, prefix_blocks) -> list[int]:
        """Prefix blocks as ints: distinct entries of the prefix cache (full blocks named by
        their tokens' hash, held by a sequence or cached-free). Another sequence's unnamed block
        (a partial last block it still writes into) holds nothing this one can claim."""
        if self.prefix is None:
            raise RequestError("prefix_blocks need prefix caching (prefix_caching=True)")
        blocks = list(prefix_blocks)
        ok = all(isinstance(b, numbers.Integral) and not isinstance(b, bool)
                 and 0 <= b < self.num_blocks for b in blocks) and len(set(blocks)) == len(blocks)
        if not ok or any(int(b) not in self.prefix.hash_of for b in blocks):
            raise RequestError(f"prefix_blocks must be distinct blocks in [0, {self.num_blocks}) "
                               f"that the prefix cache names (from match_prefix), not {blocks!r}")
        return [int(b) for b in blocks]

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as a copy of `parent`'s table: every block shared, count +1, no copy."""
        p, c = check_one(self, parent), check_new(self, child)
        k = int(self._held[p])
        self._table[c, :k] = self._table[p, :k]
        self.refs[self._table[p, :k]] += 1
        self._held[c], self._lens[c] = k, self._lens[p]
        self._live.add(c)

    def grow(self, seq_ids, num_new_tokens: int) -> int:
        """Stage 2's `grow`, with a copy-on-write first for every row about to write into a
        shared last block. All rows grow, or none. Returns the blocks taken, copies included."""
        rows = check_live(self, seq_ids, unique=True)                # (B,)
        n = check_count(num_new_tokens)
        cow = self._shared_writes(rows, n)
        seqs, held, needed = self._crossing(rows, n)
        total = sum(needed) - sum(held) + len(cow)
        if total:
            check_room(self, seqs or [int(rows[0])], needed or [0], total)
        self._copy_on_write(cow)
        if seqs:
            self._add_blocks(seqs, held, needed)
        self._lens[rows] += n
        return total

    def blocks_needed(self, seq_ids, num_new_tokens: int) -> int:
        """New blocks `grow(seq_ids, num_new_tokens)` would take, copies-on-write included."""
        rows, n = check_live(self, seq_ids, unique=True), check_count(num_new_tokens)
        _, held, needed = self._crossing(rows, n)
        return sum(needed) - sum(held) + len(self._shared_writes(rows, n))

    def _shared_writes(self, rows, n) -> list[tuple[int, int]]:
        """(row, block) pairs where a row would write into a partial last block that another
        table still holds: each needs a copy. The last writer of a block keeps the original."""
        if not n or self.refs.max(initial=0) <= 1:
            return []
        held = self._held[rows]
        last = self._table[rows, np.maximum(held - 1, 0)]            # (B,)
        partial = (self._lens[rows] % self.block_size != 0) & (self.refs[last] > 1)
        cow, left = [], {}                        # left: tables still holding each block
        for r, b in zip(rows[partial].tolist(), last[partial].tolist()):
            left[b] = left.get(b, int(self.refs[b]))
            if left[b] > 1:                       # someone else still reads it: copy
                cow.append((r, b))
                left[b] -= 1
        return cow

    def _copy_on_write(self, cow) -> None:
        """Give each (row, block) its own copy of the block's K/V before it writes there."""
        for (s, old), new in zip(cow, self._take(len(cow))):
            self.k_cache_paged[new] = self.k_cache_paged[old]       # (bs, Hk, D)
            self.v_cache_paged[new] = self.v_cache_paged[old]
            self._table[s, int(self._held[s]) - 1] = new
            self.refs[old] -= 1                   # still >= 1: another table holds it

    def _take(self, k: int) -> list[int]:
        """k blocks to write into, each now held by one table: really free ones first, then the
        least recently freed cached blocks (evicted: their hashes are forgotten)."""
        fresh = self.free_blocks.take(min(k, len(self.free_blocks)))
        blocks = fresh + (self.prefix.evict(k - len(fresh)) if k > len(fresh) else [])
        self.refs[blocks] = 1
        return blocks

    def hold(self, blocks) -> None:
        """One more reference on each block, held outside every block table (stage 9b: the
        prefill side keeps a request's blocks until the decode side has read them)."""
        self.refs[blocks] += 1

    def let_go(self, blocks) -> None:
        """Give back a `hold`: each block loses the reference it added."""
        self._release(blocks)

    def _release(self, blocks) -> None:
        """Each block loses one reference; those at zero go back to the free set, or, if named
        by a hash, to the cached-free queue."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0 and not (self.prefix is not None and self.prefix.release(b)):
                self.free_blocks.put([b])

    # -- prefix caching -------------------------------------------------------------------------
    def match_prefix(self, hashes) -> list[int]:
        """Blocks already holding the leading full blocks named by `hashes` (none: caching off)."""
        return self.prefix.match(hashes) if self.prefix is not None else []

    def name_block(self, seq_id: int, j: int, h: bytes) -> None:
        """Logical block j of a sequence is full: name its physical block `h` for later hits."""
        s = check_one(self, seq_id)
        full = (j + 1) * self.block_size <= self._lens[s]
        if self.prefix is not None and j < self._held[s] and full:
            self.prefix.name(int(self._table[s, j]), h)


class SharedPagedCache(PagedCache):
    """Stage 3's PagedCache over SharedCacheManagers: fork, prefix hits and block naming, kept
    in step across the layers."""

    def __init__(self, *args, prefix_caching: bool = False, **kwargs):
        self.prefix_caching = prefix_caching
        self.hashes: dict[int, list[bytes]] = {}      # seq id -> its full blocks' chained hashes
        super().__init__(*args, **kwargs)

    def new_manager(self, *args, **kwargs) -> SharedCacheManager:
        return SharedCacheManager(*args, prefix_caching=self.prefix_caching, **kwargs)

    def free(self, seq_id: int) -> None:
        """A finished sequence lets go of its blocks: shared ones only lose a reference."""
        super().free(seq_id)
        self.hashes.pop(int(seq_id), None)

    def fork(self, parent: int, child: int) -> None:
        """`child` shares every block of `parent`, in every layer; nothing is copied yet."""
        for m in self.managers:
            m.fork(parent, child)
        self.hashes[int(child)] = list(self.hashes.get(int(parent), []))

    def prefix_hits(self, tokens) -> list[list[int]]:
        """Per layer, the cached blocks that hold the longest known prefix of `tokens`, as many in
        every layer (none without prefix caching). Never the block of the last token, whose
        logits the caller needs: a prompt seen in full still recomputes its last block."""
        check_tokens(tokens)
        if not self.prefix_caching:
            return [[] for _ in self.managers]
        n, bs = len(tokens), self.block_size
        hashes = block_hashes(tokens[:(n - 1) // bs * bs], bs)
        per_layer = [m.match_prefix(hashes) for m in self.managers]
        found = min(len(h) for h in per_layer)
        return [h[:found] for h in per_layer]

    def start(self, seq_id: int, tokens, num_new_tokens: int | None = None) -> int:
        """Begin a sequence whose prompt is `tokens`, reusing the cached blocks of its longest
        known prefix, and prepare the forward over the `num_new_tokens` tokens after them (None:
        all the rest). Returns the tokens skipped: run the model on tokens[skipped:]."""
        s, bs = int(seq_id), self.block_size
        hits = self.prefix_hits(tokens)
        skipped = len(hits[0]) * bs
        n = len(tokens) if num_new_tokens is None else skipped + num_new_tokens
        if not skipped:
            self.prepare([s], n)
            return 0
        first = self.managers[0]
        reviving = sum(first.refs[b] == 0 for b in hits[0])
        check_step_room(self, first.blocks_for(n) - len(hits[0]) + reviving, n)
        for m, layer_hits in zip(self.managers, hits):
            m.reserve(s, n, prefix_blocks=layer_hits)
        self.set_step([s], n - skipped)
        return skipped

    def name_blocks(self, seq_id: int, prompt, output=()) -> None:
        """The cache now holds prompt + output for this sequence: name its newly full blocks,
        so later prompts can find them. Cheap when no block has filled since the last call."""
        if not self.prefix_caching:
            return
        s, bs = int(seq_id), self.block_size
        have = self.hashes.setdefault(s, [])
        if (len(prompt) + len(output)) // bs <= len(have):
            return
        new = block_hashes(list(prompt) + list(output), bs, have[-1] if have else None, len(have))
        for j, h in enumerate(new, start=len(have)):
            for m in self.managers:
                m.name_block(s, j, h)
        have += new
