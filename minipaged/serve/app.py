"""The HTTP side: FastAPI routes in OpenAI's shapes over the engine loop (`loop.py`).

    GET  /v1/models              the one model served
    POST /v1/completions         a prompt (text or token ids) continued
    POST /v1/chat/completions    messages, through the model's chat format
    GET  /metrics                Prometheus text (`metrics.py`)
    GET  /                       the pool, live (`live_page.py`); GET /pool and /pool/events
                                 give the state it draws, once or as server-sent events

Each request is read and checked here, then handed to the loop; what the engine refuses (a
prompt too long for the context or the pool) comes back as OpenAI's 400 error, and the engine
is as it was. A streamed answer is server-sent events ending `data: [DONE]`; a client that
hangs up has its request aborted, and its blocks are free after the next step.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import RequestError
from ..formats import chat_format
from .live_page import LIVE_PAGE
from .loop import EngineLoop, QueueFullError
from .metrics import prometheus_text
from .protocol import (APIError, Answer, get_model, parse_json, sampling, sse, usage)

CHAT_DEFAULT_MAX_TOKENS = 256     # a chat reply's length when the request names none
COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
EVENTS_PERIOD = 0.1               # seconds between two pictures of the pool on /pool/events


class Choice:
    """One sample's text as it streams: decoded token by token, cut at a stop string, and held
    back by as many characters as a stop string could still need."""

    def __init__(self, tokenizer, stops):
        self.decoder, self.stops = tokenizer.stream_decoder(), stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent, self.finish = "", 0, None

    def push(self, tokens, reason) -> bool:
        """Add new tokens (and the end, if `reason`). True if a stop string ended it here."""
        for t in tokens:
            self.text += self.decoder.push(t)
        if reason:
            self.text += self.decoder.flush()
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish = self.text[:cut], "stop"
            return True
        self.finish = reason
        return False

    def take(self) -> str:
        """The text not sent yet that no stop string can still take back."""
        end = len(self.text) if self.finish else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


def create_app(loop: EngineLoop, tokenizer, model_name: str) -> FastAPI:
    app = FastAPI(title="minipaged", docs_url=None, redoc_url=None, openapi_url=None)
    engine = loop.engine
    fmt = chat_format(tokenizer)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(str(e.detail), status=e.status_code).body(),
                            status_code=e.status_code)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "minipaged"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_json(await request.body())
        get_model(body, model_name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                          # a batch of one
        if isinstance(prompt, str) and prompt:
            ids = tokenizer.encode(prompt, bos=True)
        elif isinstance(prompt, list) and prompt and \
                all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise APIError("prompt must be a non-empty string or a non-empty list of token ids "
                           "(one prompt per request)", param="prompt", code="invalid_type")
        opts = sampling(body, COMPLETION_DEFAULT_MAX_TOKENS)
        return await answer(request, Answer(False, model_name), ids, opts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_json(await request.body())
        get_model(body, model_name)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError("messages must be a non-empty list of {role, content} objects",
                           param="messages", code="invalid_type")
        try:
            ids = fmt.encode_dialog_prompt([plain_message(m) for m in messages])
        except RequestError as e:
            raise APIError(str(e), param="messages", code="invalid_value") from None
        opts = sampling(body, CHAT_DEFAULT_MAX_TOKENS)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            opts["max_tokens"] = max(1, min(opts["max_tokens"], engine.max_seq_len - len(ids)))
        return await answer(request, Answer(True, model_name), ids, opts)

    async def answer(request, ans: Answer, ids, opts):
        """Hand the request to the engine loop; stream its tokens or gather them."""
        stop_tokens = [] if opts["ignore_eos"] else tokenizer.stop_tokens
        try:
            ticket = await asyncio.wrap_future(loop.submit(
                ids, opts["max_tokens"], opts["temperature"], opts["top_p"], opts["n"],
                opts["seed"], stop_tokens))
        except QueueFullError as e:
            raise APIError(str(e), code="queue_full", status=503, kind="server_overloaded") \
                from None
        except RequestError as e:
            raise APIError(str(e), param=_param_of(str(e)), code="invalid_value") from None
        choices = [Choice(tokenizer, opts["stop"]) for _ in range(opts["n"])]
        if opts["stream"]:
            return StreamingResponse(stream(ans, ticket, choices, opts["include_usage"]),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in tokens(ticket, choices, request):
                pass
        finally:
            if not all(c.finish for c in choices):     # the client went away, or shutdown
                loop.abort(ticket)
        texts = [c.text for c in choices]
        return ans.whole(texts, [c.finish for c in choices],
                         usage(ticket.prompt_tokens, sum(len(r.output) for r in ticket.samples)))

    async def tokens(ticket, choices, request=None):
        """Each sample's new text as the loop posts its tokens: (index, text) until all end."""
        while not all(c.finish for c in choices):
            try:
                i, new, reason = await asyncio.wait_for(ticket.queue.get(), 0.5)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    return
                continue
            c = choices[i]
            if c.finish:
                continue                              # ended by a stop string already
            if c.push(new, reason) and not reason:
                loop.abort(ticket, i)                 # a stop string: no more tokens for it
            yield i, c.take()

    async def stream(ans: Answer, ticket, choices, include_usage):
        finished = [False] * len(choices)
        try:
            if ans.chat:
                for i in range(len(choices)):
                    yield sse(ans.chunk(i, None, role=True))
            async for i, text in tokens(ticket, choices):
                if text:
                    yield sse(ans.chunk(i, text))
                if choices[i].finish and not finished[i]:
                    finished[i] = True
                    yield sse(ans.chunk(i, None if ans.chat else "", choices[i].finish))
            if include_usage:
                yield sse(ans.usage_chunk(usage(ticket.prompt_tokens,
                                                sum(len(r.output) for r in ticket.samples))))
            yield sse("[DONE]")
        finally:             # the client hung up (the response was cancelled), or shutdown
            if not all(finished):
                loop.abort(ticket)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(loop.snapshot()),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def live_page():
        return HTMLResponse(LIVE_PAGE)

    @app.get("/pool")
    async def pool():
        return loop.snapshot()

    @app.get("/pool/trace")
    async def pool_trace():
        """(version, blocks used, cached free blocks) after each of the loop's recent changes."""
        with loop.lock:
            return [list(t) for t in loop.trace]

    @app.get("/pool/events")
    async def pool_events(request: Request):
        async def pictures():
            last = None
            while not loop.stopping:
                state = loop.snapshot()
                key = json.dumps(state)
                if key != last:
                    last = key
                    yield sse(key)
                await asyncio.sleep(EVENTS_PERIOD)
        return StreamingResponse(pictures(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app


def plain_message(m) -> dict:
    """A chat message with its content as one string (OpenAI also allows a list of text
    parts)."""
    if isinstance(m, dict) and isinstance(m.get("content"), list):
        parts = m["content"]
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in parts):
            return {**m, "content": "".join(p["text"] for p in parts)}
    return m


def _param_of(message: str) -> str | None:
    """Which field an engine refusal is about."""
    if "n=" in message or "samples" in message:
        return "n"
    if "max_new_tokens" in message or "blocks" in message or "positions" in message:
        return "max_tokens"
    return "prompt"
