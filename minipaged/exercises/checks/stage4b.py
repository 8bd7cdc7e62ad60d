"""Stage 4b's checks: int8 slots, against a quantizer written here in numpy.

The reference is the rule the lesson states, computed independently: per row of the last axis,
scale = max|x| / 127 rounded to float16 (at most float16's largest number), codes =
round-half-even(x / scale) with the scale as stored, clipped to [-127, 127]; a row whose scale
is 0 gets codes 0. Reading back is code x scale, which float32 holds exactly (7 bits times 11).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ...cache_manager import PAD_BLOCK
from ...kv_quant import dequantize_int8, flash_attn_with_int8_kvcache, quantize_int8
from ..grader import expect
from .common import close, dense_attention, prop


def reference_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (..., D) int8, scales (...,) float16) of float rows x (..., D), in numpy."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.minimum(amax / np.float32(127), np.float32(65504)).astype(np.float16)
    s = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s > 0, np.clip(np.rint(x / s), -127, 127), 0).astype(np.int8)
    return codes, scale[..., 0]


def reference_slots(x) -> torch.Tensor:
    """The bytes of int8 slots (..., D + 2): the reference's codes, then its scale's 2 bytes
    (little-endian, as the pool stores them)."""
    codes, scale = reference_quantize(x.float().numpy())
    scale_bytes = np.ascontiguousarray(scale[..., None]).view(np.int8)          # (..., 2)
    return torch.from_numpy(np.concatenate([codes, scale_bytes], -1))


def reference_values(slots: torch.Tensor) -> np.ndarray:
    """float64 values of int8 slots (..., D + 2): code x the float16 scale after the codes."""
    a = slots.numpy()
    scale = np.ascontiguousarray(a[..., -2:]).view(np.float16).astype(np.float64)  # (..., 1)
    return a[..., :-2].astype(np.float64) * scale


MAGNITUDES = st.sampled_from([0.0, 1e-9, 1e-6, 3e-3, 1.0, 70.0, 5e3, 2e7, 1e10])


@st.composite
def float_rows(draw):
    """Rows (R, H, D) (D even, as head dims are: a slot's scale then starts at an even byte) of floats of magnitudes from 0 to past float16's range, some with one
    outlier channel, in float32, float64 or bfloat16."""
    R, H = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([2, 4, 8, 32]))
    seed = draw(st.integers(0, 10**6))
    mags = draw(st.lists(MAGNITUDES, min_size=R * H, max_size=R * H))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, H, D, generator=g, dtype=torch.float64) * \
        torch.tensor(mags, dtype=torch.float64).view(R, H, 1)
    if draw(st.booleans()):                                  # an outlier channel, as keys have
        x[..., draw(st.integers(0, D - 1))] *= 100
    return x.to(dtype)


def _show(x) -> str:
    return f"rows of shape {tuple(x.shape)} in {x.dtype} (largest |x| {float(x.abs().max()):.3g})"


@prop(60)
@example(torch.zeros(2, 1, 4))                                # rows of zeros: scale 0, codes 0
@example(torch.tensor([[[1.0, -0.5, 0.25, 127.0]]]))          # codes exactly representable
@example(torch.tensor([[[100.0, 0.3, -0.8, 0.5]]]))           # an outlier: small codes
@example(torch.tensor([[[1e-9, -2e-9, 0.0, 5e-10]]]))         # the scale underflows to 0
@example(torch.tensor([[[3e9, -1.0, 2.0, 1e9]]]))             # past float16's largest scale
@given(float_rows())
def quantize_matches_the_reference(x):
    """quantize_int8 gives int8 slots (..., D + 2): each row's codes, then its float16 scale's
    two bytes, equal to the reference's byte for byte; reading them back every value is within
    half a scale of the input (where the scale is a normal float16: a subnormal one is coarse
    enough to clip the largest value, and one at float16's largest clips every large one)."""
    packed = quantize_int8(x)
    D = x.shape[-1]
    expect(isinstance(packed, torch.Tensor) and packed.dtype == torch.int8 and
           tuple(packed.shape) == (*x.shape[:-1], D + 2),
           f"{_show(x)}: quantize_int8 should return an int8 tensor of shape "
           f"{(*x.shape[:-1], D + 2)} (the codes, then the scale's 2 bytes), got "
           f"{getattr(packed, 'dtype', type(packed).__name__)} "
           f"{tuple(getattr(packed, 'shape', ()))}")
    want = reference_slots(x)
    codes, want_codes = packed[..., :D], want[..., :D]
    got_scale = packed[..., D:].contiguous().view(torch.float16)[..., 0]
    want_scale = want[..., D:].contiguous().view(torch.float16)[..., 0]
    bad = (got_scale != want_scale) & ~(got_scale.isnan() & want_scale.isnan())
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        expect(False, f"{_show(x)}: row {i}, whose largest |x| is "
                      f"{float(x[i].abs().max()):.6g}, got scale {float(got_scale[i]):.6g}; "
                      f"max|x| / 127 as a float16 (at most 65504) is "
                      f"{float(want_scale[i]):.6g}, stored in the last 2 bytes")
    wrong = (codes != want_codes).any(-1)
    if wrong.any():
        i = tuple(wrong.nonzero()[0].tolist())
        expect(False, f"{_show(x)}: row {i} with scale {float(want_scale[i]):.6g} got codes "
                      f"{codes[i].tolist()}, expected {want_codes[i].tolist()} (round(x / "
                      f"scale) with the float16 scale as stored, clipped to [-127, 127]; a row "
                      f"whose scale is 0 gets codes 0)")
    back = torch.from_numpy(reference_values(packed))
    fits = (want_scale.double() >= 2 ** -14) & (want_scale.double() < 65504)   # normal scales
    err = (back - x.double()).abs().amax(-1)
    expect(bool((err[fits] <= want_scale.double()[fits] / 2 * (1 + 1e-6)).all()),
           f"{_show(x)}: a value read back is further than half a scale from what was written")


@st.composite
def int8_slots(draw):
    """Slots (R, H, D + 2) of random codes in [-127, 127] and random finite float16 scales
    (subnormal ones and zero included), and a dtype to read them as."""
    R, H, D = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 32]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 10**6)))
    codes = torch.randint(-127, 128, (R, H, D), generator=g, dtype=torch.int8)
    bits = torch.randint(0, 0x7C00, (R, H, 1), generator=g, dtype=torch.int32)  # finite, >= 0
    bits = bits | (torch.randint(0, 2, (R, H, 1), generator=g, dtype=torch.int32) << 15)
    scales = bits.to(torch.int16).view(torch.float16)
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    return torch.cat([codes, scales.view(torch.int8)], -1), dtype


@prop(60)
@given(int8_slots())
def dequantize_matches_the_reference(case):
    """dequantize_int8(slots, dtype) gives (..., D) values of `dtype`: each code times the
    float16 scale stored in its slot's last 2 bytes, the product rounded once to `dtype`."""
    slots, dtype = case
    D = slots.shape[-1] - 2
    what = f"slots of shape {tuple(slots.shape)} read as {dtype}"
    got = dequantize_int8(slots, dtype)
    expect(isinstance(got, torch.Tensor) and got.dtype == dtype and
           tuple(got.shape) == (*slots.shape[:-1], D),
           f"{what}: dequantize_int8 should return {dtype} of shape {(*slots.shape[:-1], D)}, "
           f"got {getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}")
    want = torch.from_numpy(reference_values(slots)).to(dtype)
    wrong = (got != want).any(-1)
    if wrong.any():
        i = tuple(wrong.nonzero()[0].tolist())
        scale = float(slots[i][D:].contiguous().view(torch.float16))
        expect(False, f"{what}: slot {i} has codes {slots[i][:D].tolist()[:8]}... and scale "
                      f"{scale:.6g} (its last 2 bytes, a float16); read back as "
                      f"{got[i].tolist()[:8]}..., expected code x scale = "
                      f"{want[i].tolist()[:8]}...")


@st.composite
def int8_calls(draw):
    block_size, B = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    Hk = draw(st.sampled_from([1, 2]))
    Hq = Hk * draw(st.sampled_from([1, 2]))
    stored = draw(st.lists(st.integers(0, 9), min_size=B, max_size=B))
    return block_size, B, Hq, Hk, stored, draw(st.integers(1, 3)), draw(st.integers(0, 10**6))


@prop(30)
@given(int8_calls())
def int8_attention_reads_what_was_written(case):
    """Through `flash_attn_with_int8_kvcache` (your quantize on write, your dequantize on
    read): each new token's slot holds the reference's bytes, and the output is dense float64
    attention over the reference's reading of every stored and new token."""
    block_size, B, Hq, Hk, stored, new, seed = case
    D, g = 8, torch.Generator().manual_seed(seed)
    need = [-(-(n + new) // block_size) for n in stored]
    num_blocks = sum(need) + 2
    perm = iter(torch.randperm(num_blocks, generator=g).tolist())
    table = torch.full((B, max(need) + 1), PAD_BLOCK, dtype=torch.int32)
    for b in range(B):
        for j in range(need[b]):
            table[b, j] = next(perm)
    k_cache = torch.randint(-127, 128, (num_blocks, block_size, Hk, D + 2), generator=g,
                            dtype=torch.int8)                     # free slots: random bytes
    v_cache = k_cache.clone()
    old_k = [reference_slots(torch.randn(n, Hk, D, generator=g) * 3) for n in stored]
    old_v = [reference_slots(torch.randn(n, Hk, D, generator=g)) for n in stored]
    for b in range(B):                           # what the rows stored before: the reference's
        for p in range(stored[b]):
            blk, off = int(table[b, p // block_size]), p % block_size
            k_cache[blk, off], v_cache[blk, off] = old_k[b][p], old_v[b][p]
    q = torch.randn(B, new, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, new, Hk, D, generator=g) * 3
    v = torch.randn(B, new, Hk, D, generator=g)
    out = flash_attn_with_int8_kvcache(q, k_cache, v_cache, k, v,
                                       torch.tensor(stored, dtype=torch.int32), table,
                                       backend="torch")
    what = f"block_size={block_size}, rows storing {stored} tokens, {new} new each"
    for b in range(B):
        for t in range(new):
            p = stored[b] + t
            blk, off = int(table[b, p // block_size]), p % block_size
            expect(torch.equal(k_cache[blk, off], reference_slots(k[b, t])) and
                   torch.equal(v_cache[blk, off], reference_slots(v[b, t])),
                   f"{what}: new token {t} of row {b} should be written to block {blk}, offset "
                   f"{off} as the reference's codes and scale, and is not")
        keys = torch.from_numpy(reference_values(torch.cat([old_k[b], reference_slots(k[b])])))
        values = torch.from_numpy(reference_values(torch.cat([old_v[b], reference_slots(v[b])])))
        want = dense_attention(q[b], keys, values)
        expect(close(out[b], want, 1e-6),
               f"{what}: row {b}'s attention is off by {float((out[b] - want).abs().max()):.3g} "
               f"from dense attention over the tokens as the reference reads them back")
