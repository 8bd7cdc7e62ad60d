"""Stage 3: stage 1's static batch on the paged cache — `generate_paged`, the driver, kept beside
`paged_cache.py` so that the cache itself reads on its own."""

from __future__ import annotations

import torch

from .generation import generate_static
from .paged_cache import PagedCache
from .sizing import static_pool_blocks


@torch.inference_mode()
def generate_paged(model, prompts, max_new_tokens, block_size: int = 16,
                   num_blocks: int | None = None, kv_budget: int | None = None, seed: int = 0,
                   backend: str = "auto", max_seq_len: int | None = None,
                   cache_class=None, **options):
    """Stage 1's static batch on a PagedCache (`cache_class`, e.g. the speed layer's) of
    `num_blocks` blocks per layer, or as many as `kv_budget` bytes hold, or just enough for every
    prompt at full length. Other options (temperature, stop_tokens, ...) are `generate_static`'s."""
    max_seq_len = max_seq_len or model.args.max_seq_len
    p = next(model.parameters())
    blocks = static_pool_blocks(model, prompts, max_new_tokens, max_seq_len, block_size,
                                num_blocks, kv_budget, options)
    cache = (cache_class or PagedCache)(model.args, blocks, block_size, len(prompts),
                                        max_seq_len, device=p.device, dtype=p.dtype, seed=seed,
                                        backend=backend)
    return generate_static(model, prompts, max_new_tokens, cache=cache, seed=seed,
                           max_seq_len=max_seq_len, **options)
