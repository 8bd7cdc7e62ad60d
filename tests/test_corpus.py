"""The demo model's training corpus: reproducible, well-formed, sized, and held out honestly."""

import math
import re
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from minipaged.embedded.corpus import build_corpus, corpus_stats
from minipaged.embedded.dialogs import TECH_TOPICS


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(seed=0)


def user_texts(dialog):
    return [m["content"] for m in dialog["messages"] if m["role"] == "user"]


def answers(dialog):
    return [m["content"] for m in dialog["messages"] if m["role"] == "assistant"]


def all_answers(dialogs):
    return "\n".join(a for d in dialogs for a in answers(d))


def test_same_seed_gives_the_same_corpus_and_another_seed_a_different_split(corpus):
    assert build_corpus(seed=0) == corpus
    other = build_corpus(seed=1)
    assert {q for d in other.heldout for q in user_texts(d)} != \
           {q for d in corpus.heldout for q in user_texts(d)}


def test_no_heldout_question_appears_verbatim_in_train(corpus):
    seen = {q.lower() for d in corpus.train for q in user_texts(d)}
    for d in corpus.heldout:
        for q in user_texts(d):
            assert q.lower() not in seen, q


def test_every_topic_is_in_both_splits(corpus):
    train = {d["topic"] for d in corpus.train}
    heldout = {d["topic"] for d in corpus.heldout}
    assert train == heldout
    assert len(train) >= 25


def test_heldout_is_about_five_percent_of_dialogs(corpus):
    share = len(corpus.heldout) / (len(corpus.train) + len(corpus.heldout))
    assert 0.04 <= share <= 0.06


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_dialogs_alternate_roles_and_end_with_the_assistant(corpus, split):
    for d in getattr(corpus, split):
        assert set(d) == {"messages", "topic", "keywords"}
        roles = [m["role"] for m in d["messages"]]
        if roles[0] == "system":
            roles = roles[1:]
        assert 2 <= len(roles) <= 6 and len(roles) % 2 == 0, roles
        assert roles == ["user", "assistant"] * (len(roles) // 2), roles
        for m in d["messages"]:
            assert set(m) == {"role", "content"}
            assert m["content"] and m["content"] == m["content"].strip()


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_keywords_are_lower_case_and_in_the_dialogs_final_answer(corpus, split):
    for d in getattr(corpus, split):
        assert d["keywords"] and all(k == k.lower() and k.strip() for k in d["keywords"])
        final = answers(d)[-1].lower()
        assert any(k in final for k in d["keywords"]), (d["topic"], final)


def test_keywords_single_out_their_topic(corpus):
    # An on-topic check is only worth something if other topics' answers rarely pass it.
    by_topic = defaultdict(list)
    keywords = {}
    for d in corpus.train:
        by_topic[d["topic"]].append(answers(d)[-1].lower())
        keywords[d["topic"]] = d["keywords"]
    for topic, kws in keywords.items():
        others = [a for t, texts in by_topic.items() if t != topic for a in texts]
        hits = sum(any(k in a for k in kws) for a in others)
        assert hits / len(others) < 0.3, (topic, hits / len(others))


def test_train_text_is_one_and_a_half_to_three_megabytes(corpus):
    chars = sum(len(m["content"]) for d in corpus.train for m in d["messages"])
    assert 1_500_000 <= chars <= 3_000_000


def test_building_takes_well_under_two_seconds():
    start = time.perf_counter()
    build_corpus(seed=3)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_single_and_multi_turn_dialogs_with_and_without_system_prompts(corpus, split):
    dialogs = getattr(corpus, split)
    exchanges = [len(user_texts(d)) for d in dialogs]
    assert {1, 2, 3} <= set(exchanges)
    assert 0.3 <= sum(n > 1 for n in exchanges) / len(dialogs) <= 0.6
    with_system = sum(d["messages"][0]["role"] == "system" for d in dialogs) / len(dialogs)
    assert 0.1 <= with_system <= 0.4


def test_each_topic_is_asked_in_many_phrasings(corpus):
    # Technical topics mix templates, subjects, openers and closers; small talk is short lists.
    final_questions = defaultdict(set)
    for d in corpus.train:
        final_questions[d["topic"]].add(user_texts(d)[-1].lower())
    for topic, questions in final_questions.items():
        assert len(questions) >= (60 if topic in TECH_TOPICS else 8), (topic, len(questions))


# The ideas the demo model must know, as a reader would search for them.
IDEAS = ["kv cache", "prefill", "decode", "contiguous", "792", "block size", "block table",
         "{0: [7, 1, 3], 1: [5, 2]}", "free block", "internal fragmentation",
         "external fragmentation", "reservation", "pagedattention", "vllm",
         "flash_attn_with_kvcache", "cache_seqlens", "continuous batching", "preempt", "swap",
         "recompute", "copy-on-write", "reference count", "prefix", "parallel sampling",
         "grouped-query", "rotary", "llama 3", "hello", "welcome",
         "i am minipaged's tiny demo model"]


@pytest.mark.parametrize("idea", IDEAS)
def test_every_idea_is_taught_in_train_and_asked_in_heldout(corpus, idea):
    assert idea in all_answers(corpus.train).lower()
    heldout = "\n".join(m["content"] for d in corpus.heldout for m in d["messages"]).lower()
    assert idea in heldout


def test_the_numbers_taught_are_right(corpus):
    text = all_answers(corpus.train)
    # A 792-token request in an 8,192-slot reservation: the seed article's example.
    wasted = 8192 - 792
    for answer in {a for a in text.split("\n") if "792" in a and "8,192" in a}:
        assert f"{wasted:,}" in answer or f"{round(100 * wasted / 8192)}%" in answer, answer
    # Blocks of 16 and 256 for the same request.
    assert f"ceil(792 / 16) = {math.ceil(792 / 16)} blocks" in text
    assert f"holding {792 - 16 * (792 // 16)} tokens" in text
    assert f"takes {math.ceil(792 / 256)} blocks and leaves {256 * math.ceil(792 / 256) - 792} slots" in text
    # Llama 3 8B: 32 layers, 8 KV heads, head_dim 128, bf16 (2 bytes); K and V.
    per_token = 2 * 32 * 8 * 128 * 2
    assert f"= {per_token // 1024} KiB" in text
    assert per_token * 8192 == 2**30 and "8,192 tokens take 1 GiB" in text
    # Block table {0: [7, 1, 3]}, block size 4: token 9 is in logical block 2 -> physical 3.
    table, block_size, pos = [7, 1, 3], 4, 9
    physical, offset = table[pos // block_size], pos % block_size
    assert f"is physical block {physical}, at offset {offset}" in text
    assert f"= {physical * block_size + offset}." in text
    # vLLM paper Fig. 2, Orca (Max): the four shares add up to the whole KV memory.
    shares = re.findall(r"(\d+\.\d)% of KV memory", text)
    assert {"57.3", "13.3"} <= set(shares)
    assert abs(20.4 + 13.3 + 57.3 + 8.9 - 100) < 0.2


def test_corpus_stats_counts_match_the_dialogs(corpus):
    stats = corpus_stats(corpus)
    for split in ("train", "heldout"):
        dialogs = getattr(corpus, split)
        assert stats[split]["dialogs"] == len(dialogs)
        assert stats[split]["chars"] == sum(len(m["content"]) for d in dialogs for m in d["messages"])
        assert stats[split]["multi_turn"] == sum(len(user_texts(d)) > 1 for d in dialogs)
    for topic, counts in stats["topics"].items():
        assert counts["train"] == sum(d["topic"] == topic for d in corpus.train)
        assert counts["heldout"] == sum(d["topic"] == topic for d in corpus.heldout)


def test_the_command_line_prints_stats_and_samples():
    out = subprocess.run([sys.executable, "-m", "minipaged.embedded.corpus", "--samples", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "heldout" in out.stdout and "block_table" in out.stdout and "assistant" in out.stdout


def test_every_answer_variant_is_short_and_carries_a_keyword():
    # All variants, not only the ones seed 0 happened to draw.
    from minipaged.embedded.dialogs import CHAT_TOPICS
    for topic, spec in {**TECH_TOPICS, **CHAT_TOPICS}.items():
        intents = [v for v in spec.values() if isinstance(v, dict)]
        assert intents, topic
        for intent in intents:
            assert intent["questions"] and intent["answers"], topic
            for answer in intent["answers"]:
                assert any(k in answer.lower() for k in spec["keywords"]), (topic, answer)
                sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])", answer)
                assert 1 <= len(sentences) <= 3, (topic, answer)
