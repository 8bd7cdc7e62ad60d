"""OpenAI's request and response shapes: reading a request's fields (each wrong one refused with
OpenAI's error object, naming the field), and writing completions, chunks and usage."""

from __future__ import annotations

import json
import math
import time
import uuid

MAX_STOP_STRINGS = 4            # OpenAI's limit


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


def sampling(body, max_tokens_default, max_n) -> dict:
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


class Answer:
    """One response (completion or chat), the shapes of its chunks and of its whole body."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def chunk(self, index: int, text: str | None, finish_reason=None, role=False) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        return {**self._head(obj), "choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    def whole(self, texts, reasons, use: dict) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t},
                        "logprobs": None, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, reasons))]
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, reasons))]
        return {**self._head(self.object), "choices": choices, "usage": use}


def sse(data) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
