"""The paged attention backends against a dense reference written here, the slow obvious way.

The reference follows flash-attn's documented rules for `flash_attn_with_kvcache`: new k/v
land at positions cache_seqlens[b] .. cache_seqlens[b] + Sk - 1 of row b, row b then has
cache_seqlens[b] + Sk keys, and a causal query i sees key j only if j <= i + keys - Sq.
Block tables are drawn from a shuffled pool with torch.randperm, like flash-attn's own test.

Every semantic test runs on each backend a CPU can run: "torch" (the gather path), "cpu" (stage
3b's C kernel for decode steps, built by the machine's C compiler) and "triton" (stage 3b's
Triton kernel, in Triton's interpreter without a GPU — slowly, so with fewer random seeds; on
a CUDA machine it runs compiled, on CUDA tensors).
"""

import logging
import math
import random
import types

import pytest
import torch

from minipaged import UsageError, backends, cpu_attention
from minipaged.fast import paged as paged_module
from minipaged.fast.paged import (QUERIES_AS_ROWS, ROW_KEYS, PagedStep, attend_step, fast_backend,
                                   plan_step)
from minipaged.paged_attention import flash_attn_with_kvcache

BACKENDS = ["torch", "cpu", "triton"]
SEEDS = {"torch": 30, "cpu": 30, "triton": 6}        # random cases per block size
GPU = torch.cuda.is_available()


def on_backend(case, backend):
    """The call's tensors where the backend runs them: CUDA for the compiled Triton kernel."""
    if backend == "triton" and GPU:
        return {k: (t.cuda() if torch.is_tensor(t) else t) for k, t in case.items()}
    return case


def attend(case, backend, **extra):
    """flash_attn_with_kvcache on `backend`; the output, and the call's k_cache and v_cache
    after it, on the CPU."""
    call = on_backend(case, backend)
    out = flash_attn_with_kvcache(**call, **extra, backend=backend).cpu()
    return out, call["k_cache"].cpu(), call["v_cache"].cpu()


def dense_reference(q, k_cache, v_cache, k, v, cache_seqlens, locate, causal, softmax_scale=None):
    """Expected (output in float64, k_cache after, v_cache after), with loops and lists.

    `locate(b, p)` gives the (index0, index1) of row b's position p in the cache tensors.
    """
    k_after, v_after = k_cache.clone(), v_cache.clone()
    B, Sq, Hq, D = q.shape
    Hk = k_cache.shape[2]
    Sk = 0 if k is None else k.shape[1]
    for b in range(B):
        for t in range(Sk):
            where = locate(b, cache_seqlens[b] + t)
            k_after[where] = k[b, t]
            v_after[where] = v[b, t]
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(D)
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = cache_seqlens[b] + Sk
        places = [locate(b, p) for p in range(n)]
        keys = torch.stack([k_after[i0, i1] for i0, i1 in places]).double() if n else None
        values = torch.stack([v_after[i0, i1] for i0, i1 in places]).double() if n else None
        for i in range(Sq):
            visible = [j for j in range(n) if not causal or j <= i + n - Sq]
            if not visible:
                continue                      # a query that sees no key outputs zeros
            for h in range(Hq):
                kv_head = h // (Hq // Hk)
                scores = keys[visible, kv_head] @ q[b, i, h].double() * scale
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                out[b, i, h] = weights @ values[visible, kv_head]
    return out, k_after, v_after


def random_paged_case(seed, block_size):
    """A random paged call: lengths include 0 and exact block multiples, GQA or MHA."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B = rng.randint(1, 3)
    Hk, group, D = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([8, 16])
    Sq = rng.choice([1, 1, rng.randint(2, 6)])
    new_kv = rng.random() < 0.7
    Sk = (Sq if rng.random() < 0.8 else rng.randint(1, 5)) if new_kv else 0
    longest = max(20, min(4 * block_size, 600))
    lengths = [rng.choice([0, block_size * rng.randint(1, 3), rng.randint(0, longest)])
               for _ in range(B)]
    if rng.random() < 0.2:
        lengths = [lengths[0]] * B            # the same for all: pass it as an int
    max_blocks = -(-(max(lengths) + Sk) // block_size) + rng.randint(0, 2)
    num_blocks = B * max_blocks + rng.randint(1, 5)
    pool = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    block_table = pool[:B * max_blocks].view(B, max_blocks)
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    case = dict(
        q=randn(B, Sq, Hk * group, D),
        k_cache=randn(num_blocks, block_size, Hk, D), v_cache=randn(num_blocks, block_size, Hk, D),
        k=randn(B, Sk, Hk, D) if new_kv else None, v=randn(B, Sk, Hk, D) if new_kv else None,
        cache_seqlens=(lengths[0] if len(set(lengths)) == 1 and rng.random() < 0.5
                       else torch.tensor(lengths, dtype=torch.int32)),
        block_table=block_table, causal=rng.random() < 0.6,
        softmax_scale=rng.choice([None, None, 0.3]))
    return case, lengths


def paged_locate(block_table, block_size):
    return lambda b, p: (int(block_table[b, p // block_size]), p % block_size)


def check_against_reference(case, lengths, locate, backend):
    k_snapshot, v_snapshot = case["k_cache"].clone(), case["v_cache"].clone()
    out, k_cache, v_cache = attend(case, backend)
    expected, k_after, v_after = dense_reference(
        case["q"], k_snapshot, v_snapshot, case["k"], case["v"], lengths, locate,
        case["causal"], case["softmax_scale"])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # the reference starts from the snapshot: the new tokens exactly where expected, and
    # every other slot of the pool untouched
    assert torch.equal(k_cache, k_after) and torch.equal(v_cache, v_after)


CASES = [(backend, block_size, seed) for backend in BACKENDS for block_size in [1, 3, 16, 256]
         for seed in range(SEEDS[backend])]


@pytest.mark.parametrize("backend,block_size,seed", CASES)
def test_paged_attention_matches_dense_reference(backend, block_size, seed):
    case, lengths = random_paged_case(1000 * block_size + seed, block_size)
    check_against_reference(case, lengths, paged_locate(case["block_table"], block_size), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size,seed", [(b, s) for b in [1, 3, 16] for s in range(4)])
def test_a_planned_step_matches_the_dense_reference_in_every_layer(block_size, seed, backend):
    """The speed layer's step: `plan_step` once over every layer's table (each layer its own
    scattered blocks), then `attend_step` per layer, as FastPagedCache.attend calls it."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n_layers, B, Hk, group, D = 3, rng.randint(1, 3), 2, 2, 8
    T = rng.choice([1, 1, rng.randint(2, 5)])
    lengths = [rng.choice([0, block_size * rng.randint(1, 3), rng.randint(0, 40)])
               for _ in range(B)]
    max_blocks = -(-(max(lengths) + T) // block_size) + rng.randint(0, 2)
    num_blocks = B * max_blocks + 3
    tables = torch.stack([torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
                          [:B * max_blocks].view(B, max_blocks) for _ in range(n_layers)])
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32)
    step = plan_step(tables, cache_seqlens, T, block_size)
    for layer in range(n_layers):
        randn = lambda *shape: torch.randn(*shape, generator=gen)
        q, k, v = randn(B, T, Hk * group, D), randn(B, T, Hk, D), randn(B, T, Hk, D)
        k_cache, v_cache = randn(num_blocks, block_size, Hk, D), randn(num_blocks, block_size, Hk, D)
        expected, k_after, v_after = dense_reference(
            q, k_cache.clone(), v_cache.clone(), k, v, lengths,
            paged_locate(tables[layer], block_size), causal=True)
        call = on_backend(dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache), backend)
        step_there = PagedStep(*(t.to(call["q"].device) for t in step))
        name = backends.pick_backend(backend, call["q"], call["k_cache"], step_there.block_tables[layer])
        out = attend_step(call["q"], call["k"], call["v"], call["k_cache"], call["v_cache"],
                             step_there, layer, name).cpu()
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(call["k_cache"].cpu(), k_after)
        assert torch.equal(call["v_cache"].cpu(), v_after)


@pytest.mark.parametrize("T", [2, 5, QUERIES_AS_ROWS, QUERIES_AS_ROWS + 1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("longest", [None, ROW_KEYS, ROW_KEYS + 1])
def test_several_tokens_per_row_through_the_c_kernel(T, dtype, longest, monkeypatch):
    """A step of T > 1 tokens per row on the "cpu" backend (a speculative verify pass, a prompt
    or a chunk of one): up to QUERIES_AS_ROWS tokens, or where no row reads more than ROW_KEYS
    keys, each query is a decode row of the C kernel; else each row's keys are gathered for
    PyTorch's flash attention (`attend_chunks`: the whole prompt in row 0, a chunk after cached
    tokens in the others). Either way the dense reference's numbers, and, through the kernel,
    each query's output is exactly that of a one-token decode step at its position."""
    if cpu_attention.why_not_cpu(torch.zeros(1, 1, 4, 8), torch.zeros(1, 4, 2, 8)):
        pytest.skip("no C compiler builds stage 3b's kernel here")
    gen = torch.Generator().manual_seed(T)
    n_layers, B, Hk, group, D, block_size = 2, 3, 2, 2, 8, 4
    # empty, mid-block, on a block boundary; or the last row reading `longest` keys in all
    lengths = [0, 7, 12 if longest is None else longest - T]
    max_blocks = -(-(max(lengths) + T) // block_size)
    num_blocks = B * max_blocks + 2
    tables = torch.stack([torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
                          [:B * max_blocks].view(B, max_blocks) for _ in range(n_layers)])
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    q, k, v = randn(B, T, Hk * group, D), randn(B, T, Hk, D), randn(B, T, Hk, D)
    k_cache, v_cache = randn(num_blocks, block_size, Hk, D), randn(num_blocks, block_size, Hk, D)
    kernel_rows = []
    real_kernel = paged_module.decode_attention
    monkeypatch.setattr(paged_module, "decode_attention", lambda q_, *a: kernel_rows.append(
        q_.shape[0]) or real_kernel(q_, *a))
    layer = 1
    expected, k_after, _ = dense_reference(q.float(), k_cache.float(), v_cache.float(), k.float(),
                                           v.float(), lengths,
                                           paged_locate(tables[layer], block_size), causal=True)
    step = plan_step(tables, torch.tensor(lengths, dtype=torch.int32), T, block_size)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = attend_step(q, k, v, kc, vc, step, layer, "cpu")
    as_rows = T <= QUERIES_AS_ROWS or longest in (None, ROW_KEYS)
    assert kernel_rows == ([B * T] if as_rows else [])
    assert torch.equal(kc.float(), k_after.to(dtype).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    if not as_rows:
        return
    # the same tokens one at a time, as decode steps: the same numbers, bit for bit
    kc, vc = k_cache.clone(), v_cache.clone()
    for t in range(T):
        one = plan_step(tables, torch.tensor(lengths, dtype=torch.int32) + t, 1, block_size)
        y = attend_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], kc, vc, one, layer, "cpu")
        assert torch.equal(y, out[:, t:t + 1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(10))
def test_non_paged_mode_with_cache_batch_idx(seed, backend):
    """flash-attn's other mode: one long cache row per sequence, picked by cache_batch_idx."""
    gen = torch.Generator().manual_seed(seed)
    B, B_cache, seqlen_cache, Hk, Hq, D, Sq = 3, 5, 24, 2, 4, 8, 1 + seed % 4
    rows = torch.randperm(B_cache, generator=gen, dtype=torch.int32)[:B]
    lengths = torch.randint(0, seqlen_cache - Sq + 1, (B,), generator=gen, dtype=torch.int32)
    case = dict(q=torch.randn(B, Sq, Hq, D, generator=gen),
                k_cache=torch.randn(B_cache, seqlen_cache, Hk, D, generator=gen),
                v_cache=torch.randn(B_cache, seqlen_cache, Hk, D, generator=gen),
                k=torch.randn(B, Sq, Hk, D, generator=gen), v=torch.randn(B, Sq, Hk, D, generator=gen),
                cache_seqlens=lengths, causal=seed % 2 == 0, softmax_scale=None,
                cache_batch_idx=rows if seed < 7 else None)
    if case["cache_batch_idx"] is None:
        rows = torch.arange(B)
    check_against_reference(case, lengths.tolist(), lambda b, p: (int(rows[b]), p), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_cache_seqlens_every_row_is_full(backend):
    """cache_seqlens=None: each row attends to every slot its block table addresses."""
    case, _ = random_paged_case(7, 4)
    case.update(k=None, v=None, cache_seqlens=None)
    full = case["block_table"].shape[1] * 4
    check_against_reference(case, [full] * case["q"].shape[0],
                            paged_locate(case["block_table"], 4), backend)


def owned_slots(block_table, block_size, seqlens):
    """The set of (block, offset) that hold a row's tokens."""
    return {(int(block_table[b, p // block_size]), p % block_size)
            for b, n in enumerate(seqlens) for p in range(n)}


def garbage_case(block_size, n_new, seed=42):
    """Rows of 5 tokens, none and two full blocks, each adding n_new: one query each (a decode
    step) or several (a prompt continued after a cached part), over a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    lengths, Hk, Hq, D = [5, 0, 2 * block_size], 2, 4, 8
    max_blocks = -(-(max(lengths) + n_new) // block_size) + 1
    num_blocks = len(lengths) * max_blocks + 3
    pool = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    B = len(lengths)
    case = dict(q=randn(B, n_new, Hq, D), k_cache=randn(num_blocks, block_size, Hk, D),
                v_cache=randn(num_blocks, block_size, Hk, D), k=randn(B, n_new, Hk, D),
                v=randn(B, n_new, Hk, D), cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                block_table=pool[:B * max_blocks].view(B, max_blocks), causal=True)
    return case, lengths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_new", [1, 4])
@pytest.mark.parametrize("block_size", [3, 16])
def test_garbage_outside_owned_slots_changes_nothing(block_size, n_new, backend):
    """Free blocks hold stale data, even NaN or inf: no row's output may depend on it."""
    case, lengths = garbage_case(block_size, n_new)
    owned = owned_slots(case["block_table"], block_size, [n + n_new for n in lengths])
    outputs = []
    for junk in (0.0, float("nan"), float("inf"), -1e30):
        call = {name: (t.clone() if torch.is_tensor(t) else t) for name, t in case.items()}
        for blk in range(call["k_cache"].shape[0]):
            for off in range(block_size):
                if (blk, off) not in owned:
                    call["k_cache"][blk, off] = junk
                    call["v_cache"][blk, off] = junk
        outputs.append(attend(call, backend)[0])
    assert torch.isfinite(outputs[0]).all()
    for other in outputs[1:]:
        assert torch.equal(outputs[0], other)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_table_entries_past_a_row_are_never_read(backend):
    """Table padding (-1, ids past the pool) after a row's last block is ignored."""
    gen = torch.Generator().manual_seed(3)
    bs, lengths = 16, [5, 0, 40]
    case = dict(q=torch.randn(3, 2, 4, 8, generator=gen),
                k_cache=torch.randn(12, bs, 2, 8, generator=gen),
                v_cache=torch.randn(12, bs, 2, 8, generator=gen),
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                block_table=torch.randperm(12, generator=gen, dtype=torch.int32).view(3, 4),
                causal=True)
    expected = attend(case, backend)[0]
    padded = case["block_table"].clone()
    for b, n in enumerate(lengths):
        padded[b, -(-n // bs):] = -1 if b % 2 else 10**6
    assert torch.equal(attend({**case, "block_table": padded}, backend)[0], expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_cache_on_cpu(backend):
    case, lengths = random_paged_case(11, 16)
    for name in ("q", "k_cache", "v_cache", "k", "v"):
        if case[name] is not None:
            case[name] = case[name].bfloat16()
    out = attend(case, backend)[0]
    expected, _, _ = dense_reference(case["q"], case["k_cache"], case["v_cache"], case["k"],
                                     case["v"], lengths, paged_locate(case["block_table"], 16),
                                     case["causal"], case["softmax_scale"])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_auto_on_a_cpu_is_stage_3s_pytorch_path_and_the_c_kernel_only_when_asked(monkeypatch,
                                                                                 caplog):
    """"auto" on a CPU: stage 3's PyTorch path, logged once with flash_attn's reason; the C
    kernel runs when asked for by name (or by the speed layer's "auto")."""
    monkeypatch.setattr(backends, "_announced", set())
    case, _ = random_paged_case(5, 16)
    with caplog.at_level(logging.INFO, logger="minipaged.paged_attention"):
        out = flash_attn_with_kvcache(**{**case, "k": None, "v": None})
        flash_attn_with_kvcache(**{**case, "k": None, "v": None})
    assert backends.last_backend == "torch"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "torch implementation" in lines[0], lines
    assert torch.equal(out, flash_attn_with_kvcache(**{**case, "k": None, "v": None},
                                                    backend="torch"))
    flash_attn_with_kvcache(**{**case, "k": None, "v": None}, backend="cpu")
    assert backends.last_backend == "cpu"
    if not torch.cuda.is_available():
        assert not backends.flash_attn_available()
    with pytest.raises(ValueError, match="not on a CUDA GPU|not installed"):
        flash_attn_with_kvcache(**case, backend="flash_attn")


def test_flash_attns_kernel_gets_every_argument_of_the_call_unchanged(monkeypatch):
    """Where flash-attn's kernel serves a call (stood in for here: it needs a CUDA GPU), it is
    handed every argument of flash-attn's signature by name, as given (the lengths as an int32
    tensor); nothing of our own writes or attends."""
    calls = []
    monkeypatch.setattr(backends, "flash_attn", types.SimpleNamespace(
        flash_attn_with_kvcache=lambda *args, **kwargs: calls.append((args, kwargs)) or "kernel"))
    monkeypatch.setattr(backends, "why_not_flash", lambda q, k_cache, block_table: None)
    case, _ = random_paged_case(5, 16)
    call = {**case, "cache_seqlens": 3, "rotary_cos": torch.ones(1), "rotary_sin": torch.zeros(1),
            "softmax_scale": 0.25, "causal": True, "window_size": (3, 0), "softcap": 0.5,
            "rotary_interleaved": False, "alibi_slopes": torch.ones(2), "num_splits": 2,
            "return_softmax_lse": True}
    k_cache_before = case["k_cache"].clone()
    assert flash_attn_with_kvcache(**call) == "kernel"
    assert backends.last_backend == "flash_attn" and len(calls) == 1
    args, kwargs = calls[0]
    expected = {**call, "cache_batch_idx": None, "cache_leftpad": None}
    assert args == () and set(kwargs) == set(expected)
    for name, value in expected.items():
        if name == "cache_seqlens":
            assert kwargs[name].dtype == torch.int32 and kwargs[name].tolist() == [3] * len(case["q"])
        else:
            assert kwargs[name] is value, name
    assert torch.equal(case["k_cache"], k_cache_before)     # the kernel writes, not us


def test_the_speed_layers_auto_runs_the_c_kernel_and_says_so(monkeypatch, caplog):
    """The speed layer's "auto" on a CPU: the C kernel, logged once; flash_attn refused with
    its reason."""
    monkeypatch.setattr(backends, "_announced", set())
    case, _ = random_paged_case(5, 16)
    with caplog.at_level(logging.INFO, logger="minipaged.paged_attention"):
        assert fast_backend("auto", case["q"], case["k_cache"], case["block_table"]) == "cpu"
        assert fast_backend("auto", case["q"], case["k_cache"], case["block_table"]) == "cpu"
    assert backends.last_backend == "cpu"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "cpu implementation" in lines[0], lines
    assert "not installed" in lines[0] or "CUDA" in lines[0]


def test_without_a_compiler_auto_runs_pytorch_and_says_why(monkeypatch, caplog):
    """No C compiler: the speed layer's "auto" falls back to the gather path and the log line
    says why; backend="cpu" is refused with the same reason."""
    monkeypatch.setattr(backends, "_announced", set())
    monkeypatch.setattr(cpu_attention, "compiler", lambda: None)
    cpu_attention.build.cache_clear()
    case, _ = random_paged_case(5, 16)
    try:
        with caplog.at_level(logging.INFO, logger="minipaged.paged_attention"):
            name = fast_backend("auto", case["q"], case["k_cache"], case["block_table"])
        assert name == "torch" and backends.last_backend == "torch"
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "torch implementation" in lines[0] \
            and "no C compiler was found" in lines[0], lines
        with pytest.raises(ValueError, match="backend='cpu' cannot serve this call: no C comp"):
            flash_attn_with_kvcache(**case, backend="cpu")
    finally:
        cpu_attention.build.cache_clear()      # the next test builds with the real compiler


def base_call():
    B, Hq, Hk, D, bs = 2, 4, 2, 8, 4
    return dict(q=torch.randn(B, 1, Hq, D), k_cache=torch.randn(6, bs, Hk, D),
                v_cache=torch.randn(6, bs, Hk, D), k=torch.randn(B, 1, Hk, D),
                v=torch.randn(B, 1, Hk, D), cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), causal=True)


BAD_CALLS = [
    ("block_table int64", dict(block_table=torch.tensor([[0, 1], [2, 3]])), "int32"),
    ("cache_seqlens int64", dict(cache_seqlens=torch.tensor([3, 4])), "int32"),
    ("cache_seqlens wrong length", dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), r"\(2,\)"),
    ("k without v", dict(v=None), "both k and v"),
    ("k without lengths", dict(cache_seqlens=None), "cache_seqlens"),
    ("heads not a multiple", dict(q=torch.randn(2, 1, 3, 8)), "multiple"),
    ("head_dim mismatch", dict(q=torch.randn(2, 1, 4, 16)), "head_dim"),
    ("q is 3-D", dict(q=torch.randn(2, 4, 8)), "q must be"),
    ("dtype mismatch", dict(q=torch.randn(2, 1, 4, 8, dtype=torch.float64)), "dtype|float"),
    ("k wrong heads", dict(k=torch.randn(2, 1, 4, 8), v=torch.randn(2, 1, 4, 8)), "n_kv_heads"),
    ("v_cache differs", dict(v_cache=torch.randn(6, 4, 2, 4)), "share one"),
    ("row past its table", dict(cache_seqlens=torch.tensor([3, 8], dtype=torch.int32)), "addresses only"),
    ("block id past the pool", dict(block_table=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)), "points outside"),
    ("negative length", dict(cache_seqlens=torch.tensor([-2, 1], dtype=torch.int32)), ">= 0"),
    ("NaN softmax_scale", dict(softmax_scale=float("nan")), "softmax_scale must be a finite"),
    ("infinite softmax_scale", dict(softmax_scale=float("inf")), "softmax_scale must be a finite"),
    ("paged + cache_batch_idx", dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)), "cannot be combined"),
    ("unknown backend", dict(backend="xformers"), "'auto', 'flash_attn', 'torch', 'cpu', 'triton'"),
    ("empty batch", dict(q=torch.randn(0, 1, 4, 8), k=torch.randn(0, 1, 2, 8),
                         v=torch.randn(0, 1, 2, 8), cache_seqlens=torch.zeros(0, dtype=torch.int32),
                         block_table=torch.zeros(0, 2, dtype=torch.int32)), "a batch of 0 rows"),
    # row 0 writes its 4th key into block 0, which row 1 holds as its first block
    ("a shared block written into", dict(block_table=torch.tensor([[0, 1], [0, 3]], dtype=torch.int32)),
     r"block 0 is in the block tables of rows \[0, 1\].*copy-on-write"),
    # row 1 writes its 5th key into block 2, where its 1st to 4th already are
    ("a block twice in one row", dict(block_table=torch.tensor([[0, 1], [2, 2]], dtype=torch.int32)),
     r"block 2 is in the block tables of rows \[1\]"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label,change,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_wrong_inputs_raise_a_sentence(label, change, message, backend):
    call = on_backend({**base_call(), "backend": backend}, backend)
    k_before = call["k_cache"].clone()
    with pytest.raises(UsageError, match=message):        # a ValueError, and the project's kind
        flash_attn_with_kvcache(**{**call, **on_backend(change, backend)})
    assert torch.equal(call["k_cache"], k_before)         # a refused call writes nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_two_rows_only_read_is_shared_legally(backend):
    """Sharing itself is legal (a prefix, a fork): block 0 in both rows, full, written by neither,
    gives what two private copies of it give."""
    shared = {**base_call(), "cache_seqlens": torch.tensor([4, 4], dtype=torch.int32),
              "block_table": torch.tensor([[0, 1], [0, 3]], dtype=torch.int32)}
    private = {**shared, "k_cache": shared["k_cache"].clone(), "v_cache": shared["v_cache"].clone(),
               "block_table": torch.tensor([[0, 1], [5, 3]], dtype=torch.int32)}
    private["k_cache"][5], private["v_cache"][5] = shared["k_cache"][0], shared["v_cache"][0]
    torch.testing.assert_close(attend(shared, backend)[0], attend(private, backend)[0])


@pytest.mark.parametrize("change", [
    dict(rotary_cos=torch.zeros(8, 4), rotary_sin=torch.zeros(8, 4)),
    dict(window_size=(16, 0)), dict(softcap=30.0), dict(alibi_slopes=torch.ones(4)),
    dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), dict(return_softmax_lse=True)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_features_the_torch_path_lacks_are_refused(change, backend):
    with pytest.raises(NotImplementedError, match=next(iter(change)).split("_")[0]):
        flash_attn_with_kvcache(**on_backend(base_call(), backend), **on_backend(change, backend),
                                backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_defaults_and_perf_knobs_are_accepted(backend):
    case = base_call()
    expected = attend(case, "torch")[0]
    for num_splits in (0, 1, 4):
        call = {k: (t.clone() if torch.is_tensor(t) else t) for k, t in case.items()}
        out = attend(call, backend, window_size=[-1, -1], softcap=0.0, num_splits=num_splits,
                     rotary_interleaved=False, return_softmax_lse=False)[0]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
