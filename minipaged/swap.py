"""Stage 5: swap space — a second pool of blocks in CPU memory, where a preempted sequence's K/V
wait until the KV pool has room for them again.

Preemption by swap (vLLM's other mode besides recompute) copies a sequence's blocks, in every
layer, into free blocks of the CPU pool and frees them in the KV pool; swapping in copies them
back into whatever blocks are free then, so the sequence comes back with a new block table and
its tokens need no prefill. On a GPU the two pools are GPU and CPU memory and a swap crosses the
PCIe bus; on a CPU both are RAM and a swap is a copy.
"""

from __future__ import annotations

import torch

from .cache_manager import CacheManager
from .errors import OutOfBlocksError
from .cache_checks import check_memory, pool_bytes
from .kv_cache import kv_bytes_per_token


def move_sequence(src: CacheManager, dst: CacheManager, seq_id: int) -> tuple[list[int], list[int]]:
    """Copy a sequence's K/V blocks from one pool into free blocks of another, then free them in
    the first. KV pool -> CPU pool is a swap-out, CPU -> KV pool a swap-in; the sequence lands in
    whatever blocks `dst` draws, so its block table there is new. Returns (src, dst) blocks.

    Raises (OutOfBlocksError, from `dst.reserve`) before anything changes if `dst` lacks room.
    """
    n = int(src.seq_lens_for([seq_id])[0])
    src_blocks = src.blocks_of(seq_id)
    dst_blocks = dst.reserve(seq_id, n)
    frm = torch.tensor(src_blocks, dtype=torch.long, device=src.device)     # (k,)
    to = torch.tensor(dst_blocks, dtype=torch.long, device=dst.device)      # (k,)
    dst.k_cache_paged[to] = src.k_cache_paged[frm].to(dst.device)           # (k, bs, Hk, D)
    dst.v_cache_paged[to] = src.v_cache_paged[frm].to(dst.device)
    src.free(seq_id)
    return src_blocks, dst_blocks


class SwapSpace:
    """A CPU pool of `num_cpu_blocks` blocks per layer beside a PagedCache's KV pool."""

    def __init__(self, cache, num_cpu_blocks: int, seed: int = 1000):
        first = cache.managers[0]
        k = first.k_cache_paged
        self.cache = cache
        per_layer = pool_bytes(num_cpu_blocks, cache.block_size, k.shape[2], k.shape[3],
                               first.max_seqs, first.max_blocks_per_seq, k.dtype,
                               kv_bytes_per_token)
        check_memory(len(cache.managers) * per_layer, "cpu", f"a CPU swap pool of "
                     f"{num_cpu_blocks:,} blocks in each of {len(cache.managers)} layers")
        self.cpu_managers = [CacheManager(num_cpu_blocks, cache.block_size, k.shape[2],
                                          k.shape[3], first.max_seqs, first.max_blocks_per_seq,
                                          device="cpu", dtype=k.dtype, seed=seed + layer)
                             for layer in range(len(cache.managers))]

    def can_swap_out(self, seq_id: int) -> bool:
        """Is there room in the CPU pool for this sequence's blocks?"""
        return len(self.cache.managers[0].blocks_of(seq_id)) <= \
            self.cpu_managers[0].num_free_blocks

    def swap_out(self, seq_id: int) -> int:
        """Copy the sequence's blocks, every layer, into the CPU pool and free them in the KV
        pool. Returns the blocks moved per layer."""
        return self._move(seq_id, self.cache.managers, self.cpu_managers, "CPU swap pool")

    def swap_in(self, seq_id: int) -> int:
        """Copy a swapped sequence back into whatever KV blocks are free now."""
        return self._move(seq_id, self.cpu_managers, self.cache.managers, "KV pool")

    def _move(self, seq_id, src, dst, where) -> int:
        n = len(src[0].blocks_of(seq_id))
        if n > dst[0].num_free_blocks:               # check once: all layers move, or none
            raise OutOfBlocksError(f"the {where} has no room for sequence {seq_id}'s {n} blocks "
                                   f"per layer; nothing was moved")
        for s, d in zip(src, dst):
            move_sequence(s, d, seq_id)
        return n
