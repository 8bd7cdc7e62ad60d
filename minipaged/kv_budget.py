"""Stage 2: how many blocks a pool gets from a memory budget (every layer the same number)."""

from __future__ import annotations

import torch

from .cache_checks import check_budget
from .kv_cache import kv_bytes_per_token


def bytes_per_block(block_size: int, n_kv_heads: int, head_dim: int, dtype=torch.float32,
                    n_layers: int = 1) -> int:
    """Bytes that `block_size` tokens of K and V take in `n_layers` layers."""
    return block_size * kv_bytes_per_token(n_kv_heads, head_dim, dtype, n_layers)


def num_blocks_for_budget(budget_bytes: int, block_size: int, n_kv_heads: int, head_dim: int,
                          dtype=torch.float32, n_layers: int = 1) -> int:
    """Blocks per layer that `budget_bytes` of KV memory holds across all `n_layers` layers."""
    per_block = bytes_per_block(block_size, n_kv_heads, head_dim, dtype, n_layers)
    return check_budget(int(budget_bytes) // per_block, budget_bytes, block_size, n_layers,
                        per_block)
