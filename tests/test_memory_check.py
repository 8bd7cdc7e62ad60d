"""A cache checks the memory it is about to zero against what the machine has available, and
refuses, before allocating anything, with a sentence naming the size and what fits."""

import resource

import pytest
import torch
from conftest import tiny_args, tiny_model

from minipaged import Engine, NotEnoughMemoryError, generate
from minipaged.cache_manager import CacheManager
from minipaged.cache_checks import available_memory
from minipaged.kv_cache import ContiguousCache
from minipaged.paged_cache import PagedCache
from minipaged.swap import SwapSpace

TB = 1 << 40


def meminfo_available():
    """MemAvailable, read here independently of the code under test."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024


def test_available_memory_is_memavailable():
    assert available_memory("cpu") == pytest.approx(meminfo_available(), rel=0.05)
    assert available_memory("meta") is None               # nothing to check there


@pytest.mark.parametrize("build", [
    lambda a: ContiguousCache(a, 1, 10 ** 12),                       # a huge max_seq_len
    lambda a: ContiguousCache(a, 10 ** 9, 256),                      # a huge batch
    lambda a: PagedCache(a, 10 ** 11, 16, 1, 256),                   # a huge pool
    lambda a: PagedCache(a, 4, 10 ** 11, 1, 256),                    # a huge block
    lambda a: PagedCache(a, 4, 16, 10 ** 11, 256),                   # huge block tables
    lambda a: CacheManager(10 ** 11, 16, 2, 16, 1, 4),
], ids=["contiguous rows", "contiguous batch", "pool", "block", "tables", "one layer"])
def test_sizes_past_memory_are_refused_before_allocating(build):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(NotEnoughMemoryError, match=r"needs [\d.]+ [TPE]iB, but cpu has only "
                                                   r".* available.*nothing was allocated"):
        build(tiny_args())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100_000   # < 100 MB more


def test_all_layers_count_and_the_message_says_what_fits(monkeypatch):
    """With 1 MiB available, a pool whose one layer fits but whose layers together do not is
    refused; the count of blocks that fit is 1 MiB over a block's bytes in all layers."""
    monkeypatch.setattr("minipaged.cache_checks.available_memory", lambda device: 1 << 20)
    a = tiny_args()                                          # 2 layers, 2 KV heads of 16
    per_block = 2 * a.n_layers * 16 * a.n_kv_heads * a.head_dim * 4      # K+V, fp32, 16 tokens
    fits = (1 << 20) // per_block
    CacheManager(fits + 10, 16, a.n_kv_heads, a.head_dim, 1, 4)          # one layer: fits
    with pytest.raises(NotEnoughMemoryError) as e:
        PagedCache(a, fits + 10, 16, 1, 64)
    assert f"room for at most {fits:,} blocks of 16 tokens per layer" in str(e.value)
    PagedCache(a, fits - 1, 16, 1, 64)                       # (the block tables take a little)


def test_swap_space_the_engine_and_generate_check_too():
    model = tiny_model(dtype=torch.float32)
    cache = PagedCache(model.args, 8, 16, 1, 64)
    with pytest.raises(NotEnoughMemoryError, match="CPU swap pool"):
        SwapSpace(cache, 10 ** 11)
    with pytest.raises(NotEnoughMemoryError):
        Engine(model, kv_budget=TB)
    with pytest.raises(NotEnoughMemoryError):
        generate(model, [[1, 2, 3]], 4, cache="paged", kv_budget=TB)
    with pytest.raises(NotEnoughMemoryError):
        generate(model, [[1, 2, 3]], 4, cache="contiguous", max_seq_len=10 ** 12)

