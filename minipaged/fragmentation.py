"""Stage 4: where KV memory goes — token states, reservation, internal and external fragmentation.

Every slot of KV memory (one token's K and V, in every layer) is, at any moment, one of:

  token states  it holds the K/V of a token already processed: the only useful slot;
  reservation   it is held for a token its request has not produced yet, but will;
  internal      it is held by a request that will never fill it (reserved past its true length,
                or, paged, the tail of its last block that it will not reach);
  external      it is free, but in a piece too small for the next waiting request, although the
                free memory as a whole would hold it: lost to the split, not to a lack of memory;
  idle          it is free for any other reason (nobody waits, or too little is free anyway).

Shares are of the KV memory (the pool or the region the cache owns), not of the whole GPU.
Reading them off a cache needs one thing the cache cannot know: each request's final length.

`FirstFitAllocator` is the contiguous allocator the simulator (`simulator.py`) runs the
contiguous policies on, so their external fragmentation is measured, not assumed.
`python -m minipaged.benchmarks.policies` compares the policies on a workload (`workloads.py`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np

from .errors import MiniPagedError, RequestError
from .kv_cache import kv_bytes_per_token

KINDS = ("token states", "reservation", "internal", "external", "idle")
TOKEN, RESERVED, INTERNAL, EXTERNAL, IDLE = range(5)     # slot categories in a slot map

# vLLM paper (Kwon et al., SOSP 2023), Fig. 2: shares of KV memory, in percent ("—" is 0).
PAPER_FIG2 = {
    "Orca (Max)": (20.4, 13.3, 57.3, 8.9),
    "Orca (Pow2)": (26.8, 17.9, 13.6, 41.6),
    "Orca (Oracle)": (38.2, 25.2, 0.0, 36.6),
    "vLLM": (96.3, None, None, None),        # the paper gives only the token-state share
}


# -- the arithmetic ------------------------------------------------------------------------------

def split_allocated(stored, allocated, final):
    """Split the slots requests hold into (token states, reservation, internal), summed over
    requests (axis 0).

    stored: tokens a request's cache holds now; allocated: slots it holds; final: the tokens
    its cache will hold when it ends. Of the allocated slots, min(allocated, final) will be used
    some day: the stored ones now, the rest later (reservation); the others never (internal).
    Arrays of shape (R,) give numbers; (R, k) arrays give k moments at once (the simulator).
    """
    stored, allocated, final = (np.asarray(a, dtype=np.int64) for a in (stored, allocated, final))
    used_some_day = np.minimum(allocated, final)
    if (used_some_day < stored).any():
        raise RequestError("a request stores more tokens than it holds slots for, or than its "
                           "final length: check the lengths passed in")
    return stored.sum(0), (used_some_day - stored).sum(0), (allocated - used_some_day).sum(0)


def split_free(free: int, pieces=None, next_need: int | None = None):
    """Split free slots into (external, idle).

    pieces: the sizes of the free extents of a contiguous region, or None for a paged pool
    (any free block serves any request: no piece is ever too small). next_need: the slots the
    next waiting request needs, or None if nobody waits. External = the pieces smaller than
    next_need, counted only when all free memory together would hold it.
    """
    if pieces is None or next_need is None or free < next_need:
        return 0, int(free)
    small = int(sum(p for p in pieces if p < next_need))
    return small, int(free) - small


@dataclass(frozen=True)
class KVWaste:
    """KV memory at one moment, in slots by kind; a slot is one token's K and V in every layer."""
    tokens: int
    reservation: int
    internal: int
    external: int
    idle: int
    bytes_per_slot: int = 1

    @property
    def capacity(self) -> int:
        return self.tokens + self.reservation + self.internal + self.external + self.idle

    @property
    def allocated(self) -> int:
        return self.tokens + self.reservation + self.internal

    def slots(self) -> dict:
        return dict(zip(KINDS, (self.tokens, self.reservation, self.internal, self.external,
                                self.idle)))

    def bytes(self) -> dict:
        return {k: v * self.bytes_per_slot for k, v in self.slots().items()}

    def shares(self) -> dict:
        """Each kind as a fraction of the KV memory (all five add up to 1)."""
        return {k: v / self.capacity for k, v in self.slots().items()}


def waste(stored, allocated, final, capacity: int, pieces=None, next_need=None,
          bytes_per_slot: int = 1) -> KVWaste:
    """KVWaste of requests holding `allocated` slots in a memory of `capacity` slots."""
    tokens, reservation, internal = (int(x) for x in split_allocated(stored, allocated, final))
    free = capacity - int(np.sum(allocated))
    if free < 0:
        raise RequestError(f"the requests hold {capacity - free} slots, more than the "
                           f"{capacity} the memory has")
    external, idle = split_free(free, pieces, next_need)
    return KVWaste(tokens, reservation, internal, external, idle, bytes_per_slot)


# -- reading the real caches ---------------------------------------------------------------------

def _finals(final_lens, seq_ids):
    missing = [s for s in seq_ids if s not in final_lens]
    if missing:
        raise RequestError(f"no final length given for live sequence(s) {missing}: pass "
                           f"final_lens={{seq_id: tokens its cache will hold at the end}}")
    return np.array([final_lens[s] for s in seq_ids], dtype=np.int64)


def measure_paged(cache, final_lens: dict) -> KVWaste:
    """Read a PagedCache (or one CacheManager, or a list of them) as KVWaste.

    Every layer's pool is read; they must agree (every layer holds the same tokens), and a slot
    is then one token in all layers. Free blocks are never external: any serves any request.
    """
    managers = getattr(cache, "managers", cache)
    managers = managers if isinstance(managers, (list, tuple)) else [managers]
    layers, layer_bytes = [], 0
    for m in managers:
        ids = m.live_seq_ids()
        stored = m.seq_lens.numpy()[ids]
        allocated = m.num_blocks_held.numpy()[ids] * m.block_size
        layers.append(waste(stored, allocated, _finals(final_lens, ids),
                            m.num_blocks * m.block_size))
        _, _, n_kv_heads, head_dim = m.k_cache_paged.shape
        layer_bytes += kv_bytes_per_token(n_kv_heads, head_dim, m.k_cache_paged.dtype)
    if any(w != layers[0] for w in layers):
        raise MiniPagedError("the layers of this cache disagree about what they hold: "
                             "drive every layer's CacheManager with the same calls")
    return replace(layers[0], bytes_per_slot=layer_bytes)


def measure_contiguous(cache, final_lens: dict, next_need: int | None = None) -> KVWaste:
    """Read a ContiguousCache as KVWaste: row i is request i's `max_seq_len` slots.

    A row that stores no token holds no request (not started, or freed) and counts as free.
    Rows sit back to back in one region, so neighbouring free rows form one free piece. All
    layers share the rows' lengths, so one layer's picture is every layer's.
    """
    lens = cache.seq_lens.numpy().astype(np.int64)
    live = np.flatnonzero(lens > 0)
    pieces, run = [], 0
    for n in lens.tolist() + [1]:                       # runs of empty rows, in slots
        if n == 0:
            run += cache.max_seq_len
        elif run:
            pieces.append(run)
            run = 0
    return waste(lens[live], np.full(live.size, cache.max_seq_len),
                 _finals(final_lens, live.tolist()), cache.max_batch * cache.max_seq_len,
                 pieces, next_need, bytes_per_slot=cache.bytes_per_slot())


# -- slot maps: the category of every slot, for drawings -----------------------------------------

def slot_map_paged(cm, final_lens: dict):
    """(num_blocks, block_size) int array: the category of every slot of one CacheManager's pool."""
    out = np.full((cm.num_blocks, cm.block_size), IDLE, dtype=np.int64)
    for s in cm.live_seq_ids():
        n, final = int(cm.seq_lens[s]), int(_finals(final_lens, [s])[0])
        flat = np.full(len(cm.blocks_of(s)) * cm.block_size, INTERNAL)
        flat[:final] = RESERVED
        flat[:n] = TOKEN
        out[cm.blocks_of(s)] = flat.reshape(-1, cm.block_size)
    return out


def slot_map_region(allocator, stored: dict, final: dict, next_need: int | None = None):
    """(capacity,) int array: the category of every slot of a FirstFitAllocator's region."""
    out = np.full(allocator.capacity, IDLE, dtype=np.int64)
    for owner, (start, size) in allocator.extents().items():
        out[start:start + size] = INTERNAL
        out[start:start + min(size, final[owner])] = RESERVED
        out[start:start + stored[owner]] = TOKEN
    if next_need is not None and allocator.free_slots >= next_need:
        for start, size in allocator.holes():
            if size < next_need:
                out[start:start + size] = EXTERNAL
    return out


# -- a contiguous allocator ----------------------------------------------------------------------

class FirstFitAllocator:
    """One region of `capacity` slots; each request takes one contiguous extent, first fit.

    The free extents are kept sorted by start; freeing merges an extent with free neighbours,
    so two adjacent holes are always one. This is how a cache that needs each request's KV in
    one piece (Orca-style reservation) must place it, and where external fragmentation comes from.
    """

    def __init__(self, capacity: int):
        if int(capacity) != capacity or capacity < 1:
            raise RequestError(f"capacity must be a positive number of slots, got {capacity!r}")
        self.capacity = int(capacity)
        self._starts, self._sizes = [0], [self.capacity]    # free extents, sorted by start
        self._held: dict = {}                               # owner -> (start, size)

    @property
    def free_slots(self) -> int:
        return sum(self._sizes)

    def holes(self) -> list[tuple[int, int]]:
        """The free extents as (start, size), in address order."""
        return list(zip(self._starts, self._sizes))

    def largest_hole(self) -> int:
        return max(self._sizes, default=0)

    def extents(self) -> dict:
        """owner -> (start, size) of every extent handed out."""
        return dict(self._held)

    def allocate(self, owner, size: int) -> int | None:
        """Give `owner` the first free extent of `size` slots; its start, or None if none fits."""
        if owner in self._held:
            raise RequestError(f"{owner!r} already holds an extent; free it first")
        if int(size) != size or size < 1:
            raise RequestError(f"an extent must be a positive number of slots, got {size!r}")
        for i, hole in enumerate(self._sizes):
            if hole >= size:
                start = self._starts[i]
                if hole == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self._held[owner] = (start, int(size))
                return start
        return None

    def free(self, owner) -> None:
        """Return `owner`'s extent, merged with the free extents on either side."""
        if owner not in self._held:
            raise RequestError(f"{owner!r} holds no extent here")
        start, size = self._held.pop(owner)
        i = bisect.bisect(self._starts, start)
        if i < len(self._starts) and start + size == self._starts[i]:    # merge the next hole
            size += self._sizes[i]
            del self._starts[i], self._sizes[i]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge the previous
            self._sizes[i - 1] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)
