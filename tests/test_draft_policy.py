"""Stage 7's drafting policy (`draft_policy.py`): its per-request rule step by step, its
per-step gate against a brute-force search over every choice of drafts, and through every
switch (adapt_k, batch_gate) the greedy tokens of the no-cache forward, with drafts that are
rejected at every place, preemption and a token budget. Sampling through the policy keeps the
model's distribution (exact probabilities of a Markov chain, chi-square), and an engine that
accepts every draft fails the same test."""

import itertools
import math
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import FakeModel, greedy_reference, tiny_model
from minipaged import generate
from minipaged.draft_policy import MAX_WAIT, DraftPolicy, StepCosts
from minipaged.errors import RequestError
from minipaged.scheduler import Request
from minipaged.speculative import SpeculativeEngine
from test_speculative import PlantedDrafts, repetitive_prompts, run

SWITCHES = list(itertools.product([False, True], repeat=2))      # (adapt_k, batch_gate)
# on three rows, drafts kept half the time pay (three of them: 4.5 tokens for 1.4 of time,
# against 3 for 1) and drafts kept a third of the time never do (3 + m / 3 < 3 (1.1 + m / 10))
COSTS = StepCosts(batches=[1, 3], plain=[1.0, 1.0], fixed=[0.1, 0.1], per_draft=[0.1, 0.1],
                  segment=[0.0, 0.0])
# drafts pay on a batch of one but not on three rows, at any rate of acceptance below 0.9
ONE_NOT_THREE = StepCosts([1, 3], [1.0, 1.0], [0.1, 0.1], [0.2, 0.2], [0.0, 0.0])
CHEAP = StepCosts([1], [1.0], [0.0], [0.01], [0.0])          # every draft pays


def asked(policy, req, found=True, k=4):
    """One step of the policy for one request: what it let lookup ask for."""
    engine = SimpleNamespace(num_speculative_tokens=k, step_count=0)
    policy.drafts([req], lambda r: [7] * policy.k_for(r, k) if found else [], engine)
    return policy.states[req].asked


# -- the rules, by hand ---------------------------------------------------------------------------
def test_k_follows_the_last_verify_and_backs_off_after_misses():
    p, r = DraftPolicy(batch_gate=False), Request(0, [1], 100)
    assert asked(p, r) == 4                     # all k at first
    p.update(r, 4, 4)
    assert asked(p, r) == 4                     # all kept: twice as many, at most k
    p.update(r, 4, 1)
    assert asked(p, r) == 2                     # 1 of 4 kept: 1 + 1
    p.update(r, 2, 2)
    assert asked(p, r) == 4                     # 2 of 2: 4
    waits = []
    for _ in range(7):                          # probes that keep nothing
        p.update(r, asked(p, r) if waits else 4, 0)
        n = 0
        while asked(p, r) == 0:
            n += 1
        waits.append(n)
        assert p.states[r].asked == 1    # after the pause, a probe of one draft
    assert waits == [1, 2, 4, 8, 16, MAX_WAIT, MAX_WAIT]
    p.update(r, 1, 1)
    assert asked(p, r) == 2                     # a kept probe grows again


def test_a_lookup_that_finds_nothing_pauses_the_next_ones():
    p, r = DraftPolicy(batch_gate=False), Request(0, [1], 100)
    pattern = [asked(p, r, found=False) for _ in range(15)]
    assert pattern == [4, 0, 4, 0, 0, 4, 0, 0, 0, 0, 4, 0, 0, 0, 0]
    assert asked(p, r, found=True) == 4                    # found: the pauses start again at 1
    assert [asked(p, r, found=False) for _ in range(4)] == [4, 0, 4, 0]


def test_fixed_asks_for_k_every_step():
    p, r = DraftPolicy(adapt_k=False, batch_gate=False), Request(0, [1], 100)
    for kept in (0, 0, 0, 4, 1):
        assert asked(p, r) == 4
        p.update(r, 4, kept)


def test_step_costs_interpolate_between_batches_and_grow_past_the_last():
    c = StepCosts([1, 4], [1.0, 2.0], [0.2, 0.5], [0.1, 0.04], [0.0, 0.3])
    assert c.at(1) == (1.0, 0.2, 0.1, 0.0) and c.at(4) == (2.0, 0.5, 0.04, 0.3)
    assert c.at(2) == pytest.approx((4 / 3, 0.3, 0.08, 0.1))
    assert c.at(8) == pytest.approx((4.0, 1.0, 0.04, 0.3))


def rate(alphas, counts, costs):
    """Expected tokens per second of a step running counts[j] drafts of request j."""
    B = len(alphas)
    plain, fixed, per, seg = costs.at(B)
    if not any(counts):
        return B / plain
    gain = sum(a ** i for a, n in zip(alphas, counts) for i in range(1, n + 1))
    return (B + gain) / (plain + fixed + sum(counts) * per + seg * (0 in counts))


def brute_force(alphas, lengths, costs):
    """The best rate over every choice of requests that draft and their common count c."""
    best = rate(alphas, [0] * len(alphas), costs)
    for c in range(1, max(lengths) + 1):
        for chosen in itertools.product([0, 1], repeat=len(alphas)):
            if all(n >= c for n, x in zip(lengths, chosen) if x):
                best = max(best, rate(alphas, [c * x for x in chosen], costs))
    return best


def test_the_gate_finds_the_best_choice_of_drafts():
    rng = random.Random(0)
    for _ in range(300):
        B = rng.randint(1, 4)
        costs = StepCosts([1, 4], [rng.uniform(0.5, 2), rng.uniform(1, 4)],
                          [rng.uniform(0, 0.5), rng.uniform(0, 1)],
                          [rng.uniform(0, 0.3), rng.uniform(0, 0.5)],
                          [0.0, rng.uniform(0, 0.5)])
        p = DraftPolicy(step_costs=costs)
        reqs = [Request(i, [1], 100) for i in range(B)]
        alphas, lengths = [], []
        for r in reqs:
            p.update(r, 4, rng.randint(0, 4))
            p.update(r, 4, rng.randint(0, 4))
            alphas.append(p.alpha(r))
            lengths.append(rng.randint(0, 4))
        if not any(lengths):
            continue
        counts = p.best_counts(dict(zip(reqs, lengths)))
        got = [counts.get(r, 0) for r in reqs]
        assert rate(alphas, got, costs) == pytest.approx(brute_force(alphas, lengths, costs))
        assert all(g <= n for g, n in zip(got, lengths)) and len(set(got) - {0}) <= 1


def test_the_gate_opens_on_one_row_and_closes_on_three():
    p = DraftPolicy(step_costs=ONE_NOT_THREE)
    one, three = [Request(0, [1], 100)], [Request(i, [1], 100) for i in range(3)]
    # two drafts: 1.75 / 1.5 beats one (1.5 / 1.3), three (1.875 / 1.7) and none (1 / 1)
    assert p.best_counts({one[0]: 4}) == {one[0]: 2}
    assert p.best_counts({r: 4 for r in three}) == {}


def test_observed_steps_correct_the_costs_until_drafts_stop_paying():
    """Measured: a step 1 s, a draft 0.01 s (CHEAP: drafts pay). The steps then run take 2 s
    plain and 2 s more per draft: the corrected costs reach that, one step at a time, and the
    gate closes (one row of alpha 0.9: at best 1.9 tokens in 4 s, against 1 in 2 s)."""
    p = DraftPolicy(step_costs=CHEAP, follow_steps=True)
    r = Request(0, [1], 100)
    for _ in range(8):
        p.update(r, 4, 4)                    # every draft kept: alpha near 1 ...
    p.update(r, 4, 3)                        # ... but not quite
    assert p.best_counts({r: 4}) == {r: 4}
    for _ in range(60):
        p.observe([0], 2.0)
        p.observe([4], 2.0 + 4 * 2.0)
    plain, fixed, per, _ = p.costs(1)
    assert plain == pytest.approx(2.0, rel=0.02) and per == pytest.approx(2.0, rel=0.02)
    assert p.best_counts({r: 4}) == {}
    p.observe([0], 1e6)                      # one step slowed by something else: a quarter,
    assert p.costs(1)[0] == pytest.approx(2.0 * (0.8 + 0.2 * 4))   # at most 4x, of the way


def test_the_engine_tells_the_policy_what_its_steps_took(tiny):
    """Costs given are decided by as they are, unless asked to follow the steps; measured ones
    (the speed layer's default) follow them."""
    for follow in (True, None):
        policy = DraftPolicy(step_costs=CHEAP, follow_steps=follow)   # 1 s a step: far more
        run(tiny, repetitive_prompts(), 16, num_blocks=64, block_size=4, speculative="ngram",
            num_speculative_tokens=3, draft_policy=policy)               # than the tiny model's
        moved = policy.plain_scale < 0.9 and policy.draft_scale < 1.0
        assert moved if follow else (policy.plain_scale, policy.draft_scale) == (1.0, 1.0)


def test_lookup_pauses_while_the_gate_runs_none_of_what_it_finds():
    """Three rows that may ask for 4 drafts each could pay (COSTS), but lookup finds one draft
    for one row, which cannot: the gate runs nothing, and lookup pauses 1 step, then 2, then 4;
    a batch of another size looks again at once."""
    p, calls = DraftPolicy(step_costs=COSTS, adapt_k=False), []

    def propose(r):
        calls.append(step)
        return [7] if r.req_id == 0 else []
    three = [Request(i, [1], 100) for i in range(3)]
    for step in range(12):
        assert p.drafts(three, propose, SimpleNamespace(num_speculative_tokens=4,
                                                        step_count=step)) == {}
    assert sorted(set(calls)) == [0, 2, 5, 10]         # looked, paused 1, 2, then 4 steps
    calls.clear()
    p.drafts(three[:2], propose, SimpleNamespace(num_speculative_tokens=4, step_count=step + 1))
    assert calls                                       # two rows: another gate, looked again


def test_stage_7_drafts_every_step_by_default_and_the_speed_layer_decides(tiny):
    from minipaged.fast import FastEngine
    options = dict(speculative="ngram", num_speculative_tokens=2)
    p = SpeculativeEngine(tiny, 64, 4, **options).policy
    assert not p.adapt_k and not p.batch_gate
    p = FastEngine(tiny, 64, 4, **options).policy
    assert p.adapt_k and p.batch_gate and p.step_costs is None          # measured
    assert not FastEngine(tiny, 64, 4, draft_policy="fixed", **options).policy.batch_gate


def test_draft_policy_option_is_checked(tiny):
    with pytest.raises(RequestError, match="draft_policy must be"):
        SpeculativeEngine(tiny, 64, 4, speculative="ngram", num_speculative_tokens=2,
                          draft_policy="sometimes")


# -- greedy exactness through the switches --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def reference(tiny):
    return [greedy_reference(tiny, p, 24) for p in repetitive_prompts()]


class PlantedThroughPolicy(PlantedDrafts):
    """Planted drafts (right up to a random place, wrong after it), as many as the policy lets
    the request ask for."""

    def propose(self, req):
        return super().propose(req)[:self.policy.k_for(req, self.num_speculative_tokens)]


def run_planted_through(model, reference, policy, seed=0, **options):
    prompts = repetitive_prompts()
    PlantedDrafts.truth = {tuple(p): r for p, r in zip(prompts, reference)}
    PlantedDrafts.rng = random.Random(seed)
    engine = PlantedThroughPolicy(model, options.pop("num_blocks", 256), max_num_seqs=8,
                                  speculative="ngram", num_speculative_tokens=4,
                                  draft_policy=policy, **options)
    for p in prompts:
        engine.add_request(p, 24, stop_tokens=[])
    return [r.output for r in engine.run()], engine


@pytest.mark.parametrize("adapt_k,batch_gate", SWITCHES)
@pytest.mark.parametrize("block_size", [1, 3])
def test_planted_drafts_through_the_policy_give_the_no_cache_forwards_tokens(
        tiny, reference, adapt_k, batch_gate, block_size):
    """Drafts rejected at every place, cut by the policy as it likes."""
    trace = []
    policy = DraftPolicy(adapt_k, batch_gate, step_costs=COSTS, trace=trace)
    out, engine = run_planted_through(tiny, reference, policy, block_size=block_size)
    assert out == reference
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    s = engine.spec
    assert s.accepted_tokens > 0 and s.draft_tokens > s.accepted_tokens
    if batch_gate:        # the gate cut drafts lookup found
        assert any(row["found"] > row["drafts"] for row in trace)
    else:
        assert all(row["found"] == row["drafts"] for row in trace)
    ks = {row["k"] for row in trace}
    assert ks >= {0, 1, 4} if adapt_k else ks == {4}     # paused, probed, asked for all


@pytest.mark.parametrize("adapt_k,batch_gate", SWITCHES)
def test_ngram_drafts_through_the_policy_give_the_no_cache_forwards_tokens(
        tiny, reference, adapt_k, batch_gate):
    trace = []
    policy = DraftPolicy(adapt_k, batch_gate, step_costs=CHEAP,
                         trace=trace)
    out, engine = run(tiny, repetitive_prompts(), 24, block_size=3, speculative="ngram",
                      num_speculative_tokens=4, draft_policy=policy)
    assert out == reference
    assert engine.spec.accepted_tokens > 0
    if adapt_k:            # the per-request rule paused lookups that found nothing
        assert {row["k"] for row in trace} >= {0, 4}
    else:
        assert {row["k"] for row in trace} == {4}


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_policy_survives_preemption_and_a_budget(tiny, reference, preemption):
    out, engine = run_planted_through(tiny, reference, DraftPolicy(step_costs=COSTS), seed=1,
                                      block_size=3, num_blocks=16, preemption=preemption,
                                      max_num_batched_tokens=5)
    assert out == reference
    assert engine.stats.preemptions > 0 and engine.stats.max_step_tokens <= 5


def test_measured_costs_the_default_keep_the_tokens(tiny, reference):
    """The default policy measures its step costs on the model (a scratch engine's steps):
    the numbers are times, and the tokens are the no-cache forward's whatever they are."""
    from minipaged.fast import FastEngine
    model32 = tiny_model(seed=3, dtype=torch.float32)
    want32 = [greedy_reference(model32, p, 24) for p in repetitive_prompts()]
    for cls, model, want in ((SpeculativeEngine, tiny, reference),
                             (FastEngine, model32, want32)):
        engine = cls(model, 256, 3, max_num_seqs=8, speculative="ngram",
                     num_speculative_tokens=4, draft_policy="adaptive")
        for p in repetitive_prompts():
            engine.add_request(p, 24, stop_tokens=[])
        assert [r.output for r in engine.run()] == want, cls.__name__
        p = engine.policy                  # measured costs, then corrected by the steps run
        assert p.plain_scale != 1.0 or p.draft_scale != 1.0, cls.__name__
        costs = StepCosts.measure(engine, batches=(1, 2), repeat=1)
        assert costs.batches == [1, 2]
        assert all(0 < x < 10 for x in costs.plain)
        assert all(0 <= x < 10 for x in costs.fixed + costs.per_draft)
        assert engine.cache.num_free_blocks == engine.cache.num_blocks
        assert torch.get_num_threads() >= 1


# -- sampling keeps the model's distribution ------------------------------------------------------
VOCAB = 4
TABLE = torch.tensor([[2.0, 0.5, 0.0, -1.0], [0.0, 2.0, 0.3, 0.2],
                      [-0.5, 0.0, 2.0, 0.5], [1.5, 0.0, 0.0, 1.0]])   # logits after each token


class MarkovModel(FakeModel):
    """Logits that depend on the last token only (TABLE): the probability of any continuation
    is a product of softmax(TABLE) entries, known exactly."""

    def forward(self, tokens, cache=None, last_only=False, logits_indices=None):
        super().forward(tokens, cache, last_only, logits_indices)      # the cache traffic
        if logits_indices is not None:
            return TABLE[tokens[0, logits_indices]][None]
        return TABLE[tokens[:, -1:] if last_only else tokens]


def continuations(**options):
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0]
    model = MarkovModel(0, vocab=VOCAB)
    out = generate(model, [prompt] * 1500, 4, cache="paged", block_size=2, temperature=1.0,
                   stop_tokens=[], max_num_seqs=256, speculative="ngram",
                   num_speculative_tokens=3, **options)
    return [tuple(o[1:4]) for o in out], prompt[-1]


def chi_square_of(samples, last):
    p = torch.softmax(TABLE, -1).tolist()
    stat = 0.0
    for cell in itertools.product(range(VOCAB), repeat=3):
        # tokens 2-4 given the prompt: sum over token 1
        prob = sum(p[last][a] * p[a][cell[0]] * p[cell[0]][cell[1]] * p[cell[1]][cell[2]]
                   for a in range(VOCAB))
        e = len(samples) * prob
        stat += (samples.count(cell) - e) ** 2 / e
    return stat


CRITICAL_63 = 103.44       # chi-square, 63 degrees of freedom, 1 - 0.001


def test_sampling_through_the_policy_keeps_the_models_distribution(monkeypatch):
    trace = []
    policy = DraftPolicy(step_costs=CHEAP, trace=trace)
    samples, last = continuations(draft_policy=policy)
    assert any(row["drafts"] for row in trace) and any(row["k"] == 0 for row in trace)
    assert chi_square_of(samples, last) < CRITICAL_63
    # an engine that keeps every draft fails the same test
    monkeypatch.setattr(SpeculativeEngine, "accept", lambda self, r, drafts, logits: list(
        drafts) + [int(torch.multinomial(torch.softmax(logits[len(drafts)], -1), 1,
                                         generator=r.generator))])
    wrong, last = continuations(draft_policy=DraftPolicy(
        step_costs=CHEAP))
    assert chi_square_of(wrong, last) > CRITICAL_63
    assert math.isfinite(CRITICAL_63)


def test_the_embedded_model_through_the_measured_policy_keeps_plain_decodings_tokens():
    """The speed layer's default (the policy on costs measured on the model), on prompts that
    lookup suits and on one it does not, through a pool that preempts: the tokens of decoding
    without speculation."""
    from minipaged import load_model, load_tokenizer
    from minipaged.benchmarks.speculative import prompts as benchmark_prompts
    from minipaged.fast import FastEngine
    model, tok = load_model(), load_tokenizer()
    # a question asked again after the model answered it (it repeats its answer), a text to
    # repeat, and an open question
    prompts = benchmark_prompts(model, tok, "lookup", 2) + benchmark_prompts(model, tok, "chat", 1)
    for kw in (dict(), dict(num_blocks=40, preemption="swap")):
        plain = generate(model, prompts, 40, cache="paged", stop_tokens=[], block_size=4, **kw)
        trace = []
        spec = generate(model, prompts, 40, cache="paged", stop_tokens=[], block_size=4,
                        engine_class=FastEngine, speculative="ngram", num_speculative_tokens=4,
                        draft_policy=DraftPolicy(trace=trace), **kw)
        assert spec == plain, kw
        assert any(row["drafts"] for row in trace)         # drafts ran


def test_the_speed_layers_lookup_skips_only_what_cannot_match(tiny):
    """FastEngine's `propose` skips the scan where the last two tokens never came before:
    as a request grows step by step, its drafts are always stage 7's `ngram_propose`'s."""
    from minipaged.fast import FastEngine
    from minipaged.speculative import ngram_propose
    rng = random.Random(5)
    engine = FastEngine(tiny, 64, 4, speculative="ngram", num_speculative_tokens=3,
                        draft_policy="fixed")
    skipped = 0
    for i in range(150):
        req = Request(i, [rng.randrange(6) for _ in range(rng.randint(1, 8))], 40,
                      output=[rng.randrange(6)])
        for _ in range(20):
            want = ngram_propose(req.prompt + req.output, 3, 2, 4)
            assert engine.propose(req) == want
            skipped += not want
            req.output.append(rng.randrange(6))
    assert skipped > 100
