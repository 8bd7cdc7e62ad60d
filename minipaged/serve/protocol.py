"""OpenAI's request and response shapes: reading a request's fields (each wrong one refused with
OpenAI's error object, naming the field), and writing completions, chunks and usage."""

from __future__ import annotations

import json
import math
import time
import uuid

MAX_STOP_STRINGS = 4            # OpenAI's limit
MAX_LOGPROBS = 20               # rivals per token at most (vLLM's default max_logprobs)
LOGPROB_FLOOR = -9999.0         # what a -inf logprob is sent as (JSON has no -inf; vLLM's floor)

# The request fields each endpoint honours. Any other is refused with a 400 naming it, as
# OpenAI refuses an unknown argument, unless it asks for what the server does anyway: the
# values in NO_EFFECT (vLLM's and OpenAI's defaults). Nothing is silently ignored.
SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream",
                 "stream_options", "logprobs", "ignore_eos",
                 "user"}                 # an end-user id for the operator's logs: no effect
COMPLETION_FIELDS = SHARED_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = SHARED_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
NO_EFFECT = {"top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,),
             "frequency_penalty": (0,), "repetition_penalty": (1,), "min_tokens": (0,),
             "best_of": (1,), "suffix": ("",), "logit_bias": ({},), "tools": ([],),
             "tool_choice": ("none",), "functions": ([],), "response_format": ({"type": "text"},),
             "store": (False,)}


class APIError(Exception):
    """An answer with OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError("the request body nests too deeply to read; send a flatter JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body


def _kind_error(name, value, what):
    return APIError(f"{name} must be {what}, not {json.dumps(value)[:60]}", param=name,
                    code="invalid_type")


def get_int(body, name, default, low=None, high=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _kind_error(name, v, "an integer")
    if (low is not None and v < low) or (high is not None and v > high):
        bounds = f"at least {low}" if high is None else f"from {low} to {high}"
        raise APIError(f"{name} must be {bounds}, not {v}", param=name, code="invalid_value")
    return v


def get_number(body, name, default, low, high, low_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _kind_error(name, v, "a number")
    if v > high or v < low or (low_open and v == low):
        side = ">" if low_open else ">="
        raise APIError(f"{name} must be {side} {low} and <= {high}, not {v}", param=name,
                       code="invalid_value")
    return float(v)


def get_bool(body, name, default=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _kind_error(name, v, "true or false")
    return v


def get_stop(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or \
            len(stops) > MAX_STOP_STRINGS:
        raise _kind_error("stop", v, f"a non-empty string or a list of up to {MAX_STOP_STRINGS}")
    return stops


def get_model(body, served: str) -> str:
    v = body.get("model")
    if not isinstance(v, str):
        raise _kind_error("model", v, f"a string naming the model ({served!r})")
    if v != served:
        raise APIError(f"the model {v!r} is not served here; this server serves {served!r} "
                       f"(GET /v1/models)", param="model", code="model_not_found")
    return v


def check_fields(body, known: set) -> None:
    """Refuse the first field of `body` not in `known` (400, naming it)."""
    for name, v in body.items():
        if name in known or v is None or any(
                v == d and isinstance(v, bool) == isinstance(d, bool) for d in NO_EFFECT.get(name, ())):
            continue
        what = f"{name}={json.dumps(v)[:40]} is not supported by this server" \
            if name in NO_EFFECT else f"unknown field {name!r}"
        raise APIError(f"{what}; leave it out (this endpoint reads: {', '.join(sorted(known))})",
                       param=name, code="unsupported_parameter")


def get_logprobs(body, chat: bool) -> int | None:
    """How many rivals to send with each token's logprob; None: no logprobs. Completions ask
    with `logprobs: k`, chat with `logprobs: true` and `top_logprobs: k`."""
    if not chat:
        return get_int(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
    if get_bool(body, "logprobs"):
        return get_int(body, "top_logprobs", 0, low=0, high=MAX_LOGPROBS)
    if body.get("top_logprobs") is not None:
        raise APIError("top_logprobs needs \"logprobs\": true", param="top_logprobs",
                       code="invalid_value")
    return None


def sampling(body, max_tokens_default, max_n, chat: bool) -> dict:
    """The fields every generation request shares, checked (`n` before anything is built for
    it: at most `max_n`, the samples the engine runs at once)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return {
        "max_tokens": get_int({name: max_tokens}, name, max_tokens_default, low=1),
        "temperature": get_number(body, "temperature", 1.0, 0, 2),
        "top_p": get_number(body, "top_p", 1.0, 0, 1, low_open=True),
        "n": get_int(body, "n", 1, low=1, high=max_n),
        "seed": get_int(body, "seed", None),
        "stop": get_stop(body),
        "stream": get_bool(body, "stream"),
        "include_usage": _include_usage(body),
        "ignore_eos": get_bool(body, "ignore_eos"),    # vLLM's extension: run to max_tokens
        "logprobs": get_logprobs(body, chat),
    }


def _include_usage(body) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _kind_error("stream_options", opts, "an object such as {\"include_usage\": true}")
    return get_bool(opts, "include_usage")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


class Answer:
    """One response (completion or chat), the shapes of its chunks and of its whole body.
    `piece(token)` gives a token's (text, bytes), for logprobs."""

    def __init__(self, chat: bool, model: str, piece=None):
        self.chat, self.model, self.created, self.piece = chat, model, int(time.time()), piece
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def logprobs(self, tokens, entries, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for `tokens` and their engine entries (logprob, rivals);
        None if the request asked for none. `offset`: where the first token's text starts in
        the choice's text (completions' text_offset)."""
        if entries is None:
            return None
        if self.chat:
            def one(t, lp):
                text, raw = self.piece(t)
                return {"token": text, "logprob": _lp(lp), "bytes": list(raw)}
            return {"content": [{**one(t, lp), "top_logprobs": [one(r, x) for r, x in rivals]}
                                for t, (lp, rivals) in zip(tokens, entries)]}
        texts = [self.piece(t)[0] for t in tokens]
        offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [_lp(lp) for lp, _ in entries],
                "top_logprobs": [{self.piece(r)[0]: _lp(x) for r, x in [(t, lp)] + rivals}
                                 for t, (lp, rivals) in zip(tokens, entries)],
                "text_offset": offsets}

    def chunk(self, index: int, text: str | None, finish_reason=None, role=False,
              logprobs=None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
        return {**self._head(obj), "choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    def whole(self, texts, reasons, use: dict, logprobs=None) -> dict:
        logprobs = logprobs or [None] * len(texts)
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t},
                        "logprobs": lp, "finish_reason": f}
                       for i, (t, f, lp) in enumerate(zip(texts, reasons, logprobs))]
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                       for i, (t, f, lp) in enumerate(zip(texts, reasons, logprobs))]
        return {**self._head(self.object), "choices": choices, "usage": use}


def sse(data) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
