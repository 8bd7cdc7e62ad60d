"""How many KV blocks fit in a memory budget: the arithmetic that sizes stage 2's pools.

A block of `block_size` tokens holds, in each layer, a key and a value vector per KV head, so
its bytes are 2 * n_layers * block_size * n_kv_heads * head_dim * bytes per element. Every
layer gets a pool of the same number of blocks; together they stay within the budget.
"""

from __future__ import annotations

import torch

from .cache_manager import CacheManager
from .errors import OutOfBlocksError, RequestError


def bytes_per_block(block_size: int, n_kv_heads: int, head_dim: int, dtype=torch.float32,
                    n_layers: int = 1) -> int:
    """Bytes that `block_size` tokens of K and V take in `n_layers` layers.

    2 (K and V) * n_layers * block_size * n_kv_heads * head_dim * bytes per element.
    """
    return 2 * n_layers * block_size * n_kv_heads * head_dim * dtype.itemsize


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
    lands on different physical blocks in different layers, as in the seed code.
    """
    num_blocks = num_blocks_for_budget(budget_bytes, block_size, args.n_kv_heads, args.head_dim,
                                       dtype, args.n_layers)
    max_blocks_per_seq = min(num_blocks, -(-args.max_seq_len // block_size))
    return [CacheManager(num_blocks, block_size, args.n_kv_heads, args.head_dim, max_seqs,
                         max_blocks_per_seq, device=device, dtype=dtype, seed=seed + i)
            for i in range(args.n_layers)]
