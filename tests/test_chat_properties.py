"""The chat's Conversation under random use: messages short, long and too long for the
context, /reset, and pools small enough to run dry. After every step the history, the tokens
the cache holds and the blocks the conversation holds agree, and /stats says so; a refused
message changes none of them.

The model is a fake with no weights (conftest.FakeModel): it writes each token's id into the
cache as its key, so the test reads the pool back and compares it with the history token for
token. The tokenizer and chat format are the embedded model's own.
"""

import pytest
import torch
from conftest import FakeModel
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minipaged import load_tokenizer
from minipaged.chat.app import make_chat_cache, stats_rows
from minipaged.chat.conversation import Conversation
from minipaged.errors import MiniPagedError, OutOfBlocksError, RequestError
from minipaged.kv_budget import bytes_per_block

WORDS = ["block", "table", "what", "is", "a", "KV", "cache", "paged", "attention", "?"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def stored_tokens(conv, layer):
    """The token ids whose keys the conversation's sequence holds in `layer`, in order."""
    cache, n = conv.cache, conv.cached
    if not hasattr(cache, "managers"):
        return cache.k_cache[layer][conv.seq_id, :n, 0, 0].long().tolist()
    m = cache.managers[layer]
    if conv.seq_id not in m:
        return []
    blocks = torch.tensor(m.blocks_of(conv.seq_id))
    return m.k_cache_paged[blocks].reshape(-1, 1, 2)[:n, 0, 0].long().tolist()


def state(conv):
    """Everything a refused message must leave as it was."""
    cache = conv.cache
    blocks = [m.blocks_of(conv.seq_id) if conv.seq_id in m else [] for m in
              getattr(cache, "managers", [])]
    return (list(conv.tokens), conv.cached, conv.turns, [dict(m) for m in conv.messages],
            blocks, getattr(cache, "num_free_blocks", None),
            [stored_tokens(conv, layer) for layer in range(conv.model.args.n_layers)])


def check(conv):
    history, cache, n = conv.tokens, conv.cache, conv.cached
    # the history is the chat format's encoding of the messages it keeps
    assert len(conv.messages) == 2 * len(conv.exchanges)
    assert history == conv.prefix + [t for pair in conv.exchanges for part in pair for t in part]
    for (user, _), message in zip(conv.exchanges, conv.messages[::2]):
        assert user == conv.user_tokens(message["content"])
    assert n <= len(history) <= conv.max_seq_len
    # the cache holds exactly the first `cached` tokens of the history, in every layer
    for layer in range(conv.model.args.n_layers):
        assert stored_tokens(conv, layer) == history[:n]
    rows = dict(stats_rows(conv))
    assert rows["tokens in the history"] == str(len(history))
    assert rows["tokens whose K/V are cached"] == str(n)
    assert rows["turns"] == str(conv.turns)
    if hasattr(cache, "managers"):
        # ...in as many blocks as those tokens fill, and every other block is free
        held = -(-n // cache.block_size)
        for m in cache.managers:
            assert (conv.seq_id in m) == (n > 0)
            assert int(m.seq_lens[conv.seq_id]) == n
            assert len(m.blocks_of(conv.seq_id) if n else []) == held
            assert m.num_free_blocks == cache.num_blocks - held
        assert rows["blocks held / free / in the pool"].startswith(
            f"{held} / {cache.num_blocks - held} / {cache.num_blocks}")
    else:
        assert int(cache.seq_lens[conv.seq_id]) == n


words = st.one_of(st.integers(0, 12), st.integers(0, 40), st.integers(0, 250))  # short...too long
step = st.one_of(st.tuples(st.just("say"), words, st.integers(0, 9)), st.tuples(st.just("reset")))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["paged", "paged", "contiguous"]),
       block_size=st.sampled_from([1, 4, 16]), context=st.integers(40, 160),
       pool_blocks=st.one_of(st.integers(1, 12), st.integers(1, 200)),
       max_new_tokens=st.integers(1, 24), system=st.integers(0, 24),
       steps=st.lists(step, min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_history_cache_and_blocks_agree_after_every_step(tokenizer, kind, block_size, context,
                                                         pool_blocks, max_new_tokens, system,
                                                         steps, seed):
    model = FakeModel(seed, tokenizer.n_words, max_seq_len=context)
    budget = pool_blocks * bytes_per_block(block_size, 1, 2, torch.float32, n_layers=2)
    cache = make_chat_cache(model, kind, block_size, kv_budget=budget)
    try:
        conv = Conversation(model, tokenizer, cache, max_new_tokens=max_new_tokens,
                            temperature=1.0, seed=seed,
                            system=" ".join(WORDS[i % 10] for i in range(system)) or None)
    except RequestError as e:        # settings that leave no room for a message: said so
        assert "--max-new-tokens" in str(e) or "system prompt" in str(e)
        return
    check(conv)
    for action in steps:
        before = state(conv)
        if action[0] == "reset":
            conv.reset()
            assert conv.cached == conv.turns == 0 and conv.tokens == conv.prefix
        else:
            _, n_words, offset = action
            text = " ".join(WORDS[(offset + i) % 10] for i in range(n_words))
            try:
                info = conv.reply(text)
            except (RequestError, OutOfBlocksError) as e:
                event(f"refused: {type(e).__name__}")
                assert state(conv) == before, f"refused ({e}) but changed"
                assert ("this message takes" in str(e)) == isinstance(e, RequestError)
            else:
                for what in ("rebuilt", "pool_full", "cached_tokens"):
                    if info[what]:
                        event(what)
                assert conv.messages[-2]["content"] == text
                assert info["history_tokens"] <= conv.max_seq_len
        check(conv)


def test_a_pool_larger_than_one_context_is_not_allocated(tokenizer):
    """The chat sizes its pool to what a conversation can fill, whatever --kv-budget says."""
    model = FakeModel(0, tokenizer.n_words, max_seq_len=128)
    default = make_chat_cache(model, "paged", 16)
    huge = make_chat_cache(model, "paged", 16, kv_budget=100 << 30)      # 100 GiB asked
    assert default.num_blocks == huge.num_blocks == 128 // 16


def test_settings_without_room_for_a_message_say_which_one(tokenizer):
    model = FakeModel(0, tokenizer.n_words, max_seq_len=100)
    cache = make_chat_cache(model, "paged", 16)
    with pytest.raises(MiniPagedError, match="--max-new-tokens.*context of 100"):
        Conversation(model, tokenizer, cache, max_new_tokens=100)
    with pytest.raises(MiniPagedError, match="system prompt is .* tokens"):
        Conversation(model, tokenizer, cache, max_new_tokens=20, system="block " * 90)
