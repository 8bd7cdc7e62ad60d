"""Support, not a stage (not needed on a first read): sizing a model's pools in one call.

`pool_blocks` is what the engines and the chat call, `static_pool_blocks` stage 3's static
generation; the arithmetic is stage 2's (`kv_budget.py`).
"""

from __future__ import annotations

import torch

from .cache_manager import CacheManager
from .checks import check_request
from .errors import OutOfBlocksError, RequestError
from .kv_budget import num_blocks_for_budget
from .kv_formats import stored_layout


def pool_blocks(args, dtype, block_size: int, num_blocks: int | None = None,
                kv_budget: int | None = None, lengths=(), kv_dtype: str | None = None) -> int:
    """Blocks per layer for a model (`ModelArgs`): `num_blocks` if given, else as many as
    `kv_budget` bytes hold (in slots of `kv_dtype`: int8 codes and scales, stage 4b), else exactly
    enough for sequences of `lengths` tokens all at once."""
    if not isinstance(block_size, int) or block_size < 1:
        raise RequestError(f"block_size must be a positive integer, not {block_size!r}")
    if num_blocks is None and kv_budget is not None:
        slot, store = stored_layout(args.head_dim, dtype, kv_dtype)
        num_blocks = num_blocks_for_budget(kv_budget, block_size, args.n_kv_heads, slot, store,
                                           args.n_layers)
    if num_blocks is None:
        num_blocks = sum(-(-n // block_size) for n in lengths)
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise RequestError(f"a pool needs a positive number of blocks (num_blocks, or a kv_budget "
                           f"in bytes), not {num_blocks!r}")
    return num_blocks


def static_pool_blocks(model, prompts, max_new_tokens, max_seq_len: int, block_size: int,
                       num_blocks: int | None, kv_budget: int | None, options: dict) -> int:
    """`pool_blocks` for a static batch (stage 3's `generate_paged`: its request checked first,
    `options` its temperature and top_p), which cannot wait or preempt (that is stage 5): a pool
    too small for every prompt at its full length at once is refused."""
    limits = check_request(model, prompts, max_new_tokens, options.get("temperature", 0.0),
                           options.get("top_p", 1.0), max_seq_len)
    lengths = [len(p) + m for p, m in zip(prompts, limits)]
    args, dtype = model.args, next(model.parameters()).dtype
    blocks = pool_blocks(args, dtype, block_size, num_blocks, kv_budget, lengths)
    worst = pool_blocks(args, dtype, block_size, lengths=lengths)
    if worst > blocks:
        raise OutOfBlocksError(
            f"these prompts may need {worst} blocks per layer at once but the pool has "
            f"{blocks}: a static batch cannot wait for blocks. Give the pool more memory, or "
            f"serve them with stage 5's engine (minipaged.generate(..., cache='paged')), which "
            f"admits and preempts.")
    return blocks


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
