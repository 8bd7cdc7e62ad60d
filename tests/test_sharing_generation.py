"""Stage 6 end to end: parallel samples and prefix caching give exactly the tokens of plain
generation. Ground truth: the no-cache forward (greedy) and the contiguous cache, which shares
nothing and runs each of the n samples of a prompt as a prompt of its own (seeded sampling)."""

import random

import pytest
import torch

from conftest import greedy_reference, tiny_model
from minipaged import generate
from minipaged import Engine
from minipaged.errors import RequestError
from minipaged.generation import row_generator

BS = 8


def prompts_with_a_system_prompt(k=3, system=21, seed=0):
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(1, 500) for _ in range(system)]
    return [sys_prompt + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
            for _ in range(k)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def test_greedy_samples_and_prefix_hits_match_the_no_cache_forward(model):
    prompts = prompts_with_a_system_prompt()
    out = generate(model, prompts, 10, cache="paged", block_size=BS, n=3, stop_tokens=[])
    for p, samples in zip(prompts, out):
        assert samples == [greedy_reference(model, p, 10)] * 3


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_seeded_samples_are_the_contiguous_runs_of_each_prompt_repeated(model, prefix_caching):
    prompts = prompts_with_a_system_prompt(seed=2)
    kw = dict(temperature=1.0, top_p=0.9, seed=7, stop_tokens=[], n=4)
    paged = generate(model, prompts, 12, cache="paged", block_size=BS,
                     prefix_caching=prefix_caching, **kw)
    contiguous = generate(model, prompts, 12, cache="contiguous", **kw)
    assert paged == contiguous
    repeated = generate(model, [p for p in prompts for _ in range(4)], 12, cache="contiguous",
                        temperature=1.0, top_p=0.9, seed=7, stop_tokens=[])
    assert [s for samples in paged for s in samples] == repeated   # the documented seed rule
    assert all(len({tuple(s) for s in samples}) > 1 for samples in paged)   # streams differ


def test_n1_keeps_the_flat_shape_and_stage1_streams(model):
    prompts = prompts_with_a_system_prompt(k=2)
    kw = dict(temperature=1.0, seed=3, stop_tokens=[])
    out = generate(model, prompts, 5, cache="paged", block_size=BS, n=1, **kw)
    assert out == generate(model, prompts, 5, cache="contiguous", **kw)
    assert all(isinstance(t, int) for t in out[0])
    with pytest.raises(RequestError):
        generate(model, prompts, 5, n=0)


def run_engine(model, requests, **options):
    """requests: (prompt, max_new_tokens, arrival_step, n, seed index)."""
    engine = Engine(model, options.pop("num_blocks", 200), BS, max_num_seqs=16, **options)
    for prompt, m, arrival, n, index in requests:
        gens = [row_generator(5, index + j) for j in range(n)]
        engine.add_request(prompt, m, temperature=1.0, stop_tokens=[], arrival_step=arrival,
                           n=n, generators=gens)
    return [r.output for r in engine.run()], engine.stats


def expected(model, requests):
    """Each sample alone on the contiguous cache, with its own stream."""
    return [_alone(model, prompt, m, row_generator(5, index + j))
            for prompt, m, _, n, index in requests for j in range(n)]


def _alone(model, prompt, m, generator):
    engine = Engine(model, 100, BS, prefix_caching=False)
    engine.add_request(prompt, m, temperature=1.0, stop_tokens=[], generator=generator)
    return engine.run()[0].output


def test_a_system_prompt_and_a_next_chat_turn_hit_the_prefix_cache(model):
    system, first_q = prompts_with_a_system_prompt(k=1, system=30)[0][:30], [7, 8, 9]
    first = system + first_q
    first_answer = _alone(model, first, 12, row_generator(5, 0))
    second_turn = first + first_answer + [11, 12, 13]       # the history, then the new message
    requests = [(first, 12, 0, 1, 0), (system + [4, 5], 6, 3, 1, 1),
                (second_turn, 6, 20, 1, 2), (first, 12, 40, 1, 0)]   # last: a full repeat
    out, stats = run_engine(model, requests, prefix_caching=True)
    assert out == expected(model, requests)
    assert out[0] == out[3] == first_answer
    # system: 3 blocks of 8 hit; the next turn: the blocks the first turn filled (the cache
    # held first + answer but the answer's last token);
    # the repeat: every block but the one holding its last token.
    hits = 3 * BS + (len(first) + 11) // BS * BS + (len(first) - 1) // BS * BS
    assert stats.cached_tokens == hits
    _, off = run_engine(model, requests, prefix_caching=False)
    assert off.cached_tokens == 0
    assert off.prefill_tokens - stats.prefill_tokens == hits


def test_parallel_samples_share_the_prompt_blocks(model):
    prompt = prompts_with_a_system_prompt(k=1, system=40)[0]          # 41..51 tokens
    requests = [(prompt, 6, 0, 4, 0)]
    out, shared = run_engine(model, requests)
    assert out == expected(model, requests)
    engine = Engine(model, 200, BS, max_num_seqs=16)                  # 4 independent copies
    for j in range(4):
        engine.add_request(prompt, 6, temperature=1.0, stop_tokens=[],
                           generator=row_generator(5, j))
    engine.run()
    assert [r.output for r in engine.requests] == out
    blocks_alone = -(-(len(prompt) + 5) // BS)
    assert engine.stats.peak_used_blocks == 4 * blocks_alone
    full = len(prompt) // BS                                          # shared for good
    assert shared.peak_used_blocks == 4 * blocks_alone - 3 * full
    assert shared.prefill_tokens == len(prompt)                       # one prefill for four


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_forked_groups_survive_preemption(model, preemption):
    prompts = prompts_with_a_system_prompt(k=3, system=13, seed=4)
    requests = [(p, 14, 0, 3, 3 * i) for i, p in enumerate(prompts)]
    out, stats = run_engine(model, requests, num_blocks=14, preemption=preemption,
                            prefix_caching=True)
    assert stats.preemptions > 0
    assert out == expected(model, requests)


def test_the_pool_is_whole_again_after_everything_finishes(model):
    prompts = prompts_with_a_system_prompt(k=3, system=17, seed=5)
    engine = Engine(model, 40, BS, max_num_seqs=16, prefix_caching=True)
    for p in prompts:
        engine.add_request(p, 9, n=2, stop_tokens=[])
    engine.run()
    for m in engine.cache.managers:
        assert m.live_seq_ids() == [] and not m.refs.any()
        assert m.num_free_blocks == 40 and m.num_cached_free_blocks > 0
    with torch.no_grad():
        assert [r.output for r in engine.requests] == \
            [greedy_reference(model, p, 9) for p in prompts for _ in range(2)]


def test_a_prompt_seen_in_full_recomputes_only_its_last_block(model):
    prompt = prompts_with_a_system_prompt(k=1, system=24)[0][:3 * BS]   # exactly 3 full blocks
    engine = Engine(model, 40, BS, prefix_caching=True)
    first = engine.add_request(prompt, 5, stop_tokens=[])
    engine.run()
    again = engine.add_request(prompt, 5, stop_tokens=[])
    engine.run()
    assert engine.stats.cached_tokens == 2 * BS                         # not the last block
    assert engine.stats.prefill_tokens == 3 * BS + BS
    assert first.output == again.output == greedy_reference(model, prompt, 5)
