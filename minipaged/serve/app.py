"""The HTTP side: FastAPI routes in OpenAI's shapes over the engine loop (`loop.py`).

    GET  /v1/models              the one model served
    POST /v1/completions         a prompt (text or token ids) continued
    POST /v1/chat/completions    messages, through the model's chat format
    GET  /metrics                Prometheus text (`metrics.py`)
    GET  /health                 200 while the engine loop runs, 503 once it has stopped
    GET  /version                {"version"} of minipaged
    POST /tokenize, /detokenize  a prompt (or messages) to token ids and back, as vLLM's
    GET  /                       the pool, live (`live_page.py`), sent with its first picture;
                                 GET /pool and /pool/events give the state it draws, once or as
                                 server-sent events; GET /pool/request/{id} one request's block
                                 tables, every layer; GET /lesson the lesson it links to

Each request is read and checked here, then handed to the loop; what the engine refuses (a
prompt too long for the context or the pool) comes back as OpenAI's 400 error, and the engine
is as it was. A streamed answer is server-sent events ending `data: [DONE]`; a client that
hangs up, at any point after its first byte, has its request aborted, and its blocks are free
after the next step. The event loop never waits for a step: a body is read up to a size limit,
and parsed and tokenized in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import (HTMLResponse, JSONResponse, PlainTextResponse, Response,
                               StreamingResponse)
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..errors import RequestError, TokenizerError
from ..formats import chat_format
from .live_page import render
from .loop import EngineLoop, QueueFullError, block_tables, pool_state
from .metrics import prometheus_text
from .protocol import (CHAT_FIELDS, COMPLETION_FIELDS, APIError, Answer, check_fields,
                       get_bool, get_model, parse_json, sampling, sse, usage)

CHAT_DEFAULT_MAX_TOKENS = 256     # a chat reply's length when the request names none
COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
LESSON = Path(__file__).resolve().parents[2] / "lessons" / "08-serving.md"
EVENTS_PERIOD = 0.1               # seconds between two pictures of the pool on /pool/events
MAX_BODY_BYTES = 2**20            # a request body past this is refused (413), unread
log = logging.getLogger("minipaged.serve")
try:
    VERSION = importlib.metadata.version("minipaged")
except importlib.metadata.PackageNotFoundError:     # run from a checkout never installed
    VERSION = "unknown"


class Choice:
    """One sample's text as it streams: decoded token by token, cut at a stop string, and held
    back by as many characters as a stop string could still need."""

    def __init__(self, tokenizer, stops):
        self.decoder, self.stops = tokenizer.stream_decoder(), stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent, self.finish = "", 0, None
        self.tokens, self.logprobs = [], []      # every token, and its logprobs if asked

    def push(self, tokens, reason, logprobs=None) -> bool:
        """Add new tokens (and the end, if `reason`). True if a stop string ended it here."""
        self.tokens += tokens
        self.logprobs += logprobs or []
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


def create_app(loop: EngineLoop, tokenizer, model_name: str,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="minipaged", docs_url=None, redoc_url=None, openapi_url=None)
    engine = loop.engine
    fmt = chat_format(tokenizer)
    max_n = engine.scheduler.max_num_seqs

    @functools.lru_cache(maxsize=65536)
    def piece(token: int):
        """A token's text and bytes (the bytes may be part of a UTF-8 character)."""
        raw = tokenizer.decode_bytes([token])
        return raw.decode("utf-8", errors="replace"), raw

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(str(e.detail), status=e.status_code).body(),
                            status_code=e.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request, e):           # hung up while sending its body: nobody reads
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):
        log.exception("a request failed")
        return JSONResponse(APIError(f"the server failed on this request ({type(e).__name__}: "
                                     f"{e}); it goes on serving", status=500,
                                     kind="server_error").body(), status_code=500)

    async def read_json(request: Request) -> dict:
        """The body as a JSON object: read up to `max_body_bytes`, parsed in a worker thread."""
        declared = request.headers.get("content-length", "")
        too_big = APIError(f"the request body is over {max_body_bytes} bytes; send a shorter "
                           f"prompt (or start the server with a larger --max-body-bytes)",
                           code="body_too_large", status=413)
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_big
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body_bytes:
                raise too_big
        return await asyncio.to_thread(parse_json, bytes(raw))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "minipaged"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        check_fields(body, COMPLETION_FIELDS)
        get_model(body, model_name)
        opts = sampling(body, COMPLETION_DEFAULT_MAX_TOKENS, max_n, chat=False)
        echo = get_bool(body, "echo")
        if echo and opts["logprobs"] is not None:
            raise APIError("echo with logprobs would need the prompt's logprobs, which this "
                           "server does not compute; ask for echo or for logprobs",
                           param="echo", code="unsupported_parameter")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                          # a batch of one
        if isinstance(prompt, str) and prompt:
            ids = await asyncio.to_thread(tokenizer.encode, prompt, bos=True)
        elif isinstance(prompt, list) and prompt and len(prompt) < engine.max_seq_len and \
                all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        elif isinstance(prompt, list) and len(prompt) >= engine.max_seq_len:
            raise APIError(f"the prompt has {len(prompt)} tokens, and the context holds "
                           f"{engine.max_seq_len} with the answer; shorten it", param="prompt",
                           code="invalid_value")
        else:
            raise APIError("prompt must be a non-empty string or a non-empty list of token ids "
                           "(one prompt per request: send several as several requests)",
                           param="prompt", code="invalid_type")
        if echo:
            opts["echo"] = prompt if isinstance(prompt, str) else \
                await asyncio.to_thread(tokenizer.decode, ids)
        return await answer(request, Answer(False, model_name, piece), ids, opts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        check_fields(body, CHAT_FIELDS)
        get_model(body, model_name)
        opts = sampling(body, CHAT_DEFAULT_MAX_TOKENS, max_n, chat=True)
        ids = await dialog_ids(body.get("messages"))
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            opts["max_tokens"] = max(1, min(opts["max_tokens"], engine.max_seq_len - len(ids)))
        return await answer(request, Answer(True, model_name, piece), ids, opts)

    async def dialog_ids(messages) -> list[int]:
        """A chat's messages through the model's chat format, in a worker thread."""
        if not isinstance(messages, list) or not messages:
            raise APIError("messages must be a non-empty list of {role, content} objects",
                           param="messages", code="invalid_type")
        try:
            return await asyncio.to_thread(fmt.encode_dialog_prompt,
                                           [plain_message(m) for m in messages])
        except RequestError as e:
            raise APIError(str(e), param="messages", code="invalid_value") from None

    async def answer(request, ans: Answer, ids, opts):
        """Hand the request to the engine loop; stream its tokens or gather them."""
        check_room(engine, len(ids), opts["max_tokens"])
        stop_tokens = [] if opts["ignore_eos"] else tokenizer.stop_tokens
        try:
            ticket = await asyncio.wrap_future(loop.submit(
                ids, opts["max_tokens"], opts["temperature"], opts["top_p"], opts["n"],
                opts["seed"], stop_tokens, opts["logprobs"], name=ans.id))
        except QueueFullError as e:
            raise APIError(str(e), code=e.code, status=503, kind=e.kind) from None
        except RequestError as e:
            raise APIError(str(e), param=_param_of(str(e)), code="invalid_value") from None
        watcher = asyncio.create_task(hang_up(request, ticket))
        choices = [Choice(tokenizer, opts["stop"]) for _ in range(opts["n"])]
        echo = opts.get("echo", "")
        if opts["stream"]:
            return StreamingResponse(stream(ans, ticket, choices, opts["include_usage"], watcher,
                                            echo),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in tokens(ticket, choices):
                pass
        finally:
            watcher.cancel()
            if not all(c.finish for c in choices):     # shutdown
                loop.abort(ticket)
        if ticket.error:
            raise APIError(ticket.error, status=500, kind="server_error", code="engine_error")
        texts = [echo + c.text for c in choices]
        logprobs = None if opts["logprobs"] is None else \
            [ans.logprobs(c.tokens, c.logprobs) for c in choices]
        return ans.whole(texts, [c.finish for c in choices],
                         usage(ticket.prompt_tokens, sum(len(r.output) for r in ticket.samples)),
                         logprobs)

    async def hang_up(request, ticket):
        """Abort `ticket` once its client hangs up, whatever its request is doing by then (the
        server learns it from the connection, not from a failed write)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        loop.abort(ticket)

    async def tokens(ticket, choices):
        """Each sample's new text as the loop posts its tokens: (index, text, the new tokens,
        their logprobs or None) until all end."""
        while not all(c.finish for c in choices):
            i, new, reason, logprobs = await ticket.queue.get()
            c = choices[i]
            if c.finish:
                continue                              # ended by a stop string already
            if c.push(new, reason, logprobs) and not reason:
                loop.abort(ticket, i)                 # a stop string: no more tokens for it
            yield i, c.take(), new, logprobs

    async def stream(ans: Answer, ticket, choices, include_usage, watcher, echo=""):
        finished = [False] * len(choices)
        offset = [len(echo)] * len(choices)           # where the next token's text starts
        try:
            for i in range(len(choices)):
                if ans.chat:
                    yield sse(ans.chunk(i, None, role=True))
                elif echo:
                    yield sse(ans.chunk(i, echo))
            async for i, text, new, logprobs in tokens(ticket, choices):
                if text or logprobs:
                    yield sse(ans.chunk(i, text, logprobs=ans.logprobs(new, logprobs, offset[i])))
                    offset[i] += sum(len(piece(t)[0]) for t in new)
                if choices[i].finish and not finished[i]:
                    finished[i] = True
                    yield sse(APIError(ticket.error, status=500, kind="server_error",
                                       code="engine_error").body()
                              if choices[i].finish == "error" else
                              ans.chunk(i, None if ans.chat else "", choices[i].finish))
            if include_usage:
                yield sse(ans.usage_chunk(usage(ticket.prompt_tokens,
                                                sum(len(r.output) for r in ticket.samples))))
            yield sse("[DONE]")
        finally:             # the client hung up (the response was cancelled), or shutdown
            watcher.cancel()
            if not all(finished):
                loop.abort(ticket)

    async def picture():
        """The pool as the live page draws it, taken by the loop between two steps."""
        return await asyncio.wrap_future(loop.ask(lambda: pool_state(engine, loop)))

    @app.get("/health")
    async def health():
        if loop.thread.is_alive() and not loop.stopping:
            return Response(status_code=200)
        raise APIError("the engine loop has stopped; restart the server", status=503,
                       kind="server_error", code="engine_stopped")

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's shapes: {prompt, add_special_tokens} or {messages} in; {count, max_model_len,
        tokens, token_strs} out (token_strs if `return_token_strs`)."""
        body = await read_json(request)
        chat = "messages" in body
        check_fields(body, {"model", "return_token_strs"} |
                     ({"messages", "add_generation_prompt"} if chat else
                      {"prompt", "add_special_tokens"}))
        if body.get("model") is not None:
            get_model(body, model_name)
        if chat:
            if body.get("add_generation_prompt") is False:
                raise APIError("add_generation_prompt=false is not supported: the chat format "
                               "always ends with the assistant's header", code="invalid_value",
                               param="add_generation_prompt")
            ids = await dialog_ids(body["messages"])
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError("prompt must be a string (or send messages)", param="prompt",
                               code="invalid_type")
            ids = await asyncio.to_thread(tokenizer.encode, prompt,
                                          bos=get_bool(body, "add_special_tokens", True))
        strs = [piece(t)[0] for t in ids] if get_bool(body, "return_token_strs") else None
        return {"count": len(ids), "max_model_len": engine.max_seq_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's shapes: {tokens} in, {prompt} out."""
        body = await read_json(request)
        check_fields(body, {"model", "tokens"})
        if body.get("model") is not None:
            get_model(body, model_name)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError("tokens must be a list of token ids", param="tokens",
                           code="invalid_type")
        try:
            return {"prompt": await asyncio.to_thread(tokenizer.decode, ids)}
        except TokenizerError as e:
            raise APIError(str(e), param="tokens", code="invalid_value") from None

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(loop.counters),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def live_page():
        return HTMLResponse(render(await picture()))

    @app.get("/pool/request/{name}")
    async def pool_request(name: str):
        """The block tables, every layer, of the request its client knows as `name`."""
        tables = await asyncio.wrap_future(loop.ask(lambda: block_tables(engine, loop, name)))
        if tables is None:
            raise APIError(f"no request {name!r} is in the engine (a finished request is "
                           f"forgotten); GET /pool lists the ids in flight", status=404,
                           code="not_found", param="id")
        return tables

    @app.get("/lesson")
    async def lesson():
        """Lesson 08 (serving), as text, when the server runs from a checkout."""
        if not LESSON.is_file():
            raise APIError("lesson 08 is lessons/08-serving.md in the minipaged repository; "
                           "this installed copy does not have it", status=404, code="not_found")
        return PlainTextResponse(LESSON.read_text(encoding="utf-8"))

    @app.get("/pool")
    async def pool():
        return await picture()

    @app.get("/pool/trace")
    async def pool_trace():
        """(version, blocks used, cached free blocks) after each of the loop's recent changes."""
        return await asyncio.wrap_future(loop.ask(lambda: [list(t) for t in loop.trace]))

    @app.get("/pool/events")
    async def pool_events(request: Request):
        async def pictures():
            last = None
            while not loop.stopping:
                try:
                    state = await picture()
                except QueueFullError:                # shutting down
                    return
                key = json.dumps(state)
                if key != last:
                    last = key
                    yield sse(key)
                await asyncio.sleep(EVENTS_PERIOD)
        return StreamingResponse(pictures(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app


def check_room(engine, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse, in the server's words (its flags), a request the context or the pool could never
    hold: the engine would refuse it too, in its own."""
    ctx, s = engine.max_seq_len, engine.scheduler
    if prompt_tokens >= ctx:
        raise APIError(f"the prompt has {prompt_tokens} tokens, and this server's context holds "
                       f"{ctx} with the answer (--max-model-len); shorten it", param="prompt",
                       code="invalid_value")
    if prompt_tokens + max_tokens > ctx:
        raise APIError(f"the prompt's {prompt_tokens} tokens and max_tokens={max_tokens} need "
                       f"{prompt_tokens + max_tokens} positions, past this server's context of "
                       f"{ctx} (--max-model-len): ask for at most {ctx - prompt_tokens} tokens",
                       param="max_tokens", code="invalid_value")
    blocks = s.blocks_for(prompt_tokens + max_tokens - 1)
    if blocks > s.num_blocks:
        raise APIError(f"the prompt's {prompt_tokens} tokens and max_tokens={max_tokens} may "
                       f"need {blocks} blocks of {s.block_size} tokens, but this server's pool "
                       f"has {s.num_blocks} (--num-blocks, --kv-budget): ask for fewer tokens",
                       param="max_tokens", code="invalid_value")


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
