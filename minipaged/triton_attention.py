"""Stage 3b: the walk of `online_softmax.py` as a Triton kernel — `backend="triton"`.

`paged_attention_kernel` is `paged_attention_v1`'s loop, written for a GPU: every program of
the grid runs at once, each a (sequence, KV head) — and, for queries longer than one token, a
slice of the query positions — walking its row's block table and keeping a running max, a
running sum and an accumulator in registers. The grid is (B, Hk, query slices x splits):

  * one program per KV head, not per query head: with grouped-query attention the `group`
    query heads of a KV head are rows of one tile, so each block of keys is read once for
    all of them (vLLM's Triton "unified attention" kernel does the same; vLLM's CUDA v1
    kernel runs one thread block per query head and reads the keys `group` times);
  * a tile of 64 key positions per step, whatever the block size; each position looks its
    block up in the table, so any block size works: a tile spans 64 blocks of 1, four blocks
    of 16, or a quarter of one block of 256;
  * `num_splits > 1` cuts each row into that many partitions, one program each (v2,
    flash-decoding): more programs for a small batch of long rows. `combine_kernel` merges
    them after, `combine_partitions`' arithmetic with a program per output row, so the merge
    is one more launch rather than a handful of PyTorch ops each reading all the partitions.

Importing this module registers "triton" with stage 3's `flash_attn_with_kvcache`, so a
PagedCache, `generate_paged` and the Engine accept `backend="triton"`. Triton compiles for
GPUs; on a CPU it runs only through Triton's interpreter (`TRITON_INTERPRET=1` set before
triton is imported), slowly: for tests and the notebook, never for serving. It runs only when
asked for: `backend="auto"` never picks it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .paged_attention import register_backend

try:  # optional: `pip install triton` (also the `test` extra)
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


class Launch(NamedTuple):
    """How `triton_paged_attention` cuts a call into programs."""
    rows: int               # query rows per program: (query position, head of the group)
    q_per_program: int      # query positions per program: rows // group
    tile: int               # key positions per step of the loop
    splits: int             # partitions per row (1: v1)
    grid: tuple             # (B, Hk, query slices x splits)


def launch(B: int, Sq: int, Hq: int, Hk: int, num_splits: int = 0) -> Launch:
    """The grid and tile sizes for a call. tl.dot wants every side of a tile to be at least 16
    on a GPU, so a program holds at least 16 rows (a decode's group of 4 query heads fills 4).
    A tile holds 64 keys at any block size: small blocks cost table lookups, while small tiles
    would cost a loop step per 16 keys. The interpreter runs the same shapes."""
    group = Hq // Hk
    rows = max(16, _next_pow2(group))
    q_per_program = rows // group
    tile = 64
    splits = max(1, num_splits)
    return Launch(rows, q_per_program, tile, splits, (B, Hk, -(-Sq // q_per_program) * splits))


MIN_SPLIT_KEYS = 64      # a partition holds at least one tile of keys


def choose_splits(programs: int, longest: int, sms: int, min_keys: int = MIN_SPLIT_KEYS) -> int:
    """`num_splits=0` on a GPU (flash-attn's meaning of 0: the kernel decides). A grid of
    `programs` without splits leaves most of `sms` multiprocessors idle when the batch is small,
    so rows are cut until there are two programs per multiprocessor, no partition shorter than
    `min_keys` keys (`longest`: the keys of the longest row), and at most 32 partitions."""
    return max(1, min(32, -(-2 * sms // max(programs, 1)), longest // min_keys))


if triton is not None:
    @triton.jit
    def paged_attention_kernel(
            out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seqlens_k_ptr,
            m_ptr, l_ptr, scale, Sq, split_len,
            stride_qb, stride_qs, stride_qh,             # q, out: (B, Sq, Hq, D), D contiguous
            stride_kb, stride_ks, stride_kh,             # k_cache: (num_blocks, bs, Hk, D)
            stride_vb, stride_vs, stride_vh,             # v_cache: (num_blocks, bs, Hk, D)
            stride_table, Hq,                            # (int8: (..., Hk, D + 2), stage 4b)
            GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
            ROWS: tl.constexpr, Q_PER_PROGRAM: tl.constexpr, HEAD_DIM: tl.constexpr,
            D_PAD: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
            DOT_TYPE: tl.constexpr, KV_INT8: tl.constexpr):
        b, kv_head = tl.program_id(0), tl.program_id(1)
        q_slice, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
        n = tl.load(seqlens_k_ptr + b)                        # keys of this row

        # This program's rows: (query position i, head of the group), padded to ROWS.
        r = tl.arange(0, ROWS)
        i = q_slice * Q_PER_PROGRAM + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_ok = (r < Q_PER_PROGRAM * GROUP) & (i < Sq)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_at = b * stride_qb + i[:, None] * stride_qs + head[:, None] * stride_qh + d[None, :]
        rows = tl.load(q_ptr + q_at, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_TYPE)

        # The last key each row sees (bottom-right causal mask), and the keys this program
        # walks: its split of the row, no further than its last row can see.
        if CAUSAL:
            last_key = tl.minimum(n - Sq + i, n - 1)
        else:
            last_key = tl.zeros_like(i) + n - 1
        last_key = tl.where(row_ok, last_key, -1)
        start = split * split_len
        end = tl.minimum(tl.max(last_key, axis=0) + 1, start + split_len)

        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)          # running max
        l = tl.zeros([ROWS], dtype=tl.float32)                         # running sum
        acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)                # running output
        for first in range(start, end, TILE):
            pos = first + tl.arange(0, TILE)                           # key positions
            pos_ok = pos < end
            # Each position's physical block, from the row's block table; masked loads never
            # touch a slot past the row's keys, so stale data (even NaN) is never read.
            block = tl.load(block_table_ptr + b * stride_table + pos // BLOCK_SIZE,
                            mask=pos_ok, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
            k_at = block * stride_kb + slot * stride_ks + kv_head * stride_kh
            v_at = block * stride_vb + slot * stride_vs + kv_head * stride_vh
            keys = tl.load(k_cache_ptr + k_at[None, :] + d[:, None],             # (D_PAD, TILE)
                           mask=pos_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_TYPE)
            values = tl.load(v_cache_ptr + v_at[:, None] + d[None, :],           # (TILE, D_PAD)
                             mask=pos_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_TYPE)

            scores = tl.dot(rows, keys, input_precision="ieee") * scale        # (ROWS, TILE)
            if KV_INT8:     # stage 4b's slots: codes, then a float16 scale in the next 2 bytes
                scores = scores * _slot_scale(k_cache_ptr + k_at + HEAD_DIM, pos_ok)[None, :]
                values = (values * _slot_scale(v_cache_ptr + v_at + HEAD_DIM, pos_ok)[:, None]
                          ).to(DOT_TYPE)
            scores = tl.where(pos[None, :] <= last_key[:, None], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row that saw nothing
            p = tl.exp(scores - shift[:, None])
            alpha = tl.exp(m - shift)
            l = alpha * l + tl.sum(p, axis=1)
            acc = alpha[:, None] * acc + tl.dot(p.to(DOT_TYPE), values, input_precision="ieee")
            m = m_new

        if NUM_SPLITS == 1:                                    # v1: the answer, in q's dtype
            acc = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(out_ptr + q_at, acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:                                                  # v2: this partition's state
            at = ((split * tl.num_programs(0) + b) * Sq + i) * Hq + head     # (splits, B, Sq, Hq)
            tl.store(m_ptr + at, m, mask=row_ok)
            tl.store(l_ptr + at, l, mask=row_ok)
            tl.store(out_ptr + at[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _slot_scale(at, ok):
        """The float16 scales stored at byte addresses `at` (2 bytes each, little-endian), as
        float32; 0 where not `ok`."""
        lo = tl.load(at, mask=ok, other=0).to(tl.int32) & 0xFF
        hi = tl.load(at + 1, mask=ok, other=0).to(tl.int32) & 0xFF
        return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def combine_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, n_rows,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
        """`combine_partitions` for one output row (b, i, head) of the n_rows = B * Sq * Hq:
        m, l (NUM_SPLITS, n_rows), acc (NUM_SPLITS, n_rows, HEAD_DIM) in fp32, as the
        partitions stored them; out (n_rows, HEAD_DIM) in the output's dtype."""
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, SPLITS_PAD)
        p_ok = p < NUM_SPLITS
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        m = tl.load(m_ptr + p * n_rows + row, mask=p_ok, other=float("-inf"))    # (P,)
        l = tl.load(l_ptr + p * n_rows + row, mask=p_ok, other=0.0)              # (P,)
        acc = tl.load(acc_ptr + (p[:, None] * n_rows + row) * HEAD_DIM + d[None, :],
                      mask=p_ok[:, None] & d_ok[None, :], other=0.0)             # (P, D_PAD)

        M = tl.max(m, axis=0)                                       # the overall max
        shift = tl.where(M == float("-inf"), 0.0, M)
        weight = tl.exp(m - shift)                                  # (P,) each one's worth
        total = tl.sum(weight * l, axis=0)
        o = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _interpreted() -> bool:
    """True when the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(paged_attention_kernel, triton.runtime.jit.JITFunction)


def _dot_type(dtype):
    """The type the kernel multiplies its tiles in: the inputs' own, on a GPU. Triton 3.9's
    interpreter multiplies bf16 tiles as raw 16-bit integers (numpy has no bf16), so there
    bf16 tiles are widened to fp32 first: exact, since every bf16 is an fp32."""
    if dtype == torch.bfloat16 and _interpreted():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16,
            torch.bfloat16: tl.bfloat16}[dtype]


def why_not_triton(q, k_cache) -> str | None:
    """Why the Triton kernel cannot serve a call, or None if it can."""
    if triton is None:
        return ("triton is not installed: pip install triton (on a CPU also set "
                "TRITON_INTERPRET=1 before importing minipaged, to run it in Triton's interpreter)")
    if not q.is_cuda and not _interpreted():
        return ("the tensors are on the CPU, where Triton has no compiler: set TRITON_INTERPRET=1 "
                "before importing minipaged to run the kernel in Triton's interpreter (slowly: "
                "for tests), or use backend='torch'")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the Triton kernel computes in fp32, fp16 or bf16, not {q.dtype}"
    return None


def triton_paged_attention(q, k_cache, v_cache, block_table, seqlens_k, causal=True,
                           softmax_scale=None, num_splits=0):
    """Launch `paged_attention_kernel`: the "triton" backend of `flash_attn_with_kvcache`.

    Arguments as `paged_attention_v1`'s (block_table: every entry a real block). `num_splits`
    > 1 walks each row in that many partitions and merges them (flash-attn's knob of that
    name); 1 means one program per row, and 0 lets `choose_splits` decide on a GPU (in the
    interpreter, which runs programs one at a time, 0 means 1).
    """
    B, Sq, Hq, D = q.shape
    Hk = k_cache.shape[2]            # (int8 pools, stage 4b: head_dim codes + a 2-byte scale)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the Triton kernel reads each key and value as head_dim contiguous "
                         "elements: pass k_cache and v_cache with stride 1 in their last dimension")
    seqlens_k = seqlens_k.to(device=q.device, dtype=torch.int32)
    longest = int(seqlens_k.max()) if B else 0         # the host waits for the GPU here, once
    if num_splits == 0 and q.is_cuda:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = choose_splits(math.prod(launch(B, Sq, Hq, Hk).grid), longest, sms)
    how = launch(B, Sq, Hq, Hk, num_splits)
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    return run_kernels(how, q.contiguous(), k_cache, v_cache, block_table.contiguous(), seqlens_k,
                       longest, causal, scale)


def run_kernels(how: Launch, q, k_cache, v_cache, block_table, seqlens_k, longest: int,
                causal: bool, scale: float):
    """The launches of one call and nothing that waits for the GPU, so a CUDA graph can capture
    them (the GPU benchmark does): `longest`, the keys of the longest row, comes from the host.
    v1 writes the answer straight into `out`; v2's partitions write their m, l and acc in fp32,
    and `combine_kernel` merges them into `out`."""
    B, Sq, Hq, D = q.shape
    split_len = how.tile * -(-max(longest, 1) // (how.tile * how.splits))   # whole tiles
    out = torch.empty_like(q)
    parts = m = l = out                                # v1: m and l are not used
    if how.splits > 1:
        parts = torch.empty(how.splits, B, Sq, Hq, D, dtype=torch.float32, device=q.device)
        m, l = (torch.empty(how.splits, B, Sq, Hq, dtype=torch.float32, device=q.device)
                for _ in range(2))
    if B and Sq:
        paged_attention_kernel[how.grid](
            parts, q, k_cache, v_cache, block_table, seqlens_k, m, l, scale, Sq, split_len,
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0), Hq,
            GROUP=Hq // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], CAUSAL=causal,
            ROWS=how.rows, Q_PER_PROGRAM=how.q_per_program, HEAD_DIM=D,
            D_PAD=max(16, _next_pow2(D)), TILE=how.tile, NUM_SPLITS=how.splits,
            DOT_TYPE=_dot_type(q.dtype), KV_INT8=k_cache.dtype == torch.int8)
        if how.splits > 1:
            return combine(m, l, parts, out)
    return out


def combine(m, l, acc, out):
    """v2's merge on the device: `combine_partitions(m, l, acc)` written into `out` (..., D) in
    out's dtype by `combine_kernel`. m, l (P, ...) and acc (P, ..., D): fp32, contiguous."""
    D = acc.shape[-1]
    n_rows = out.numel() // D if D else 0
    if n_rows:
        combine_kernel[(n_rows,)](out, m, l, acc, n_rows, HEAD_DIM=D,
                                  D_PAD=max(16, _next_pow2(D)), NUM_SPLITS=acc.shape[0],
                                  SPLITS_PAD=max(2, _next_pow2(acc.shape[0])))
    return out


register_backend("triton", triton_paged_attention, why_not_triton)
