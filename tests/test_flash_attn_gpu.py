"""flash-attn's CUDA kernel and the PyTorch path compute the same paged attention.

Runs only where both a CUDA GPU and the flash_attn package are present (a lent GPU machine):
a Llama-3-8B-like layer (32 query heads, 8 kv heads, head_dim 128), bf16, block 256,
block tables scattered over the pool with randperm, lengths 100-1000, new k/v written in place.
"""

import logging

import pytest
import torch

from minipaged import backends
from minipaged.paged_attention import flash_attn_with_kvcache

pytestmark = pytest.mark.skipif(
    not backends.flash_attn_available(),
    reason="needs a CUDA GPU and flash-attn (pip install flash-attn --no-build-isolation)")

DEVICE = "cuda"


def scattered_case(seed, Sq, block_size=256, B=4, Hq=32, Hk=8, D=128):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 1001, (B,), generator=gen, dtype=torch.int32)
    max_blocks = -(-(1000 + Sq) // block_size)
    num_blocks = 2 * B * max_blocks
    pool = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16)
    return dict(q=randn(B, Sq, Hq, D), k_cache=randn(num_blocks, block_size, Hk, D),
                v_cache=randn(num_blocks, block_size, Hk, D), k=randn(B, Sq, Hk, D),
                v=randn(B, Sq, Hk, D), cache_seqlens=lengths.to(DEVICE),
                block_table=pool[:B * max_blocks].view(B, max_blocks).to(DEVICE), causal=True)


def as_float32(case):
    return {name: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t)
            for name, t in case.items()}


@pytest.mark.parametrize("Sq", [1, 16], ids=["decode", "chunk-of-16"])
def test_flash_attn_kernel_matches_the_torch_path(Sq):
    flash_case = scattered_case(seed=Sq, Sq=Sq)
    torch_case = as_float32(flash_case)              # the PyTorch path in fp32: the reference
    out = flash_attn_with_kvcache(**flash_case, backend="flash_attn")
    assert backends.last_backend == "flash_attn"
    expected = flash_attn_with_kvcache(**torch_case, backend="torch")
    assert backends.last_backend == "torch"
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    # both wrote the same new k/v into the same slots (bf16 -> fp32 -> bf16 is exact)
    assert torch.equal(flash_case["k_cache"], torch_case["k_cache"].bfloat16())
    assert torch.equal(flash_case["v_cache"], torch_case["v_cache"].bfloat16())


def test_auto_uses_the_kernel_at_block_256_and_the_torch_path_at_block_16(caplog, monkeypatch):
    """The same tokens laid out in blocks of 16: flash-attn 2 refuses that size, so `auto` falls
    back to PyTorch (and warns), and the answer does not change."""
    case = scattered_case(seed=3, Sq=1)
    small = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    small["k_cache"] = small["k_cache"].view(-1, 16, *small["k_cache"].shape[2:])
    small["v_cache"] = small["v_cache"].view(-1, 16, *small["v_cache"].shape[2:])
    # big block j, slot i  ==  small block 16 * j + i // 16, slot i % 16
    sixteenths = torch.arange(16, device=DEVICE, dtype=torch.int32)
    small["block_table"] = (case["block_table"][:, :, None] * 16 + sixteenths).flatten(1)

    out_256 = flash_attn_with_kvcache(**case)
    assert backends.last_backend == "flash_attn"
    monkeypatch.setattr(backends, "_announced", set())      # the fallback's warning, afresh
    with caplog.at_level(logging.WARNING, logger="minipaged.paged_attention"):
        out_16 = flash_attn_with_kvcache(**small)
    assert backends.last_backend == "torch"
    assert any("multiple of 256" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out_16.float(), out_256.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(small["k_cache"].view_as(case["k_cache"]), case["k_cache"])
