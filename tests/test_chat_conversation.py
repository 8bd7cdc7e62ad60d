"""The chat's conversation keeps its KV blocks between turns: the replies are the ones the
stage-1 cache gives from the full history, and each turn prefills only what is new."""

import pytest
import torch

from minipaged import generate, load_model, load_tokenizer
from minipaged.chat.app import make_chat_cache
from minipaged.chat.conversation import Conversation
from minipaged.formats.gguf_checkpoint import packaged_model_path
from minipaged.paged_cache import PagedCache
from minipaged.formats.tokenizer import chat_format

QUESTIONS = ["what is a block table?", "what is paged attention?", "what is a KV cache?"]


@pytest.fixture(scope="module")
def embedded():
    return load_model(dtype=torch.float32), load_tokenizer()


def counting(model):
    """Record the number of tokens of every forward call (an independent count of the work)."""
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(args[0].shape[1]),
                                    with_kwargs=True)
    return calls


def contiguous_reply(model, tokenizer, history, n):
    """Stage-1 ground truth: the whole history, from scratch, through the contiguous cache."""
    return generate(model, [history], n, cache="contiguous",
                    stop_tokens=tokenizer.stop_tokens)[0]


def two_turns(model, tokenizer, cache, max_new=24):
    conv = Conversation(model, tokenizer, cache, max_new_tokens=max_new)
    first = conv.reply(QUESTIONS[0])
    second = conv.reply(QUESTIONS[1])
    history = conv.tokens[:len(conv.tokens) - len(conv.exchanges[-1][1])]   # before reply 2
    return conv, first, second, history


@pytest.mark.parametrize("block_size", [4, 16])
def test_second_turn_is_the_reply_the_full_history_gives(embedded, block_size):
    model, tok = embedded
    conv, first, second, history = two_turns(model, tok, make_chat_cache(model, "paged",
                                                                        block_size))
    # The token history is the chat format's own encoding of the text conversation...
    assert history == chat_format(tok).encode_dialog_prompt(conv.messages[:3])
    # ...and the reply through the kept blocks is the one recomputing everything gives.
    assert second["tokens"] == contiguous_reply(model, tok, history, 24)
    assert first["tokens"] == contiguous_reply(model, tok, history[:first["history_tokens"]], 24)


def test_second_turn_prefills_only_the_new_tokens(embedded):
    model, tok = embedded
    calls = counting(model)
    conv = Conversation(model, tok, make_chat_cache(model, "paged", 16), max_new_tokens=24)
    conv.reply(QUESTIONS[0])
    processed_in_turn_1 = sum(calls)
    calls.clear()
    info = conv.reply(QUESTIONS[1])
    history = chat_format(tok).encode_dialog_prompt(conv.messages[:3])
    # The first forward of turn 2 is its prefill: what turn 1 did not already put in the cache.
    assert calls[0] == len(history) - processed_in_turn_1 == info["prefill_tokens"]
    assert calls[0] < len(history) / 2
    assert calls[1:] == [1] * (len(calls) - 1)            # then one token per decode step
    cm = conv.cache.managers[0]
    assert int(cm.seq_lens[0]) == conv.cached == processed_in_turn_1 + sum(calls)


def test_contiguous_cache_gives_the_same_conversation(embedded):
    model, tok = embedded
    paged = two_turns(model, tok, make_chat_cache(model, "paged", 8))
    contiguous = two_turns(model, tok, make_chat_cache(model, "contiguous"))
    assert paged[2]["tokens"] == contiguous[2]["tokens"] and paged[3] == contiguous[3]


def test_dropping_old_exchanges_rebuilds_the_cache(embedded):
    model, tok = embedded
    cache = PagedCache(model.args, 64, 8, 1, max_seq_len=120)          # a short context
    conv = Conversation(model, tok, cache, max_new_tokens=30)
    infos = [conv.reply(q) for q in QUESTIONS]
    assert not infos[0]["rebuilt"]
    rebuilt = [i for i in infos if i["rebuilt"]]
    assert rebuilt, "the third turn should not fit in 120 tokens with the whole history"
    info = rebuilt[-1]
    assert info["prefill_tokens"] == info["history_tokens"]       # everything computed again
    history = conv.tokens[:len(conv.tokens) - len(conv.exchanges[-1][1])]
    assert conv.messages[0]["content"] != QUESTIONS[0]           # the oldest exchange is gone
    assert history == chat_format(tok).encode_dialog_prompt(conv.messages[:-1])
    assert info["tokens"] == contiguous_reply(model, tok, history, 30)
    assert int(cache.managers[0].seq_lens[0]) == conv.cached
    held = -(-conv.cached // 8)
    assert cache.num_free_blocks == 64 - held                    # the old blocks came back


def test_a_full_pool_keeps_the_conversation_usable(embedded):
    model, tok = embedded
    cache = PagedCache(model.args, 3, 16, 1, model.args.max_seq_len)    # 48 tokens in all
    conv = Conversation(model, tok, cache, max_new_tokens=40)
    info = conv.reply(QUESTIONS[0])                 # 21 prompt tokens + 40 do not fit
    assert info["pool_full"] and "/reset" in info["pool_full"] and "--kv-budget" in info["pool_full"]
    assert cache.num_free_blocks == 0 and conv.cached == 48
    with pytest.raises(Exception) as e:             # no room for the next message at all
        conv.reply(QUESTIONS[1])
    assert type(e.value).__name__ == "OutOfBlocksError" and "/reset" in str(e.value)
    assert conv.turns == 1 and conv.cached == 48    # the failed turn changed nothing
    conv.reset()
    assert cache.num_free_blocks == 3
    again = conv.reply(QUESTIONS[1])
    assert again["new_tokens"] > 0


def test_smollm2_conversation_keeps_its_blocks_exactly():
    path = packaged_model_path("smollm2")
    model, tok = load_model(path, dtype=torch.float32), load_tokenizer(path)
    conv, first, second, history = two_turns(model, tok, make_chat_cache(model, "paged", 16,
                                                                        kv_budget=8 << 20), 8)
    assert history == chat_format(tok).encode_dialog_prompt(conv.messages[:3])
    assert second["prefill_tokens"] < len(history) / 2
    assert second["tokens"] == contiguous_reply(model, tok, history, 8)


def test_stats_count_the_conversations_memory(embedded):
    from minipaged.chat.app import stats_rows
    model, tok = embedded
    a = model.args
    conv = Conversation(model, tok, make_chat_cache(model, "paged", 16), max_new_tokens=20)
    conv.reply(QUESTIONS[0])
    rows = dict(stats_rows(conv))
    slot = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4          # K and V, fp32, all layers
    n = int(conv.cache.managers[0].seq_lens[0])
    held = -(-n // 16)
    assert rows["token states"] == f"{n} slots, {n * slot:,} B"
    assert rows["internal fragmentation (empty tail of the last block)"].startswith(
        f"{held * 16 - n} slots")
    assert rows["blocks held / free / in the pool"].startswith(f"{held} / {128 - held} / 128")
    assert rows["contiguous cache would reserve"].startswith(
        f"{a.max_seq_len} slots, {a.max_seq_len * slot:,} B")


def test_a_new_conversation_with_the_same_system_prompt_hits_the_prefix_cache(embedded):
    model, tok = embedded
    system = "You explain KV caches, blocks, block tables and paging to newcomers, briefly."
    cache = make_chat_cache(model, "paged", 4)
    conv = Conversation(model, tok, cache, max_new_tokens=16, system=system)
    first = conv.reply(QUESTIONS[0])
    assert first["cached_tokens"] == 0                      # nothing was cached before
    conv.reset()                                            # its named blocks stay cached-free
    calls = counting(model)
    info = conv.reply(QUESTIONS[1])
    prefix_len = len(conv.prefix)                           # begin_of_text + the system message
    assert info["cached_tokens"] >= prefix_len // 4 * 4 > 0
    assert calls[0] == info["prefill_tokens"] == info["history_tokens"] - info["cached_tokens"]
    # The blocks found are real: the reply is the one the whole history gives from scratch.
    history = chat_format(tok).encode_dialog_prompt(
        [{"role": "system", "content": system}] + conv.messages[:1])
    assert info["tokens"] == contiguous_reply(model, tok, history, 16)
