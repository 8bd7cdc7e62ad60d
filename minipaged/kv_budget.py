"""Stage 2: how many blocks a pool gets from a memory budget.

A block of `block_size` tokens holds, in each layer, a key and a value vector per KV head, so its
bytes are block_size * `kv_bytes_per_token` (stage 1's arithmetic). Every layer gets a pool of
the same number of blocks; together they stay within the budget. (Sizing a model's pool in
one call, `pool_blocks`, is support code: `sizing.py`.)
"""

from __future__ import annotations

import torch

from .errors import OutOfBlocksError
from .kv_cache import kv_bytes_per_token


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
