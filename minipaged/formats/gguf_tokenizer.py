"""The tokenizer a GGUF file carries, as a tiktoken Encoding, and the chat template it names.

A GGUF stores a byte-level BPE (`tokenizer.ggml.model` = "gpt2") as metadata:

    tokenizer.ggml.tokens      every token, id order, spelled with GPT-2's byte-to-unicode table
    tokenizer.ggml.token_type  1 = normal; 3 = control (<|im_end|>), 4 = user-defined, ...
    tokenizer.ggml.merges      "Ġ t", "Ġ a", ...: the merge order
    tokenizer.ggml.pre         which split pattern cuts text into chunks before BPE
    tokenizer.chat_template    the Jinja template the model was tuned with

tiktoken wants {token bytes: rank}, the rank being both the id and the merge priority. In the
files we read, merge i produces a token whose id grows with i, so the ids are the ranks (we check
it). Control tokens become tiktoken's special tokens: they have ids and decode to their text, but
no text encodes to them (as in `tokenizer.Tokenizer`, a user cannot type a control token).
"""

from __future__ import annotations

import re
from pathlib import Path

import tiktoken

from ..errors import RequestError, TokenizerError
from .gguf_checkpoint import gguf_metadata
from .tokenizer import LLAMA3_PATTERN, ChatFormat, Tokenizer

# GPT-2's split: contractions, letters, numbers, punctuation runs, and spaces (a space sticks to
# the word after it). Hugging Face adds a last `\s+`; llama.cpp omits it and gets the same chunks.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# SmolLM2 (like StarCoder) first cuts every digit off on its own, then runs GPT-2's split on
# the pieces between. As one pattern: a digit is a chunk, and a run of spaces before a digit is
# a chunk to its end, as it would be at the end of a piece ("x  1" -> "x", "  ", "1").
SMOLLM_PATTERN = r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"

# tokenizer.ggml.pre -> split pattern (the names llama.cpp's converter writes).
PRETOKENIZER_PATTERNS = {"llama-bpe": LLAMA3_PATTERN, "llama3": LLAMA3_PATTERN,
                         "llama-v3": LLAMA3_PATTERN, "smollm": SMOLLM_PATTERN,
                         "gpt2": GPT2_PATTERN}

NORMAL_TOKEN = 1


def gpt2_byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the other 68 are
    moved to U+0100 onwards (so the space 0x20 is spelled "Ġ", U+0120, and newline "Ċ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, moved = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + moved)
            moved += 1
    return table


def _token_bytes(token: str, byte_of: dict[str, int]) -> bytes:
    try:
        return bytes(byte_of[ch] for ch in token)
    except KeyError as e:
        raise TokenizerError(f"token {token!r} uses the character {e.args[0]!r}, which is not in "
                             "GPT-2's byte spelling: not a byte-level BPE vocabulary") from None


class GGUFTokenizer(Tokenizer):
    """A GGUF file's byte-level BPE, with `Tokenizer`'s interface (encode, decode,
    stream_decoder, stop_tokens, n_words) and the chat format its template names."""

    def __init__(self, meta: dict, name: str = "gguf"):
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"{name} has a {kind!r} tokenizer; minipaged reads byte-level BPE ('gpt2': "
                "Llama 3, SmolLM2, ...), not SentencePiece ('llama': Llama 1/2, Mistral)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str) or pre not in PRETOKENIZER_PATTERNS:
            raise TokenizerError(f"{name} splits text with the pre-tokenizer {pre!r}, which "
                                 f"minipaged does not know; known: {', '.join(PRETOKENIZER_PATTERNS)}")
        tokens, types = _vocabulary(meta, name)
        byte_of = {ch: b for b, ch in gpt2_byte_spelling().items()}
        ranks, self.special_tokens = {}, {}
        for i, (token, kind) in enumerate(zip(tokens, types)):
            if kind == NORMAL_TOKEN:
                ranks[_token_bytes(token, byte_of)] = i
            else:
                self.special_tokens[token] = i
        _check_merge_order(meta.get("tokenizer.ggml.merges"), tokens, name)
        self.n_words = len(tokens)
        if len(ranks) + len(self.special_tokens) != self.n_words:
            raise TokenizerError(f"{name}: tokenizer.ggml.tokens spells some tokens twice; "
                                 "each id needs a token of its own")
        # tiktoken needs every byte as a token. A vocabulary trained without some bytes (SmolLM2
        # lacks 21, e.g. \x04) drops them from the text, as Hugging Face and llama.cpp do: give
        # them ids past the vocabulary and remove those ids after encoding.
        missing = [bytes([b]) for b in range(256) if bytes([b]) not in ranks]
        ranks.update({b: self.n_words + k for k, b in enumerate(missing)})
        try:
            self.model = tiktoken.Encoding(name=name, pat_str=PRETOKENIZER_PATTERNS[pre],
                                           mergeable_ranks=ranks,
                                           special_tokens=self.special_tokens)
        except ValueError as e:
            raise TokenizerError(f"{name}: tiktoken cannot build this vocabulary ({e})") from None

        ids = {k: _token_id(meta, f"tokenizer.ggml.{k}_token_id", self.n_words, name)
               for k in ("bos", "eos", "eot", "eom")}
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        # The padding id is never used here, and some converters write one past the vocabulary.
        pad = meta.get("tokenizer.ggml.padding_token_id")
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.n_words else None
        self.chat_template = meta.get("tokenizer.chat_template") or ""
        if not isinstance(self.chat_template, str):
            raise TokenizerError(f"{name}: tokenizer.chat_template must be text, not "
                                 f"{self.chat_template!r:.60}")
        self.chat_format_class = _chat_format_class(self.chat_template)
        lacking = [t for t in CONTROL_TOKENS.get(self.chat_format_class, ())
                   if t not in self.special_tokens]
        if lacking:
            raise TokenizerError(f"{name}: the chat template writes {', '.join(lacking)}, which "
                                 f"the vocabulary lacks (or holds as ordinary text); the "
                                 f"template and the tokens do not belong together")
        # The end-of-turn token: the one the template closes each message with.
        turn_end = {ChatFormat: "<|eot_id|>", ChatMLFormat: "<|im_end|>"}.get(self.chat_format_class)
        self.eot_id = self.special_tokens.get(turn_end, ids["eot"])
        stops = [ids[k] for k in ("eos", "eot", "eom")]
        self.stop_tokens = list(dict.fromkeys(t for t in [*stops, self.eot_id] if t is not None))

    def encode(self, s, bos=False, eos=False):
        """Text -> ids, as `Tokenizer.encode`, without the bytes the vocabulary lacks."""
        return [i for i in super().encode(s, bos=bos, eos=eos) if i < self.n_words]


def _vocabulary(meta, name):
    """The tokens (strings) and their types (ints), checked to be lists of one length."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise TokenizerError(f"{name}: tokenizer.ggml.tokens must be a non-empty list of "
                             f"strings, not {tokens!r:.60}")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL_TOKEN] * len(tokens)
    if not (isinstance(types, list) and len(types) == len(tokens) and
            all(isinstance(t, int) and not isinstance(t, bool) for t in types)):
        raise TokenizerError(f"{name}: tokenizer.ggml.token_type must be one whole number per "
                             f"token ({len(tokens):,} of them)")
    return tokens, types


def _token_id(meta, key, n_words, name):
    """An optional token id of the vocabulary (None if absent)."""
    value = meta.get(key)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                  and 0 <= value < n_words):
        raise TokenizerError(f"{name}: {key} is {value!r:.40}, not an id of its vocabulary "
                             f"of {n_words:,} tokens")
    return value


def _check_merge_order(merges, tokens, name):
    """tiktoken merges by rank; the file's merges must produce tokens in id order for the ids
    to serve as ranks."""
    if not merges:
        return
    if not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise TokenizerError(f"{name}: tokenizer.ggml.merges must be a list of strings "
                             f"('a b': a pair to merge)")
    ids = {t: i for i, t in enumerate(tokens)}
    made = [ids.get("".join(m.split(" ", 1)), -1) for m in merges]
    if min(made) < 0 or any(a >= b for a, b in zip(made, made[1:])):
        raise TokenizerError(f"{name}: the merges do not produce tokens in id order; minipaged's "
                             "tiktoken tokenizer needs token ids that follow the merge order")


def _chat_format_class(template: str):
    """The chat format a Jinja template writes, recognised by its control tokens."""
    if "<|start_header_id|>" in template:
        return ChatFormat
    if "<|im_start|>" in template:
        return ChatMLFormat
    return None


class ChatMLFormat:
    """ChatML (SmolLM2, Qwen, ...): <|im_start|>role\\ncontent<|im_end|>\\n per message, the
    content written as it is; a prompt ends with an open `<|im_start|>assistant\\n`.

    Some templates write a fixed system message when a dialog brings none (SmolLM2's names
    the model); we read that sentence from the checkpoint's template and do the same.
    """

    ROLES = ("system", "user", "assistant", "tool")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.im_start = tokenizer.special_tokens["<|im_start|>"]
        self.im_end = tokenizer.special_tokens["<|im_end|>"]
        default = re.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]*?)<\|im_end\|>",
                            getattr(tokenizer, "chat_template", ""))
        self.default_system = default.group(1) if default else None

    def encode_message(self, message):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)):
            raise RequestError(f"a chat message is a dict {{'role': str, 'content': str}}, "
                               f"got {message!r:.80}.")
        if message.get("role") not in self.ROLES:
            raise RequestError(f"unknown chat role {message.get('role')!r}; expected one of "
                               f"{', '.join(self.ROLES)}.")
        return ([self.im_start] + self.tokenizer.encode(f"{message['role']}\n{message['content']}")
                + [self.im_end] + self.tokenizer.encode("\n"))

    def encode_dialog_prompt(self, dialog):
        """The template's system message if the dialog has none, every message, then an open
        assistant turn for the model to fill."""
        ids = []
        if dialog and self.default_system is not None and dialog[0].get("role") != "system":
            ids += self.encode_message({"role": "system", "content": self.default_system})
        for message in dialog:
            ids += self.encode_message(message)
        return ids + [self.im_start] + self.tokenizer.encode("assistant\n")


# The control tokens each chat format writes: a template that names a format whose tokens the
# vocabulary lacks is refused when the tokenizer is read, not at the first message.
CONTROL_TOKENS = {ChatFormat: ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                  ChatMLFormat: ("<|im_start|>", "<|im_end|>")}


def load_gguf_tokenizer(file) -> GGUFTokenizer:
    """The tokenizer of a GGUF file (metadata read once, then from the cache)."""
    meta = gguf_metadata(file)
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(f"{file} carries no tokenizer (no tokenizer.ggml.tokens)")
    return GGUFTokenizer(meta, name=Path(file).name)
