"""Stage 6b properties: random beam searches on the paged cache, checked after every phase of
every step against what the live beams' tokens alone say.

  - in every layer, each block's count equals the number of live beams' tables holding it, and
    the free blocks are exactly those no table holds: a pruned beam's blocks are free at once;
  - the pool holds the beams' tree: one block per distinct (block index, tokens up to that
    block's end) among the live beams' written tokens, so a block is shared exactly as long as
    the beams agree on everything up to its end;
  - `blocks_held` reports that many blocks, beside the sum of what each beam would need alone;
  - every beam reads its own history: its logits are the no-cache forward's over its tokens.
"""

import random

import torch
from hypothesis import given, settings, strategies as st

from conftest import tiny_model
from minipaged.beams import BeamSearch

MODELS = [tiny_model(seed) for seed in range(2)]


def check_pool(search, prompt):
    """The counts, the free set and the tree, in every layer, from the beams' tokens."""
    cache, bs = search.cache, search.cache.block_size
    rows = [b.seq_id for b in search.beams]
    assert sorted(rows) == search.cache.managers[0].live_seq_ids()
    for m in cache.managers:
        held = {}
        for s in rows:
            for b in m.blocks_of(s):
                held[b] = held.get(b, 0) + 1
        assert {b: int(m.refs[b]) for b in range(m.num_blocks) if m.refs[b]} == held
        assert set(m.free_blocks.ids()) == set(range(m.num_blocks)) - set(held)
        tree = {}                                     # (j, tokens up to block j's end) -> block
        for beam in search.beams:
            written = prompt + beam.tokens[:int(m.seq_lens[beam.seq_id]) - len(prompt)]
            assert int(m.seq_lens[beam.seq_id]) == len(written)
            for j, b in enumerate(m.blocks_of(beam.seq_id)):
                key = (j, tuple(written[:(j + 1) * bs]))
                assert tree.setdefault(key, b) == b, "beams that agree share the block"
        assert len(set(tree.values())) == len(tree) == len(held), "no two keys share a block"


def check_logits(search, prompt):
    for row, beam in enumerate(search.beams):
        with torch.no_grad():
            want = search.model(torch.tensor([prompt + beam.tokens]))[0, -1]
        torch.testing.assert_close(search.logits[row], want, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_pool_holds_the_beams_tree_after_every_step(data):
    model = MODELS[data.draw(st.integers(0, 1), label="model")]
    rng = random.Random(data.draw(st.integers(0, 10**6), label="seed"))
    prompt = [rng.randrange(512) for _ in range(data.draw(st.integers(1, 12), label="prompt"))]
    beam_width = data.draw(st.integers(1, 5), label="beam_width")
    block_size = data.draw(st.integers(1, 6), label="block_size")
    stop = rng.sample(range(512), data.draw(st.sampled_from([0, 20, 60]), label="stops"))
    search = BeamSearch(model, prompt, beam_width, data.draw(st.integers(1, 10), label="new"),
                        block_size=block_size, stop_tokens=stop,
                        length_penalty=data.draw(st.sampled_from([-1.0, 0.0, 1.0, 2.0])))
    check_pool(search, prompt)
    while not search.done:
        old = list(search.beams)
        search.keep(search.select())                  # forks and frees: nothing written yet
        step = search.history[-1]
        if search.done:
            assert search.cache.managers[0].live_seq_ids() == []
            assert all(m.num_free_blocks == m.num_blocks for m in search.cache.managers)
            break
        check_pool(search, prompt)
        parents = [p for p, s in zip(step.parents, step.status) if s == "live"]
        assert sorted(step.freed) == sorted(b.seq_id for i, b in enumerate(old)
                                            if i not in parents)     # childless: freed
        firsts = set()
        for p, beam in zip(parents, search.beams):    # first child: the parent's row; others fork
            if p in firsts:
                assert (old[p].seq_id, beam.seq_id) in step.forks
            else:
                assert beam.seq_id == old[p].seq_id and beam.tokens[:-1] == old[p].tokens
            firsts.add(p)
        assert len(step.forks) == len(parents) - len(firsts)
        search.decode()                               # copy-on-write, then every beam writes
        check_pool(search, prompt)
        check_logits(search, prompt)
        unshared = sum(-(-(len(prompt) + len(b.tokens)) // block_size) for b in search.beams)
        assert search.blocks_held[-1] == (search.cache.num_used_blocks, unshared)


def test_beams_that_agree_for_long_share_most_of_their_blocks():
    """With no stop token, four beams of 24 tokens over a 30-token prompt, blocks of 4: by the
    end, most of what the beams hold is shared."""
    search = BeamSearch(MODELS[0], list(range(1, 31)), 4, 24, block_size=4, stop_tokens=[])
    search.run()
    shared, unshared = search.blocks_held[-1]
    assert shared < 0.6 * unshared
