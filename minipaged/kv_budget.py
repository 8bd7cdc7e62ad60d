"""Stage 2: how many blocks a pool gets — from a memory budget, or from the lengths it must hold
— and how many of them to keep free when admitting a sequence.

A block of `block_size` tokens holds, in each layer, a key and a value vector per KV head, so its
bytes are block_size * `kv_bytes_per_token` (stage 1's arithmetic). Every layer gets a pool of
the same number of blocks; together they stay within the budget.
"""

from __future__ import annotations

import math

import torch

from .cache_manager import CacheManager
from .errors import OutOfBlocksError, RequestError
from .kv_cache import kv_bytes_per_token

# vLLM v0's block manager admits a sequence only if 1% of the pool stays free afterwards, so the
# decode steps right after an admission do not run dry at once.
WATERMARK = 0.01


def bytes_per_block(block_size: int, n_kv_heads: int, head_dim: int, dtype=torch.float32,
                    n_layers: int = 1) -> int:
    """Bytes that `block_size` tokens of K and V take in `n_layers` layers."""
    return block_size * kv_bytes_per_token(n_kv_heads, head_dim, dtype, n_layers)


def num_blocks_for_budget(budget_bytes: int, block_size: int, n_kv_heads: int, head_dim: int,
                          dtype=torch.float32, n_layers: int = 1) -> int:
    """The number of blocks per layer that `budget_bytes` of KV memory holds across all layers.

    Every layer gets a pool of this many blocks, so the pools together take
    num_blocks * bytes_per_block(..., n_layers) <= budget_bytes.
    """
    per_block = bytes_per_block(block_size, n_kv_heads, head_dim, dtype, n_layers)
    num_blocks = int(budget_bytes) // per_block
    if num_blocks < 1:
        raise OutOfBlocksError(
            f"a KV budget of {int(budget_bytes):,} bytes holds no block: one block of {block_size} "
            f"tokens in {n_layers} layers takes {per_block:,} bytes; raise the budget or shrink "
            f"block_size")
    return num_blocks


def pool_blocks(args, dtype, block_size: int, num_blocks: int | None = None,
                kv_budget: int | None = None, lengths=()) -> int:
    """Blocks per layer for a model (`ModelArgs`): `num_blocks` if given, else as many as
    `kv_budget` bytes hold, else exactly enough for sequences of `lengths` tokens all at once."""
    if not isinstance(block_size, int) or block_size < 1:
        raise RequestError(f"block_size must be a positive integer, not {block_size!r}")
    if num_blocks is None and kv_budget is not None:
        num_blocks = num_blocks_for_budget(kv_budget, block_size, args.n_kv_heads, args.head_dim,
                                           dtype, args.n_layers)
    if num_blocks is None:
        num_blocks = sum(-(-n // block_size) for n in lengths)
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise RequestError(f"a pool needs a positive number of blocks (num_blocks, or a kv_budget "
                           f"in bytes), not {num_blocks!r}")
    return num_blocks


def kv_budget_from_free_memory(fraction: float = 0.9, device="cuda") -> int:
    """`fraction` of the memory free now on a CUDA device, in bytes; call after loading weights."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RequestError(f"free memory can only be read on a CUDA device, not {device}; "
                           f"give the KV budget in bytes instead")
    free_bytes, _total = torch.cuda.mem_get_info(device)
    return int(free_bytes * fraction)


def make_cache_managers(args, budget_bytes: int, block_size: int, max_seqs: int,
                        device="cpu", dtype=torch.float32, seed: int = 0) -> list[CacheManager]:
    """One CacheManager per layer of a model (`ModelArgs`), pools sized from a KV memory budget.

    Layer i draws its free blocks with seed `seed + i`, so the same logical block of a sequence
    lands on different physical blocks in different layers.
    """
    num_blocks = num_blocks_for_budget(budget_bytes, block_size, args.n_kv_heads, args.head_dim,
                                       dtype, args.n_layers)
    max_blocks_per_seq = min(num_blocks, -(-args.max_seq_len // block_size))
    return [CacheManager(num_blocks, block_size, args.n_kv_heads, args.head_dim, max_seqs,
                         max_blocks_per_seq, device=device, dtype=dtype, seed=seed + i)
            for i in range(args.n_layers)]


# -- keeping a few blocks free ------------------------------------------------------------------

def watermark_blocks(num_blocks: int, watermark: float = WATERMARK) -> int:
    """Blocks to leave free after admitting a sequence: `watermark` of the pool, at least one
    (none when the watermark is 0)."""
    return max(1, math.ceil(watermark * num_blocks)) if watermark else 0


def admits(need: int, num_free: int, reserve: int, alone: bool) -> bool:
    """May a sequence that needs `need` blocks start now? Only if `reserve` blocks (the
    watermark) stay free afterwards — unless it would run alone, when it may take them all."""
    return need <= num_free if alone else need + reserve <= num_free
