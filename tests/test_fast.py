"""minipaged.fast: the same Llama rearranged for speed gives the model's results.

Ground truth is stage 1's `Llama` on the same weights: its no-cache forward and the greedy
tokens of `greedy_reference`. The fused model is checked eager and compiled, on both caches
and through the engine; the real weights (SmolLM2 against transformers) are in test_gguf.py.
"""

import logging
import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import greedy_reference, tiny_model
from minipaged import generate
from minipaged import OutOfBlocksError, RequestError
from minipaged import cpu_attention
from minipaged.cache_manager import CacheManager
from minipaged.fast import FastContiguousCache, FastEngine, FastPagedCache, FusedLlama, compile_decode
from minipaged.fast.paged import FastSharedPagedCache
from minipaged.sharing import SharedPagedCache
from minipaged.fast import paged as fast_paged
from minipaged.fast.paged import share_bookkeeping
from minipaged.fast import compiled as compiled_module
from minipaged.fast import matvec, operators
from minipaged.fast.matvec import MatVec
from minipaged.fast import kernels
from test_kernels_every_isa import native_isa
from minipaged.kv_cache import ContiguousCache
from minipaged.paged_cache import PagedCache
from minipaged.paged_generation import generate_paged

PROMPTS = [[5, 9, 2, 77, 31], [100, 3], list(range(40, 70))]


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2,
             torch.float16: 2e-3}


def assert_linear(mv, w, rows, dtype):
    """mv(x) is F.linear(x, w) up to the order of the sums, for x of `rows` rows (in 2 batches)."""
    x = torch.randn(2, rows, w.shape[1], dtype=dtype)
    got, want = mv(x), F.linear(x, w.to(dtype))
    assert got.shape == want.shape and got.dtype == dtype
    assert (got.double() - want.double()).abs().max() <= TOLERANCE[dtype] * want.double().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 70])
def test_matvec_is_a_linear_layer(dtype, rows):
    """Split into slabs, as panels, packed by oneDNN or none of these, the product is F.linear's
    up to the order of the sums."""
    torch.manual_seed(rows)
    w = torch.randn(96, 128, dtype=dtype)
    mv = MatVec(w)
    assert mv.splits == (4 if dtype == torch.float32 else 1)
    assert_linear(mv, w, rows, dtype)


def test_the_panel_kernel_builds_for_this_cpus_vector_width():
    """With a C compiler the kernel builds on any CPU, for its widest vectors (simd.h), and
    `kernels()` says so; tests/test_kernels_every_isa.py checks each width against plain
    loops."""
    if not cpu_attention.compiler():
        pytest.skip("no C compiler: the products go to oneDNN (the test below)")
    kernel = matvec.panel_kernel()
    assert not isinstance(kernel, str), kernel
    if not os.environ.get("MINIPAGED_MARCH"):
        assert matvec.built_isa == native_isa()
    report = kernels(torch.float32)
    assert report["products"] == f"panels.c ({matvec.built_isa}), float32 weights; past " \
        f"{matvec.MOST_ROWS} rows, torch's product"
    assert report["attention"].startswith("cpu_attention.c (")
    assert report["decode step"].startswith("one C++ call up to 64 rows")
    assert set(report) == {"cpu", "built for", "products", "one row", "attention",
                           "decode step"}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch without oneDNN")
def test_matvec_keeps_the_copy_several_rows_are_multiplied_by():
    """fp32: panels where the kernel builds and the outputs are a multiple of 32, else oneDNN's
    packed copy; bf16: panels where `half_panels` says so, else oneDNN's where the CPU has bf16
    instructions; fp16: panels; fp64: neither."""
    panels = not isinstance(matvec.panel_kernel(), str)
    mv = MatVec(torch.randn(96, 128))
    assert (mv.panels is not None, mv.packed is not None) == (panels, not panels)
    assert mv.panels is None or mv.panels.shape == (3, 128, 32)
    mv = MatVec(torch.randn(40, 128))                     # 40 outputs: no panels of 32
    assert mv.panels is None and mv.packed is not None
    mv = MatVec(torch.randn(96, 128).bfloat16())
    assert (mv.panels is not None) == (panels and matvec.half_panels(torch.bfloat16))
    assert mv.panels is None or mv.panels.dtype == torch.bfloat16
    assert (mv.packed is not None) == (mv.panels is None and
                                       torch.ops.mkldnn._is_mkldnn_bf16_supported())
    mv = MatVec(torch.randn(96, 128).half())
    assert (mv.panels is not None) == panels and mv.packed is None
    mv = MatVec(torch.randn(96, 128, dtype=torch.float64))
    assert mv.panels is None and mv.packed is None


@pytest.mark.skipif(isinstance(matvec.panel_kernel(), str), reason="the panel kernel needs "
                    "a C compiler (test_the_panel_kernel_builds_for_this_cpus_vector_width)")
@pytest.mark.parametrize("out_features, in_features", [(32, 7), (96, 64), (160, 1536)])
def test_the_panel_product_is_a_product_at_every_number_of_rows(out_features, in_features):
    """panels.c against float64, for 1 to 40 rows (passes of up to 12 rows, split evenly, and
    their remainders), around MOST_ROWS (the kernel below, torch's product above) and far
    above it; each entry within fp32 rounding of its own sum's size."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    mv = MatVec(w)
    most = matvec.MOST_ROWS
    operators.build()               # the operator's kernel in C++ where it builds (next test)
    for rows in [*range(1, 41), most - 1, most, most + 1, 2 * most]:
        x = torch.randn(rows, in_features, generator=gen)
        want = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T            # the size of each entry's sum
        got = matvec.panel_linear(x, mv.panels, mv._weight_t())                   # Python's
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-30).all(), rows
        assert torch.equal(torch.ops.minipaged.panel_linear(x, mv.panels, mv._weight_t()), got)
        if rows > 1:                                            # and MatVec sends rows there
            assert torch.equal(mv(x), got)
    for product in (matvec.panel_linear, torch.ops.minipaged.panel_linear):
        assert product(x[:0], mv.panels, mv._weight_t()).shape == (0, out_features)


@pytest.mark.skipif(isinstance(matvec.panel_kernel(), str), reason="the panel kernel needs "
                    "a C compiler (test_the_panel_kernel_builds_for_this_cpus_vector_width)")
@pytest.mark.parametrize("dtype, rounding", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11)])
def test_half_precision_panels_are_a_product_at_every_number_of_rows(dtype, rounding):
    """bf16 and fp16 panels (widened as they stream in, summed in fp32) against float64 over the
    same half-precision weights, 1 to 40 rows, around `most_rows` (bf16 on a CPU with bf16 dot
    products: torch's product beyond it) and past MOST_ROWS (fp32's bound), through the Python
    function and the C++ operator alike; each entry within its dtype's rounding of the exact
    sum. The panels are made even where MatVec would give bf16 to oneDNN."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(160, 200, generator=gen).to(dtype)
    panels = w.reshape(5, 32, 200).transpose(1, 2).contiguous()
    operators.build()
    most = min(matvec.most_rows(dtype), 2 * matvec.MOST_ROWS)
    for rows in [*range(1, 41), most, most + 1, matvec.MOST_ROWS + 1]:
        x = torch.randn(rows, 200, generator=gen).to(dtype)
        want = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T
        got = matvec.panel_linear(x, panels, w.t())
        assert got.shape == (rows, 160) and got.dtype == dtype
        assert ((got.double() - want).abs() <= rounding * want.abs() + 1e-5 * scale).all(), rows
        assert torch.equal(torch.ops.minipaged.panel_linear(x, panels, w.t()), got)


@pytest.mark.skipif(isinstance(matvec.panel_kernel(), str), reason="the panel kernel needs "
                    "a C compiler (test_the_panel_kernel_builds_for_this_cpus_vector_width)")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the helper takes another core")
def test_with_the_helper_each_panel_product_is_the_same_bit_for_bit():
    """panels.c's helper (on while another process holds a core and a step runs on one
    thread) takes chunks of panels beside the caller, which takes back any the helper is slow
    with. With a Python busy loop on the helper's core, so that it is stopped mid-chunk now and
    then, thousands of one-thread products equal the products without the helper bit for bit
    (rows 1 to 40; 5 panels, a chunk and a part-full one; 192 panels); the helper multiplied
    chunks and chunks were taken back from it (in a second phase the helper stalls before
    committing each chunk, as if stopped there: on some machines 3 s beside the busy loop
    caused no take-back). Quiet, it falls asleep between products 20 ms
    apart, and the products wake it: it takes part again. Stopped, it is off."""
    operators.build()                   # the copy of panels.c that serves the products
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(n, 576, generator=gen) for n in (160, 6144)]
    cases = [(MatVec(w), torch.randn(rows, 576, generator=gen))
             for w in weights for rows in (1, 2, 7, 12, 13, 40)]
    product = torch.ops.minipaged.panel_linear
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    here, there = sorted(affinity)[:2]
    busy = None
    try:
        torch.set_num_threads(1)
        want = [product(x, mv.panels, mv._weight_t()) for mv, x in cases]   # no helper
        os.sched_setaffinity(0, {here})           # this thread; the helper goes elsewhere
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(busy.pid, {there})
        _, helped, taken = matvec.panel_helper_state()
        assert matvec.panel_helper(True) == 0 and matvec.panel_helper_state()[0]
        for stall in (0, 100_000):    # as it runs; then stalled after each chunk, as the
            matvec.panel_helper_stall(stall)   # scheduler may or may not stop it in 2 s
            end = time.monotonic() + 2
            while time.monotonic() < end:
                for (mv, x), y in zip(cases, want):
                    assert torch.equal(product(x, mv.panels, mv._weight_t()), y)
        on, helped_busy, taken_busy = matvec.panel_helper_state()
        assert on and helped_busy > helped and taken_busy > taken
        busy.kill()
        busy.wait()
        matvec.panel_helper_stall(0)
        (mv, x), y = cases[6], want[6]            # 192 panels, one row
        for _ in range(40):                       # quiet, and products far apart
            time.sleep(0.02)
            assert torch.equal(product(x, mv.panels, mv._weight_t()), y)
        assert matvec.panel_helper_state()[1] > helped_busy
    finally:
        if busy is not None:
            busy.kill()
        matvec.panel_helper(False)
        matvec.panel_helper_stall(0)
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    assert not matvec.panel_helper_state()[0]


@pytest.mark.skipif(isinstance(matvec.panel_kernel(), str), reason="the panel kernel needs "
                    "a C compiler (test_the_panel_kernel_builds_for_this_cpus_vector_width)")
def test_a_child_of_fork_has_no_helper_and_may_start_its_own():
    """fork copies the helper's state but not its thread: in the child it is off (products on
    one thread as without it, stopping it returns at once instead of waiting for a thread that
    is not there), and the child may start a helper of its own; the parent's runs on."""
    operators.build()
    mv = MatVec(torch.randn(6144, 576, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(4))
    product = torch.ops.minipaged.panel_linear
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = product(x, mv.panels, mv._weight_t())
        assert matvec.panel_helper(True) == 0
        pid = os.fork()
        if pid == 0:                                  # the child: its verdict as exit status
            ok = not matvec.panel_helper_state()[0] and \
                torch.equal(product(x, mv.panels, mv._weight_t()), want) and \
                matvec.panel_helper(False) == 0 and matvec.panel_helper(True) == 0 and \
                matvec.panel_helper_state()[0] and \
                torch.equal(product(x, mv.panels, mv._weight_t()), want) and \
                matvec.panel_helper(False) == 0
            os._exit(0 if ok else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert matvec.panel_helper_state()[0]
        assert torch.equal(product(x, mv.panels, mv._weight_t()), want)
    finally:
        matvec.panel_helper(False)
        torch.set_num_threads(threads)


@pytest.mark.skipif(isinstance(matvec.panel_kernel(), str), reason="the panel kernel needs "
                    "a C compiler (test_the_panel_kernel_builds_for_this_cpus_vector_width)")
def test_the_operators_cpu_kernels_are_registered_in_cpp():
    """Where a C++ compiler builds operators.cpp (this project's machines), its kernels are the
    two operators' CPU kernels (the tests beside them check they give the Python functions'
    numbers); it is built once, and a compiled step asks for it."""
    has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    if operators.cxx_compiler():
        assert operators.build() is None and matvec.operator_in_cpp
        assert has_cpu_kernel("minipaged::panel_linear", "CPU")
        assert has_cpu_kernel("minipaged::attend", "CPU")
        assert operators.build.cache_info().currsize == 1


@pytest.mark.skipif(isinstance(matvec.panel_kernel(), str), reason="the panel kernel needs "
                    "a C compiler (test_the_panel_kernel_builds_for_this_cpus_vector_width)")
def test_a_cpp_compiler_that_fails_is_a_sentence(monkeypatch, tmp_path):
    """A C++ compiler that exits with an error: the line that says so, in build's sentence (a
    compiled step logs it and its operators run their Python functions)."""
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'In file included from x.h' >&2\n"
                    "echo 'operators.cpp:1: error: the test made me fail' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert operators.build.__wrapped__() == "c++ could not build operators.cpp: " \
        "operators.cpp:1: error: the test made me fail"
    monkeypatch.setenv("CXX", str(tmp_path / "missing"))
    assert operators.build.__wrapped__().startswith("missing could not build operators.cpp")
    monkeypatch.setattr(matvec, "panel_kernel", lambda: "no C compiler was found")
    assert operators.build.__wrapped__() == "no C compiler was found"


def test_without_the_panel_kernel_fp32_rows_go_to_onednn(monkeypatch):
    """No kernel (no compiler, no AVX-512): fp32 MatVecs keep oneDNN's copy and stay products."""
    monkeypatch.setattr(matvec, "panel_kernel", lambda: "no C compiler was found")
    w = torch.randn(96, 128)
    mv = MatVec(w)
    assert mv.panels is None and (mv.packed is not None) == torch.backends.mkldnn.is_available()
    for rows in (1, 3, 70):
        assert_linear(mv, w, rows, torch.float32)


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_matvec_without_onednn_is_still_a_linear_layer(monkeypatch, rows):
    monkeypatch.setattr(matvec, "onednn_weight", lambda weight: None)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(96, 128, dtype=dtype)
        mv = MatVec(w)
        assert mv.packed is None
        assert_linear(mv, w, rows, dtype)


def test_matvec_moved_to_another_dtype_packs_the_new_weight():
    """`.to(dtype)` converts the weight; the copy for several rows follows it: bf16 panels or
    oneDNN's (`half_panels`), fp16 panels, none in fp64, panels again back in fp32."""
    w = torch.randn(96, 128)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        mv = MatVec(w).to(dtype)
        panels = matvec.panel_weight(w.to(dtype))
        assert (mv.panels is None) == (panels is None)
        assert mv.panels is None or (mv.panels.dtype == dtype and torch.equal(mv.panels, panels))
        assert (mv.packed is None) == (panels is not None or
                                       matvec.onednn_weight(w.to(dtype)) is None)
        assert (mv.panels is not None) == (dtype != torch.float64 and
                                           not isinstance(matvec.panel_kernel(), str) and
                                           matvec.half_panels(dtype))
        for rows in (1, 3):
            assert_linear(mv, w, rows, dtype)
    mv = MatVec(w).to(torch.float64).to(torch.float32)
    assert (mv.panels is None) == (matvec.panel_weight(w) is None)
    for rows in (1, 3, 70):
        assert_linear(mv, w, rows, torch.float32)


def test_matvec_keeps_a_weight_it_cannot_split():
    w = torch.randn(10, 7)                     # 7 input features: no 4 equal slabs
    mv = MatVec(w)
    assert mv.splits == 1
    assert_linear(mv, w, 1, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_forward_equals_the_models(dtype):
    model = tiny_model(dtype=dtype)
    fast = FusedLlama(model)
    x = torch.tensor([PROMPTS[2]])
    tol = 1e-5 if dtype == torch.float64 else 1e-4    # both models rotate and normalise in fp32
    with torch.no_grad():
        assert (fast(x) - model(x)).abs().max() < tol
        assert (fast(x, last_only=True) - model(x, last_only=True)).abs().max() < tol
        idx = torch.tensor([0, 7, 29])
        assert (fast(x, logits_indices=idx) - model(x, logits_indices=idx)).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fusing_leaves_the_model_as_it_was(dtype):
    model = tiny_model(dtype=dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    FusedLlama(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("cache,options", [("contiguous", {}), ("paged", {"block_size": 4}),
                                           ("paged", {"block_size": 4,
                                                      "max_num_batched_tokens": 8})])
def test_fused_greedy_tokens_are_the_no_cache_references(cache, options):
    model = tiny_model()
    fast = FusedLlama(model)
    got = generate(fast, PROMPTS, 12, cache=cache, stop_tokens=[], max_seq_len=64, **options)
    assert got == [greedy_reference(model, p, 12) for p in PROMPTS]


def test_the_fast_contiguous_cache_gives_the_no_cache_references():
    """Rows of different lengths, decoded row by row over views: the greedy tokens of the
    no-cache forward, and logits equal to stage 1's ContiguousCache's."""
    model = tiny_model()
    got = generate(model, PROMPTS, 12, cache=FastContiguousCache(model.args, len(PROMPTS), 64,
                                                                 dtype=torch.float64),
                   stop_tokens=[])
    assert got == [greedy_reference(model, p, 12) for p in PROMPTS]
    caches = [FastContiguousCache(model.args, 3, 64, dtype=torch.float64),
              ContiguousCache(model.args, 3, 64, dtype=torch.float64)]
    logits = []
    with torch.no_grad():
        for cache in caches:
            for i, p in enumerate(PROMPTS):
                cache.prepare([i], len(p))
                model(torch.tensor([p]), cache=cache)
            cache.prepare([0, 1, 2], 1)
            logits.append(model(torch.tensor([[1], [2], [3]]), cache=cache))
    assert torch.allclose(logits[0], logits[1], rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def compiled_pair():
    """A tiny fp32 model and its fused copy with the decode step compiled (once: it takes
    seconds)."""
    model = tiny_model(dtype=torch.float32)
    fast = FusedLlama(model)
    seconds = compile_decode(fast)
    assert fast.compiled is not None and seconds > 0
    return model, fast


def test_the_compiled_step_runs_and_gives_the_models_logits(compiled_pair):
    """Batch-1 decode on either cache goes through the compiled step, and each token's logits
    are the no-cache forward's at that position."""
    model, fast = compiled_pair
    prompt = PROMPTS[0]
    calls = []
    step = fast.compiled
    fast.compiled = lambda *a: calls.append(1) or step(*a)
    try:
        for cache in ("contiguous", "paged"):
            seen = []
            out = generate(fast, [prompt], 10, cache=cache, stop_tokens=[], max_seq_len=32,
                           callback=lambda event, seq, token, c: seen.append(token))
            seq = prompt + out[0]
            with torch.no_grad():
                want = model(torch.tensor([seq]))[0].argmax(-1)          # no cache
            assert out[0] == want[len(prompt) - 1:-1].tolist() == seen
    finally:
        fast.compiled = step
    assert len(calls) == 2 * 9            # every token after the first, on both caches


def test_the_compiled_steps_logits_are_the_eager_ones(compiled_pair):
    model, fast = compiled_pair
    logits, step = {}, fast.compiled
    try:
        for name, run in (("compiled", step), ("eager", None)):
            fast.compiled = run
            cache = ContiguousCache(model.args, 1, 32)
            cache.prepare([0], len(PROMPTS[1]))
            with torch.no_grad():
                fast(torch.tensor([PROMPTS[1]]), cache=cache)
                cache.prepare([0], 1)
                logits[name] = fast(torch.tensor([[42]]), cache=cache)
    finally:
        fast.compiled = step
    assert (logits["compiled"] - logits["eager"]).abs().max() < 1e-4


def test_the_compiled_step_on_the_engine_with_a_token_budget(compiled_pair):
    """Stage 5b's packed steps call the model with one token of one sequence too: the compiled
    step serves them, and the tokens are the references'."""
    model, fast = compiled_pair
    got = generate(fast, PROMPTS, 8, cache="paged", stop_tokens=[], max_seq_len=64,
                   block_size=4, max_num_batched_tokens=6)
    assert got == [greedy_reference(model, p, 8) for p in PROMPTS]


def test_a_batch_and_a_prompt_run_eager_with_the_same_tokens(compiled_pair):
    model, fast = compiled_pair
    got = generate_paged(fast, PROMPTS, 8, stop_tokens=[], max_seq_len=64, block_size=4)
    assert got == generate(model, PROMPTS, 8, cache="contiguous", stop_tokens=[],
                           max_seq_len=64)


@pytest.mark.parametrize("budget", [None, 6])
def test_batch_one_on_the_fast_engine_attends_through_one_plan_a_step(compiled_pair,
                                                                      monkeypatch, budget):
    """One sequence's compiled decode step on the speed layer's cache attends through a
    `DecodeAttention` worked out once a step (every layer of every decode step goes through
    it), and the greedy tokens are the no-cache references'."""
    model, fast = compiled_pair
    calls, plans = record_decode_attention(monkeypatch)
    prompt = PROMPTS[2]
    got = generate(fast, [prompt], 8, cache="paged", stop_tokens=[], max_seq_len=64,
                   block_size=4, engine_class=FastEngine, max_num_batched_tokens=budget)
    assert got == [greedy_reference(model, prompt, 8)]
    every_layer = [(1, layer) for layer in range(model.args.n_layers)] * 7   # all but token 1
    assert_through_plans(calls, plans, every_layer, steps=7)


def test_int8_blocks_on_the_compiled_step_attend_through_one_plan_a_step(compiled_pair,
                                                                        monkeypatch):
    """kv_dtype="int8" (stage 4b) on the compiled decode step: every layer of every decode step
    goes through the step's plan (operators.cpp quantizing k/v into their slots with
    int8_slots.c, then the C kernel; where it is not built, `DecodeAttention.attend`); the
    tokens are the eager speed layer's on int8 blocks."""
    model, fast = compiled_pair
    calls, plans = record_decode_attention(monkeypatch)
    prompt = PROMPTS[2]
    options = dict(cache="paged", stop_tokens=[], max_seq_len=64, block_size=4,
                   engine_class=FastEngine, kv_dtype="int8")
    got = generate(fast, [prompt], 8, **options)
    every_layer = [(1, layer) for layer in range(model.args.n_layers)] * 7
    assert_through_plans(calls, plans, every_layer, steps=7)
    assert got == generate(model, [prompt], 8, **options)


def record_decode_attention(monkeypatch):
    """Lists that fill in as `DecodeAttention`s serve layers in Python, (rows, layer) a call,
    and as their plans are installed for operators.cpp's `attend` (rows a step)."""
    calls, plans = [], []
    attend, address = fast_paged.DecodeAttention.attend, fast_paged.DecodeAttention.address
    monkeypatch.setattr(fast_paged.DecodeAttention, "attend", lambda self, layer, *a:
                        calls.append((self.rows, layer)) or attend(self, layer, *a))
    monkeypatch.setattr(fast_paged.DecodeAttention, "address", lambda self:
                        plans.append(self.rows) or address(self))
    return calls, plans


def assert_through_plans(calls, plans, every_layer, steps):
    """Every layer of the decode steps went through a plan: its C++ kernel, with one plan
    installed a step and no call left to Python, where operators.cpp is built; else the
    Python `DecodeAttention.attend`, every layer of every step."""
    if operators.build() is None:
        assert calls == [] and plans == [every_layer[0][0]] * steps
    else:
        assert calls == every_layer


def decode_step_of_rows(dtype, lengths, seed=0):
    """A FastPagedCache (blocks of 4) of a tiny model holding rows of the given lengths, each
    filled with random k/v in every layer, then prepared for one new token a row."""
    a = tiny_model(dtype=dtype).args
    cache = FastPagedCache(a, 24, 4, len(lengths), 64, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for row, n in enumerate(lengths):
        cache.prepare([row], n)
        for layer in range(a.n_layers):
            cache.attend(layer, *(torch.randn(1, n, h, a.head_dim, generator=gen).to(dtype)
                                  for h in (a.n_heads, a.n_kv_heads, a.n_kv_heads)))
    cache.prepare(list(range(len(lengths))), 1)
    return cache


# rows before the step: 9 tokens, and rows of 4 and 12 whose new token opens a block (of 4)
@pytest.mark.parametrize("lengths", [[9], [9, 4, 7, 12, 1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_gives_the_caches_own_attend_numbers(dtype, lengths):
    """`DecodeAttention.attend`, and the C++ `attend` on its plan as a compiled step calls it
    (operators.cpp; q as (B, 1, ...) and as one row, (1, B, ...)), against the cache's `attend`
    on the same step, one row or rows of different lengths: the same k/v written to the same
    slots and bit for bit the same output, in every layer."""
    ways = ["plan", "attend"] + (["operator", "operator, one row"]
                                 if operators.build() is None else [])
    out = {}
    for way in ways:
        cache = decode_step_of_rows(dtype, lengths)
        a, B = cache.args, len(lengths)
        assert cache.plan.positions.tolist() == [[n] for n in lengths]
        step = cache.decode_attention() if way == "plan" else cache
        assert way != "plan" or step is not None
        gen = torch.Generator().manual_seed(1)
        ys = []
        for layer in range(a.n_layers):
            q, k, v = (torch.randn(B, 1, h, a.head_dim, generator=gen).to(dtype)
                       for h in (a.n_heads, a.n_kv_heads, a.n_kv_heads))
            if way.startswith("operator"):
                one_row = way.endswith("one row")
                with compiled_module.running_on(cache, B, 1):
                    compiled_module._caches[-1] = None     # the Python function would fail
                    q_, k_, v_ = (x.transpose(0, 1) if one_row else x for x in (q, k, v))
                    y = torch.ops.minipaged.attend(q_, k_, v_, layer)
                ys.append(y.transpose(0, 1) if one_row else y)
            else:
                ys.append(step.attend(layer, q, k, v))
        out[way] = ys, [(m.k_cache_paged.clone(), m.v_cache_paged.clone())
                        for m in cache.managers]
    for way in ways[:1] + ways[2:]:
        for y1, y2 in zip(out[way][0], out["attend"][0]):
            assert y1.dtype == dtype and y1.shape == y2.shape and torch.equal(y1, y2), way
        for (k1, v1), (k2, v2) in zip(out[way][1], out["attend"][1]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), way


@pytest.mark.parametrize("lengths", [[9], [9, 4, 7]])
def test_decode_attention_refuses_keys_of_another_dtype_and_changes_nothing(lengths):
    """k/v are copied into the pool byte for byte, so k or v of another dtype than the pool's
    is refused with one line, and no slot is written."""
    cache = decode_step_of_rows(torch.bfloat16, lengths)
    a, B = cache.args, len(lengths)
    step = cache.decode_attention()
    before = [(m.k_cache_paged.clone(), m.v_cache_paged.clone()) for m in cache.managers]
    q = torch.randn(B, 1, a.n_heads, a.head_dim).bfloat16()
    k = torch.randn(B, 1, a.n_kv_heads, a.head_dim)
    for k_, v_ in ((k, k.bfloat16()), (k.bfloat16(), k)):
        with pytest.raises(RequestError, match=r"the new keys and values must be "
                           r"torch.bfloat16, the cache's dtype \(got torch.float32\)"):
            step.attend(0, q, k_, v_)
        if operators.build() is None:     # the C++ kernel leaves such a call to the function
            with compiled_module.running_on(cache, B, 1), pytest.raises(
                    RequestError, match="the new keys and values must be torch.bfloat16"):
                torch.ops.minipaged.attend(q, k_, v_, 0)
    assert all(torch.equal(k0, m.k_cache_paged) and torch.equal(v0, m.v_cache_paged)
               for (k0, v0), m in zip(before, cache.managers))


def test_greedy_tokens_are_torchs_argmax_ties_and_nans_included():
    """The fast engine's argmax (numpy's on a CPU for float32) picks what `argmax` picks: the
    first of tied largest values, the first NaN, index 0 of a row of -inf; strided rows and
    other dtypes too."""
    logits = torch.randn(5, 1000)
    logits[1, [7, 500]] = 100.0
    logits[2, [3, 9]] = float("nan")
    logits[3] = -math.inf
    assert fast_paged.greedy_tokens(logits)[1:4] == [7, 3, 0]
    for x in (logits, logits.double(), logits.bfloat16(), logits[:, 1::2], logits[:0]):
        assert fast_paged.greedy_tokens(x) == x.argmax(-1).tolist()


@pytest.fixture(scope="module")
def batches_pair():
    """A tiny fp32 model and its fused copy with every step on a cache compiled."""
    model = tiny_model(dtype=torch.float32)
    fast = FusedLlama(model)
    assert compile_decode(fast, batches=True) > 0
    assert fast.compiled is not None and fast.compiled_batches is not None
    return model, fast


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=6),
                                     dict(max_num_batched_tokens=64, engine_class=FastEngine)])
def test_the_compiled_batch_step_serves_every_step_and_gives_the_references(batches_pair,
                                                                          options):
    """Batches of decode rows, prompts and stage 5b's packed steps (decode rows and prompt
    chunks in one row of tokens, a few logits kept) all run the one compiled graph, whatever
    their number of tokens, and the greedy tokens are the no-cache references'."""
    model, fast = batches_pair
    step, shapes, native = fast.compiled_batches, [], fast.native
    fast.compiled_batches = lambda tokens, *a: shapes.append(tuple(tokens.shape)) or \
        step(tokens, *a)
    fast.native = None           # decode steps through the graph, not as one C++ call
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        got = generate(fast, PROMPTS, 8, cache="paged", stop_tokens=[], max_seq_len=64,
                       block_size=4, **options)
    finally:
        fast.compiled_batches, fast.native = step, native
    assert got == [greedy_reference(model, p, 8) for p in PROMPTS]
    assert len(set(shapes)) >= 2                                    # steps of several sizes,
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # none compiled anew


def test_the_compiled_bf16_batch_step_stays_within_bf16_rounding_at_every_size():
    """In bf16 the compiler writes the batch step's products itself, one kernel for any number
    of rows. Steps of 1 to 33 rows (prompts of 3 tokens, then one decode token each) through
    the compiled graph land as close to the float64 model as the eager bf16 forward does."""
    exact = tiny_model(dtype=torch.float64)
    fast = FusedLlama(tiny_model(dtype=torch.bfloat16))
    assert compile_decode(fast, batches=True) > 0
    assert fast.compiled_batches.options is compiled_module.OPTIONS    # the compiler's own
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 2, 7, 16, 33):
        tokens = torch.randint(0, 512, (rows, 4), generator=gen)
        want = exact(tokens)[:, -1]                                      # (rows, vocab)
        errors = []
        for compiled in (True, False):
            cache = ContiguousCache(fast.args, rows, 8, dtype=torch.bfloat16)
            cache.prepare(list(range(rows)), 3)
            step = fast if compiled else lambda t, c: fast.run(t, c.positions, c)
            with torch.inference_mode():                                 # as generate runs
                step(tokens[:, :3], cache)                               # the prompts
                cache.prepare(list(range(rows)), 1)
                got = step(tokens[:, 3:], cache)[:, -1]                  # one decode row each
            errors.append((got.double() - want).abs().max().item())
        assert errors[0] <= 2 * errors[1] + 0.05, (rows, errors)


def test_a_batch_step_whose_products_the_compiler_cannot_write_gets_onednns(monkeypatch,
                                                                            caplog):
    """Where inductor has no kernel of its own for the products (here: asked for its own only,
    without freezing, whose constant weights its kernels need), the batch step is compiled
    again with oneDNN's instead of staying eager."""
    monkeypatch.setattr(compiled_module, "batch_options", lambda dtype: {
        "freezing": False, "max_autotune": True, "max_autotune_gemm_backends": "CPP"})
    monkeypatch.setattr(matvec, "panel_weight", lambda weight: None)   # fp32 products: mm
    model = tiny_model(dtype=torch.float32)
    fast = FusedLlama(model)
    with caplog.at_level(logging.INFO, logger=compiled_module.__name__):
        assert compile_decode(fast, batches=True) > 0
    assert fast.compiled_batches.options is compiled_module.ONEDNN
    assert "the batch step's products go to oneDNN" in caplog.text
    assert generate(fast, PROMPTS, 5, cache="paged", stop_tokens=[], max_seq_len=64,
                    block_size=4) == [greedy_reference(model, p, 5) for p in PROMPTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_steps_called_with_gradients_on_run_the_graphs_compiled(dtype):
    """A compiled model called as a user might call it, gradients on (no inference_mode), runs
    the graphs compile_decode compiled, one sequence's and a batch's, compiling nothing more,
    and gives what it gives under inference_mode."""
    fast = FusedLlama(tiny_model(dtype=dtype))
    assert compile_decode(fast, batches=True) > 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    tokens = torch.randint(0, 512, (2, 3), generator=torch.Generator().manual_seed(6))
    for rows, count in ((1, 1), (2, 3)):
        got = []
        for mode in (torch.enable_grad, torch.inference_mode):
            cache = ContiguousCache(fast.args, rows, 8, dtype=dtype)
            cache.prepare(list(range(rows)), count)
            with mode():
                got.append(fast(torch.tensor(tokens[:rows, :count].tolist()), cache))
        assert torch.equal(got[0], got[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_two_compiled_models_each_run_their_own_graphs():
    """The compiled steps keep no guards on their modules (compiled.py: `compiled_alone`), and
    those guards were what told one model's graph from another's: two models of the same shape
    and other weights, compiled one after the other and then called in turns, one row and a
    batch, each give their own no-cache references."""
    models = [tiny_model(seed=seed, dtype=torch.float32) for seed in (1, 2)]
    fasts = [FusedLlama(m) for m in models]
    for fast in fasts:
        assert compile_decode(fast, batches=True) > 0
    want = [[greedy_reference(m, p, 6) for p in PROMPTS] for m in models]
    assert want[0] != want[1]                                 # the models differ
    for _ in range(2):
        for model, fast, tokens in zip(models, fasts, want):
            assert generate(fast, PROMPTS, 6, cache="paged", stop_tokens=[], max_seq_len=64,
                            block_size=4) == tokens                              # a batch
            assert generate(fast, PROMPTS[:1], 6, cache="paged", stop_tokens=[],
                            max_seq_len=64, block_size=4) == tokens[:1]          # one row
    code = [fast.compiled.step._orig_mod.forward.__code__ for fast in fasts]
    assert code[0] is not code[1]                              # graphs kept apart


@pytest.mark.parametrize("budget", [None, 64])
def test_batch_decode_steps_on_the_fast_engine_attend_through_one_plan_a_step(batches_pair,
                                                                             monkeypatch, budget):
    """The compiled batch step's decode steps on the speed layer's cache (rows of different
    lengths, one token each; with a token budget, stage 5b's packed step of decode rows alone)
    attend through one `DecodeAttention` a step for all rows: every layer of every step after
    the prompts' goes through it, and the greedy tokens are the no-cache references'."""
    model, fast = batches_pair
    calls, plans = record_decode_attention(monkeypatch)
    got = generate(fast, PROMPTS, 8, cache="paged", stop_tokens=[], max_seq_len=64,
                   block_size=4, engine_class=FastEngine, max_num_batched_tokens=budget)
    assert got == [greedy_reference(model, p, 8) for p in PROMPTS]
    # the prompts' step(s) first, then 7 steps of the 3 rows, one plan each
    assert_through_plans(calls, plans, [(3, layer) for layer in range(model.args.n_layers)] * 7,
                         steps=7)


def test_the_compiled_batch_steps_logits_are_the_eager_ones(batches_pair):
    """A decode step of three rows, compiled and eager: the same logits up to the order of
    the sums (one row of the graph's tokens per row of the batch)."""
    model, fast = batches_pair
    logits, step = {}, fast.compiled_batches
    try:
        for name, run in (("compiled", step), ("eager", None)):
            fast.compiled_batches = run
            cache = ContiguousCache(model.args, 3, 40)
            with torch.no_grad():
                for row, prompt in enumerate(PROMPTS):
                    cache.prepare([row], len(prompt))
                    fast(torch.tensor([prompt]), cache=cache, last_only=True)
                cache.prepare([0, 1, 2], 1)
                logits[name] = fast(torch.tensor([[42], [7], [9]]), cache=cache)
    finally:
        fast.compiled_batches = step
    assert logits["compiled"].shape == (3, 1, model.args.vocab_size)
    assert (logits["compiled"] - logits["eager"]).abs().max() < 1e-4


def test_a_failed_compile_warns_and_stays_eager(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(compiled_module.torch, "compile", broken)
    model = tiny_model(dtype=torch.float32)
    fast = FusedLlama(model)
    with caplog.at_level(logging.WARNING):
        assert math.isnan(compile_decode(fast, fewer_threads=True))
    assert fast.compiled is None and fast.compiled_threads == ()
    assert "could not compile the decode step (RuntimeError: no C++ compiler here)" in caplog.text
    got = generate(fast, PROMPTS[:1], 6, stop_tokens=[], max_seq_len=32)
    assert got == [greedy_reference(model, PROMPTS[0], 6)]


def test_the_step_by_step_comparison_runs_both_caches_to_the_same_tokens(monkeypatch):
    """The SmolLM2 benchmark's paged-against-contiguous measure, on a tiny model: a positive
    ratio and every part of both caches' steps timed when both caches decode alike (the
    timers unwrapped afterwards), and a refusal when they do not."""
    from minipaged import cpu_attention, kv_cache
    from minipaged.benchmarks import smollm2

    model = tiny_model(dtype=torch.float32)
    original, kernel_call = kv_cache.sdpa, cpu_attention.decode_attention
    ratio, parts = smollm2.paged_over_contiguous(model, PROMPTS[2], 20, rounds=1)
    assert math.isfinite(ratio) and ratio > 0
    assert set(parts) == {"contiguous", "paged"}
    for split in parts.values():      # a part a timer never reached would read 0
        assert all(split[k] > 0 for k in ("prepare", "write+gather", "attention", "rest"))
    assert kv_cache.sdpa is original
    assert cpu_attention.decode_attention is kernel_call
    broken = smollm2.FastPagedCache.attend
    monkeypatch.setattr(smollm2.FastPagedCache, "attend",
                        lambda self, layer, q, k, v: broken(self, layer, q, k, v) * 0)
    with pytest.raises(RuntimeError, match="differs from the contiguous cache"):
        smollm2.paged_over_contiguous(model, PROMPTS[2], 20, rounds=1)


def test_a_near_tie_in_bf16_is_no_disagreement():
    """The step comparison's guard: a different greedy token is refused in float32 and wherever
    the contiguous cache's two best logits are far apart; in bf16 or fp16, within `near_tie` of
    each other (two steps of the dtype at their size), either choice is rounding, and the
    comparison goes on."""
    from minipaged.benchmarks import smollm2

    assert smollm2.near_tie(13.15, torch.bfloat16) == 0.125              # two bf16 steps
    assert smollm2.near_tie(-36.25, torch.bfloat16) == 0.5
    tie, apart = (torch.tensor([0.0, 13.15, 13.15 - 0.0625]), torch.tensor([0.0, 13.15, 12.0]))
    far_up = torch.tensor([0.0, 36.25, 36.0])         # one bf16 step apart, at 32-64: a tie
    for contiguous in (tie, apart, far_up):
        paged = contiguous.clone()
        paged[2] = contiguous.max() + 1              # the paged cache picks token 2, not 1
        logits = {"contiguous": contiguous, "paged": paged}
        with pytest.raises(RuntimeError, match="differs from the contiguous cache"):
            smollm2.check_same_choice(logits, torch.float32, 0)
        if contiguous is apart:
            with pytest.raises(RuntimeError, match="differs from the contiguous cache"):
                smollm2.check_same_choice(logits, torch.bfloat16, 0)
        else:
            smollm2.check_same_choice(logits, torch.bfloat16, 0)
    smollm2.check_same_choice({"contiguous": apart, "paged": apart}, torch.float32, 0)


# A step's parts in µs, as paged_over_contiguous gives them.
A_STEP = {"prepare": 300.0, "write+gather": 1500.0, "attention": 2500.0, "rest": 16000.0,
          "total": 20300.0}


def test_the_gap_to_llama_cpp_is_split_by_cause():
    from minipaged.benchmarks import smollm2

    assert smollm2.behind_llama_cpp(A_STEP, {"transformers generate": 40.0}) == []
    [line] = smollm2.behind_llama_cpp(A_STEP, {"llama.cpp": 50.0})                # 20 ms a token
    assert line == ("fast (paged) step 20.30 ms against llama.cpp's 20.00 ms a token: attention "
                    "4.00 (write+gather 1.50, the math 2.50), bookkeeping 0.30, and the rest "
                    "16.00, -4.00 ms from llama.cpp's whole token")
    compiled = {**A_STEP, "prepare": 300.0, "write+gather": 0.0, "attention": 0.0,
                "rest": 20000.0, "products": 18500.0}        # a compiled step's timers
    assert len(smollm2.behind_llama_cpp(compiled, {"llama.cpp": 50.0})) == 1   # no peer token
    first, second = smollm2.behind_llama_cpp({**compiled, "peer token": 19000.0},
                                             {"llama.cpp": 50.0})
    assert first.startswith("fast (paged) step 20.30 ms against llama.cpp's 20.00 ms")
    assert second == ("in the same seconds (medians, a llama.cpp token after every step): fast "
                      "(paged) step 20.30 ms, llama.cpp's token 19.00 ms; the step's products "
                      "alone 18.50 ms (-0.50 ms from llama.cpp's token), everything else 1.80 ms")


def test_the_products_alone_are_the_fused_models_own():
    """`products_seconds`: none for stage 1's model; for a FusedLlama, a time, and every one of
    its MatVecs called once (SmolLM2's step: 121)."""
    from minipaged.benchmarks import smollm2
    from minipaged.fast import matvec

    model = tiny_model(dtype=torch.float32)
    assert smollm2.products_seconds(model) is None
    fast = FusedLlama(model)
    called = []
    real = matvec.MatVec._panel_product
    with pytest.MonkeyPatch.context() as m:
        m.setattr(matvec.MatVec, "_panel_product",
                  lambda self, rows: called.append(self) or real(self, rows))
        seconds = smollm2.products_seconds(fast)
    assert seconds > 0
    mats = [x for x in fast.modules() if isinstance(x, matvec.MatVec)]
    assert len(mats) == 4 * model.args.n_layers + 1
    assert called == [x for x in mats if x.panels is not None]
    asked = []

    class Peer:                  # LlamaCpp's llm: its generator, a token at every next()
        class llm:
            @staticmethod
            def generate(prompt, **options):
                while True:
                    asked.append(prompt)
                    yield 0

    _, parts = smollm2.paged_over_contiguous(fast, PROMPTS[2], 6, rounds=1, peer=Peer)
    assert all(split["products"] > 0 and split["peer token"] > 0 for split in parts.values())
    assert asked == [PROMPTS[2]] * 6           # the prompt, then one token after each step
    _, parts = smollm2.paged_over_contiguous(model, PROMPTS[2], 6, rounds=1)
    assert not any("products" in split for split in parts.values())


def test_the_plot_draws_each_part_of_a_step_at_its_length(tmp_path):
    """The benchmark's third panel: one stacked bar per cache and dtype, each segment as long
    as that part's median ms, and llama.cpp's whole token beside them."""
    import matplotlib.pyplot as plt

    from minipaged.benchmarks import smollm2

    step_parts = {"float32": {"minipaged Llama": {"contiguous": A_STEP, "paged": A_STEP},
                              "minipaged.fast": {"contiguous": A_STEP, "paged": A_STEP}}}
    decode = {"float32": {"minipaged.fast, paged cache": 45.0, "llama.cpp": 50.0}}
    fig, ax = plt.subplots()
    smollm2.draw_step_parts(ax, step_parts, decode)
    bars = [(round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_width()) for p in ax.patches]
    assert [label.get_text() for label in ax.get_yticklabels()] == [
        "minipaged.fast, contiguous, float32", "minipaged.fast, paged, float32", "llama.cpp, F32"]
    for row in (0, 1):
        segments = sorted((x, w) for y, x, w in bars if y == row)
        assert [w for _, w in segments] == pytest.approx([0.3, 1.5, 2.5, 16.0])
        assert [x for x, _ in segments] == pytest.approx([0.0, 0.3, 1.8, 4.3])
    assert [(x, w) for y, x, w in bars if y == 2] == [(0.0, pytest.approx(20.0))]
    plt.close(fig)
    path = tmp_path / "engines.png"
    smollm2.draw({"float32": decode["float32"]}, {"float32": {"minipaged.fast, engine": 180.0}},
                 step_parts, 2, 64, path)
    assert path.stat().st_size > 10_000


# -- the speed layer's paged cache (moved here from test_paged_generation.py) -------------------

def test_a_steps_stacked_tables_are_each_layers_own_under_random_steps():
    """Every layer's manager keeps its table in its row of the cache's stacked tensor; the
    tables a step reads at once are, layer by layer, what each manager's block_table_for says,
    through reserves, growth across block boundaries and frees, with each layer's blocks its
    own."""
    rng = random.Random(0)
    args = tiny_model().args
    cache = FastPagedCache(args, num_blocks=40, block_size=4, max_seqs=5, max_seq_len=48)
    live = {}
    for _ in range(300):
        if live and rng.random() < 0.15:
            s = rng.choice(sorted(live))
            cache.free(s)
            del live[s]
            continue
        new = [s for s in range(5) if s not in live and rng.random() < 0.3]
        ids = sorted(set(rng.sample(sorted(live), k=rng.randint(0, len(live))) + new)) \
            if live or new else []
        if not ids:
            continue
        n = rng.randint(1, 6)                   # new ones reserve n, running ones grow n
        if any(live.get(s, 0) + n > 48 for s in ids):
            continue
        try:
            cache.prepare(ids, n)
        except OutOfBlocksError:
            continue
        for s in ids:
            live[s] = live.get(s, 0) + n
        for layer, m in enumerate(cache.managers):
            assert torch.equal(cache.block_tables[layer], m.block_table_for(ids))
            assert m.block_table.data_ptr() == cache.block_table[layer].data_ptr()
            # lengths advanced for all layers at once (no block changing hands) or by each
            # manager's grow: every layer holds the tokens counted here
            assert m.seq_lens_for(ids).tolist() == [live[s] for s in ids]
            assert m.num_blocks_held[ids].tolist() == [-(-live[s] // 4) for s in ids]
        assert cache.plan.block_tables is cache.block_tables
    assert len({tuple(m.block_table.flatten().tolist()) for m in cache.managers}) > 1


@pytest.mark.parametrize("shared", [False, True], ids=["stage 3", "stage 6"])
def test_a_step_takes_the_blocks_stage_3s_prepare_takes_under_random_steps(shared):
    """The speed layer's prepare sends only the rows that take a block through every layer's
    allocator. Driven side by side with the stage's own cache (the same seed, so the same
    random blocks), through steps where some rows cross a block boundary and others do not,
    forks whose shared last blocks are copied on write, frees and refusals, every layer's
    table, lengths and reference counts stay the stage's, and a refused step changes
    nothing in either. Each step's plan is the one `plan_step` makes anew from the stage's
    tables, also where the last decode step's plan went on in place (`goes_on`), as many
    steps that repeat the last one's rows do."""
    rng = random.Random(1)
    args = tiny_model().args
    kinds = (SharedPagedCache, FastSharedPagedCache) if shared else (PagedCache, FastPagedCache)
    ref, fast = (kind(args, num_blocks=18, block_size=4, max_seqs=6, max_seq_len=40)
                 for kind in kinds)
    live, refusals, crossing_steps, went_on, last = {}, 0, 0, 0, None
    for _ in range(400):
        op = rng.random()
        if live and (op < 0.1 or max(live.values()) > 36):
            s = rng.choice(sorted(live)) if op < 0.1 else max(live, key=live.get)
            ref.free(s), fast.free(s)
            del live[s]
            continue
        free = [s for s in range(6) if s not in live]
        if shared and live and free and op < 0.25:
            parent, child = rng.choice(sorted(live)), free[0]
            ref.fork(parent, child), fast.fork(parent, child)
            live[child] = live[parent]
            continue
        if free and (not live or op < 0.4):        # a new sequence: its prompt
            ids, n = free[:1], rng.randint(1, 9)
        elif last and all(s in live for s in last) and op < 0.8:   # the last step's rows
            ids, n = last, 1
        else:                                       # running ones: decode, or a few tokens
            ids = sorted(rng.sample(sorted(live), k=rng.randint(1, len(live))))
            n = rng.choice([1, 1, 1, 2, 3])
        results, before = [], (fast.block_table.clone(), fast.seq_lens.clone())
        last_plan = fast.plan
        for cache in (ref, fast):
            try:
                cache.prepare(ids, n)
                results.append("ok")
            except (OutOfBlocksError, RequestError) as e:
                results.append(type(e).__name__)
        assert results[0] == results[1]
        if results[0] == "ok":
            crossing_steps += any(live.get(s, 0) % 4 == 0 or live.get(s, 0) % 4 + n > 4
                                  for s in ids)
            for s in ids:
                live[s] = live.get(s, 0) + n
        else:
            refusals += 1
            assert torch.equal(fast.block_table, before[0])
            assert torch.equal(fast.seq_lens, before[1])
        for layer, (a, b) in enumerate(zip(ref.managers, fast.managers)):
            assert torch.equal(a.block_table, b.block_table), layer
            assert torch.equal(a.seq_lens, b.seq_lens), layer
            assert a.num_free_blocks == b.num_free_blocks, layer
            if shared:
                assert (a.refs == b.refs).all(), layer
        if results[0] == "ok":
            assert fast.plan.cache_seqlens.tolist() == [live[s] - n for s in ids]
            width = -(-max(live[s] for s in ids) // 4)
            anew = fast_paged.plan_step(
                torch.stack([m.block_table[ids, :width] for m in ref.managers]),
                torch.tensor([live[s] - n for s in ids], dtype=torch.int32), n, 4)
            for name, want, got in zip(anew._fields, anew, fast.plan):
                assert torch.equal(got, want), name
            went_on += fast.plan is last_plan
        last = ids if n == 1 and results[0] == "ok" else None
    assert refusals > 5 and crossing_steps > 50 and went_on > 20, \
        (refusals, crossing_steps, went_on)


def test_a_decode_step_goes_on_from_the_last_plan_only_inside_its_blocks():
    """`goes_on`'s rule, asked directly after a decode step of rows 7 and 5 tokens long
    (block_size 4): one token more each stays in their blocks; a row whose next token opens a
    block (length 8) does not go on, even with the same tables; nor do other rows or lengths."""
    cache = FastPagedCache(tiny_model().args, num_blocks=16, block_size=4, max_seqs=4,
                           max_seq_len=32)
    cache.prepare([0], 6), cache.prepare([1], 4), cache.prepare([0, 1], 1)
    assert cache.plan.seqlens_k.tolist() == [7, 5]
    assert cache.goes_on([0, 1], 1, np.array([8, 6]), 2)
    for ids, n, lens in (([0, 1], 1, [9, 6]), ([0, 1], 1, [8, 7]), ([0, 1], 2, [9, 7]),
                         ([0], 1, [8])):
        assert not cache.goes_on(ids, n, np.array(lens), 2), (ids, n, lens)
    cache.plan.seqlens_k[1] = 4       # as if row 1 held its second block ahead: the tables
                                      # are the same, but its next token opens that block
    assert not cache.goes_on([0, 1], 1, np.array([8, 5]), 2)


def test_a_manager_refuses_a_block_table_of_the_wrong_shape_or_type():
    for table in (torch.empty(3, 4, dtype=torch.int32), torch.empty(2, 5, dtype=torch.int32),
                  torch.empty(2, 4, dtype=torch.int64)):
        with pytest.raises(RequestError, match="block_table must be an int32 CPU tensor"):
            share_bookkeeping(CacheManager(8, 4, 2, 8, 2, 4), table)
    table = torch.zeros(2, 4, dtype=torch.int32)
    m = share_bookkeeping(CacheManager(8, 4, 2, 8, 2, 4), table)
    m.reserve(0, 5)
    assert table[0, :2].tolist() == m.block_table_for([0])[0].tolist() and table[1, 0] == -1


def test_the_backend_is_chosen_once_a_step_not_once_a_layer(monkeypatch):
    """The speed layer's cache picks its backend (`fast_backend`) at a step's first layer; the
    other layers reuse its answer."""
    calls = []
    real = fast_paged.fast_backend
    monkeypatch.setattr(fast_paged, "fast_backend", lambda *a: calls.append(1) or real(*a))
    model, prompts = tiny_model(n_layers=3), [[5, 9, 2, 77], [100, 3]]
    out = generate_paged(model, prompts, 6, stop_tokens=[], max_seq_len=32, block_size=4,
                         cache_class=FastPagedCache)
    assert out == [greedy_reference(model, p, 6) for p in prompts]
    # two prefills, and of the five decode steps the three that make a new plan (a row enters
    # a block: lengths 4 and 2 before the first step, block_size 4); not times 3 layers. The
    # other two go on from the last plan (`goes_on`), and their backend with it.
    assert len(calls) == 2 + 3


@pytest.mark.parametrize("options", [
    dict(), dict(prefix_caching=True, max_num_batched_tokens=8),
    dict(num_blocks=12, block_size=4), dict(num_blocks=12, block_size=4, preemption="swap"),
    dict(n=2, temperature=0.8, prefix_caching=True),
    dict(speculative="ngram", num_speculative_tokens=4),
    dict(num_blocks=12, block_size=4, speculative="ngram", num_speculative_tokens=2),
    dict(temperature=0.8, speculative="ngram", num_speculative_tokens=3,
         draft_policy="fixed")], ids=repr)
def test_the_speed_layers_engine_gives_the_engines_tokens(options):
    """FastEngine (the engine on FastSharedPagedCache) against the Engine, under preemption,
    swapping, prefix caching, a token budget, parallel sampling and speculative decoding;
    greedy runs also against the no-cache forward. Sampled with speculation, both draft every
    step (`draft_policy="fixed"`): the draws follow the drafts, so the same drafts give the
    same samples."""
    model = tiny_model()
    prompts = [list(range(1, 19)), list(range(1, 17)) + [40, 41], [5, 6]]
    want = generate(model, prompts, 12, cache="paged", stop_tokens=[], **options)
    got = generate(model, prompts, 12, cache="paged", stop_tokens=[], engine_class=FastEngine,
                   **options)
    assert got == want
    if "temperature" not in options:
        assert got == [greedy_reference(model, p, 12) for p in prompts]
