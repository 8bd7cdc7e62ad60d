"""A conversation that keeps its KV blocks between turns.

The chat used to re-encode and re-run the whole history on every turn. Here the conversation is
one sequence of the cache for its whole life: after a reply its keys and values stay in their
blocks, and the next turn feeds the model only what is new — the end of the last reply, the
user's message, the opening of the assistant's turn — with `cache.prepare([seq_id], n_new)`.

The history is kept as token ids, not text: the tokens the model produced are the ones its
cache holds (decoding a reply and encoding it again need not give the same ids back). It is
built from three pieces of the checkpoint's chat format, found by asking the format itself:

    prefix    what opens a dialog (Llama 3: begin_of_text; SmolLM2: its default system message)
    opening   what opens the assistant's turn (the header the model fills)
    closing   what ends a message (Llama 3: eot_id; ChatML: <|im_end|> and a newline)

When the next turn would not fit in the model's context, the oldest exchanges are dropped. The
tokens after them were computed attending to them, so their cached keys and values are wrong
now: the conversation frees its blocks and prefills what is left from scratch (`rebuilt`).

A turn that cannot be served — a message too long for the context even with every earlier
exchange dropped, or too many tokens for the free blocks — is refused before anything changes:
the history, the cached tokens and the blocks held stay exactly as they were.
"""

from __future__ import annotations

import time

import torch

from ..checks import check_sampling
from ..errors import OutOfBlocksError, RequestError
from ..formats import chat_format
from ..generation import row_generator, sample


def format_pieces(fmt, system=None):
    """(prefix, opening, closing) token lists of a chat format, read off its own encodings."""
    probe = {"role": "user", "content": "hi"}
    head = [{"role": "system", "content": system}] if system else []
    full = fmt.encode_dialog_prompt(head + [probe])
    user = fmt.encode_message(probe)
    empty_reply = fmt.encode_message({"role": "assistant", "content": ""})
    # The opening is the longest start of an empty assistant message that ends the prompt.
    k = max(k for k in range(len(empty_reply) + 1) if full[len(full) - k:] == empty_reply[:k])
    prefix = full[:len(full) - k - len(user)]
    if full[len(prefix):len(full) - k] != user:
        raise RequestError("this chat format does not put messages one after another; the "
                           "chat cannot keep its cache between turns")
    return prefix, empty_reply[:k], empty_reply[k:]


class Conversation:
    """One conversation as one sequence (`seq_id`) of a PagedCache or ContiguousCache."""

    def __init__(self, model, tokenizer, cache, seq_id: int = 0, max_new_tokens: int = 200,
                 temperature: float = 0.0, top_p: float = 0.9, seed: int = 0, system=None):
        check_sampling(temperature, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.model, self.tokenizer, self.cache, self.seq_id = model, tokenizer, cache, seq_id
        self.format = chat_format(tokenizer)
        self.prefix, self.opening, self.closing = format_pieces(self.format, system)
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.seed, self.system = seed, system
        self.stop = set(tokenizer.stop_tokens)
        self.max_seq_len = getattr(cache, "max_seq_len", model.args.max_seq_len)
        self._check_context()
        self.device = next(model.parameters()).device
        self.turns = 0
        self.exchanges: list[list[list[int]]] = []   # [user tokens, reply tokens] per exchange
        self.messages: list[dict] = []               # the same exchanges as text
        self.cached = 0                              # tokens of `self.tokens` the cache holds

    @property
    def tokens(self) -> list[int]:
        """The whole conversation as the model sees it (the last reply's closing included)."""
        return self.prefix + [t for pair in self.exchanges for part in pair for t in part]

    @property
    def reply_tokens(self) -> int:
        """The most a reply adds to the history: its tokens and the closing after them."""
        return self.max_new_tokens + len(self.closing)

    def _check_context(self) -> None:
        """Refuse settings that leave no room for even an empty message, naming the culprit:
        the reply's length, or the system prompt."""
        empty = len(self.user_tokens(""))                  # a message's header and closing
        bare = len(format_pieces(self.format)[0])          # the prefix without a system prompt
        room = self.max_seq_len - self.reply_tokens - empty
        if bare > room:
            raise RequestError(
                f"a reply of up to {self.max_new_tokens} new tokens (max_new_tokens, "
                f"--max-new-tokens) is past the context of {self.max_seq_len} tokens, which "
                f"must also hold a message; ask for at most "
                f"{self.max_seq_len - empty - bare - len(self.closing)}")
        if len(self.prefix) > room:
            raise RequestError(
                f"the system prompt is {len(self.prefix) - bare} tokens: with a reply of up to "
                f"{self.max_new_tokens} new tokens (--max-new-tokens) it leaves no room for a "
                f"message in the context of {self.max_seq_len} tokens. Shorten the system "
                f"prompt (--system) to at most {room - bare} tokens, or ask for fewer new "
                f"tokens.")

    def reset(self) -> None:
        """Forget everything and give every block back: a new conversation."""
        self._free()
        self.exchanges, self.messages, self.turns = [], [], 0

    def _free(self) -> None:
        """Give the sequence's blocks back (also those of a step interrupted half-way)."""
        managers = getattr(self.cache, "managers", None)
        if managers is None or self.seq_id in managers[0]:
            self.cache.free(self.seq_id)
        self.cached = 0

    # -- one turn ----------------------------------------------------------------------------
    def user_tokens(self, text: str) -> list[int]:
        """A user message and the opening of the assistant's turn."""
        return self.format.encode_message({"role": "user", "content": text}) + self.opening

    @torch.inference_mode()
    def reply(self, text: str, on_text=None) -> dict:
        """Feed the new tokens, generate the answer (streamed to `on_text`), keep its blocks.

        Runs under `torch.inference_mode()`: with autograd on, every key and value written into
        the pool would keep the graph that computed it alive, turn after turn.

        Returns what the turn did: the reply, how many tokens the prefill processed, whether
        the history was dropped and rebuilt, `pool_full` if blocks ran out mid-reply, and
        `cut` if the reply stopped at max_new_tokens rather than at an end-of-turn token.
        Raises RequestError (a message too long for the context) or OutOfBlocksError (the pool
        cannot hold it) before anything changes.
        """
        user = self.user_tokens(text)
        dropped = self._exchanges_to_drop(len(user))
        rebuilt = dropped > 0 and self.cached > 0
        if rebuilt:                           # the kept tokens attended to the dropped ones
            kept = sum(len(t) for pair in self.exchanges[dropped:] for t in pair)
            self._check_rebuild_room(len(self.prefix) + kept + len(user))
            self._free()
        del self.exchanges[:dropped], self.messages[:2 * dropped]
        history = self.tokens
        feed = history[self.cached:] + user   # the last reply's closing, then the new message
        start = time.perf_counter()
        skipped, fresh = 0, self.cached == 0 and getattr(self.cache, "prefix_caching", False)
        if fresh:
            # A fresh start (first turn, after /reset, after a rebuild): the pool may still hold
            # the blocks of an earlier conversation's same beginning (stage 6's prefix cache).
            try:
                skipped = self.cache.start(self.seq_id, feed)  # raises before changing anything
            except OutOfBlocksError as e:
                raise OutOfBlocksError(pool_full_message(self.cache, len(feed))) from e
        first = self._step(feed[skipped:], prefill=True, prepared=fresh)
        self.exchanges.append([user, []])
        self.messages.append({"role": "user", "content": text})
        self.cached = len(history) + len(user)
        answer, pool_full = self._decode(first, on_text)
        seconds = time.perf_counter() - start
        if getattr(self.cache, "prefix_caching", False):   # name the blocks that filled up
            self.cache.name_blocks(self.seq_id, (history + user + answer)[:self.cached])
        self.exchanges[-1][1] = answer + self.closing
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(answer)})
        self.turns += 1
        return {"text": self.messages[-1]["content"], "tokens": answer,
                "prefill_tokens": len(feed) - skipped, "cached_tokens": skipped,
                "history_tokens": len(history) + len(user),
                "new_tokens": len(answer), "seconds": seconds, "dropped": dropped,
                "rebuilt": rebuilt, "pool_full": pool_full,
                "cut": len(answer) == self.max_new_tokens}

    def _exchanges_to_drop(self, n_user: int) -> int:
        """How many of the oldest exchanges must go for the history, the message and a full
        reply (closing included) to fit; RequestError if the message cannot fit even alone.
        Changes nothing."""
        room = self.max_seq_len - self.reply_tokens - len(self.prefix) - n_user
        if room < 0:
            limit = self.max_seq_len - self.reply_tokens - len(self.prefix)
            raise RequestError(
                f"this message takes {n_user} tokens, but beside a reply of up to "
                f"{self.max_new_tokens} new tokens{' and the system prompt' * bool(self.system)}"
                f" the context of {self.max_seq_len} tokens leaves room for {limit}. Send a "
                f"shorter message; the conversation is as it was.")
        total, dropped = len(self.tokens) - len(self.prefix), 0
        while total > room:
            total -= sum(len(t) for t in self.exchanges[dropped])
            dropped += 1
        return dropped

    def _check_rebuild_room(self, n_tokens: int) -> None:
        """A rebuild frees the conversation's blocks and prefills `n_tokens` from scratch:
        refuse it (OutOfBlocksError) before freeing anything if the pool cannot hold them."""
        managers = getattr(self.cache, "managers", None)
        if managers is None:                  # a contiguous row always holds its max_seq_len
            return
        free = self.cache.num_free_blocks + len(managers[0].blocks_of(self.seq_id))
        if managers[0].blocks_for(n_tokens) > free:
            raise OutOfBlocksError(pool_full_message(self.cache, n_tokens, free))

    def _step(self, tokens, prefill: bool = False, prepared: bool = False) -> int:
        """Append `tokens` to the conversation's sequence in the cache (`prepared`: the cache's
        `start` already made room for them); sample the next token."""
        try:
            if not prepared:
                self.cache.prepare([self.seq_id], len(tokens))
        except OutOfBlocksError as e:
            raise OutOfBlocksError(pool_full_message(self.cache, len(tokens))) from e
        logits = self.model(torch.tensor([tokens], device=self.device), cache=self.cache,
                            last_only=True)                                  # (1, 1, V)
        gen = row_generator(self.seed, self.turns) if self.temperature > 0 else None
        if prefill:
            self._gen = gen
        return sample(logits[0, -1], self.temperature, self.top_p, self._gen)

    def _decode(self, token: int, on_text):
        """Greedy or sampled decoding, one token at a time, into the conversation's blocks."""
        decoder, answer = self.tokenizer.stream_decoder(), []
        pool_full = None
        while token not in self.stop and len(answer) < self.max_new_tokens:
            answer.append(token)
            if on_text:
                on_text(decoder.push(token))
            if len(answer) == self.max_new_tokens:
                break                         # the last token goes in with the next turn
            try:
                token = self._step([token])
            except OutOfBlocksError as e:     # keep what was said; the reply stops here
                pool_full = str(e)
                break
            self.cached += 1
        if on_text:
            on_text(decoder.flush())
        return answer, pool_full


def pool_full_message(cache, n_tokens: int, free: int | None = None) -> str:
    """What to tell a chat user whose conversation no longer fits in the KV pool (`free`: the
    blocks that would be free for it, by default those free now)."""
    if not hasattr(cache, "managers"):
        return ("the contiguous cache's row is full; type /reset to start a new conversation")
    free = cache.num_free_blocks if free is None else free
    total = cache.num_blocks
    return (f"the KV pool is full: {n_tokens} more token(s) need blocks but only {free} of "
            f"{total} blocks (of {cache.block_size} tokens) are free. Type /reset to start a "
            f"new conversation and free its blocks, or restart the chat with a larger "
            f"--kv-budget.")
