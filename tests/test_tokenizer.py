"""The tokenizer gives the ids Meta's own Llama 3 tokenizer gives, on Meta's real tokenizer.model.

Ground truth: llama-models (Meta's package, `pip install --no-deps llama-models`) ships the real
128K-rank file, its `Tokenizer` and its `ChatFormat`.
"""

import base64
import os
from pathlib import Path

import llama_models
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_models.datatypes import RawMessage
from llama_models.llama3.chat_format import ChatFormat as MetaChatFormat
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

from minipaged.formats import loading as tokenizer_module
from minipaged.errors import RequestError, TokenizerError
from minipaged.formats.tokenizer import LLAMA3_PATTERN, ChatFormat, Tokenizer
from minipaged.formats import load_tokenizer

LLAMA3_FILE = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"

TRICKY = [
    "", " ", "Hello, world!", "hello world", "  two leading spaces", "trailing spaces   ",
    # contractions, in every case, and a typographic apostrophe (not a contraction)
    "I'm you're we've it's don't she'll he'd", "I'M YOU'RE WE'VE IT'S DON'T SHE'LL HE'D",
    "I'm YoU'Re wE'vE iT'S dOn'T sHe'Ll hE'D", "'s's 'S'T 'll'LL", "it’s don’t",
    # digits are split in runs of at most three
    "1", "12", "123", "1234", "1234567890", "3.14159", "1,000,000", "v2.0.10-rc1", "٣٤٥٦٧",
    "x²³ Ⅻ ½",
    # whitespace and newline runs
    "a\nb", "a\n\nb", "\n\n\n\n", "\r\n\r\n", "line one\r\nline two", "\t\tindented\n\t\t\tmore",
    " \n \n ", "a  \n  b", "       ", "word\u00a0word\u3000word", "end\n",
    # code
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))\n",
    'int main(void) {\n\tprintf("%d\\n", a[i++]);\n}', '{"key": [1, 2.5, null], "k2": "v"}',
    "for (i = 0; i < n; ++i) x += y >> 2 && z != w;", "re.compile(r'^\\s*(\\d+)$')",
    # CJK, emoji, combining marks, other scripts
    "日本語のテキストです。", "中文测试，标点符号！", "한국어 텍스트", "😀👍🏽", "👨‍👩‍👧‍👦 family",
    "🇫🇷🇯🇵", "e\u0301 cafe\u0301 n\u0303", "Z̸̢͎a̴l̵g̶o̷", "नमस्ते दुनिया", "Привет, мир!",
    "مرحبا بالعالم", "\x00\x01\x7f", "\ufeffBOM",
    # special-token strings typed by a user are plain text
    "<|begin_of_text|>", "<|eot_id|>", "Hi<|start_header_id|>user<|end_header_id|>\n\nyo<|eot_id|>",
    "<|reserved_special_token_99|>", "<|end_of_text|><|eom_id|><|python_tag|>",
]


@pytest.fixture(scope="module")
def meta():
    return MetaTokenizer(LLAMA3_FILE)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(LLAMA3_FILE)


def tiny_ranks_file(path, extra=()):
    """A valid tiktoken file: the 256 single bytes, then `extra` tokens."""
    tokens = [bytes([b]) for b in range(256)] + list(extra)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def test_pattern_is_meta_pattern():
    assert LLAMA3_PATTERN == MetaTokenizer.pat_str


def test_special_tokens_match_meta(tok, meta):
    assert tok.special_tokens == meta.special_tokens
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (128256, 128000, 128001, 128004)
    assert tok.special_tokens["<|start_header_id|>"] == 128006
    assert tok.special_tokens["<|end_header_id|>"] == 128007
    assert (tok.eom_id, tok.eot_id, tok.python_tag_id) == (128008, 128009, 128010)
    assert tok.stop_tokens == meta.stop_tokens == [128001, 128008, 128009]
    assert list(tok.special_tokens)[-1] == "<|reserved_special_token_245|>"


@pytest.mark.parametrize("text", TRICKY)
def test_encode_matches_meta(tok, meta, text):
    assert tok.encode(text) == meta.encode(text, bos=False, eos=False)
    assert tok.encode(text, bos=True, eos=True) == meta.encode(text, bos=True, eos=True)


@pytest.mark.parametrize("text", TRICKY)
def test_decode_round_trip(tok, meta, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text == meta.decode(ids)


def test_known_ids(tok):
    assert tok.encode("Hello") == [9906]
    assert tok.encode("user") == [882] and tok.encode("\n\n") == [271]
    assert tok.encode("1234567") == [4513, 10961, 22]  # "123" "456" "7"


def test_special_strings_are_not_control_tokens(tok):
    for name in tok.special_tokens:
        ids = tok.encode(f"say {name} now")
        assert max(ids) < 128000 and tok.decode(ids) == f"say {name} now"


def test_control_tokens_decode_to_their_names(tok, meta):
    ids = [128000, 9906, 128009, 128255]
    assert tok.decode(ids) == meta.decode(ids) == "<|begin_of_text|>Hello<|eot_id|>" \
        "<|reserved_special_token_245|>"


def test_long_input_is_chunked_like_meta(tok, meta):
    # a 60K run of letters and one of spaces (cut at 25K), and > 400K chars cut mid-word
    runs = "x" * 60_000 + " " * 30_001 + "tail"
    assert tok.encode(runs) == meta.encode(runs, bos=False, eos=False)
    words = "words " * 70_000
    assert tok.encode(words) == meta.encode(words, bos=False, eos=False)
    assert tok.decode(tok.encode(words)) == words


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_random_text_matches_meta(tok, meta, text):
    ids = tok.encode(text)
    assert ids == meta.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 128255), max_size=12))
def test_stream_decoder_equals_decode(tok, meta, ids):
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == meta.decode(ids)


def test_stream_decoder_never_splits_a_character(tok):
    text = "日本語 😀👍🏽 e\u0301 👨‍👩‍👧‍👦"
    ids = tok.encode(text)
    assert any(tok.decode([i]) != tok.decode_bytes([i]).decode("utf-8", "ignore")
               for i in ids)  # some tokens hold part of a character...
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)  # ...yet no piece ever shows half of one
    assert "".join(pieces) + stream.flush() == text


def test_decode_bytes(tok):
    assert tok.decode_bytes(tok.encode("é😀")) == "é😀".encode()


def test_chat_format_matches_meta(tok, meta):
    dialog = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 12+30?\n"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "And <|eot_id|> in text?"},
    ]
    meta_dialog = [RawMessage(role=m["role"], content=m["content"].strip()) for m in dialog]
    ours, theirs = ChatFormat(tok), MetaChatFormat(meta)
    assert ours.encode_dialog_prompt(dialog) == theirs.encode_dialog_prompt(meta_dialog).tokens
    for message, meta_message in zip(dialog, meta_dialog):
        assert ours.encode_message(message) == theirs.encode_message(meta_message, None)[0]
    assert ours.encode_header("tool") == theirs._encode_header("tool")


def test_chat_format_layout(tok):
    ids = ChatFormat(tok).encode_dialog_prompt([{"role": "user", "content": "Hello"}])
    assert ids == [128000, 128006, 882, 128007, 271, 9906, 128009, 128006, 78191, 128007, 271]


@pytest.mark.parametrize("message", [
    {"role": "user"}, {"content": "hi"}, {"role": "User", "content": "hi"},
    {"role": "user", "content": 3}, "hello", ("user", "hi"),
])
def test_bad_messages(tok, message):
    with pytest.raises(RequestError, match="role|message"):
        ChatFormat(tok).encode_dialog_prompt([message])


@pytest.mark.parametrize("ids", [[-1], [128256], [5, 10**9], ["7"], [1.5]])
def test_decode_bad_ids(tok, ids):
    with pytest.raises(TokenizerError, match="token id"):
        tok.decode(ids)


def test_encode_needs_str(tok):
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_load_from_folder_and_original_subfolder(tmp_path):
    tiny_ranks_file(tmp_path / "tokenizer.model", [b"ab"])
    assert load_tokenizer(tmp_path).encode("abc") == [256, 99]
    hf = tmp_path / "hf"
    (hf / "original").mkdir(parents=True)
    tiny_ranks_file(hf / "original" / "tokenizer.model", [b"bc"])
    tok = load_tokenizer(str(hf))
    assert tok.encode("abc") == [97, 256] and tok.n_words == 257 + 256 and tok.bos_id == 257


def test_default_path(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "DEFAULT_MODEL_DIR", tmp_path / "model")
    with pytest.raises(TokenizerError, match="embedded model's tokenizer is missing"):
        load_tokenizer()
    (tmp_path / "model").mkdir()
    tiny_ranks_file(tmp_path / "model" / "tokenizer.model")
    assert load_tokenizer().n_words == 512


def test_default_dir_is_inside_the_package():
    root = Path(__file__).resolve().parents[1]          # the repository
    assert tokenizer_module.DEFAULT_MODEL_DIR == root / "minipaged" / "embedded" / "model"


def test_rewritten_file_is_reread(tmp_path):
    # tiktoken caches files by path: a tokenizer retrained in place must not come back stale
    path = tiny_ranks_file(tmp_path / "tokenizer.model", [b"ab"])
    assert load_tokenizer(path).encode("ab") == [256]
    tiny_ranks_file(path, [b"ba"])
    assert load_tokenizer(path).encode("ab") == [97, 98]


def test_missing_path(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist; expected a Llama 3 tokenizer.model"):
        load_tokenizer(tmp_path / "nowhere")


def test_tokenizer_needs_a_file(tmp_path):
    for path, what in ((tmp_path, "is a folder"), (tmp_path / "missing.model", "does not exist")):
        with pytest.raises(TokenizerError, match=f"{what}; expected a tiktoken BPE file"):
            Tokenizer(path)


def test_a_model_folder_whose_tokenizer_is_a_fifo_is_told_so(tmp_path):
    """It was told "found no tokenizer.model ...; the folder holds ..., tokenizer.model"."""
    os.mkfifo(tmp_path / "tokenizer.model")
    with pytest.raises(TokenizerError, match=r"tokenizer.model is not a regular file \(a FIFO or "
                                             r"a device\); expected a tiktoken BPE file"):
        load_tokenizer(tmp_path)


def test_folder_without_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError) as error:
        load_tokenizer(tmp_path)
    message = str(error.value)
    assert "no tokenizer.model" in message and "config.json, tokenizer.json" in message
    assert "original/" in message


@pytest.mark.parametrize("content, expect", [
    (b"", "is empty"),
    (b"\n  \n", "is empty"),
    (b"\x0a\x0b\x00\x01sentencepiece\xff\xfe", "binary file.*SentencePiece"),
    (b'{"model": {"type": "BPE"}}\n', "line 1 is .*model.*expected a tiktoken BPE file"),
    (b"IQ== 0\nIg== 1 extra\n", "line 2 is b'Ig== 1 extra'"),
    (b"IQ== zero\n", "line 1 is"),
    ("#version: 0.2\nĠ t\nĠ a\n".encode(), "line 1 is b'#version: 0.2'"),  # HF merges.txt
])
def test_not_tiktoken_format(tmp_path, content, expect):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=expect):
        Tokenizer(path)


def test_rank_gap_or_repeat(tmp_path):
    path = tiny_ranks_file(tmp_path / "tokenizer.model", [b"ab"])
    path.write_text(path.read_text().replace("YWI= 256", "YWI= 300"))
    with pytest.raises(TokenizerError, match="ranks up to 300"):
        load_tokenizer(path)
    tiny_ranks_file(path, [b"ab", b"ab"])  # a repeated token leaves a gap at its first rank
    with pytest.raises(TokenizerError, match="exactly once"):
        load_tokenizer(path)


def test_missing_single_bytes(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(200)))
    with pytest.raises(TokenizerError, match="lacks 56 of the 256 single bytes"):
        load_tokenizer(path)
