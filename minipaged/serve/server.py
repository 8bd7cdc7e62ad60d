"""Putting the server together: the model, its engine in a loop, the app, uvicorn."""

from __future__ import annotations

import os
import socket
import threading
import time

import torch
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..api import Engine
from ..chat.options import model_path
from ..disaggregated_engine import DisaggregatedEngine
from ..errors import UsageError
from ..formats import load_model, load_tokenizer
from ..sizing import pool_blocks
from .app import MAX_BODY_BYTES, create_app
from .loop import EngineLoop

DEFAULT_CONTEXT = 4096      # tokens a request may hold, at most (or the model's, if shorter)
HEADER_TIMEOUT = 10.0       # seconds a new connection has to send its first request's headers


def build(model=None, dtype=torch.float32, block_size: int = 16, num_blocks=None,
          kv_budget=None, preemption: str = "recompute", max_num_seqs: int = 64,
          max_num_batched_tokens=None, prefix_caching: bool = True, max_model_len=None,
          max_waiting: int = 64, record: bool = False, kv_dtype=None,
          max_body_bytes: int = MAX_BODY_BYTES, tensor_parallel: int = 1,
          disaggregated: bool = False):
    """The model, its engine in a loop, and the app; `model` as the chat's --model.
    `record=True` keeps the engine's `history` of steps, for the drawings of `minipaged.viz`;
    `kv_dtype="int8"` stores the KV blocks as int8 codes with their scales (stage 4b);
    `tensor_parallel=N` runs the engine on N processes (stage 9): the loop drives rank 0's, in
    this process, whose model calls the other ranks follow (`loop.engine.close()` ends them);
    `disaggregated=True` prefills on an engine in another process and decodes on the loop's
    (stage 9b; `loop.engine.close()` ends the other)."""
    if disaggregated:
        check_disaggregated(tensor_parallel, kv_dtype, prefix_caching)
    path = model_path(model) if model else None
    llama = load_model(path, dtype=dtype)
    tokenizer = load_tokenizer(path)
    context = min(llama.args.max_seq_len, max_model_len or DEFAULT_CONTEXT)
    if num_blocks is None and kv_budget is None:       # four full contexts
        num_blocks = pool_blocks(llama.args, dtype, block_size, lengths=[context] * 4)
    options = dict(kv_budget=kv_budget, max_num_seqs=max_num_seqs, max_seq_len=context,
                   prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens,
                   record=record, kv_dtype=kv_dtype)
    if disaggregated:
        engine = DisaggregatedEngine(llama, num_blocks, block_size, preemption, **options)
    else:
        engine = Engine(llama, num_blocks, block_size, preemption,
                        tensor_parallel=tensor_parallel, **options)
    loop = EngineLoop(engine, max_waiting=max_waiting)
    name = model or "embedded"
    return loop, create_app(loop, tokenizer, name, max_body_bytes), tokenizer, llama


def check_disaggregated(tensor_parallel: int, kv_dtype, prefix_caching: bool) -> None:
    """What disaggregated serving cannot combine with, refused before the model loads."""
    if tensor_parallel != 1:
        raise UsageError(f"disaggregated serving runs each engine in one process: it cannot "
                         f"combine with tensor_parallel={tensor_parallel} (--tensor-parallel); "
                         f"drop one of them")
    if kv_dtype is not None:
        raise UsageError(f"disaggregated serving moves the pool's K and V as they are: it cannot "
                         f"combine with kv_dtype={kv_dtype} (--kv-dtype); drop one of them")
    if not prefix_caching:
        raise UsageError("disaggregated serving finds the blocks it moved by the prefix cache: "
                         "it cannot run without it; drop --no-prefix-caching")


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: a free one), or one clear UsageError: taken
    before the model loads, so a second server on a port fails at once."""
    try:
        socket.getaddrinfo(host, port)
        return socket.create_server((host, port))
    except socket.gaierror as e:
        raise UsageError(f"cannot listen on {host}: {e.strerror}; give --host an address of "
                         f"this machine (127.0.0.1, 0.0.0.0)") from None
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port} ({os.strerror(e.errno)}): is another "
                         f"server running there? Choose another --port") from None


def protocol(header_timeout: float = HEADER_TIMEOUT):
    """uvicorn's HTTP/1.1 protocol, with a deadline for a connection's first request: one that
    sends nothing, or its headers a byte at a time, is closed after `header_timeout` seconds
    (uvicorn times out idle connections only between two requests)."""
    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.loop.call_later(header_timeout, self.no_request_yet)

        def no_request_yet(self):
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()
    return Protocol


def config(app, header_timeout: float = HEADER_TIMEOUT, **options) -> uvicorn.Config:
    """uvicorn's settings for the server (`options`: host, port, timeout_graceful_shutdown)."""
    return uvicorn.Config(app, http=protocol(header_timeout), log_level="warning", **options)


class UvicornServer(uvicorn.Server):
    """uvicorn's server, except that after Ctrl-C or SIGTERM the answers in flight have
    `drain` seconds to finish, then the loop aborts them (each ends with finish_reason
    "abort" and `data: [DONE]`), and the process exits with status 0 (uvicorn would raise
    the signal again once it has shut down)."""

    def __init__(self, config, loop=None, drain: float = 5.0):
        super().__init__(config)
        self.loop, self.drain, self.timer = loop, drain, None

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if self.loop is not None and self.timer is None:
            self.timer = threading.Timer(self.drain, self.loop.abort_all)
            self.timer.daemon = True
            self.timer.start()


class Running:
    """A server running in a thread of this process (tests, the notebook, the benchmark)."""

    def __init__(self, loop, app, tokenizer, model, host="127.0.0.1",
                 header_timeout: float = HEADER_TIMEOUT):
        self.loop, self.app, self.tokenizer, self.model = loop, app, tokenizer, model
        self.sock = listen(host, 0)                    # a free port, held from now on
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = UvicornServer(config(app, header_timeout, timeout_graceful_shutdown=2))
        loop.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    @property
    def engine(self):
        return self.loop.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.loop.stop()
        self.sock.close()
        if hasattr(self.loop.engine, "close"):      # tensor_parallel: end the other ranks
            self.loop.engine.close()


def start(model=None, header_timeout: float = HEADER_TIMEOUT, **options) -> Running:
    """Build a server (options: `build`'s) and run it on 127.0.0.1, on a free port."""
    return Running(*build(model, **options), header_timeout=header_timeout)
