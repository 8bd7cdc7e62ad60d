"""Stage 3b's Triton kernel: `flash_attn_with_kvcache(..., backend="triton")` gives the gather
path's answer on random block tables, and a model generating on it gives the contiguous
cache's tokens.

Without a CUDA GPU the kernel runs in Triton's interpreter (conftest.py switches it on before
triton is imported): slow, so the cases are small. With one, it runs compiled, on CUDA tensors.
The semantic tests of flash_attn_with_kvcache (test_paged_attention.py) run on this backend too.
"""

import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import check_paged_generation
from test_paged_attention import attend, random_paged_case

from minipaged import triton_attention as ta
from minipaged.online_softmax import combine_partitions
from minipaged.paged_attention import flash_attn_with_kvcache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def clone(case):
    return {k: (t.clone() if torch.is_tensor(t) else t) for k, t in case.items()}


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("seed", range(10))
def test_kernel_matches_the_gather_path(block_size, seed):
    """Random block tables, GQA, lengths 0 and exact block multiples, decode and chunks with the
    bottom-right causal mask, new k/v written first — one program per row, or split in 2-3."""
    case, _ = random_paged_case(500 * block_size + seed, block_size)
    expected, k_after, v_after = attend(clone(case), "torch")
    num_splits = random.Random(seed).choice([0, 1, 2, 3])
    out, k_cache, v_cache = attend(case, "triton", num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, k_after) and torch.equal(v_cache, v_after)


def llama_like_case(seed, Sq, cache_len, block_size=16, Hq=8, Hk=1, D=64, B=2):
    """A grouped layer (8 query heads on one KV head, as in Llama 3 70B), scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-(cache_len + Sq) // block_size)
    num_blocks = B * max_blocks + 3
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    return dict(q=randn(B, Sq, Hq, D), k_cache=randn(num_blocks, block_size, Hk, D),
                v_cache=randn(num_blocks, block_size, Hk, D), k=randn(B, Sq, Hk, D),
                v=randn(B, Sq, Hk, D),
                cache_seqlens=torch.tensor([cache_len, cache_len // 3], dtype=torch.int32),
                block_table=torch.randperm(num_blocks, generator=gen,
                                           dtype=torch.int32)[:B * max_blocks].view(B, -1),
                causal=True)


@pytest.mark.parametrize("Sq,cache_len", [(1, 70), (5, 40), (11, 0)],
                         ids=["decode", "chunk", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_and_query_lengths(Sq, cache_len, dtype):
    """fp32 to fp32 rounding; fp16/bf16 within their rounding of the fp32 answer on the same
    (rounded) inputs. With 8 query heads to a KV head, a program holds 2 query positions: a
    prefill of 11 spans 6 query slices of the grid."""
    case = llama_like_case(Sq, Sq, cache_len)
    case = {k: (t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t)
            for k, t in case.items()}
    as_fp32 = {k: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t)
               for k, t in case.items()}
    expected = attend(as_fp32, "torch")[0]
    out = attend(case, "triton")[0]
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_a_prefill_is_plain_causal_attention():
    """An empty cache and a whole prompt: the answer of torch's own causal attention."""
    case = llama_like_case(5, 29, 0, block_size=8, Hq=4, Hk=2, D=24)   # head_dim 24: padded
    case["cache_seqlens"] = torch.zeros(2, dtype=torch.int32)
    q, k, v = (case[name].transpose(1, 2) for name in ("q", "k", "v"))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(case, "triton")[0], expected, atol=1e-5, rtol=1e-5)


def test_a_query_that_sees_no_key_gets_zeros():
    """More queries than keys under the bottom-right causal mask: the first queries see none."""
    case = llama_like_case(6, 5, 0, Hq=2, Hk=2, D=16)
    case.update(k=case["k"][:, :2], v=case["v"][:, :2],
                cache_seqlens=torch.zeros(2, dtype=torch.int32))
    out = attend(clone(case), "triton")[0]
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    torch.testing.assert_close(out, attend(case, "torch")[0], atol=1e-5, rtol=1e-5)


def partitions(seed, P, B=2, Sq=3, Hq=4, D=24):
    """What v2's partitions store: m, l (P, B, Sq, Hq) and acc (P, B, Sq, Hq, D) in fp32, with
    maxima far apart (exp(m - M) underflows for some), partitions that saw no key (m = -inf,
    l = 0, acc = 0), and one output row that no partition saw a key for."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(P, B, Sq, Hq, generator=gen) * 40
    l = torch.rand(P, B, Sq, Hq, generator=gen) * 30 + 1
    acc = torch.randn(P, B, Sq, Hq, D, generator=gen) * l[..., None]
    empty = torch.rand(P, B, Sq, Hq, generator=gen) < 0.3
    empty[:, 1, 2, 3] = True
    m[empty], l[empty], acc[empty] = float("-inf"), 0.0, 0.0
    return m, l, acc


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_merge_kernel_is_combine_partitions(P, dtype):
    """`combine_kernel` against the readable merge, `combine_partitions`: fp32 to fp32 rounding;
    fp16 and bf16 within one unit of their last place (the interpreter rounds bf16 its own way);
    a row no partition saw a key for gets zeros. 3 and 5 partitions pad the kernel's tile, as
    a head_dim of 24 does."""
    m, l, acc = (t.to(DEVICE) for t in partitions(seed=P, P=P))
    out = ta.combine(m, l, acc, torch.empty(acc.shape[1:], dtype=dtype, device=DEVICE))
    expected = combine_partitions(m, l, acc)
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert torch.equal(out[1, 2, 3], torch.zeros_like(out[1, 2, 3]))


def test_v2_merges_with_the_kernel_even_where_partitions_are_empty(monkeypatch):
    """7 partitions of rows 70 and 23 keys long: a partition is whole tiles of 64 keys, so most
    hold no key. The backend merges with `combine` once per call, and equals the gather path."""
    calls, merge = [], ta.combine
    monkeypatch.setattr(ta, "combine", lambda *args: calls.append(1) or merge(*args))
    case = llama_like_case(9, 1, 70)
    expected = attend(clone(case), "torch")[0]
    torch.testing.assert_close(attend(case, "triton", num_splits=7)[0], expected,
                               atol=1e-5, rtol=1e-5)
    assert len(calls) == 1


def test_choose_splits_fills_the_gpu_with_partitions_of_a_tile_or_more():
    """num_splits=0 on a GPU: two programs per multiprocessor, none shorter than 64 keys, at
    most 32. One Llama-3-8B row (8 KV heads) on 132 multiprocessors:"""
    assert ta.choose_splits(8, 8192, 132) == 32            # capped
    assert ta.choose_splits(8, 1024, 132) == 16            # partitions of one tile
    assert ta.choose_splits(8, 100, 132) == 1              # too short to split
    assert ta.choose_splits(8 * 64, 8192, 132) == 1        # 64 rows fill the GPU already
    assert ta.choose_splits(8 * 8, 8192, 132) == 5
    assert ta.choose_splits(0, 0, 132) == 1                # an empty batch


def test_missing_triton_is_a_sentence(monkeypatch):
    monkeypatch.setattr(ta, "triton", None)
    case, _ = random_paged_case(3, 16)
    with pytest.raises(ValueError, match="pip install triton"):
        flash_attn_with_kvcache(**case, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU without the interpreter does")
def test_on_a_cpu_without_the_interpreter_auto_is_not_triton_and_triton_says_how():
    code = ("import torch\n"
            "from minipaged.paged_attention import flash_attn_with_kvcache\n"
            "from minipaged import backends\n"
            "args = (torch.randn(1, 1, 2, 8), torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8))\n"
            "kw = dict(cache_seqlens=torch.tensor([5], dtype=torch.int32),\n"
            "          block_table=torch.tensor([[1, 0]], dtype=torch.int32))\n"
            "flash_attn_with_kvcache(*args, **kw)\n"
            "print(backends.last_backend)\n"
            "try:\n"
            "    flash_attn_with_kvcache(*args, **kw, backend='triton')\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.splitlines()
    # stage 3's "auto" on a CPU is its PyTorch path: never triton, never the C kernel
    assert lines[0] == "torch", done.stderr
    assert "TRITON_INTERPRET=1" in lines[1] and "backend='torch'" in lines[1]


def test_paged_generation_on_the_kernel_gives_the_contiguous_caches_tokens():
    check_paged_generation("triton", 4, device="cuda" if torch.cuda.is_available() else "cpu")
