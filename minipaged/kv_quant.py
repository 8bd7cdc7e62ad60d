"""Stage 4b: KV in fewer bytes — int8 blocks that carry their own scales.

Stage 4 measures how much of the KV pool holds tokens; the other lever is how many bytes a token
takes. Here each token's K (and V) row of each head, `head_dim` floats, is stored as `head_dim`
int8 codes followed by its scale as one float16, in the same slot of the same block:

    slot (block, offset, head) = [ q_0 q_1 ... q_{D-1} | scale ]      D int8 + 2 bytes
    scale = max|x| / 127,  q_i = round(x_i / scale),  x_i ≈ q_i * scale

so the pool is an int8 tensor `(num_blocks, block_size, n_kv_heads, head_dim + 2)` and everything
that moves a block (copy-on-write, swap, a prefix hit, a beam fork) moves its scales with it,
without knowing they are there — the layout of llama.cpp's `block_q8_0` (an fp16 scale beside
its 32 int8 values). One scale per token and head, not one per block: a block fills a token at
a time, and a block-wide scale would have to grow, re-quantizing every token already written,
whenever a larger value arrived. Here a write never touches another token, and a rollback
(stage 7) needs nothing: the slots it forgets are written again, with new scales.

The attention quantizes where a slot is written and dequantizes what it gathers: stage 3's
`flash_attn_with_kvcache`, with `quantize_int8` on the way in and `dequantize_int8` on the way
out. `PagedCache(..., kv_dtype="int8")` (and `generate(..., cache="paged", kv_dtype="int8")`,
the engines) holds such a pool.
"""

from __future__ import annotations

import torch

from .backends import pick_backend
from .cpu_attention import decode_attention
from .kv_cache import attention_over_cache
from .kv_formats import register_kv_format
from .paged_attention import _gather, owned_block_table, write_new_kv
from .triton_attention import triton_paged_attention

SCALE_BYTES = 2                # one float16 scale per token, head and K or V
QMAX = 127                     # codes in [-127, 127]: symmetric, so -x quantizes to -q


def int8_layout(head_dim: int, dtype=None) -> tuple[int, torch.dtype]:
    """(last dimension, dtype) of an int8 pool's slots: head_dim codes + a 2-byte scale."""
    return head_dim + SCALE_BYTES, torch.int8


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """(..., D) floats -> (..., D + 2) int8: each row's codes, then its float16 scale's bytes
    (max|x| / 127, at most float16's largest). A row whose scale is 0 (zeros, or too small for
    a float16) gets codes 0; every value comes back within scale / 2."""
    amax = x.abs().amax(-1, keepdim=True).float()                          # (..., 1)
    scale = (amax / QMAX).clamp(max=torch.finfo(torch.float16).max).half()  # (..., 1) stored
    s = scale.float()                         # quantize with the scale as stored, not as computed
    codes = torch.where(s > 0, x.float() / s, 0).round().clamp(-QMAX, QMAX)  # (..., D)
    return torch.cat([codes.to(torch.int8), scale.view(torch.int8)], -1)     # (..., D + 2)


def dequantize_int8(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(..., D + 2) int8 -> (..., D) `dtype`: codes times their row's scale."""
    D = packed.shape[-1] - SCALE_BYTES                                      # head_dim
    scale = packed[..., D:].view(torch.float16).float()                     # (..., 1)
    return (packed[..., :D].float() * scale).to(dtype)                      # (..., D)


def split_int8(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (..., D) int8, scales (...,) float32): what a slot holds, for the drawings."""
    scale = packed[..., -SCALE_BYTES:].view(torch.float16)[..., 0].float()
    return packed[..., :-SCALE_BYTES], scale


def flash_attn_with_int8_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                 causal: bool = True, softmax_scale=None, backend: str = "auto"):
    """Stage 3's `flash_attn_with_kvcache` (its "torch" path) over int8 pools
    (num_blocks, block_size, Hk, D + 2): the new k/v (B, Sk, Hk, D) are quantized into their
    slots, then each row's blocks are gathered and dequantized to q's dtype and attended, the
    new tokens included (as stored, so every token is read the same way). (B, Sq, Hq, D).
    backend="cpu": a decode step goes to stage 3b's C kernel, and backend="triton" any step to
    stage 3b's Triton kernel; both read codes and scales where they lie."""
    table, seqlens_k = owned_block_table(q, k_cache, k, cache_seqlens, block_table)
    write_new_kv(k_cache, v_cache, quantize_int8(k), quantize_int8(v), table, cache_seqlens)
    if backend == "cpu" and q.shape[1] == 1 and q.device.type == "cpu":
        return decode_attention(q, k_cache, v_cache, table, seqlens_k,
                                softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5)
    if backend == "triton":
        pick_backend("triton", q, k_cache, table)    # a sentence if Triton cannot run here
        return triton_paged_attention(q, k_cache, v_cache, table, seqlens_k, causal,
                                      softmax_scale)
    L = max(seqlens_k.tolist())                                 # the longest row: all we gather
    k_ctx = dequantize_int8(_gather(k_cache, table, L), q.dtype)           # (B, L, Hk, D)
    v_ctx = dequantize_int8(_gather(v_cache, table, L), q.dtype)
    return attention_over_cache(q, k_ctx, v_ctx, seqlens_k, causal=causal,
                                softmax_scale=softmax_scale)               # (B, Sq, Hq, D)


register_kv_format("int8", int8_layout, flash_attn_with_int8_kvcache,    # kv_dtype="int8"
                   backends=("auto", "torch", "cpu", "triton"), write=quantize_int8,
                   read=dequantize_int8)
