"""The server (`minipaged.serve`), tested with OpenAI's own client against a server on 127.0.0.1:
greedy answers streamed, whole and from `minipaged.generate` are the same tokens while other
requests are served; seeded samples are `generate`'s; errors have OpenAI's shape and change
nothing; a client that hangs up frees its blocks; 64 streaming clients at once are each answered
or refused cleanly and leave every block free; Ctrl-C and SIGTERM exit 0."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from minipaged import generate, load_model, load_tokenizer
from minipaged.formats import chat_format
from minipaged.serve.metrics import METRICS, parse_metrics
from minipaged.serve.server import start

ROOT = Path(__file__).resolve().parents[1]
NUM_BLOCKS, MAX_NUM_SEQS, MAX_WAITING = 64, 16, 24


@pytest.fixture(scope="module")
def server():
    srv = start(num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS, max_waiting=MAX_WAITING)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference():
    """The same checkpoint loaded again: `generate` runs on it, apart from the server's."""
    return load_model(dtype=torch.float32), load_tokenizer()


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, **kw)


def metrics(server) -> dict:
    return parse_metrics(httpx.get(server.url + "/metrics").text)


def wait_idle(server, seconds=20.0) -> dict:
    """/metrics once no request is running or waiting."""
    end = time.time() + seconds
    while time.time() < end:
        m = metrics(server)
        if m["minipaged_requests_running"] == 0 and m["minipaged_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"the server is still busy: {m}")


class Background:
    """Sampled streaming requests sent in a loop from two threads: the traffic the exactness
    tests run beside."""

    def __init__(self, server):
        self.stop, self.c = threading.Event(), client(server)
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(2)]

    def run(self, i):
        while not self.stop.is_set():
            for _ in self.c.completions.create(model="embedded", prompt=f"Blocks {i} and",
                                                max_tokens=30, temperature=0.9, stream=True):
                pass

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def streamed_text(stream):
    texts, reasons = {}, {}
    for chunk in stream:
        for ch in chunk.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (piece or "")
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)]


# -- the shapes ---------------------------------------------------------------------------------
def test_models_lists_the_model_served(server):
    assert [m.id for m in client(server).models.list()] == ["embedded"]


def test_greedy_streamed_equals_whole_equals_generate_while_others_are_served(server, reference):
    model, tok = reference
    c = client(server)
    messages = [{"role": "user", "content": "What does a block table hold?"}]
    cases = [("completion", "Paging the KV cache means", tok.encode("Paging the KV cache means",
                                                                   bos=True)),
             ("tokens", None, tok.encode("A free block is", bos=True)),
             ("chat", messages, chat_format(tok).encode_dialog_prompt(messages))]
    with Background(server):
        for kind, prompt, ids in cases:
            expected = generate(model, [ids], 40, stop_tokens=tok.stop_tokens)[0]
            if kind == "chat":
                whole = c.chat.completions.create(model="embedded", messages=prompt,
                                                  max_tokens=40, temperature=0)
                text = whole.choices[0].message.content
                stream = c.chat.completions.create(model="embedded", messages=prompt,
                                                   max_tokens=40, temperature=0, stream=True)
            else:
                prompt = prompt if kind == "completion" else ids
                whole = c.completions.create(model="embedded", prompt=prompt, max_tokens=40,
                                             temperature=0)
                text = whole.choices[0].text
                stream = c.completions.create(model="embedded", prompt=prompt, max_tokens=40,
                                              temperature=0, stream=True)
            texts, reasons = streamed_text(stream)
            assert text == texts[0] == tok.decode(expected), kind
            assert whole.usage.completion_tokens == len(expected)
            assert whole.usage.prompt_tokens == len(ids)
            reason = "length" if len(expected) == 40 else "stop"
            assert whole.choices[0].finish_reason == reasons[0] == reason


def test_seeded_samples_are_generates(server, reference):
    model, tok = reference
    prompt = "Hello"
    expected = generate(model, [tok.encode(prompt, bos=True)], 25, temperature=1.0, top_p=0.95,
                        seed=7, n=3, stop_tokens=tok.stop_tokens)[0]
    out = client(server).completions.create(model="embedded", prompt=prompt, max_tokens=25,
                                            temperature=1.0, top_p=0.95, seed=7, n=3)
    assert [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)] == \
        [tok.decode(t) for t in expected]
    assert len(set(map(tuple, expected))) > 1          # three samples, not one thrice
    assert out.usage.completion_tokens == sum(map(len, expected))


def test_stop_strings_cut_the_text_streamed_or_not(server, reference):
    model, tok = reference
    prompt = "Copy-on-write means"
    full = tok.decode(generate(model, [tok.encode(prompt, bos=True)], 40,
                               stop_tokens=tok.stop_tokens)[0])
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.find(stop)]
    c = client(server)
    whole = c.completions.create(model="embedded", prompt=prompt, max_tokens=40, temperature=0,
                                 stop=[stop, "\u2603 never"])
    texts, reasons = streamed_text(c.completions.create(
        model="embedded", prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert whole.choices[0].text == texts[0] == want
    assert whole.choices[0].finish_reason == reasons[0] == "stop"


def test_usage_chunk_when_asked(server):
    chunks = list(client(server).chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


# -- refusals -----------------------------------------------------------------------------------
BAD = {
    "malformed JSON": ('{"model": "embedded", "prompt": ', None),
    "not an object": ('["embedded"]', None),
    "unknown model": ({"model": "llama-99b", "prompt": "hi"}, "model"),
    "max_tokens -1": ({"model": "embedded", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    "max_tokens past the context": ({"model": "embedded", "prompt": "hi", "max_tokens": 2047},
                                    "max_tokens"),
    "prompt too long for the pool": ({"model": "embedded", "prompt": list(range(5, 1000)),
                                      "max_tokens": 100}, "max_tokens"),
    "max_tokens a string": ({"model": "embedded", "prompt": "hi", "max_tokens": "ten"},
                            "max_tokens"),
    "temperature a list": ({"model": "embedded", "prompt": "hi", "temperature": [1]},
                           "temperature"),
    "top_p 0": ({"model": "embedded", "prompt": "hi", "top_p": 0}, "top_p"),
    "n a bool": ({"model": "embedded", "prompt": "hi", "n": True}, "n"),
    "n past max_num_seqs": ({"model": "embedded", "prompt": "hi", "n": MAX_NUM_SEQS + 1}, "n"),
    "stop a number": ({"model": "embedded", "prompt": "hi", "stop": 3}, "stop"),
    "stream a string": ({"model": "embedded", "prompt": "hi", "stream": "yes"}, "stream"),
    "ignore_eos a number": ({"model": "embedded", "prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
    "prompt missing": ({"model": "embedded"}, "prompt"),
    "token id past the vocabulary": ({"model": "embedded", "prompt": [1, 10**6]}, "prompt"),
    "chat role unknown": ({"model": "embedded", "messages": [{"role": "wizard",
                                                              "content": "hi"}]}, "messages"),
    "chat content a number": ({"model": "embedded", "messages": [{"role": "user",
                                                                  "content": 3}]}, "messages"),
}


def engine_state(server):
    """The engine's figures, taken by its loop between two steps."""
    e = server.engine
    return server.loop.ask(lambda: (e.next_req_id, e.cache.num_free_blocks, e.step_count,
                                    e.stats.generated_tokens, len(e.scheduler.waiting))).result()


@pytest.mark.parametrize("case", BAD)
def test_a_bad_request_gets_openais_400_and_changes_nothing(server, case):
    body, param = BAD[case]
    path = "/v1/chat/completions" if "chat" in case else "/v1/completions"
    wait_idle(server)
    before = engine_state(server)
    r = httpx.post(server.url + path, content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert len(err["message"]) > 15 and "Traceback" not in err["message"]
    time.sleep(0.05)
    assert engine_state(server) == before


def test_the_openai_client_sees_a_bad_request_error(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model="gpt-4", prompt="hi")
    assert e.value.status_code == 400 and e.value.body["param"] == "model"


def test_past_the_waiting_bound_503_and_nothing_changes(server):
    wait_idle(server)
    before = engine_state(server)
    server.loop.max_waiting = 0                 # every request now finds the queue full
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(server).completions.create(model="embedded", prompt="hi", max_tokens=3)
    finally:
        server.loop.max_waiting = MAX_WAITING
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    assert engine_state(server) == before


# -- hanging up ---------------------------------------------------------------------------------
def test_a_client_that_hangs_up_mid_stream_frees_its_blocks(server):
    wait_idle(server)
    aborted = metrics(server)["minipaged_requests_aborted_total"]
    body = {"model": "embedded", "prompt": "Tell me about paging " * 20, "max_tokens": 500,
            "temperature": 0.9, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=10) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    held = metrics(server)["minipaged_kv_blocks_used"]
                    req = server.loop.ask(lambda: server.engine.requests[-1]).result()
                    break
    assert held > 0
    m = wait_idle(server)
    assert m["minipaged_kv_blocks_used"] == 0
    assert m["minipaged_requests_aborted_total"] == aborted + 1
    assert req.status == "finished" and 0 < len(req.output) < 500
    assert server.loop.ask(lambda: server.engine.requests).result() == [], \
        "an answered request is still kept by the engine"


# -- load ---------------------------------------------------------------------------------------
def sharegpt_like(k, vocab, seed=0):
    """k (prompt ids, max_tokens) pairs: lognormal lengths with ShareGPT's ratio of output to
    input (161 and 338 tokens on average), scaled down 8x for a tiny model on a small pool."""
    g = torch.Generator().manual_seed(seed)
    ins = torch.empty(k).log_normal_(0, 0.6, generator=g) * 161 / 8 / 1.2
    outs = torch.empty(k).log_normal_(0, 0.6, generator=g) * 338 / 8 / 1.2
    return [(torch.randint(10, vocab - 300, (max(1, int(i)),), generator=g).tolist(),
             max(1, min(80, int(o)))) for i, o in zip(ins, outs)]


@pytest.fixture
def small_server():
    """A pool of 32 blocks: too few for 16 requests at once, so the load preempts."""
    srv = start(num_blocks=32, max_num_seqs=MAX_NUM_SEQS, max_waiting=MAX_WAITING)
    yield srv
    srv.stop()


def test_64_streaming_clients_answered_or_refused_and_every_block_comes_back(small_server,
                                                                            reference):
    model, tok = reference
    server = small_server
    before = metrics(server)
    work = sharegpt_like(64, model.args.vocab_size)
    quitters = set(range(5, 64, 6))            # these hang up after two chunks
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)

    async def one(i, ids, m):
        try:
            stream = await c.completions.create(model="embedded", prompt=ids, max_tokens=m,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            return ("refused", e.status_code, e.body)
        text, reason, n = "", None, 0
        async for chunk in stream:
            n += 1
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
            if i in quitters and n == 2:
                await stream.close()
                return ("hung up", None, None)
        return ("answered", text, reason)

    async def all_of_them():
        return await asyncio.gather(*(one(i, ids, m) for i, (ids, m) in enumerate(work)))

    results = asyncio.run(all_of_them())
    kinds = [r[0] for r in results]
    refused = [r for r in results if r[0] == "refused"]
    assert all(r[1] == 503 and r[2]["code"] == "queue_full" for r in refused)
    assert kinds.count("answered") >= 16 and refused and "hung up" in kinds
    for i, r in enumerate(results):
        if r[0] == "answered":
            assert r[2] == "length"               # ignore_eos: each runs to its max_tokens
    # a few answers checked token for token against generate, run alone
    answered = [i for i, r in enumerate(results) if r[0] == "answered"][:4]
    expected = generate(model, [work[i][0] for i in answered], [work[i][1] for i in answered],
                        stop_tokens=[])
    assert [results[i][1] for i in answered] == [tok.decode(t) for t in expected]
    m = wait_idle(server)
    assert m["minipaged_kv_blocks_used"] == 0
    assert server.engine.cache.num_free_blocks == 32              # every block free or cached
    assert m["minipaged_requests_refused_total"] - before["minipaged_requests_refused_total"] \
        == len(refused)
    assert m["minipaged_preemptions_total"] > before["minipaged_preemptions_total"], \
        "the pool never ran dry: the load did not exercise preemption"
    print(f"\n64 clients: {kinds.count('answered')} answered, {len(refused)} refused (503), "
          f"{kinds.count('hung up')} hung up; preemptions "
          f"{m['minipaged_preemptions_total'] - before['minipaged_preemptions_total']:.0f}")


def test_metrics_names_and_format(server):
    text = httpx.get(server.url + "/metrics").text
    names = [line.split()[0] for line in text.splitlines() if not line.startswith("#")]
    assert names == [m[0] for m in METRICS]
    for name in ("minipaged_kv_blocks_used", "minipaged_kv_blocks_total",
                 "minipaged_requests_running", "minipaged_requests_waiting",
                 "minipaged_preemptions_total", "minipaged_prefix_cache_hit_tokens_total",
                 "minipaged_generated_tokens_total"):
        assert f"# TYPE {name} " in text
    m = parse_metrics(text)
    assert m["minipaged_kv_blocks_total"] == NUM_BLOCKS
    assert m["minipaged_generated_tokens_total"] == server.engine.stats.generated_tokens


# -- the command line ---------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(port):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "minipaged.serve", "--port", str(port),
                          "--num-blocks", "32", "--drain-seconds", "1"], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                         text=True)
    end = time.time() + 60
    while time.time() < end:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return p
        except httpx.TransportError:
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.2)
    p.kill()
    raise AssertionError("the server did not start in 60 s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_stop_the_server_cleanly_mid_stream(sig):
    port = free_port()
    p = serve_process(port)
    got = []

    def stream():
        try:
            body = {"model": "embedded", "prompt": "Paging " * 10, "max_tokens": 400,
                    "temperature": 1.0, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                              timeout=30) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError:
            got.append("cut")
    t = threading.Thread(target=stream)
    t.start()
    end = time.time() + 30
    while len(got) < 3 and time.time() < end and t.is_alive():
        time.sleep(0.05)
    assert len(got) >= 3 and got[0].startswith("data: "), got
    p.send_signal(sig)
    try:
        status = p.wait(timeout=30)
    finally:
        p.kill()
    t.join()
    err = p.stderr.read()
    assert status == 0, err
    assert "Traceback" not in err and "stopped" in err
    # the answer in flight was drained or aborted, and ended as a stream ends
    assert got[-1] == "data: [DONE]" or got[-2:] == ["data: [DONE]", ""], got[-3:]
    assert any('"finish_reason": "abort"' in line or '"finish_reason": "length"' in line
               for line in got)


def test_a_bad_argument_is_one_error_line():
    r = subprocess.run([sys.executable, "-m", "minipaged.serve", "--port", "70000"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
