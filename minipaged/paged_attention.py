"""Stage 3: paged attention — attend over a KV cache scattered across fixed-size blocks.

A paged cache stores a sequence's keys and values in blocks of `block_size` slots taken from
a shared pool, `k_cache`/`v_cache` of shape (num_blocks, block_size, n_kv_heads, head_dim).
Row b's `block_table[b]` lists its blocks in order: position `pos` of the row lives in block
`block_table[b, pos // block_size]`, at offset `pos % block_size`.

`flash_attn_with_kvcache` has flash-attn's signature and meaning, so the same call runs
flash-attn's CUDA kernel where it can, and a readable PyTorch version everywhere else:

  1. write the new k/v into their slots (through a slot mapping, vLLM's word for it);
  2. gather each row's blocks into one contiguous (B, L, n_kv_heads, head_dim) tensor;
  3. attend with the masked attention the contiguous cache uses (`attention_over_cache`).

`backend=` picks the implementation: "auto" (flash-attn's kernel where it can serve the call,
else this PyTorch version, "torch"), "flash_attn", "torch", or a kernel a later stage adds
(stage 3b's "triton" and "cpu"), which runs only when asked for by name. Which one served the
last call is `last_backend`. The checks of the inputs and the choice of backend are support
code beside the stages (`checks.py`, `backends.py`): not needed on a first read.
"""

from __future__ import annotations

import torch

from . import backends
from .backends import (BACKENDS, available_backends, flash_attn,  # noqa: F401 (the call's API)
                       flash_attn_available, pick_backend, register_backend)
from .checks import check_attention_inputs, check_blocks, check_implemented, check_lengths
from .kv_cache import attention_over_cache


def __getattr__(name):
    """`paged_attention.last_backend`: the implementation that served the last call."""
    if name == "last_backend":
        return backends.last_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, backend: str = "auto"):
    """Write `k`/`v` into the cache in place at `cache_seqlens`, then attend `q` over the cache.

    q (B, Sq, Hq, D); paged cache (num_blocks, block_size, Hk, D) with `block_table` int32
    (B, max_blocks), or flash-attn's non-paged cache (B_cache, seqlen_cache, Hk, D) with an
    optional `cache_batch_idx` int32 (B,); k, v (B, Sk, Hk, D); `cache_seqlens` an int or an
    int32 (B,) tensor of tokens already stored (None: every row fills its whole cache).
    Row b attends to cache_seqlens[b] + Sk keys; `causal` aligns the mask bottom-right.
    Returns (B, Sq, Hq, D). `backend` is one of `available_backends()`.
    """
    cache_seqlens = check_attention_inputs(q, k_cache, v_cache, k, v, cache_seqlens,
                                           cache_batch_idx, block_table, softmax_scale)
    name = pick_backend(backend, q, k_cache, block_table)
    if name == "flash_attn":
        return flash_attn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap,
            rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
            num_splits=num_splits, return_softmax_lse=return_softmax_lse)

    check_implemented(name, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                      cache_leftpad=cache_leftpad, window_size=window_size, softcap=softcap,
                      alibi_slopes=alibi_slopes, return_softmax_lse=return_softmax_lse)
    table, cache_seqlens, seqlens_k = owned_block_table(q, k_cache, k, cache_seqlens,
                                                        cache_batch_idx, block_table)
    write_new_kv(k_cache, v_cache, k, v, table, cache_seqlens)
    return BACKENDS[name].attend(q, k_cache, v_cache, table, seqlens_k, causal, softmax_scale,
                                 num_splits)


# -- the PyTorch implementation ----------------------------------------------------------------

def owned_block_table(q, k_cache, k, cache_seqlens, cache_batch_idx, block_table):
    """The block table every backend but flash-attn's reads, and the lengths before and after
    the new tokens: (table (B, n), cache_seqlens (B,), seqlens_k (B,)), all on q's device.

    The table is cut to the n blocks the longest row needs, and every entry a row does not own
    points at block 0: entries past a row's last block may be padding (-1, stale ids), and any
    real block will do there, since no backend reads a slot past seqlens_k[b].
    """
    B, device = q.shape[0], q.device
    num_blocks, block_size = k_cache.shape[:2]
    if block_table is None:
        # flash-attn's non-paged mode is the paged mode with one block per row, as long as
        # a whole cache row: block_table[b] = [cache_batch_idx[b]].
        rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(B)
        block_table = rows[:, None]                                           # (B, 1)
    block_table = block_table.to(device)
    capacity = block_table.shape[1] * block_size          # slots a row's table can address
    n_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:                             # no lengths: every row is full
        cache_seqlens = torch.full((B,), capacity, dtype=torch.int32, device=device)
    seqlens_k = cache_seqlens.long() + n_new                                  # (B,) keys per row
    check_lengths(cache_seqlens, seqlens_k, capacity, block_table.shape[1], block_size)
    L = max(seqlens_k.tolist())                           # the longest row: all we gather
    n = -(-L // block_size)                                                   # ceil(L / bs)
    owned = torch.arange(n, device=device) * block_size < seqlens_k[:, None]  # (B, n)
    table = torch.where(owned, block_table[:, :n].long(), 0)                  # (B, n)
    check_blocks(table, num_blocks)
    return table, cache_seqlens, seqlens_k


def write_new_kv(k_cache, v_cache, k, v, table, cache_seqlens) -> None:
    """Write the new k/v (B, Sk, Hk, D) in place, at positions cache_seqlens[b] ... of row b.

    New token t of row b goes to position p = cache_seqlens[b] + t, which is slot
    table[b, p // block_size] * block_size + p % block_size of the pool seen as one long array
    of slots (vLLM's slot_mapping). Like vLLM's reshape_and_cache, split the slot back into
    (block, offset) to write without assuming the pool's memory layout.
    """
    if k is None:
        return
    block_size, n_new, device = k_cache.shape[1], k.shape[1], k.device
    positions = cache_seqlens[:, None].long() + torch.arange(n_new, device=device)  # (B, Sk)
    slot_mapping = table.gather(1, positions // block_size) * block_size \
        + positions % block_size                                          # (B, Sk)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k                      # in place, (B, Sk, Hk, D) slots
    v_cache[blocks, offsets] = v


def _gather_and_attend(q, k_cache, v_cache, table, seqlens_k, causal, softmax_scale, num_splits):
    """The "torch" backend: gather each row's blocks, then attend (`num_splits` is a kernel's
    knob; it means nothing here)."""
    L = max(seqlens_k.tolist())                           # the longest row: all we gather
    k_ctx, v_ctx = _gather(k_cache, table, L), _gather(v_cache, table, L)    # (B, L, Hk, D)
    # the same attention as the contiguous cache
    return attention_over_cache(q, k_ctx, v_ctx, seqlens_k, causal=causal,
                                softmax_scale=softmax_scale)


def _gather(cache, table, L):
    """Copy the first L slots of each row's blocks into one contiguous (B, L, Hk, D) tensor.

    `index_select` along the block dimension copies each block as one piece of memory; the
    equivalent `cache[table]` goes element by element and takes twice as long on a CPU.
    """
    blocks = cache.index_select(0, table.reshape(-1))          # (B * n, block_size, Hk, D)
    return blocks.view(table.shape[0], -1, *cache.shape[2:])[:, :L]    # (B, L, Hk, D)


register_backend("torch", _gather_and_attend)
