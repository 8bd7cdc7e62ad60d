"""Stage 6b end to end: beam search on shared blocks finds exactly the hypotheses and scores of
a beam search written here over the no-cache forward — every beam recomputed from scratch at
every step, and run to max_new_tokens with no early stop — on tiny random models (float64) and
on SmolLM2-135M's real weights. The contiguous cache, which shares nothing, agrees too, and
beam_width=1 is greedy generation."""

import random

import pytest
import torch

from conftest import tiny_model
from minipaged import beam_search, generate, load_model, load_tokenizer
from minipaged.beams import BeamSearch
from minipaged.benchmarks.beam_savings import beam_savings
from minipaged.errors import RequestError
from minipaged.formats import packaged_model_path


def reference_beam_search(model, prompt, beam_width, max_new_tokens, length_penalty, stop):
    """Beam search the plain way: each step, every live beam's whole sequence through
    `model(tokens)`; the best beam_width of all (sum, beam, token) candidates survive; a stop
    token finishes its hypothesis, and so does the last step. No early stop."""
    live, finished = [([], 0.0)], []                     # finished: (tokens, sum, length)
    for length in range(1, max_new_tokens + 1):
        candidates = []
        for i, (tokens, total) in enumerate(live):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens]))[0, -1]
            logp = torch.log_softmax(logits.double(), dim=-1).tolist()
            candidates += [(total + lp, i, t) for t, lp in enumerate(logp)]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        next_live = []
        for total, i, t in candidates[:beam_width]:
            tokens = live[i][0]
            if t in stop:
                finished.append((tokens, total, length))
            elif length == max_new_tokens:
                finished.append((tokens + [t], total, length))
            else:
                next_live.append((tokens + [t], total))
        live = next_live
        if not live:
            break
    ranked = sorted(finished, key=lambda h: -h[1] / h[2] ** length_penalty)
    return [(tokens, total / n ** length_penalty) for tokens, total, n in ranked[:beam_width]]


def assert_same(got, want):
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-6, abs=1e-6)


def case(seed):
    """A prompt and a stop set of 40 ids out of 512, so that hypotheses do finish early."""
    rng = random.Random(seed)
    prompt = [rng.randrange(512) for _ in range(rng.randrange(2, 15))]
    return prompt, rng.sample(range(512), 40)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beam_width", [2, 3, 5])
@pytest.mark.parametrize("length_penalty", [-0.5, 0.0, 1.0, 2.0])
def test_both_caches_find_the_reference_hypotheses(seed, beam_width, length_penalty):
    model = tiny_model(seed % 2)
    prompt, stop = case(seed)
    want = reference_beam_search(model, prompt, beam_width, 9, length_penalty, stop)
    for cache, block_size in [("paged", 4), ("paged", 1), ("paged", 16), ("contiguous", 16)]:
        got = beam_search(model, prompt, beam_width, 9, cache=cache, block_size=block_size,
                          length_penalty=length_penalty, stop_tokens=stop)
        assert_same(got, want)
        assert len(got) == beam_width


@pytest.mark.parametrize("length_penalty", [-0.5, 0.0, 0.5])
def test_stopping_early_never_changes_the_result(length_penalty):
    """Seed 0's stop set finishes four hypotheses within a few steps: the search ends long
    before max_new_tokens, with the result of the reference, which never stops early."""
    model = tiny_model(0)
    prompt, stop = case(0)
    search = BeamSearch(model, prompt, 4, 16, block_size=4, length_penalty=length_penalty,
                        stop_tokens=stop)
    got = search.run()
    assert len(search.history) < 16 and search.beams          # it gave up on live beams
    assert_same(got, reference_beam_search(model, prompt, 4, 16, length_penalty, stop))


def sum_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens]))[0].double(), dim=-1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))


@pytest.mark.parametrize("length_penalty", [0.5, 1.0])
def test_length_counts_the_stop_token_which_is_not_returned(length_penalty):
    """The stop token is the greedy continuation's third token: some hypotheses end with it.
    Their score divides the log-probabilities of their tokens and of the stop token by the
    number of those tokens, stop token included."""
    model = tiny_model(1)
    prompt = [5, 17, 300, 42]
    stop = generate(model, [prompt], 3, stop_tokens=[])[0][2]
    got = beam_search(model, prompt, 4, 8, block_size=4, length_penalty=length_penalty,
                      stop_tokens=[stop])
    stopped = [(t, s) for t, s in got if len(t) < 8]
    assert stopped and all(stop not in t for t, _ in got)
    for tokens, s in got:
        if len(tokens) < 8:                                   # ended by the stop token
            want = sum_logprobs(model, prompt, tokens + [stop]) / (len(tokens) + 1) ** \
                length_penalty
        else:                                                 # ran to max_new_tokens
            want = sum_logprobs(model, prompt, tokens) / len(tokens) ** length_penalty
        assert s == pytest.approx(want, rel=1e-6)
    assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)


@pytest.mark.parametrize("stop_tokens", [[], None])
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_beam_width_one_is_greedy(cache, stop_tokens):
    model = tiny_model(2, stop_tokens=[7, 99, 250])
    for seed in range(3):
        prompt, _ = case(seed)
        (tokens, _), = beam_search(model, prompt, 1, 12, cache=cache, block_size=4,
                                   stop_tokens=stop_tokens)
        assert tokens == generate(model, [prompt], 12, stop_tokens=stop_tokens)[0]


def test_a_small_pool_fits_because_beams_share():
    """Four beams of prompt 30 + 10 tokens each need 12 blocks of 4 unshared, 48 in all; the
    search runs in a pool of 24 and finds the same hypotheses."""
    model = tiny_model(0)
    prompt = list(range(100, 130))
    full = beam_search(model, prompt, 4, 10, block_size=4, stop_tokens=[])
    small = beam_search(model, prompt, 4, 10, block_size=4, stop_tokens=[], num_blocks=24)
    assert small == full
    search = BeamSearch(model, prompt, 4, 10, block_size=4, stop_tokens=[], num_blocks=24)
    search.run()
    assert max(shared for shared, _ in search.blocks_held) <= 24 < \
        max(unshared for _, unshared in search.blocks_held)


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0), "beam_width"), (dict(beam_width=513), "beam_width"),
    (dict(beam_width=2.0), "beam_width"), (dict(max_new_tokens=0), "max_new_tokens >= 1"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(length_penalty=float("nan")), "finite"),
    (dict(length_penalty="1"), "length_penalty"), (dict(length_penalty=True), "length_penalty"),
    (dict(stop_tokens=[512]), "stop_tokens"), (dict(cache="tree"), "cache='paged'"),
    (dict(num_blocks=10, cache="contiguous"), "with num_blocks"),
    (dict(temperature=1.0), "with temperature"),
    (dict(prompt=[]), "empty"), (dict(prompt=[1, 600]), "outside"),
    (dict(prompt=[1] * 250), "positions"), (dict(block_size=0), "block_size"),
])
def test_bad_requests_say_what_to_do(kwargs, match):
    args = dict(model=tiny_model(0), prompt=[1, 2, 3], beam_width=2, max_new_tokens=8)
    args.update(kwargs)
    with pytest.raises(RequestError, match=match):
        beam_search(**args)


def test_real_weights_smollm2():
    """SmolLM2-135M (its GGUF file, in float64): a few steps of the search on both caches
    against the reference over the no-cache forward."""
    file = packaged_model_path("smollm2")
    smollm2 = load_model(file, dtype=torch.float64)
    prompt = load_tokenizer(file).encode("The capital of France is")
    want = reference_beam_search(smollm2, prompt, 3, 4, 1.0, set(smollm2.args.stop_tokens))
    for cache in ("paged", "contiguous"):
        got = beam_search(smollm2, prompt, 3, 4, cache=cache, block_size=4)
        assert_same(got, want)
    assert len({tuple(t) for t, _ in want}) == 3


def test_the_benchmark_counts_blocks_shared_and_unshared():
    model = tiny_model(0, dtype=torch.float32)
    trace = [(list(range(1, 20)), 12), (list(range(40, 45)), 1)]
    result = beam_savings(model, trace, 3, block_size=4)
    assert result.same and len(result.held) == len(result.unshared) == 12 + 1
    assert result.unshared[0] == result.held[0] == 5              # the prompt, before any beam
    assert all(h <= u for h, u in zip(result.held, result.unshared))
    assert 0 < result.per_prompt[0] < 1 and result.per_prompt[1] == 0   # one token: one beam
    assert 0 < result.saved < 1
