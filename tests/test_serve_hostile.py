"""The server against clients that misbehave (issue 47's probes and more): a value that breaks a
step, a step that raises, a slow step beside /metrics, a large prompt, bodies past the limit,
clients that leave at every stage of a request, refusals that must not depend on timing,
connections that never send a request, and shutdown with clients attached. Each checks that
the client gets one clear answer, the server goes on serving, and every block comes back."""

import contextlib
import json
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minipaged.serve.server import start

from test_serve import ROOT, free_port, metrics, serve_process, wait_idle

GREEDY = {"model": "embedded", "prompt": "The cache holds", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    srv = start(num_blocks=160, max_num_seqs=8, max_waiting=16)     # a full context fits
    yield srv
    srv.stop()


def post(server, body, path="/v1/completions", timeout=20):
    return httpx.post(server.url + path, json=body, timeout=timeout)


@contextlib.contextmanager
def steps_taking(server, seconds):
    """Each engine step takes at least `seconds` (a slower model), so that a request is still
    running when the test acts."""
    engine, step = server.engine, server.engine.step

    def slow():
        time.sleep(seconds)
        return step()
    engine.step = slow
    try:
        yield
    finally:
        del engine.step


@contextlib.contextmanager
def held_step(server):
    """The next engine step waits, inside the step, until the block ends; yields an Event set
    once the loop is in it."""
    engine, step = server.engine, server.engine.step
    inside, release = threading.Event(), threading.Event()

    def held():
        inside.set()
        release.wait(30)
        return step()
    engine.step = held
    try:
        yield inside
    finally:
        del engine.step
        release.set()


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def raw_request(port, body: bytes, path="/v1/completions", headers=b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\n" + headers +
              (b"" if b"Content-Length" in headers else
               b"Content-Length: " + str(len(body)).encode() + b"\r\n") + b"\r\n" + body)
    return s


# -- values that once broke the loop -------------------------------------------------------------
def test_a_tiny_temperature_is_greedy_and_the_server_goes_on(server):
    greedy = post(server, GREEDY).json()["choices"][0]["text"]
    r = post(server, {**GREEDY, "temperature": 1e-300, "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy        # the limit of sampling as T -> 0
    assert post(server, GREEDY).json()["choices"][0]["text"] == greedy
    assert wait_idle(server)["minipaged_kv_blocks_used"] == 0


def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(server):
    wait_idle(server)
    failed = metrics(server)["minipaged_requests_failed_total"]
    engine, step = server.engine, server.engine.step
    calls = []

    def breaks_once():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted in the test")
        return step()
    engine.step = breaks_once
    try:
        r = post(server, {**GREEDY, "max_tokens": 20})
        with httpx.stream("POST", server.url + "/v1/completions", timeout=20,
                          json={**GREEDY, "max_tokens": 20, "stream": True}) as s:
            streamed = [line for line in s.iter_lines() if line]
    finally:
        del engine.step
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "planted in the test" in err["message"]
    assert streamed[-1] == "data: [DONE]", streamed        # the second one ran unharmed
    m = wait_idle(server)
    assert m["minipaged_kv_blocks_used"] == 0
    assert m["minipaged_requests_failed_total"] == failed + 1
    assert post(server, GREEDY).status_code == 200


def test_a_stream_whose_step_raises_gets_an_error_event(server):
    wait_idle(server)
    engine, step = server.engine, server.engine.step

    def breaks():
        if engine.step_count >= 2:
            raise RuntimeError("planted in the test")
        return step()
    engine.step = breaks
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=20,
                          json={**GREEDY, "max_tokens": 20, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    finally:
        del engine.step
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert wait_idle(server)["minipaged_kv_blocks_used"] == 0


def test_a_loop_that_raises_outside_a_step_fails_every_waiting_request_and_answers_503():
    """`_deliver` raises once two requests (one whole, one streamed) are in the engine: both
    get the error at once, /health and every later request answer 503 at once, and the
    server still stops. (Before, the loop's thread died and every request waited for ever.)"""
    srv = start(num_blocks=64, max_num_seqs=4)
    loop, deliver = srv.loop, srv.loop._deliver

    def breaks():
        if len(loop.tickets) >= 2:
            raise RuntimeError("planted in the test")
        deliver()
    loop._deliver = breaks
    body = {**GREEDY, "max_tokens": 400, "ignore_eos": True}
    try:
        out = {}

        def whole():
            out["whole"] = post(srv, body, timeout=15)
        t = threading.Thread(target=whole)
        t.start()
        while not loop.tickets:
            time.sleep(0.01)
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=15,
                          json={**body, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        t.join(15)
        r = out["whole"]
        assert r.status_code == 500 and "planted in the test" in r.json()["error"]["message"]
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "planted in the test" in err["message"]
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stopped"
        started = time.time()
        late = post(srv, GREEDY, timeout=5)
        assert late.status_code == 503 and time.time() - started < 5
        assert late.json()["error"]["code"] == "engine_stopped"
        assert "planted in the test" in late.json()["error"]["message"]
    finally:
        srv.stop()


# -- the event loop never waits for the engine -----------------------------------------------------
def test_metrics_and_models_answer_while_a_step_is_held(server):
    wait_idle(server)
    with held_step(server) as inside:
        t = threading.Thread(target=post, args=(server, GREEDY))
        t.start()
        assert inside.wait(10)
        for path in ("/metrics", "/v1/models"):
            assert httpx.get(server.url + path, timeout=2).status_code == 200
        m = metrics(server)
        assert m["minipaged_requests_running"] + m["minipaged_requests_waiting"] >= 1
    t.join()


def test_tokenizing_a_prompt_does_not_hold_the_event_loop(server):
    tok = server.tokenizer
    encode, inside, release = tok.encode, threading.Event(), threading.Event()

    def slow_encode(*a, **kw):
        inside.set()
        release.wait(30)
        return encode(*a, **kw)
    tok.encode = slow_encode
    try:
        t = threading.Thread(target=post, args=(server, {**GREEDY, "prompt": "paging " * 5000,
                                                         "max_tokens": 1}))
        t.start()
        assert inside.wait(10)
        assert httpx.get(server.url + "/v1/models", timeout=2).status_code == 200
    finally:
        release.set()
        del tok.encode
    t.join()


# -- limits come before work -----------------------------------------------------------------------
def test_a_body_past_the_limit_is_413_before_it_is_read(server):
    peak = rss_peak_mib()
    s = raw_request(server.port, b"", headers=b"Content-Length: 50000000\r\n")
    head = b""
    while b"--max-body-bytes" not in head and (chunk := s.recv(4096)):
        head += chunk                                # the headers and the body may come apart
    s.close()
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b"--max-body-bytes" in head
    r = httpx.post(server.url + "/v1/completions", timeout=20,       # no length: chunked
                   content=iter([b'{"prompt": "' + b"a" * 2**16] * 40))
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert rss_peak_mib() - peak < 30
    assert post(server, GREEDY).status_code == 200


def test_n_past_the_engines_rows_is_refused_before_anything_is_built(server):
    peak = rss_peak_mib()
    r = post(server, {**GREEDY, "n": 200000, "temperature": 1.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "from 1 to 8" in r.json()["error"]["message"]
    assert rss_peak_mib() - peak < 30


def test_token_ids_past_the_context_are_refused_before_they_are_checked(server):
    r = post(server, {**GREEDY, "prompt": [1] * 100_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "100000 tokens" in r.json()["error"]["message"]


def test_a_prompt_at_the_context_limit(server):
    ctx = server.engine.max_seq_len
    r = post(server, {**GREEDY, "prompt": [1] * (ctx - 1), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    r = post(server, {**GREEDY, "prompt": [1] * (ctx - 1), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert wait_idle(server)["minipaged_kv_blocks_used"] == 0


def test_deeply_nested_json_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"[" * 100_000, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_stop_string_never_met_runs_to_max_tokens(server):
    r = post(server, {**GREEDY, "max_tokens": 12, "stop": ["\u2603 never \u2603"]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 12


# -- clients that leave ---------------------------------------------------------------------------
def test_a_client_that_leaves_a_whole_answer_is_aborted(server):
    wait_idle(server)
    before = metrics(server)
    with steps_taking(server, 0.02):                 # 400 tokens would take 8 s
        with pytest.raises(httpx.ReadTimeout):
            post(server, {**GREEDY, "n": 2, "temperature": 1.0, "max_tokens": 400,
                          "ignore_eos": True}, timeout=0.5)
        m = wait_idle(server, 5)
    assert m["minipaged_requests_aborted_total"] == before["minipaged_requests_aborted_total"] + 2
    assert m["minipaged_generated_tokens_total"] - before["minipaged_generated_tokens_total"] < 400
    assert m["minipaged_kv_blocks_used"] == 0


def test_a_client_that_resets_before_the_headers_is_aborted(server):
    wait_idle(server)
    before = metrics(server)
    with steps_taking(server, 0.02):
        body = json.dumps({**GREEDY, "max_tokens": 400, "ignore_eos": True}).encode()
        s = raw_request(server.port, body)           # a whole answer: no headers until the end
        while metrics(server)["minipaged_requests_running"] == 0:
            time.sleep(0.01)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()                                    # a reset, not a goodbye
        m = wait_idle(server, 5)
    assert m["minipaged_requests_aborted_total"] == before["minipaged_requests_aborted_total"] + 1
    assert m["minipaged_generated_tokens_total"] - before["minipaged_generated_tokens_total"] < 400


def test_a_client_that_reads_slowly_gets_every_token(server):
    body = {**GREEDY, "max_tokens": 40, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=20) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                time.sleep(0.02)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in chunks) == \
        post(server, {**GREEDY, "max_tokens": 40, "ignore_eos": True}).json()["choices"][0]["text"]


# -- refusals and connections ---------------------------------------------------------------------
def test_refusals_past_the_waiting_bound_do_not_depend_on_timing():
    """4 rows, 2 may wait beyond them: of 10 requests that arrive one after another, 4 run,
    2 wait and 4 are refused, however the steps fall between them."""
    srv = start(num_blocks=64, max_num_seqs=4, max_waiting=2)
    try:
        with steps_taking(srv, 0.05):
            streams, codes = contextlib.ExitStack(), []
            with streams, httpx.Client(timeout=20) as h:
                for i in range(10):
                    r = streams.enter_context(h.stream("POST", srv.url + "/v1/completions", json={
                        **GREEDY, "max_tokens": 200, "stream": True, "ignore_eos": True}))
                    codes.append(r.status_code)
                    time.sleep(0.03 * (i % 3))           # arrivals between steps, or not
        assert codes.count(503) == 4 and codes.count(200) == 6, codes
        assert wait_idle(srv, 10)["minipaged_kv_blocks_used"] == 0
    finally:
        srv.stop()


def test_a_connection_that_sends_no_request_is_closed():
    srv = start(num_blocks=16, header_timeout=0.5)
    try:
        idle = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        slow = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        start_time = time.time()
        with pytest.raises(OSError):
            for byte in b"POST /v1/completions HTTP/1.1\r\n" * 10:   # a byte every 0.1 s
                slow.sendall(bytes([byte]))
                time.sleep(0.1)
        assert idle.recv(100) == b""                 # closed, not answered
        assert time.time() - start_time < 5
        idle.close(), slow.close()
        assert httpx.get(srv.url + "/v1/models", timeout=5).status_code == 200
    finally:
        srv.stop()


def test_a_second_server_on_a_taken_port_is_one_error_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        start_time = time.time()
        r = subprocess.run([sys.executable, "-m", "minipaged.serve", "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: cannot listen on") and "--port" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert time.time() - start_time < 30                       # refused before the model loads


def test_shutdown_with_watchers_and_half_sent_bodies_logs_no_traceback():
    port = free_port()
    p = serve_process(port)
    try:
        with httpx.stream("GET", f"http://127.0.0.1:{port}/pool/events", timeout=10) as events:
            next(events.iter_lines())                # a page watching the pool
            for _ in range(3):                       # clients that hang up in mid-body
                s = raw_request(port, b'{"model": "embedded", "pro',
                                headers=b"Content-Length: 1000\r\n")
                time.sleep(0.1)
                s.close()
            time.sleep(0.5)
            p.send_signal(signal.SIGTERM)
            status = p.wait(timeout=30)
    finally:
        p.kill()
    err = p.stderr.read()
    assert status == 0, err
    for word in ("Traceback", "CancelledError", "ClientDisconnect"):
        assert word not in err, err
