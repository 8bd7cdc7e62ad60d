"""Stage 7 properties: a state machine adds requests and runs speculative steps on a small pool,
with drafts of random length and a random number of them accepted, under either preemption
mode, with or without a token budget and the prefix cache. The model is conftest's FakeModel,
which stores each token's id as its key, so the pool can be read back.

After every step, for every request decoding with blocks in the pool:
  - the cache holds exactly its accepted tokens: prompt + output but the newest, read back from
    the keys in its blocks, in every layer (so no rejected draft is left where it is read);
  - it holds exactly ceil(len / block_size) blocks in every layer;
  - every block's count is the number of tables holding it, and a block is free or cached-free
    exactly when no table holds it (nothing leaks after a rollback or a preemption);
  - a block the prefix cache names holds, with everything before it, kept tokens only.
At the end every block is free or cached-free.
"""

import random

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import FakeModel
from minipaged.prefix_cache import block_hashes
from minipaged.speculative import SpeculativeEngine

BS, NUM_BLOCKS, VOCAB = 3, 18, 4


class RandomAcceptance(SpeculativeEngine):
    """Drafts of random length (random tokens), of which a random prefix is accepted, plus one
    bonus token: every acceptance pattern, whatever the model's logits say."""

    rng: random.Random = None

    def propose(self, req):
        room = min(self.num_speculative_tokens, req.max_new_tokens - len(req.output) - 1)
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, max(0, room)))]

    def accept(self, r, drafts, logits):
        return drafts[:self.rng.randint(0, len(drafts))] + [self.rng.randrange(VOCAB)]


class SpeculativeSteps(RuleBasedStateMachine):

    @initialize(preemption=st.sampled_from(["recompute", "swap"]),
                budget=st.sampled_from([None, 4, 9]), prefix_caching=st.booleans(),
                k=st.integers(1, 6), seed=st.integers(0, 2**16))
    def start(self, preemption, budget, prefix_caching, k, seed):
        RandomAcceptance.rng = random.Random(seed)
        self.engine = RandomAcceptance(FakeModel(seed, vocab=VOCAB), NUM_BLOCKS, BS, preemption,
                                       max_num_batched_tokens=budget, max_num_seqs=4,
                                       prefix_caching=prefix_caching, speculative="ngram",
                                       num_speculative_tokens=k, num_cpu_blocks=NUM_BLOCKS,
                                       draft_policy="fixed")
        self.steps = 0

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
          max_new=st.integers(1, 14), n=st.sampled_from([1, 1, 2]))
    def add(self, prompt, max_new, n):
        if len(self.engine.requests) < 12:
            self.engine.add_request(prompt, max_new, stop_tokens=[], n=n)

    @precondition(lambda self: self.engine.has_unfinished())
    @rule()
    def step(self):
        self.engine.step()
        self.steps += 1

    @invariant()
    def cache_holds_the_accepted_tokens_only(self):
        cache, prefilling = self.engine.cache, self.engine.scheduler.prefilling
        for r in self.engine.requests:
            if r.status != "running" or r in prefilling or not r.output:
                continue
            kept = r.prompt + r.output[:-1]
            for layer, m in enumerate(cache.managers):
                assert int(m.seq_lens[r.seq_id]) == len(kept)
                table = m.blocks_of(r.seq_id)
                assert len(table) == -(-len(kept) // BS)
                keys = m.k_cache_paged[:, :, 0, 0]
                assert [int(keys[table[p // BS], p % BS]) for p in range(len(kept))] == kept
            if m.prefix is not None:                   # names: kept tokens only
                truth = block_hashes(kept, BS)
                for j, b in enumerate(table):
                    if b in m.prefix.hash_of:
                        assert j < len(truth) and m.prefix.hash_of[b] == truth[j]

    @invariant()
    def counts_match_the_tables_and_nothing_leaks(self):
        for m in self.engine.cache.managers:
            held = {}
            for s in m.live_seq_ids():
                for b in m.blocks_of(s):
                    held[b] = held.get(b, 0) + 1
            assert all(m.refs[b] == held.get(b, 0) for b in range(NUM_BLOCKS))
            free = set(m.free_blocks.ids())
            cached = set(m.prefix.cached_free) if m.prefix is not None else set()
            assert not free & cached
            assert free | cached == {b for b in range(NUM_BLOCKS) if b not in held}

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for _ in range(1000):                      # a leak would make the pool livelock
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        assert not self.engine.has_unfinished()
        assert self.engine.cache.num_free_blocks == NUM_BLOCKS       # free or cached-free
        for r in self.engine.requests:
            assert r.status == "finished" and len(r.output) == r.max_new_tokens


SpeculativeSteps.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                              deadline=None)
TestSpeculativeSteps = SpeculativeSteps.TestCase
