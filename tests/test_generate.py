"""Stage 1: batched generation on the contiguous cache — sampling, stopping, bad requests."""

import pytest
import torch
from conftest import greedy_reference, tiny_model

from minipaged import RequestError, generate
from minipaged.kv_cache import ContiguousCache

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]


def test_a_stop_token_ends_only_its_own_sequence(model):
    free = generate(model, PROMPTS, 10, stop_tokens=[])
    stop = free[0][3]                       # the 4th token prompt 0 would produce
    out = generate(model, PROMPTS, 10, stop_tokens=[stop])
    for o, f in zip(out, free):             # each cut before its own first stop token
        assert o == (f[:f.index(stop)] if stop in f else f)
    assert len(out[0]) <= 3 < 10            # prompt 0 really was cut short


def test_default_stop_tokens_are_the_models(model):
    model.args.stop_tokens = [generate(model, [PROMPTS[1]], 5, stop_tokens=[])[0][2]]
    assert len(generate(model, [PROMPTS[1]], 5)[0]) == 2


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model):
    kw = dict(temperature=1.0, top_p=0.9, stop_tokens=[], seed=7)
    batch = generate(model, PROMPTS, 8, **kw)
    assert batch == generate(model, PROMPTS, 8, **kw)
    alone = generate(model, [PROMPTS[0]], 8, **kw)
    assert alone[0] == batch[0]
    assert generate(model, PROMPTS, 8, **{**kw, "seed": 8}) != batch


def test_tiny_top_p_is_greedy(model):
    sampled = generate(model, PROMPTS, 8, temperature=0.8, top_p=1e-9, stop_tokens=[])
    assert sampled == generate(model, PROMPTS, 8, stop_tokens=[])


def test_the_contiguous_cache_reports_reserved_vs_used(model):
    cache = ContiguousCache(model.args, max_batch=3, max_seq_len=32, dtype=torch.float64)
    seen = []
    generate(model, PROMPTS, 4, cache=cache, stop_tokens=[],
             callback=lambda event, i, t, c: seen.append(c.usage()[0][:]))
    assert seen[0] == [4, 0, 0]                # after prompt 0's prefill
    assert seen[2] == [4, 9, 1]                # all three prefilled
    used, reserved = cache.usage()
    assert reserved == [32, 32, 32] and used == [0, 0, 0]   # freed at the end, still reserved


def test_max_new_tokens_zero_and_one(model):
    assert generate(model, PROMPTS, 0) == [[], [], []]
    assert generate(model, PROMPTS, 1, stop_tokens=[]) == [greedy_reference(model, p, 1) for p in PROMPTS]


@pytest.mark.parametrize("prompts, n, match", [
    ([], 4, "non-empty list"),
    ([[1, 2], []], 4, "prompt 1 is empty"),
    ([[1, 600]], 4, "outside"),
    ([[1, 2.5]], 4, "non-integer"),
    ([[1, 2]], -1, "max_new_tokens"),
    ([list(range(250))], 10, "needs 260 positions, but the cache holds 256"),
])
def test_bad_requests_fail_before_any_work(model, prompts, n, match):
    with pytest.raises(RequestError, match=match):
        generate(model, prompts, n)


def test_bad_sampling_options(model):
    with pytest.raises(RequestError, match="temperature"):
        generate(model, PROMPTS, 2, temperature=-1)
    with pytest.raises(RequestError, match="top_p"):
        generate(model, PROMPTS, 2, temperature=1, top_p=0)
    with pytest.raises(RequestError, match="unknown cache"):
        generate(model, PROMPTS, 2, cache="magic")


def test_bfloat16_model_generates(model):
    m = tiny_model(dtype=torch.bfloat16)
    out = generate(m, PROMPTS, 5, stop_tokens=[])
    assert [len(o) for o in out] == [5, 5, 5]
