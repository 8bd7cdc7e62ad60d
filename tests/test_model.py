"""Stage 1: the model and the contiguous cache against ground truths.

- cached generation equals recomputing everything with the no-cache forward;
- our forward equals Meta's reference code and Hugging Face transformers on the same weights;
- the Llama 3.1 rope scaling is really applied.
"""

import json
import math

import pytest
import torch
from conftest import greedy_reference, tiny_model
from meta_reference import meta_transformer

from minipaged import OutOfBlocksError, RequestError, generate, load_model, save_model
from minipaged.kv_cache import ContiguousCache
from minipaged.model import rope_frequencies


def test_contiguous_generation_equals_no_cache_forward(model):
    prompts = [[5, 17, 99, 3, 42, 7, 8], [1, 2], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]]
    out = generate(model, prompts, max_new_tokens=12, cache="contiguous", stop_tokens=[])
    assert [len(o) for o in out] == [12, 12, 12]
    for p, o in zip(prompts, out):
        assert o == greedy_reference(model, p, 12)


def test_meta_and_hf_layouts_give_identical_logits(tmp_path):
    model = tiny_model(dtype=torch.float32)
    save_model(model, tmp_path / "meta", layout="meta")
    save_model(model, tmp_path / "hf", layout="hf")
    # The layouts really differ on disk: HF renames tensors and permutes q/k rows.
    assert (tmp_path / "meta" / "consolidated.00.pth").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    a, b = load_model(tmp_path / "meta"), load_model(tmp_path / "hf")
    x = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
        assert torch.equal(a(x), model(x))


def test_matches_meta_reference_forward_and_its_cached_decoding(tmp_path):
    model = tiny_model(dtype=torch.float32)
    save_model(model, tmp_path, layout="meta")
    params = json.loads((tmp_path / "params.json").read_text())
    params = {k: v for k, v in params.items() if k not in ("stop_tokens", "rope_scale_factor", "max_seq_len")}
    ref = meta_transformer(params, torch.load(tmp_path / "consolidated.00.pth", weights_only=True))
    ours = load_model(tmp_path)
    x = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        assert torch.allclose(ours(x), ref(x, start_pos=0), atol=1e-4)
        # Meta's own KV cache, fed token by token, against ours.
        cache = ContiguousCache(ours.args, max_batch=2, max_seq_len=64)
        cache.prepare([0, 1], 20)
        ref(x[:, :20], start_pos=0)
        ours(x[:, :20], cache=cache)
        for pos in range(20, 30):
            cache.prepare([0, 1], 1)
            assert torch.allclose(ours(x[:, pos:pos + 1], cache=cache),
                                  ref(x[:, pos:pos + 1], start_pos=pos), atol=1e-4)


def hf_reference(folder):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_matches_transformers_with_llama31_rope_scaling(tmp_path):
    model = tiny_model(dtype=torch.float32, rope_scale_factor=32.0, max_seq_len=1024)
    save_model(model, tmp_path)
    ref = hf_reference(tmp_path)
    x = torch.randint(0, 512, (1, 700))   # long enough for the scaled band to matter
    with torch.no_grad():
        expected = ref(x).logits
        assert torch.allclose(load_model(tmp_path)(x), expected, atol=1e-4)
        # A model that ignored the scaling would be measurably wrong against the reference.
        model.args.use_scaled_rope = False
        model.rope_freqs = rope_frequencies(model.args)
        assert (model(x) - expected).abs().max() > 1e-2


def test_rope_scaling_against_the_published_formula():
    args = tiny_model(dtype=torch.float32, dim=256, n_heads=2, n_kv_heads=1).args
    d = args.head_dim
    ours = rope_frequencies(args).tolist()
    for i, f in enumerate(ours):   # Meta's apply_scaling, one frequency at a time
        base = 1.0 / (args.rope_theta ** (2 * i / d))
        wavelen = 2 * math.pi / base
        if wavelen < 8192 / 4:
            want = base
        elif wavelen > 8192 / 1:
            want = base / 8
        else:
            s = (8192 / wavelen - 1) / (4 - 1)
            want = (1 - s) * base / 8 + s * base
        assert f == pytest.approx(want, rel=1e-5)
    assert ours[-1] == pytest.approx(1.0 / (args.rope_theta ** ((d - 2) / d)) / 8, rel=1e-5)


def test_tied_embeddings_round_trip(tmp_path):
    model = tiny_model(dtype=torch.float32, tie_word_embeddings=True)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    x = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        assert torch.allclose(loaded(x), hf_reference(tmp_path)(x).logits, atol=1e-4)


def test_dtype_and_stop_tokens_come_from_the_checkpoint(tmp_path):
    save_model(tiny_model(dtype=torch.float32), tmp_path, dtype=torch.bfloat16)
    m = load_model(tmp_path)
    assert m.tok_embeddings.weight.dtype == torch.bfloat16
    assert load_model(tmp_path, dtype=torch.float32).tok_embeddings.weight.dtype == torch.float32
    # 512 = 256 ranks + 256 specials: end_of_text, eom_id, eot_id sit at 257, 264, 265.
    assert m.args.stop_tokens == [257, 264, 265]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_attends_each_row_over_its_own_slots_only(dtype):
    """The contiguous cache's decode reads each row's first n slots in place: it equals
    attention written out by hand in float64, with NaN in every slot past a row's length and
    in the rows the step leaves out."""
    args = tiny_model().args
    Hq, Hk, D = args.n_heads, args.n_kv_heads, args.head_dim
    cache = ContiguousCache(args, max_batch=5, max_seq_len=40, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    lengths = {3: 17, 0: 5, 4: 30, 1: 1}                       # row: tokens stored before
    for layer in range(args.n_layers):
        cache.k_cache[layer].fill_(float("nan"))
        cache.v_cache[layer].fill_(float("nan"))
    for row, n in lengths.items():
        cache.prepare([row], n)
        for layer in range(args.n_layers):
            shape = (1, n, Hk, D)
            cache.attend(layer, torch.randn(1, n, Hq, D, generator=gen).to(dtype),
                         torch.randn(shape, generator=gen).to(dtype),
                         torch.randn(shape, generator=gen).to(dtype))
    rows = list(lengths)
    cache.prepare(rows, 1)
    q = torch.randn(len(rows), 1, Hq, D, generator=gen).to(dtype)
    k = torch.randn(len(rows), 1, Hk, D, generator=gen).to(dtype)
    v = torch.randn(len(rows), 1, Hk, D, generator=gen).to(dtype)
    out = cache.attend(1, q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    for b, (row, n) in enumerate(lengths.items()):
        keys = cache.k_cache[1][row, :n + 1].double()           # (n + 1, Hk, D), the new one last
        values = cache.v_cache[1][row, :n + 1].double()
        assert torch.equal(keys[-1], k[b, 0].double()) and torch.equal(values[-1], v[b, 0].double())
        for h in range(Hq):
            g = h // (Hq // Hk)                                 # the kv head this head reads
            weights = torch.softmax(keys[:, g] @ q[b, 0, h].double() / math.sqrt(D), dim=0)
            expected = weights @ values[:, g]
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out[b, 0, h].double(), expected, atol=tolerance, rtol=0)


def test_the_contiguous_cache_refuses_a_bad_step_before_changing_anything():
    """Rows outside the batch, a count that is not a token count, or a row that would outgrow
    its max_seq_len slots raise one clear error, and the lengths and the step stay as they were."""
    cache = ContiguousCache(tiny_model().args, max_batch=3, max_seq_len=8)
    cache.prepare([0, 2], 5)
    before = (cache.seq_lens.clone(), cache.rows.clone(), cache.positions.clone())
    for seq_ids, n, error, words in [([3], 1, RequestError, "must lie in"),
                                     ([], 1, RequestError, "must lie in"),
                                     ([-1], 1, RequestError, "must lie in"),
                                     ([0], -1, RequestError, "token count"),
                                     ([1], 1.5, RequestError, "token count"),
                                     ([1, 2], 4, OutOfBlocksError, "reach 9 tokens")]:
        with pytest.raises(error, match=words):
            cache.prepare(seq_ids, n)
        after = (cache.seq_lens, cache.rows, cache.positions)
        assert all(torch.equal(x, y) for x, y in zip(before, after)), (seq_ids, n)
    cache.prepare([1, 2], 3)                                    # row 2 fills its 8 slots exactly
    assert cache.seq_lens.tolist() == [5, 3, 8] and cache.positions.tolist()[1] == [5, 6, 7]
