"""The BPE trainer learns the merges a plain (slow) BPE loop learns, and the file it writes makes
tiktoken produce exactly the tokens those merges imply."""

import base64
import random
import tempfile
from collections import Counter
from pathlib import Path

import llama_models
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
from tiktoken.load import load_tiktoken_bpe

from minipaged.embedded.bpe import count_chunks, learn_merges, main, save_tiktoken_bpe, train_bpe
from minipaged.formats.tokenizer import Tokenizer
from minipaged.formats import load_tokenizer

LLAMA3_FILE = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
SPLIT = regex.compile(MetaTokenizer.pat_str)

WORDS = ("the cache block table holds pages of keys and values for every sequence while a "
         "request grows, attention reads them back; we'll free it when it's done. I'm sure "
         "THEY'RE right").split()
EXTRA = ["3.14159", "2048", "1,000,000", "日本語", "naïve", "café", "😀", "x += 1", "f(a, b)",
         "  indented", "\n\n", "\t", "-->", "{'k': [1, 2]}"]
SYLLABLES = "ka to ri mu se na pol tran ex ing ed ly str ch qu ou ai 7 42 é ß".split()


def make_corpus(seed, n_lines):
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) if rng.random() < 0.6 else rng.choice(EXTRA)
                 if rng.random() < 0.3 else "".join(rng.choices(SYLLABLES, k=rng.randint(1, 4)))
                 for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ":", ""]))
    return "\n".join(lines)


def reference_merges(texts, num_merges):
    """Textbook BPE: count every adjacent pair from scratch, merge the most frequent (ties:
    smallest ids), repeat. Tokens are kept as bytes."""
    chunks = Counter(c.encode() for t in texts for c in SPLIT.findall(t))
    words = {c: [bytes([b]) for b in c] for c in chunks}
    ids = {bytes([b]): b for b in range(256)}
    merges = []
    for _ in range(num_merges):
        counts = Counter()
        for c, toks in words.items():
            for pair in zip(toks, toks[1:]):
                counts[pair] += chunks[c]
        if not counts:
            break
        a, b = min(counts, key=lambda p: (-counts[p], ids[p[0]], ids[p[1]]))
        merges.append((ids[a], ids[b]))
        ids[a + b] = 255 + len(merges)
        words = {c: reference_merge(toks, a, b) for c, toks in words.items()}
    return merges


def reference_merge(toks, a, b):
    """Replace each adjacent (a, b) by a + b, scanning left to right."""
    out, i = [], 0
    while i < len(toks):
        if i + 1 < len(toks) and toks[i] == a and toks[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(toks[i])
            i += 1
    return out


def reference_encode(text, merges):
    """What the merges say the ids of `text` are: apply them in order, chunk by chunk."""
    vocab = [bytes([b]) for b in range(256)]
    for a, b in merges:
        vocab.append(vocab[a] + vocab[b])
    rank = {tok: i for i, tok in enumerate(vocab)}
    ids, seen = [], {}
    for chunk in SPLIT.findall(text):
        if chunk not in seen:
            toks = [bytes([b]) for b in chunk.encode()]
            for a, b in merges:
                toks = reference_merge(toks, vocab[a], vocab[b])
            seen[chunk] = [rank[t] for t in toks]
        ids += seen[chunk]
    return ids


def tiktoken_encode(merges, texts):
    """Save the merges as a tokenizer.model, load it through tiktoken, encode `texts`."""
    vocab = [bytes([b]) for b in range(256)]
    for a, b in merges:
        vocab.append(vocab[a] + vocab[b])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tokenizer.model"
        save_tiktoken_bpe({tok: i for i, tok in enumerate(vocab)}, path)
        tok = load_tokenizer(path)
        return [tok.encode(t) for t in texts]


def test_merges_match_textbook_bpe():
    texts = [make_corpus(0, 60), "aaaaaaa bbb aaaa", "    x\n\n\n   y"]
    assert learn_merges(count_chunks(texts), 150) == reference_merges(texts, 150)


def test_ranks_are_bytes_then_merges():
    texts = [make_corpus(1, 40)]
    ranks = train_bpe(texts, 300)
    vocab = [bytes([b]) for b in range(256)]
    for a, b in reference_merges(texts, 44):
        vocab.append(vocab[a] + vocab[b])
    assert ranks == {tok: i for i, tok in enumerate(vocab)}


def test_result_does_not_depend_on_text_order():
    texts = make_corpus(2, 80).split("\n")
    shuffled = texts[:]
    random.Random(0).shuffle(shuffled)
    assert train_bpe(texts, 400) == train_bpe(shuffled, 400)


def test_tiktoken_encodes_like_the_merges():
    train = make_corpus(3, 400)
    unseen = make_corpus(4, 50) + "\nNew words: quokka, 1234567, Straße, 中文!"
    merges = learn_merges(count_chunks([train]), 1000 - 256)
    assert len(merges) == 1000 - 256
    got_train, got_unseen = tiktoken_encode(merges, [train, unseen])
    assert got_train == reference_encode(train, merges)
    assert got_unseen == reference_encode(unseen, merges)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab c\n'1", max_size=40), min_size=1, max_size=6),
       st.text(alphabet="ab c\n'1", max_size=40), st.integers(1, 60))
def test_tiktoken_encodes_like_the_merges_on_repetitive_text(train, unseen, num_merges):
    # small alphabets make overlapping pairs ("aaa", "abab") that stress the equivalence
    merges = learn_merges(count_chunks(train), num_merges)
    assert merges == reference_merges(train, num_merges)
    texts = train + [unseen]
    assert tiktoken_encode(merges, texts) == [reference_encode(t, merges) for t in texts]


def test_save_writes_llama3_format_byte_for_byte(tmp_path):
    ranks = load_tiktoken_bpe(str(LLAMA3_FILE))
    save_tiktoken_bpe(ranks, tmp_path / "copy" / "tokenizer.model")
    assert (tmp_path / "copy" / "tokenizer.model").read_bytes() == LLAMA3_FILE.read_bytes()


def test_save_format(tmp_path):
    save_tiktoken_bpe({b"b": 1, b"a": 0, b"ab": 2}, tmp_path / "t.model")
    assert (tmp_path / "t.model").read_text() == "YQ== 0\nYg== 1\nYWI= 2\n"


def test_trained_file_loads_unchanged(tmp_path):
    ranks = train_bpe([make_corpus(5, 100)], 500)
    save_tiktoken_bpe(ranks, tmp_path / "tokenizer.model")
    tok = load_tokenizer(tmp_path)
    assert load_tiktoken_bpe(str(tmp_path / "tokenizer.model")) == ranks
    assert tok.n_words == 500 + 256 and tok.bos_id == 500 and tok.eot_id == 509
    text = "the cache: 😀 naïve <|eot_id|>"
    assert tok.decode(tok.encode(text, bos=True)) == "<|begin_of_text|>" + text


def test_runs_out_of_pairs():
    assert len(train_bpe(["ab ab"], 1000)) == 258  # "ab", then " ab"


def test_vocab_smaller_than_bytes():
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe(["hello"], 100)


def test_progress_reports_every_merge():
    seen = []
    train_bpe([make_corpus(6, 20)], 270, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 14) for i in range(1, 15)]


def test_cli(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(make_corpus(7, 50), encoding="utf-8")
    (tmp_path / "m").mkdir()
    main([str(tmp_path / "a.txt"), "--vocab-size", "300", "--out", str(tmp_path / "m" / "tok")])
    assert "300 ranks" in capsys.readouterr().out
    lines = (tmp_path / "m" / "tok").read_bytes().splitlines()
    assert len(lines) == 300 and lines[97] == base64.b64encode(b"a") + b" 97"
    assert Tokenizer(tmp_path / "m" / "tok").n_words == 556
