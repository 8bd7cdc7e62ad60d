"""Support, not a stage (not needed on a first read): the questions the drawings, the statistics
and the scheduler ask of a cache — who owns which block, how full each is, how many slots a
sequence uses and reserves, what a paged step leaves for `attend` (`PagedCacheQueries.STEP`).
The caches of stages 1-3 inherit them; none changes anything.
"""

from __future__ import annotations

import numpy as np

from .cache_checks import check_live, check_one
from .checks import check_count


class ContiguousQueries:
    """For `kv_cache.ContiguousCache`."""

    def usage(self):
        """(used, reserved) slots per row: used = tokens stored, reserved = max_seq_len each."""
        return self.seq_lens.tolist(), [self.max_seq_len] * self.max_batch

    def bytes_per_slot(self) -> int:
        """Bytes of K and V for one token position, summed over all layers."""
        return sum(cache[0, 0].nbytes for cache in self.k_cache + self.v_cache)

    def reserved_bytes(self) -> int:
        """What this cache took from memory the moment it was built, used or not."""
        return self.max_batch * self.max_seq_len * self.bytes_per_slot()


class ManagerQueries:
    """For `cache_manager.CacheManager`."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def __contains__(self, seq_id) -> bool:
        return int(seq_id) in self._live

    def blocks_needed(self, seq_ids, num_new_tokens: int) -> int:
        """New blocks `grow(seq_ids, num_new_tokens)` would take."""
        rows, n = check_live(self, seq_ids, unique=True), check_count(num_new_tokens)
        _, held, needed = self._crossing(rows, n)
        return sum(needed) - sum(held)

    def live_seq_ids(self) -> list[int]:
        return sorted(self._live)

    def blocks_of(self, seq_id: int) -> list[int]:
        """A sequence's physical blocks in logical order: its block table without the padding."""
        s = check_one(self, seq_id)
        return self._table[s, : self._held[s]].tolist()

    def pool_usage(self):
        """Per physical block: owning seq id (-1: free) and tokens filled."""
        owner = np.full(self.num_blocks, -1, dtype=np.int64)
        filled = np.zeros(self.num_blocks, dtype=np.int64)
        for s in self._live:
            blocks = self._table[s, : self._held[s]]
            owner[blocks] = s
            filled[blocks] = self.block_size
            filled[blocks[-1:]] = self._lens[s] - (len(blocks) - 1) * self.block_size  # the last
        return owner, filled


class PagedCacheQueries:
    """For `paged_cache.PagedCache` (every layer holds the same tokens: layer 0 answers)."""

    STEP = ("cache_seqlens", "positions", "block_tables")   # what `attend` reads, set by prepare

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.managers[0]

    def blocks_to_grow(self, seq_id: int, num_new_tokens: int = 1) -> int:
        """Blocks per layer that one sequence's next `num_new_tokens` tokens take."""
        return self.managers[0].blocks_needed([seq_id], num_new_tokens)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks per layer (the same in every layer)."""
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
