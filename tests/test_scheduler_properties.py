"""Stage 5: the scheduler's invariants, checked after every step of random traces.

The model is a fake with no weights: it writes each token's id into the cache as its key (and
the id minus the layer as its value) and returns random logits. So the invariants can read the
pools back and check that every running or swapped request holds exactly its own tokens, in
order — through prefill, decode, swap-out, swap-in and recompute.
"""

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import ModelArgs, RequestError
from minipaged.engine import Engine

STOP = 0                      # the fake model's stop token (when a trace uses one)


class FakeModel(torch.nn.Module):
    """Stands in for Llama: same call, same cache traffic, random next tokens."""

    def __init__(self, seed: int, vocab: int = 6, n_layers: int = 2, max_seq_len: int = 64):
        super().__init__()
        self.args = ModelArgs(dim=2, n_layers=n_layers, n_heads=1, n_kv_heads=1,
                              vocab_size=vocab, multiple_of=1, max_seq_len=max_seq_len)
        self.anchor = torch.nn.Parameter(torch.zeros(1))      # the engine reads device, dtype
        self.rng = torch.Generator().manual_seed(seed)

    def forward(self, tokens, cache=None, last_only=False):
        B, T = tokens.shape
        ids = tokens.float()[:, :, None, None].expand(B, T, 1, 2)        # (B, T, Hk=1, D=2)
        for layer in range(self.args.n_layers):
            cache.attend(layer, torch.zeros_like(ids), ids.clone(), ids - layer)
        return torch.randn(B, 1 if last_only else T, self.args.vocab_size, generator=self.rng)


def check_pool(m, holders, layer):
    """`holders` own exactly the blocks their cached tokens need, holding those very tokens;
    no block has two owners; free + used = all."""
    assert m.live_seq_ids() == sorted(r.seq_id for r in holders)
    owned = []
    for r in holders:
        n = r.num_tokens - 1                        # the newest token is not in the cache yet
        blocks = m.blocks_of(r.seq_id)
        assert int(m.seq_lens[r.seq_id]) == n
        assert len(blocks) == -(-n // m.block_size)
        stored = m.k_cache_paged[blocks].flatten(0, 1)[:n, 0, 0]          # (n,)
        values = m.v_cache_paged[blocks].flatten(0, 1)[:n, 0, 0]
        tokens = (r.prompt + r.output)[:n]
        assert stored.tolist() == tokens
        assert values.tolist() == [t - layer for t in tokens]
        owned += blocks
    assert len(owned) == len(set(owned))
    assert sorted(owned + m.free_blocks.ids()) == list(range(m.num_blocks))


def check_invariants(engine):
    s = engine.scheduler
    queues = {"pending": engine.pending, "waiting": s.waiting, "running": s.running,
              "swapped": s.swapped}
    count = Counter(id(r) for q in queues.values() for r in q)
    for r in engine.requests:                       # exactly one queue, or finished
        assert count[id(r)] == (0 if r.status == "finished" else 1)
    for name, q in queues.items():
        assert all(r.status == name for r in q)
    assert all(r.seq_id is None for r in list(s.waiting) + engine.pending)
    rows = [r.seq_id for r in s.running + list(s.swapped)]
    assert sorted(rows + s.free_rows) == list(range(engine.cache.managers[0].max_seqs))
    for layer, m in enumerate(engine.cache.managers):
        check_pool(m, s.running, layer)
    if engine.swap is None:
        assert not s.swapped
    else:
        for layer, m in enumerate(engine.swap.cpu_managers):
            check_pool(m, s.swapped, layer)


@st.composite
def traces(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(1, 12))
    longest = min(24, max(2, num_blocks * block_size * 3 // 4))   # so the pool runs dry often
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        preemption=draw(st.sampled_from(["recompute", "swap"])),
        num_cpu_blocks=draw(st.sampled_from([None, None, None, 2])),
        static_batches=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.01, 0.3])),
        max_num_seqs=draw(st.sampled_from([8, 8, 3, 1])),
        stop=draw(st.sampled_from([[], [], [STOP]])),
        seed=draw(st.integers(0, 2**16)),
        requests=draw(st.lists(st.tuples(st.integers(1, longest), st.integers(0, longest),
                                         st.integers(0, 8)), min_size=2, max_size=10)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_invariants_hold_after_every_step(trace):
    torch.set_num_threads(1)
    model = FakeModel(trace["seed"])
    engine = Engine(model, trace["num_blocks"], trace["block_size"], trace["preemption"],
                    max_num_seqs=trace["max_num_seqs"], num_cpu_blocks=trace["num_cpu_blocks"],
                    watermark=trace["watermark"], static_batches=trace["static_batches"])
    gen = torch.Generator().manual_seed(trace["seed"])
    accepted = []
    for n_prompt, max_new, arrival in trace["requests"]:
        prompt = torch.randint(1, 6, (n_prompt,), generator=gen).tolist()
        fits = -(-(n_prompt + max(max_new, 1) - 1) // trace["block_size"]) <= trace["num_blocks"]
        if not fits:                                # refused up front, never left to spin
            with pytest.raises(RequestError, match="could never run"):
                engine.add_request(prompt, max_new, stop_tokens=trace["stop"],
                                   arrival_step=arrival)
            continue
        accepted.append(engine.add_request(prompt, max_new, stop_tokens=trace["stop"],
                                           arrival_step=arrival))

    first_admissions, idle = [], 0
    while engine.has_unfinished():
        arrived = engine.scheduler.has_unfinished() or any(
            r.arrival_step <= engine.step_count for r in engine.pending)
        busy_before = engine.stats.busy_steps
        engine.step()
        check_invariants(engine)
        # Progress: a step with any arrived request runs the model for at least one of them.
        assert engine.stats.busy_steps == busy_before + 1 or not arrived
        idle += not arrived
        for r in sorted(accepted, key=lambda r: (r.arrival_step, r.req_id)):
            if r.status not in ("waiting", "pending") and r not in first_admissions:
                first_admissions.append(r)
    # Every busy step samples a token that is never taken back: steps are bounded by tokens.
    assert engine.stats.busy_steps <= sum(r.max_new_tokens for r in accepted)
    started = [r for r in first_admissions if r.max_new_tokens > 0]   # first come, first served
    assert started == sorted(started, key=lambda r: (r.arrival_step, r.req_id))

    for r in accepted:
        assert r.status == "finished" and len(r.output) <= r.max_new_tokens
        assert STOP not in r.output or not trace["stop"]
        if not trace["stop"]:
            assert len(r.output) == r.max_new_tokens
    cpu = engine.swap.cpu_managers if engine.swap else []
    for m in engine.cache.managers + cpu:                         # all free, swap pool empty
        assert m.num_free_blocks == m.num_blocks and not m.live_seq_ids()
    if trace["preemption"] == "recompute":
        assert engine.stats.swapped_blocks == 0
