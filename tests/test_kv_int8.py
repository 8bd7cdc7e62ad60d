"""Stage 4b: int8 KV blocks with their scales.

The quantizer against an independent numpy one; the int8 attention against attention over the
dequantized values and against the fp32 cache; the capacity a budget buys; and every stage that
moves a block (copy-on-write, swap, prefix hit, beam fork, speculative rollback) carrying the
scales: an invariant over random steps reads every block back and compares it with what was
written, and whole runs through each move give the tokens of a run without it.
"""

import random

import numpy as np
import pytest
import torch

from conftest import tiny_model
from minipaged import Engine, ModelArgs, beam_search, generate
from minipaged.chat.app import main as chat_main
from minipaged.errors import RequestError
from minipaged.fast import FastEngine
from minipaged.kv_budget import bytes_per_block
from minipaged.kv_cache import attention_over_cache, kv_bytes_per_token
from minipaged.kv_formats import stored_layout
from minipaged.kv_quant import dequantize_int8, flash_attn_with_int8_kvcache, quantize_int8
from minipaged.paged_cache import PagedCache
from minipaged.serve.server import build as serve_build
from minipaged.sharing import SharedPagedCache
from minipaged.sizing import pool_blocks
from minipaged.speculative import rollback
from minipaged.swap import SwapSpace


def numpy_quantize(x):
    """An independent int8 quantizer: per row of the last axis, scale = max|x| / 127 stored as
    float16, codes = round-half-even(x / scale) clipped to [-127, 127]; zero rows stay zero."""
    x = np.asarray(x, dtype=np.float32)
    scale = (np.abs(x).max(-1, keepdims=True) / np.float32(127)).astype(np.float16)
    s = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s > 0, np.clip(np.round(x / s), -127, 127), 0).astype(np.int8)
    return codes, scale[..., 0]


def unpack(packed):
    """(codes, float16 scales) of int8 slots (..., D + 2), read with numpy."""
    a = packed.numpy()
    return a[..., :-2], np.ascontiguousarray(a[..., -2:]).view(np.float16)[..., 0]


def test_quantize_matches_an_independent_numpy_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    x[0, 0] = 0                                       # a row of zeros: scale 0, codes 0
    x[1, 0, 5] = 1e4                                  # one outlier channel (as keys have)
    packed = quantize_int8(x)
    assert packed.dtype == torch.int8 and packed.shape == (64, 3, 34)
    codes, scales = unpack(packed)
    want_codes, want_scales = numpy_quantize(x.numpy())
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    back = dequantize_int8(packed)
    assert torch.equal(back, torch.from_numpy(want_codes.astype(np.float32)
                                              * want_scales.astype(np.float32)[..., None]))
    err = (back - x).abs()
    assert (err <= torch.from_numpy(want_scales.astype(np.float32))[..., None] / 2).all()
    assert torch.equal(back[0, 0], torch.zeros(32))


def test_an_int8_token_takes_about_a_quarter_of_fp32_and_half_of_bf16():
    """Per token and head: D int8 codes + a 2-byte scale, against 4D (fp32) or 2D (bf16)."""
    for D, over_bf16 in ((32, 1.88), (64, 1.93), (128, 1.96)):
        int8 = kv_bytes_per_token(8, *stored_layout(D, torch.float32, "int8"))
        assert int8 == 2 * 8 * (D + 2)
        assert kv_bytes_per_token(8, D, torch.float32) / int8 >= 3.7
        assert kv_bytes_per_token(8, D, torch.bfloat16) / int8 >= over_bf16
    # a budget holds that many more tokens (Llama 3 8B's KV shape, 32 layers)
    args = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8)
    budget = 64 * 2**20
    blocks = {"fp32": pool_blocks(args, torch.float32, 16, kv_budget=budget),
              "bf16": pool_blocks(args, torch.bfloat16, 16, kv_budget=budget),
              "int8": pool_blocks(args, torch.float32, 16, kv_budget=budget, kv_dtype="int8")}
    assert blocks["int8"] >= 1.9 * blocks["bf16"] and blocks["int8"] >= 3.5 * blocks["fp32"]
    assert blocks["int8"] * bytes_per_block(16, 8, 130, torch.int8, 32) <= budget


def random_paged_call(seed, B=3, Hq=4, Hk=2, D=16, block_size=4, num_blocks=40):
    """A paged call with cached tokens already in place and new ones to write."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([5, 0, 11], dtype=torch.int32)[:B]
    T = 3
    table = torch.randperm(num_blocks, generator=g)[:B * 5].view(B, 5).int()
    k_old = torch.randn(B, 16, Hk, D, generator=g)
    v_old = torch.randn(B, 16, Hk, D, generator=g)
    k_new, v_new = torch.randn(B, T, Hk, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    q = torch.randn(B, T, Hq, D, generator=g)
    return q, lens, table, k_old, v_old, k_new, v_new, block_size, num_blocks


def test_int8_attention_is_attention_over_the_dequantized_tokens():
    q, lens, table, k_old, v_old, k_new, v_new, bs, N = random_paged_call(1)
    B, T, Hk, D = k_new.shape
    k_cache = torch.zeros(N, bs, Hk, D + 2, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    for b in range(B):                                  # the cached tokens, quantized in place
        for p in range(int(lens[b])):
            blk, off = int(table[b, p // bs]), p % bs
            k_cache[blk, off], v_cache[blk, off] = quantize_int8(k_old[b, p]), \
                quantize_int8(v_old[b, p])
    out = flash_attn_with_int8_kvcache(q, k_cache, v_cache, k_new, v_new, lens, table)
    L = int(lens.max()) + T
    k_all = torch.zeros(B, L, Hk, D)
    v_all = torch.zeros(B, L, Hk, D)
    exact_k, exact_v = torch.zeros(B, L, Hk, D), torch.zeros(B, L, Hk, D)
    for b in range(B):                                  # the numpy reference's values
        n = int(lens[b])
        ks = torch.cat([k_old[b, :n], k_new[b]]).numpy()
        vs = torch.cat([v_old[b, :n], v_new[b]]).numpy()
        for arr, src in ((k_all, ks), (v_all, vs)):
            c, s = numpy_quantize(src)
            deq = c.astype(np.float32) * s.astype(np.float32)[..., None]
            arr[b, :n + T] = torch.from_numpy(deq)
        exact_k[b, :n + T], exact_v[b, :n + T] = torch.from_numpy(ks), torch.from_numpy(vs)
    seqlens_k = lens.long() + T
    want = attention_over_cache(q, k_all, v_all, seqlens_k)
    assert torch.allclose(out, want, atol=1e-6)
    # against the unquantized tokens: each value is off by at most half a scale (1/254 of its
    # row's largest, inputs of unit spread here); the outputs moved by 0.010 where this was
    # measured, of outputs up to ~3: the bound is 0.03, about 1% of them
    exact = attention_over_cache(q, exact_k, exact_v, seqlens_k)
    assert (out - exact).abs().max() < 0.03


def test_the_paged_cache_logits_stay_near_the_fp32_cache():
    """The tiny model in float32: its next-token logits through an int8 PagedCache, prefill then
    decode, against the no-cache forward (ground truth; an fp32 PagedCache matches it exactly).
    Every K/V value is off by at most half a scale (1/254 of its row's largest value); through
    2 layers that moved no logit by more than 0.029 where it was measured, against a spread (std)
    of 4.6 per position. The bound, 0.1, is 2% of that spread: a lost scale or a swapped block
    moves logits by whole units."""
    model = tiny_model(dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (2, 40), generator=g)
    truth = model(tokens)                                                  # (2, 40, V)
    cache = PagedCache(model.args, 40, 4, 2, 64, kv_dtype="int8")
    cache.prepare([0, 1], 30)
    got = [model(tokens[:, :30], cache=cache)]
    for t in range(30, 40):
        cache.prepare([0, 1], 1)
        got.append(model(tokens[:, t:t + 1], cache=cache))
    got = torch.cat(got, 1)
    assert (got - truth).abs().max() < 0.1
    assert (got.argmax(-1) == truth.argmax(-1)).float().mean() >= 0.95


# -- every move carries the scales: an invariant over random steps -----------------------------

def test_every_block_reads_back_what_was_written_through_random_steps():
    """Random prompts (some sharing a prefix), decodes, forks, copy-on-write, frees, rollbacks and
    swaps out and in on an int8 SharedPagedCache. A token's K/V is a fixed function of (token,
    position, layer), so a block found by a prefix hit must hold the same bytes. After every
    step, every live sequence's slots, gathered through its block table in every layer (in the
    KV pool or the CPU swap pool), are exactly the quantized K/V of its tokens: codes and scales."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    args = tiny_model().args
    L, Hk, D, Hq, bs, V, P = args.n_layers, args.n_kv_heads, args.head_dim, args.n_heads, 4, 3, 40
    K = torch.randn(L, V, P, Hk, D, generator=g) * torch.logspace(-2, 1, D)  # outlier channels
    Vv = torch.randn(L, V, P, Hk, D, generator=g)
    cache = SharedPagedCache(args, 48, bs, 12, P, prefix_caching=True, kv_dtype="int8")
    swap = SwapSpace(cache, 48)
    seqs, swapped, moves = {}, {}, set()

    def write(ids, n):
        """Attend every layer over the last n tokens of each listed sequence (writes them)."""
        for layer in range(L):
            ks = torch.stack([K[layer, seqs[s][-n:], torch.arange(len(seqs[s]) - n, len(seqs[s]))]
                              for s in ids])                                  # (B, n, Hk, D)
            vs = torch.stack([Vv[layer, seqs[s][-n:], torch.arange(len(seqs[s]) - n, len(seqs[s]))]
                              for s in ids])
            cache.attend(layer, torch.randn(len(ids), n, Hq, D, generator=g), ks, vs)

    def check():
        for pool, live in ((cache.managers, seqs), (swap.cpu_managers, swapped)):
            for s, toks in live.items():
                for layer, m in enumerate(pool):
                    slots = m.k_cache_paged[m.blocks_of(s)].flatten(0, 1)[:len(toks)]
                    vslots = m.v_cache_paged[m.blocks_of(s)].flatten(0, 1)[:len(toks)]
                    pos = torch.arange(len(toks))
                    assert torch.equal(slots, quantize_int8(K[layer, toks, pos])), (s, layer)
                    assert torch.equal(vslots, quantize_int8(Vv[layer, toks, pos])), (s, layer)

    for step in range(300):
        op = rng.choice(["new", "new", "decode", "decode", "decode", "fork", "free", "rollback",
                         "swap_out", "swap_in"])
        live = sorted(seqs)
        next_id = min(set(range(12)) - set(seqs) - set(swapped))
        try:
            if op == "new" and len(seqs) + len(swapped) < 10:
                base = [0, 1, 2, 0, 1, 2, 0, 1, 2] if rng.random() < 0.5 else []
                toks = base + [rng.randrange(V) for _ in range(rng.randint(1, 9))]
                skipped = cache.start(next_id, toks)
                seqs[next_id] = toks
                if skipped:
                    moves.add("prefix hit")
                write([next_id], len(toks) - skipped)
                cache.name_blocks(next_id, toks)
            elif op == "decode" and live:
                ids = rng.sample(live, rng.randint(1, len(live)))
                ids = [s for s in ids if len(seqs[s]) < P - 1]
                if ids:
                    before = cache.num_free_blocks
                    cow = sum(cache.managers[0].refs[cache.managers[0].blocks_of(s)[-1]] > 1
                              and len(seqs[s]) % bs for s in ids)
                    cache.prepare(ids, 1)
                    for s in ids:
                        seqs[s].append(rng.randrange(V))
                    write(ids, 1)
                    for s in ids:
                        cache.name_blocks(s, seqs[s])
                    if cow and cache.num_free_blocks < before:
                        moves.add("copy-on-write")
            elif op == "fork" and live and len(seqs) + len(swapped) < 10:
                p = rng.choice(live)
                cache.fork(p, next_id)
                seqs[next_id] = list(seqs[p])
                moves.add("fork")
            elif op == "free" and live:
                s = rng.choice(live)
                cache.free(s)
                del seqs[s]
            elif op == "rollback" and live:
                s = rng.choice(live)
                n = rng.randint(1, len(seqs[s]))
                rollback(cache, s, n)
                del seqs[s][n:]
                moves.add("rollback")
            elif op == "swap_out" and live:
                s = rng.choice(live)
                if swap.can_swap_out(s):
                    swap.swap_out(s)
                    swapped[s] = seqs.pop(s)
                    moves.add("swap")
            elif op == "swap_in" and swapped:
                s = rng.choice(sorted(swapped))
                swap.swap_in(s)
                seqs[s] = swapped.pop(s)
        except Exception as e:          # out of blocks: nothing may have changed
            assert "block" in str(e).lower(), e
        check()
    assert moves == {"prefix hit", "copy-on-write", "fork", "rollback", "swap"}


# -- whole runs through each move: the tokens of a run without it ------------------------------

@pytest.fixture(scope="module")
def f32():
    return tiny_model(dtype=torch.float32)


def prompts_of(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in lengths]


def test_swap_and_recompute_give_the_tokens_of_a_roomy_pool(f32):
    prompts = prompts_of(5, (9, 14, 6, 11))
    want = generate(f32, prompts, 12, cache="paged", block_size=4, stop_tokens=[],
                    kv_dtype="int8")
    for preemption in ("swap", "recompute"):
        engine = Engine(f32, num_blocks=12, block_size=4, preemption=preemption, kv_dtype="int8",
                        max_num_seqs=4)
        for p in prompts:
            engine.add_request(p, 12, stop_tokens=[])
        assert [r.output for r in engine.run()] == want
        assert engine.stats.preemptions > 0
        assert preemption == "recompute" or engine.stats.swapped_blocks > 0


def test_forked_samples_and_prefix_hits_give_the_tokens_of_unshared_runs(f32):
    prompts = prompts_of(6, (10, 7))
    alone = generate(f32, prompts, 10, cache="paged", block_size=4, stop_tokens=[],
                     kv_dtype="int8")
    forked = generate(f32, prompts, 10, cache="paged", block_size=4, stop_tokens=[],
                      kv_dtype="int8", n=3)                       # greedy: 3 equal samples
    assert forked == [[a] * 3 for a in alone]
    shared = [prompts[0] + p for p in prompts_of(7, (3, 5, 9))]   # a 10-token common prefix
    engine = Engine(f32, num_blocks=40, block_size=4, kv_dtype="int8", prefix_caching=True,
                    max_num_seqs=1)
    for p in shared:
        engine.add_request(p, 8, stop_tokens=[])
    assert [r.output for r in engine.run()] == generate(
        f32, shared, 8, cache="paged", block_size=4, stop_tokens=[], kv_dtype="int8")
    assert engine.stats.cached_tokens > 0


class OracleDrafts(Engine):
    """Drafts two right tokens (from a plain run) and a wrong one: every verify pass accepts
    some and rolls the rest back."""
    answers: dict = {}

    def propose(self, req):
        room = req.max_new_tokens - len(req.output) - 1
        right = self.answers[tuple(req.prompt)][len(req.output):][:min(2, room)]
        return right + [(right[-1] + 1) % 512] if room > 2 else right


def test_speculative_rollback_gives_the_tokens_of_plain_decoding(f32):
    prompts = prompts_of(8, (5, 9))
    plain = generate(f32, prompts, 16, cache="paged", block_size=4, stop_tokens=[],
                     kv_dtype="int8")
    OracleDrafts.answers = {tuple(p): out for p, out in zip(prompts, plain)}
    engine = OracleDrafts(f32, num_blocks=40, block_size=4, kv_dtype="int8",
                          speculative="ngram", num_speculative_tokens=3)
    for p in prompts:
        engine.add_request(p, 16, stop_tokens=[])
    assert [r.output for r in engine.run()] == plain
    assert 0 < engine.spec.accepted_tokens < engine.spec.draft_tokens   # some drafts rolled back
    assert engine.spec.rolled_back_blocks > 0


def test_beams_forked_on_int8_blocks_score_as_an_unshared_int8_run(f32):
    """Each beam's score, summed over steps on forked blocks, equals its log-probability
    recomputed token by token on an int8 cache of its own."""
    prompt = prompts_of(9, (6,))[0]
    for tokens, score in beam_search(f32, prompt, 3, 8, block_size=4, stop_tokens=[],
                                     length_penalty=0.0, kv_dtype="int8"):
        cache = PagedCache(f32.args, 10, 4, 1, 32, kv_dtype="int8")
        cache.prepare([0], len(prompt))
        logits = f32(torch.tensor([prompt]), cache=cache)[0, -1]
        total = 0.0
        for t in tokens:
            total += float(torch.log_softmax(logits.detach().double(), -1)[t])
            cache.prepare([0], 1)
            logits = f32(torch.tensor([[t]]), cache=cache)[0, -1]
        assert abs(total - score) < 1e-4


def test_bad_kv_dtype_is_one_clear_error(f32):
    with pytest.raises(RequestError, match="kv_dtype must be None"):
        generate(f32, [[1, 2]], 2, cache="paged", kv_dtype="int4")
    with pytest.raises(RequestError, match="read by the backends 'auto', 'torch', 'cpu', "
                                           "'triton', not 'flash_attn'"):
        generate(f32, [[1, 2]], 2, cache="paged", kv_dtype="int8", backend="flash_attn")


def test_the_speed_layer_serves_int8_blocks_with_the_same_tokens(f32):
    """FastEngine's cache hands int8 layers to stage 4b's attention: the engine's tokens."""
    prompts = prompts_of(10, (7, 12, 3))
    want = generate(f32, prompts, 10, cache="paged", block_size=4, stop_tokens=[],
                    kv_dtype="int8")
    assert generate(f32, prompts, 10, cache="paged", block_size=4, stop_tokens=[],
                    kv_dtype="int8", engine_class=FastEngine) == want


def test_the_chat_and_the_server_take_kv_dtype(capsys):
    """`python -m minipaged.chat --kv-dtype int8` answers as the fp32 blocks do (this prompt's
    reply is the same); with the contiguous cache it is one line and exit 2; the server's
    engine holds int8 blocks."""
    question = ["--prompt", "what is a block?", "--max-new-tokens", "12"]
    assert chat_main(question) == 0
    fp32 = capsys.readouterr().out
    assert chat_main(question + ["--kv-dtype", "int8"]) == 0
    assert capsys.readouterr().out == fp32
    assert chat_main(question + ["--kv-dtype", "int8", "--cache", "contiguous"]) == 2
    assert capsys.readouterr().err.startswith("error: --kv-dtype int8 stores paged blocks")
    loop, _, _, _ = serve_build(kv_dtype="int8", num_blocks=8)
    assert loop.engine.cache.managers[0].k_cache_paged.dtype == torch.int8


def int8_pools(lens, table, k_old, v_old, bs, N):
    """K and V pools (2, N, bs, Hk, D + 2) of int8 slots holding each row's old tokens, the keys
    at sizes from 1e-2 to 1e2 by position."""
    B, _, Hk, D = k_old.shape
    pools = torch.zeros(2, N, bs, Hk, D + 2, dtype=torch.int8)
    for b in range(B):
        for p in range(int(lens[b])):
            blk, off = int(table[b, p // bs]), p % bs
            pools[0, blk, off] = quantize_int8(k_old[b, p] * 10 ** (p % 5 - 2))
            pools[1, blk, off] = quantize_int8(v_old[b, p])
    return pools


@pytest.mark.parametrize("v_size", [1.0, 1e-4])      # 1e-4: every V scale a subnormal fp16
def test_the_c_kernel_reads_int8_slots_as_the_pytorch_path_does(f32, v_size):
    """backend="cpu": stage 3b's C kernel reads each row's codes and float16 scale where they
    lie; a decode step's output is the PyTorch path's (float rounding apart), for keys of many
    sizes and values whose scales are subnormal float16 numbers; whole runs give the same
    tokens."""
    q, lens, table, k_old, v_old, k_new, v_new, bs, N = random_paged_call(2)
    k_new, v_new, q = k_new[:, :1], v_new[:, :1] * v_size, q[:, :1]
    pools = int8_pools(lens, table, k_old, v_old * v_size, bs, N)
    got, want = (flash_attn_with_int8_kvcache(q, *pools.clone(), k_new, v_new, lens, table,
                                              backend=backend) for backend in ("cpu", "torch"))
    assert torch.allclose(got, want, atol=1e-5 * v_size, rtol=1e-4)
    if v_size == 1.0:
        prompts = prompts_of(11, (7, 12))
        assert generate(f32, prompts, 10, cache="paged", block_size=4, stop_tokens=[],
                        kv_dtype="int8", backend="cpu") == \
            generate(f32, prompts, 10, cache="paged", block_size=4, stop_tokens=[],
                     kv_dtype="int8")


# -- the speed layer's own int8 attention -------------------------------------------------------

def fast_int8_step(lengths, new, backend="auto", seed=3, dtype=torch.float32):
    """A FastPagedCache of int8 blocks (2 layers, 4 query heads over 2 KV heads, head_dim 16,
    blocks of 4) whose rows hold `lengths` quantized random tokens, prepared for a step of
    `new` tokens a row."""
    from minipaged.fast import FastPagedCache
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, max_seq_len=96)
    cache = FastPagedCache(args, 48, 4, len(lengths), 96, backend=backend, kv_dtype="int8",
                           dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for m in cache.managers:
        for pool in (m.k_cache_paged, m.v_cache_paged):
            pool.copy_(quantize_int8(torch.randn(*pool.shape[:-1], 16, generator=g)))
    ids = list(range(len(lengths)))
    for s, n in zip(ids, lengths):
        cache.prepare([s], n)
    cache.prepare(ids, new)
    return cache


@pytest.mark.parametrize("new, backend", [(1, "auto"), (5, "auto"), (20, "auto"), (1, "torch"),
                                          (3, "torch")],
                         ids=["decode-C-kernel", "verify-queries-as-rows", "chunk-gathered",
                              "decode-torch", "verify-torch"])
def test_the_speed_layer_reads_int8_blocks_as_the_pytorch_path_does(new, backend):
    """FastPagedCache(kv_dtype="int8").attend writes each new token's codes and scale into the
    slots stage 4b's PyTorch path writes (byte for byte) and attends as it does (float
    rounding apart), on every way the speed layer serves a step: a decode step on the C kernel,
    a verify pass as rows, a chunk gathered and read back, and its PyTorch backend."""
    lengths = [9, 4, 7, 12, 1]
    cache = fast_int8_step(lengths, new, backend)
    a, B = cache.args, len(lengths)
    g = torch.Generator().manual_seed(4)
    for layer, m in enumerate(cache.managers):
        q = torch.randn(B, new, a.n_heads, a.head_dim, generator=g)
        k, v = (torch.randn(B, new, a.n_kv_heads, a.head_dim, generator=g) for _ in range(2))
        pools = m.k_cache_paged.clone(), m.v_cache_paged.clone()
        want = flash_attn_with_int8_kvcache(q, *pools, k, v, cache.cache_seqlens,
                                            cache.block_tables[layer], backend="torch")
        got = cache.attend(layer, q, k, v)
        assert torch.equal(m.k_cache_paged, pools[0]) and torch.equal(m.v_cache_paged, pools[1])
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert cache._implementation == ("cpu" if backend == "auto" else "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[9], [9, 4, 7, 12, 1]])
def test_the_decode_plan_reads_int8_blocks_as_the_caches_attend_does(lengths, dtype):
    """A decode step's `DecodeAttention` (what a compiled step's layers call) on int8 blocks,
    and the C++ `attend` on its plan (operators.cpp, where it builds), for a model in fp32 or
    bf16: k/v quantized into the same slots and bit for bit the output of the cache's
    `attend`."""
    from minipaged.fast import compiled as compiled_module, operators
    ways = ["plan", "attend"] + (["operator"] if operators.build() is None else [])
    out = {}
    for way in ways:
        cache = fast_int8_step(lengths, 1, dtype=dtype)
        a, B = cache.args, len(lengths)
        step = cache.decode_attention() if way == "plan" else cache
        g = torch.Generator().manual_seed(5)
        ys = []
        for layer in range(a.n_layers):
            q, k, v = (torch.randn(B, 1, h, a.head_dim, generator=g).to(dtype)
                       for h in (a.n_heads, a.n_kv_heads, a.n_kv_heads))
            if way == "operator":
                with compiled_module.running_on(cache, B, 1):
                    compiled_module._caches[-1] = None     # the Python function would fail
                    ys.append(torch.ops.minipaged.attend(q, k, v, layer))
            else:
                ys.append(step.attend(layer, q, k, v))
        out[way] = ys, [(m.k_cache_paged.clone(), m.v_cache_paged.clone())
                        for m in cache.managers]
    for way in ways[:1] + ways[2:]:
        for y1, y2 in zip(out[way][0], out["attend"][0]):
            assert y1.dtype == dtype and torch.equal(y1, y2), way
        for (k1, v1), (k2, v2) in zip(out[way][1], out["attend"][1]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), way


def test_the_c_quantizer_writes_quantize_int8s_bytes():
    """The speed layer's quantize-on-write in C (fast/int8_slots.c) writes, into scattered
    slots, the bytes of `quantize_int8` for rows of every magnitude: zeros, scales that are
    subnormal or underflow to 0 in float16, past float16's range (clipped at 65504), ties of
    the rounding (x / scale = k + 0.5) and the bf16 values a bf16 model hands it."""
    from minipaged.fast.paged import int8_writer
    write = int8_writer()
    assert not isinstance(write, str), write
    g = torch.Generator().manual_seed(7)
    B, Hk, D = 64, 2, 32
    x = torch.randn(B, Hk, D, generator=g) * torch.logspace(-10, 10, B)[:, None, None]
    x[0] = 0
    x[1, 0] = torch.arange(D) - 15.5                  # scale 1.0 (max 127): x / scale = k + 0.5
    x[1, 0, 0] = 127
    x[2, 1] = x[1, 0] / 4                             # scale 0.25: ties again
    x[3] = x[3].bfloat16().float()
    slots = torch.randperm(200, generator=g)[:B]
    pool = torch.zeros(200, Hk, D + 2, dtype=torch.int8)
    write(x.contiguous().data_ptr(), pool.data_ptr(), slots.contiguous().data_ptr(), B, Hk, D)
    assert torch.equal(pool[slots], quantize_int8(x))
    assert int((pool.abs().sum((1, 2)) > 0).sum()) <= B                 # nothing else written


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("T, v_size", [(1, 1.0), (3, 1.0), (1, 1e-4)],
                         ids=["decode", "chunk", "decode-subnormal-v-scales"])
def test_the_triton_kernel_reads_int8_slots_as_the_pytorch_path_does(f32, T, v_size,
                                                                     num_splits):
    """backend="triton" (Triton's interpreter on a CPU): the kernel reads each slot's codes and
    float16 scale where they lie, one program per row or split in two; its output is the
    PyTorch path's to float rounding, decode steps and chunks (bottom-right causal) alike, keys
    of many sizes and values whose scales are subnormal float16 numbers; a whole run gives
    the same tokens."""
    q, lens, table, k_old, v_old, k_new, v_new, bs, N = random_paged_call(3)
    k_new, v_new, q = k_new[:, :T], v_new[:, :T] * v_size, q[:, :T]
    pools = int8_pools(lens, table, k_old, v_old * v_size, bs, N)
    want = flash_attn_with_int8_kvcache(q, *pools.clone(), k_new, v_new, lens, table,
                                        backend="torch")
    if num_splits == 1:
        got = flash_attn_with_int8_kvcache(q, *pools, k_new, v_new, lens, table, backend="triton")
    else:                        # stage 3b's kernel called directly, as split in two partitions
        from minipaged.kv_quant import write_new_kv
        from minipaged.triton_attention import triton_paged_attention
        write_new_kv(*pools, quantize_int8(k_new), quantize_int8(v_new), table.long(), lens)
        got = triton_paged_attention(q, *pools, table, lens.long() + T, num_splits=2)
    assert torch.allclose(got, want, atol=1e-5 * v_size, rtol=1e-4)
    if (T, v_size, num_splits) == (1, 1.0, 1):
        prompts = prompts_of(12, (7, 12))
        assert generate(f32, prompts, 6, cache="paged", block_size=4, stop_tokens=[],
                        kv_dtype="int8", backend="triton") == \
            generate(f32, prompts, 6, cache="paged", block_size=4, stop_tokens=[],
                     kv_dtype="int8")
