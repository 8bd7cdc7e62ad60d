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

from minipaged import cpu_attention
from minipaged import triton_attention as ta
from minipaged.paged_attention import flash_attn_with_kvcache


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
