"""Stage 3b's C kernel (`backend="cpu"`) on shapes the random cases of test_paged_attention.py
do not draw: Llama-like heads (64 wide, 3 to 8 query heads a KV head), blocks longer than the
kernel's tile, bf16 pools, many threads; and what building it must not do to the process.

The semantic tests of flash_attn_with_kvcache (test_paged_attention.py) run on this backend
too, against the dense reference written there.
"""

import math
import sys

import pytest
import torch
from conftest import check_paged_generation
from test_paged_attention import attend, dense_reference, paged_locate

from minipaged import cpu_attention


def decode_case(seed, lengths, block_size, Hq, Hk, D, dtype, stale=float("nan")):
    """One decode step of rows of `lengths` keys stored (the new one is written by the call),
    their blocks drawn at random from a pool whose every other slot holds `stale`."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    width = max(-(-(n + 1) // block_size) for n in lengths)
    num_blocks = B * width + 5
    table = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)[:B * width].view(B, -1)
    k_cache = torch.full((num_blocks, block_size, Hk, D), stale)
    v_cache = torch.full((num_blocks, block_size, Hk, D), stale)
    for b, n in enumerate(lengths):                      # the slots a row owns: real keys
        for p in range(n):
            k_cache[table[b, p // block_size], p % block_size] = torch.randn(Hk, D, generator=gen)
            v_cache[table[b, p // block_size], p % block_size] = torch.randn(Hk, D, generator=gen)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    return dict(q=randn(B, 1, Hq, D), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype),
                k=randn(B, 1, Hk, D), v=randn(B, 1, Hk, D),
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=table,
                causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 40, 256])
@pytest.mark.parametrize("Hq,Hk,D", [(9, 3, 64), (8, 1, 64), (4, 4, 32), (6, 2, 80)])
def test_a_decode_step_matches_the_dense_reference(Hq, Hk, D, block_size, dtype):
    """Rows of 0, 1, a block and a bit, and several hundred keys; NaN in every slot no row
    owns, so a kernel reading one slot too far fails. Block 40 is a tile and a part of one."""
    lengths = [0, 1, block_size + 3, 300 + block_size]
    case = decode_case(block_size + Hq, lengths, block_size, Hq, Hk, D, dtype)
    before = {name: case[name].clone() for name in ("k_cache", "v_cache")}
    out, k_cache, v_cache = attend(case, "cpu")
    expected, k_after, v_after = dense_reference(
        case["q"], before["k_cache"], before["v_cache"], case["k"], case["v"], lengths,
        paged_locate(case["block_table"], block_size), causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2     # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache, k_after, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_after, equal_nan=True, atol=0, rtol=0)


def test_each_row_and_head_is_the_same_whatever_the_threads():
    """A (row, KV head) is one thread's work from start to end, so the answer is bitwise the
    same on one thread as on several."""
    case = decode_case(3, [5, 700, 64, 0, 33, 129, 2, 400], 16, 12, 4, 64, torch.float32,
                       stale=0.0)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(attend({k: (t.clone() if torch.is_tensor(t) else t)
                                for k, t in case.items()}, "cpu")[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_prompts_take_the_gather_path():
    """More than one query per row: stage 3's PyTorch path, to the bit."""
    case = decode_case(4, [0, 20], 16, 9, 3, 64, torch.float32, stale=0.0)
    gen = torch.Generator().manual_seed(0)
    case.update(q=torch.randn(2, 7, 9, 64, generator=gen), k=torch.randn(2, 7, 3, 64, generator=gen),
                v=torch.randn(2, 7, 3, 64, generator=gen))
    expected = attend({k: (t.clone() if torch.is_tensor(t) else t) for k, t in case.items()},
                      "torch")[0]
    assert torch.equal(attend(case, "cpu")[0], expected)


def test_building_leaves_tiny_floats_alone():
    """The kernel is compiled with -ffast-math but not linked with it: linked with it, gcc adds
    startup code that sets the whole process to flush subnormal floats to zero."""
    cpu_attention.build.cache_clear()
    assert not isinstance(cpu_attention.build(torch.float32, 16, 2), str)
    tiny = sys.float_info.min
    assert tiny / 4 > 0 and math.isclose(tiny / 4 * 4, tiny)
    assert (torch.tensor([tiny], dtype=torch.float64) / 4).item() > 0


def test_a_compiler_that_fails_is_a_sentence(monkeypatch, tmp_path):
    """A compiler that exits with an error: the line naming it (not the "In file included"
    line before it), in why_not's sentence, and in the error of a direct call of the kernel."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'In file included from x.h' >&2\n"
                    "echo 'fatal error: the test made me fail' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    cpu_attention.build.cache_clear()
    q, pool = torch.zeros(1, 1, 4, 16), torch.zeros(2, 4, 2, 16)
    try:
        reason = cpu_attention.why_not_cpu(q, pool)
        with pytest.raises(RuntimeError, match="cannot run this call: cc could not build"):
            cpu_attention.decode_attention(q, pool, pool, torch.zeros(1, 1, dtype=torch.long),
                                           torch.tensor([3]), 0.25)
    finally:
        cpu_attention.build.cache_clear()
    assert reason == "cc could not build cpu_attention.c: fatal error: the test made me fail"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_generation_on_the_kernel_gives_the_contiguous_caches_tokens(dtype):
    check_paged_generation("cpu", 6, dtype)


@pytest.mark.parametrize("line", range(len(cpu_attention.FLAGS)))
def test_every_line_of_flags_builds_the_same_kernel(monkeypatch, line):
    """The fallbacks for compilers without libmvec or OpenMP build a kernel as exact as the
    first line's (here, where every line builds)."""
    monkeypatch.setattr(cpu_attention, "FLAGS", cpu_attention.FLAGS[line:line + 1])
    cpu_attention.build.cache_clear()
    try:
        lengths = [17, 0, 250]
        case = decode_case(line, lengths, 16, 9, 3, 64, torch.float32)
        before = {name: case[name].clone() for name in ("k_cache", "v_cache")}
        out = attend(case, "cpu")[0]
    finally:
        cpu_attention.build.cache_clear()
    expected = dense_reference(case["q"], before["k_cache"], before["v_cache"], case["k"],
                               case["v"], lengths, paged_locate(case["block_table"], 16),
                               causal=True)[0]
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
