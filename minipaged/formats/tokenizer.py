"""Llama 3's tokenizer: tiktoken's byte-level BPE with Meta's split pattern, special tokens and
chat format.

A `tokenizer.model` file is a list of `base64(token) rank` lines: the ranks are the token ids and
also the merge order. Llama 3 has 128,000 of them, followed by 256 special tokens that no text can
produce. The same file format carries the embedded model's small tokenizer
(see `minipaged/embedded/bpe.py`).
"""

import codecs
import base64
import operator
import re
from pathlib import Path

import tiktoken

from ..errors import RequestError, TokenizerError

# Text is cut into chunks by this pattern before BPE runs inside each chunk (Llama 3, like GPT-4):
# contractions, letters with one leading non-letter, numbers of at most 3 digits, punctuation
# runs, newline runs, and spaces (a space sticks to the word that follows it).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256

# tiktoken panics on very long inputs and slows down on very long runs of (non-)whitespace
# (tiktoken issue #195), so Meta encodes windows of 400K characters and cuts any run longer than
# 25K characters. We cut at the same places, so long inputs get Meta's ids too.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def special_token_names(n=NUM_SPECIAL_TOKENS):
    """The special tokens in Meta's order (llama-models' llama3/tokenizer.py, Llama 3.1 names)."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
             "<|python_tag|>", "<|image|>"]
    return named + [f"<|reserved_special_token_{2 + i}|>" for i in range(n - len(named))]


def read_ranks(path):
    """Read a tiktoken BPE file into {token bytes: rank}, or raise TokenizerError saying why not."""
    path = Path(path)
    expected = "a tiktoken BPE file (lines of `base64(token) rank`, like Llama 3's tokenizer.model)"
    if not path.is_file():
        what = "does not exist" if not path.exists() else \
            "is a folder" if path.is_dir() else "is not a regular file (a FIFO or a device)"
        raise TokenizerError(f"{path} {what}; expected {expected}.")
    data = path.read_bytes()
    if not data.strip():
        raise TokenizerError(f"{path} is empty; expected {expected}.")
    if b"\0" in data[:4096] or not _is_utf8(data):
        raise TokenizerError(
            f"{path} is a binary file; expected {expected}. Llama 1/2 and Mistral ship a "
            "SentencePiece tokenizer.model, which minipaged cannot read.")
    try:   # parsed here, not by tiktoken's loader: its download cache (TIKTOKEN_CACHE_DIR)
        ranks = {base64.b64decode(token): int(rank)       # is of no use for a file on disk
                 for token, rank in (line.split() for line in data.splitlines() if line)}
    except ValueError as error:
        bad = next(((n, line) for n, line in enumerate(data.splitlines(), start=1)
                    if line and not _is_rank_line(line)), None)
        found = f"line {bad[0]} is {bad[1][:60]!r}" if bad else str(error)
        raise TokenizerError(
            f"{path} is not in tiktoken format: {found}; expected {expected}.") from None
    if set(ranks.values()) != set(range(len(ranks))):
        raise TokenizerError(
            f"{path} has {len(ranks)} distinct tokens but ranks up to {max(ranks.values())}; "
            f"expected each rank 0..{len(ranks) - 1} exactly once (a repeated token or a gap).")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path} lacks {len(missing)} of the 256 single bytes (e.g. {bytes([missing[0]])!r}); "
            "a byte-level BPE needs every byte as a token so that any text can be encoded.")
    return ranks


def _is_utf8(data):
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _is_rank_line(line):
    fields = line.split()
    return (len(fields) == 2 and fields[1].isdigit()
            and re.fullmatch(rb"[A-Za-z0-9+/]*={0,2}", fields[0]) is not None
            and len(fields[0]) % 4 == 0)


def _split_long_runs(s, max_run):
    """Cut `s` so that no piece holds more than `max_run` consecutive (non-)whitespace chars."""
    start = 0
    for run in re.finditer(r"\s+|\S+", s):
        for cut in range(run.start() + max_run, run.end(), max_run):
            yield s[start:cut]
            start = cut
    yield s[start:]


class Tokenizer:
    """Llama 3's tokenizer (same ids as Meta's) over any tiktoken BPE file."""

    def __init__(self, model_path):
        model_path = Path(model_path)
        mergeable_ranks = read_ranks(model_path)
        num_base_tokens = len(mergeable_ranks)
        self.special_tokens = {name: num_base_tokens + i
                               for i, name in enumerate(special_token_names())}
        self.model = tiktoken.Encoding(name=model_path.name, pat_str=LLAMA3_PATTERN,
                                       mergeable_ranks=mergeable_ranks,
                                       special_tokens=self.special_tokens)
        self.n_words = num_base_tokens + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]
        self.eom_id = self.special_tokens["<|eom_id|>"]
        self.python_tag_id = self.special_tokens["<|python_tag|>"]
        self.pad_id = self.special_tokens["<|finetune_right_pad_id|>"]
        self.stop_tokens = [self.eos_id, self.eom_id, self.eot_id]

    def encode(self, s, bos=False, eos=False):
        """Text -> ids. Special-token strings in `s` ("<|eot_id|>") are ordinary text here:
        a user cannot inject control tokens. Control tokens come only from bos/eos/ChatFormat."""
        if not isinstance(s, str):
            raise TypeError(f"Tokenizer.encode takes a str, got {type(s).__name__}")
        ids = [self.bos_id] if bos else []
        for i in range(0, len(s), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_long_runs(s[i:i + TIKTOKEN_MAX_ENCODE_CHARS],
                                          MAX_NO_WHITESPACES_CHARS):
                ids.extend(self.model.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode_bytes(self, ids):
        """Ids -> the raw bytes they stand for (a token may hold part of a UTF-8 character)."""
        try:
            ids = [operator.index(i) for i in ids]  # ints, numpy or torch integers
        except TypeError:
            raise TokenizerError(f"token ids must be integers, got {ids!r:.80}.") from None
        bad = [i for i in ids if not 0 <= i < self.n_words]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is not in this tokenizer's vocabulary "
                                 f"(ids run 0..{self.n_words - 1}).")
        return self.model.decode_bytes(ids)

    def decode(self, ids):
        """Ids -> text; bytes that are not valid UTF-8 become U+FFFD, as in Meta's decode."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self):
        """A StreamDecoder for printing tokens as they are generated."""
        return StreamDecoder(self)


class StreamDecoder:
    """Decodes one token at a time, holding back a UTF-8 character split across tokens.

    Concatenating every `push` and the final `flush` gives exactly `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        """The text that token `token_id` completes (may be "" while a character is unfinished)."""
        return self._utf8.decode(self.tokenizer.decode_bytes([token_id]))

    def flush(self):
        """Whatever is still held back (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class ChatFormat:
    """Llama 3's chat template, as Meta's llama3/chat_format.py for plain text messages:
    <|start_header_id|>role<|end_header_id|>\\n\\n content.strip() <|eot_id|>."""

    ROLES = ("system", "user", "assistant", "ipython", "tool")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_header(self, role):
        if role not in self.ROLES:
            raise RequestError(
                f"unknown chat role {role!r}; expected one of {', '.join(self.ROLES)}.")
        special = self.tokenizer.special_tokens
        return ([special["<|start_header_id|>"]]
                + self.tokenizer.encode("ipython" if role == "tool" else role)
                + [special["<|end_header_id|>"]] + self.tokenizer.encode("\n\n"))

    def encode_message(self, message):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)):
            raise RequestError(f"a chat message is a dict {{'role': str, 'content': str}}, "
                               f"got {message!r:.80}.")
        return (self.encode_header(message.get("role"))
                + self.tokenizer.encode(message["content"].strip())
                + [self.tokenizer.eot_id])

    def encode_dialog_prompt(self, dialog):
        """begin_of_text, every message, then an open assistant header for the model to fill."""
        ids = [self.tokenizer.bos_id]
        for message in dialog:
            ids.extend(self.encode_message(message))
        return ids + self.encode_header("assistant")


def chat_format(tokenizer):
    """The chat format of the tokenizer's checkpoint: Llama 3's headers (`ChatFormat`) unless
    the tokenizer names another (a GGUF file's template may be ChatML)."""
    fmt = getattr(tokenizer, "chat_format_class", ChatFormat)
    if fmt is None:
        raise TokenizerError("this checkpoint names no chat template minipaged knows (Llama 3's "
                             "headers or ChatML's <|im_start|>); it is not a chat model")
    return fmt(tokenizer)
