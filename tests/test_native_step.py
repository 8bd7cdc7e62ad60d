"""The decode step as one C++ call (minipaged/fast/native_step.py) against ground truth: the
no-cache forward of stage 1's model, step after step, and the tokens of the compiled graphs."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import greedy_reference, tiny_model
from minipaged import generate
from minipaged.fast import FastEngine, FastPagedCache, FusedLlama, compile_decode
from minipaged.fast import native_step
from minipaged.kv_cache import ContiguousCache

PROMPTS = [[5, 9, 2, 77, 31], [100, 3], list(range(40, 53)), [7] * 6]
# logits against the no-cache forward's, as a fraction of the largest: float32 differs by the
# order of the sums; bfloat16 by a few roundings of bf16 (8 bits) on the way (seen: 2 ** -7)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def compiled(request):
    model = tiny_model(dtype=request.param)
    fast = FusedLlama(model)
    assert compile_decode(fast, batches=True) > 0
    assert fast.native is not None, native_step.why_not_native(fast)
    return model, fast


def test_decode_steps_as_one_call_give_the_no_cache_forwards_logits(compiled):
    """Rows of different lengths, blocks of 4 (rows entering blocks, and plans going on from
    the last step's): every decode step's logits, served by the one call, are the no-cache
    forward's at the row's last token."""
    model, fast = compiled
    dtype = next(model.parameters()).dtype
    cache = FastPagedCache(fast.args, num_blocks=40, block_size=4, max_seqs=4, max_seq_len=40,
                           dtype=dtype)
    seqs = [list(p) for p in PROMPTS]
    with torch.inference_mode():
        for i, p in enumerate(seqs):                        # the prompts, one by one
            cache.prepare([i], len(p))
            fast(torch.tensor([p]), cache)
        for step in range(9):
            new = [(7 * step + 3 * i) % 500 for i in range(len(seqs))]
            cache.prepare(list(range(len(seqs))), 1)
            got = fast.native(torch.tensor(new)[:, None], cache)
            assert got is not None and got.shape == (len(seqs), 1, fast.args.vocab_size)
            for i, t in enumerate(new):
                seqs[i].append(t)
                want = model(torch.tensor([seqs[i]]))[0, -1].float()
                error = (got[i, 0] - want).abs().max() / want.abs().max()
                assert error <= TOLERANCE[dtype], (step, i, float(error))


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=8, block_size=4),
                                     dict(block_size=4, speculative="ngram",
                                          num_speculative_tokens=2)], ids=repr)
def test_an_engine_on_the_one_call_step_gives_the_references_tokens(compiled, options):
    model, fast = compiled
    served, real = [], fast.native

    def counted(*args, **kwargs):
        logits = real(*args, **kwargs)
        served.append(logits is not None)
        return logits

    fast.native = counted
    try:
        got = generate(fast, PROMPTS[:3], 8, cache="paged", stop_tokens=[], max_seq_len=64,
                       engine_class=FastEngine, **options)
    finally:
        fast.native = real
    assert got == [greedy_reference(model, p, 8) for p in PROMPTS[:3]]
    assert sum(served) >= 7                               # the decode steps, at least


def test_int8_blocks_give_the_compiled_graphs_tokens(compiled):
    """On stage 4b's int8 blocks (k and v quantized into their slots in C), the one call gives
    the tokens the compiled graphs give."""
    _, fast = compiled
    runs, real = [], fast.native
    for native in (real, None):
        fast.native = native
        runs.append(generate(fast, PROMPTS[:3], 8, cache="paged", stop_tokens=[],
                             max_seq_len=64, block_size=4, kv_dtype="int8",
                             engine_class=FastEngine))
    fast.native = real
    assert runs[0] == runs[1]


def test_the_one_call_leaves_other_steps_to_the_graphs(compiled):
    """None (the caller goes on to the graphs) for a prompt, for more rows than it serves, and
    on the contiguous cache; the model's forward then gives the no-cache forward's logits."""
    model, fast = compiled
    dtype = next(model.parameters()).dtype
    rows = native_step.MOST_ROWS + 1
    paged = FastPagedCache(fast.args, num_blocks=2 * rows + 2, block_size=4, max_seqs=rows,
                           max_seq_len=40, dtype=dtype)
    with torch.inference_mode():
        paged.prepare([0], 5)
        assert fast.native(torch.tensor([PROMPTS[0]]), paged) is None               # a prompt
        for i in range(1, rows):
            paged.prepare([i], 5)
            fast(torch.tensor([PROMPTS[0]]), paged)
        paged.prepare(list(range(rows)), 1)
        assert fast.native(torch.full((rows, 1), 9), paged) is None              # too many
        paged.free(rows - 1)
        paged.prepare(list(range(rows - 1)), 1)
        vocab, pool = fast.args.vocab_size, paged.managers[0].k_cache_paged.clone()
        for bad in (vocab, -1):                      # nothing written, the graph says why
            assert fast.native(torch.tensor([[5]] * (rows - 2) + [[bad]]), paged) is None
            assert torch.equal(paged.managers[0].k_cache_paged, pool)
        contiguous = ContiguousCache(fast.args, 1, 8, dtype=dtype)
        contiguous.prepare([0], 5)
        fast(torch.tensor([PROMPTS[0]]), contiguous)
        contiguous.prepare([0], 1)
        assert fast.native(torch.tensor([[9]]), contiguous) is None
        got = fast(torch.tensor([[9]]), contiguous)[0, -1]
    want = model(torch.tensor([PROMPTS[0] + [9]]))[0, -1].float()
    assert (got - want).abs().max() <= TOLERANCE[dtype] * want.abs().max()


def test_a_model_the_one_call_cannot_serve_says_why():
    for dtype in (torch.float16, torch.float64):
        why = native_step.why_not_native(FusedLlama(tiny_model(dtype=dtype)))
        assert why and "the step takes float32 or bfloat16 on the CPU" in why
        with pytest.raises(RuntimeError, match="the decode step cannot be one call"):
            native_step.NativeStep(FusedLlama(tiny_model(dtype=dtype)))


def test_the_benchmarks_time_the_products_as_the_one_call_makes_them(compiled, monkeypatch):
    """`benchmarks.smollm2.products_seconds` times a model with a one-call step through it
    (`NativeStep.products_seconds`: the step's products in one C++ call), and the others' MatVecs
    one by one."""
    from minipaged.benchmarks import smollm2

    _, fast = compiled
    asked = []
    real = type(fast.native).products_seconds
    monkeypatch.setattr(type(fast.native), "products_seconds",
                        lambda self, rows=1: asked.append(rows) or real(self, rows))
    assert smollm2.products_seconds(fast) > 0 and asked == [1]
    assert fast.native.products_seconds(native_step.MOST_ROWS) > 0
    native, fast.native = fast.native, None
    try:
        assert smollm2.products_seconds(fast) > 0 and asked == [1, native_step.MOST_ROWS]
    finally:
        fast.native = native


def test_the_steps_swiglu_is_torchs_over_every_range_of_gate():
    check_swiglu()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 builds")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_avx2_and_plain_x86_builds_give_the_same_swiglu(march):
    """operators.cpp built for AVX2 and for plain x86-64 (MINIPAGED_MARCH, in a process of its
    own: a process builds it once): the same check of its SwiGLU."""
    env = {**os.environ, "MINIPAGED_MARCH": march,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    run = subprocess.run([sys.executable, "-c", "import test_native_step; "
                          "test_native_step.check_swiglu()"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def check_swiglu():
    """operators.cpp's SwiGLU (its own vectorized exponential, no branch) against silu in
    float64, for gates from -200 to 200, the largest floats, infinities and NaN: within four
    float32 roundings of the value, or 5e-36 from it where it is as small as that (past a gate
    of -87, where the step's gives -0, as torch's does in float32 a little further on)."""
    from minipaged.fast import operators

    assert operators.build() is None
    gate = torch.cat([torch.linspace(-200, 200, 400_001), torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, float("inf"), float("-inf"), float("nan")])])
    up = torch.cat([torch.linspace(-3, 3, 400_001), torch.ones(9)])
    got = torch.empty(len(gate))
    both = torch.stack([gate, up])                                # (1 row, gate then up)
    operators.swiglu(both.data_ptr(), got.data_ptr(), 1, len(gate))
    want = torch.nn.functional.silu(gate.double()) * up.double()
    finite = want.isfinite()
    error = (got.double() - want).abs()[finite]
    assert (error <= 4 * 2 ** -24 * want.abs()[finite] + 5e-36).all(), float(error.max())
    assert torch.equal(got[~finite].isnan(), want[~finite].isnan())
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()].float())
