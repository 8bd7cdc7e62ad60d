"""Stage 9b in the server: `python -m minipaged.serve --disaggregated` answers what one engine
answers (greedy and seeded samples, a prompt whose prefix the decode side already holds),
refuses what it cannot combine with in one `error:` line before the model loads, ends both
processes on Ctrl-C, and answers a request waiting on a dead prefill engine with an error
naming it — never a hang."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from cli_probes import refused, run_many
from test_tensor_parallel_cli import interrupt_mid_stream, marked_processes

from minipaged import generate, load_model, load_tokenizer
from minipaged.disaggregated import DisaggregationError
from minipaged.disaggregated_engine import NOT_YET, DisaggregatedEngine
from minipaged.errors import UsageError
from minipaged.serve import server as serve_server
from minipaged.serve.metrics import parse_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served():
    model, tok = load_model(dtype=torch.float32), load_tokenizer()
    srv = serve_server.start(num_blocks=48, disaggregated=True)
    yield srv, model, tok
    srv.stop()


def completion(srv, **body):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "embedded", "max_tokens": 12,
                                                      "ignore_eos": True, **body}, timeout=60)
    return r


def test_answers_equal_one_engines_and_shared_prefixes_are_not_moved(served):
    srv, model, tok = served
    system = tok.encode("A block table maps a sequence's logical blocks to physical blocks. "
                        "Answer in one word.", bos=True)
    asks = [system + tok.encode(q) for q in (" Paging is", " A free list is")]
    greedy = generate(model, asks, 12, cache="paged", stop_tokens=[])
    for ids, expected in zip(asks, greedy):
        out = completion(srv, prompt=ids, temperature=0).json()
        assert out["choices"][0]["text"] == tok.decode(expected), out
    samples = generate(model, [asks[0]], 12, cache="paged", stop_tokens=[], temperature=1.0,
                       top_p=0.95, seed=7, n=2)[0]
    out = completion(srv, prompt=asks[0], temperature=1.0, top_p=0.95, seed=7, n=2).json()
    got = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert got == [tok.decode(t) for t in samples] and got[0] != got[1], out
    stats = srv.engine.connector.stats
    assert stats.blocks_sent > 0 and stats.loads_failed == 0
    assert stats.blocks_skipped >= len(system) // 16     # the second ask's shared blocks
    assert srv.engine.cache.num_used_blocks == 0         # every answer's blocks came back
    m = parse_metrics(httpx.get(srv.url + "/metrics").text)
    assert (m["minipaged_kv_transfer_blocks_total"], m["minipaged_kv_transfer_bytes_total"],
            m["minipaged_kv_transfer_skipped_blocks_total"],
            m["minipaged_kv_transfer_failed_total"]) == (
        stats.blocks_sent, stats.bytes_sent, stats.blocks_skipped, 0)
    a = srv.model.args               # K and V, every layer, a block of 16 tokens, float32
    assert stats.bytes_sent == stats.blocks_sent * 2 * a.n_layers * 16 * a.n_kv_heads * \
        (a.dim // a.n_heads) * 4


def test_a_dead_prefill_engine_is_named_to_the_request_waiting_on_it_and_to_the_next():
    """The prefill process is stopped (SIGSTOP) so a request waits on it, then killed: that
    request, and each one after, is answered 500 naming the prefill engine; the server stops."""
    srv = serve_server.start(num_blocks=32, disaggregated=True)
    try:
        pid = srv.engine.followers.procs[0].pid
        os.kill(pid, signal.SIGSTOP)
        answers = []
        t = threading.Thread(target=lambda: answers.append(completion(srv, prompt="Paging is")))
        t.start()
        deadline = time.time() + 10
        while not srv.engine.waiting_for_blocks and time.time() < deadline:
            time.sleep(0.02)
        assert srv.engine.waiting_for_blocks                    # it waits on the prefill engine
        os.kill(pid, signal.SIGKILL)
        t.join(20)
        assert not t.is_alive() and answers
        for r in [answers[0], completion(srv, prompt="Paging is")]:
            assert r.status_code == 500, r.text
            assert "the prefill engine died (killed by SIGKILL)" in r.text, r.text
    finally:
        start = time.time()
        srv.stop()
        assert time.time() - start < 10
    assert not srv.engine.followers.procs[0].is_alive()


def test_the_engine_fails_only_the_requests_waiting_on_a_dead_prefill_engine():
    model = load_model(dtype=torch.float32)
    engine = DisaggregatedEngine(model, 32, 16)
    try:
        here = engine.add_request(list(range(1, 20)), 30, stop_tokens=[])
        while here.status != "running":
            engine.step()                                       # its blocks came and it runs
        pid = engine.followers.procs[0].pid
        os.kill(pid, signal.SIGSTOP)
        waiting = engine.add_request(list(range(1, 40)), 5, stop_tokens=[])
        os.kill(pid, signal.SIGKILL)
        engine.followers.procs[0].join(5)
        with pytest.raises(DisaggregationError, match="the prefill engine died") as e:
            engine.step()
        assert e.value.requests == [waiting]
        engine.abort(waiting)
        engine.run()                                            # the one already here finishes
        assert here.output == generate(model, [here.prompt], 30, stop_tokens=[])[0]
        with pytest.raises(DisaggregationError, match="the prefill engine died"):
            engine.add_request([1, 2, 3], 4)
        assert len(engine.requests) == 2                        # the refusal changed nothing
    finally:
        engine.close()


def test_a_request_aborted_while_it_waits_for_its_blocks_is_never_loaded():
    """The client hangs up before the prefill engine has answered: the request ends at once;
    its blocks, announced later, are acknowledged unread (nothing of it is loaded), and the
    decode engine's pool comes back clean."""
    model = load_model(dtype=torch.float32)
    engine = DisaggregatedEngine(model, 32, 16)
    try:
        pid = engine.followers.procs[0].pid
        os.kill(pid, signal.SIGSTOP)
        gone_req = engine.add_request(list(range(1, 40)), 5, stop_tokens=[])
        engine.abort(gone_req)
        os.kill(pid, signal.SIGCONT)
        kept = engine.add_request(list(range(1, 20)), 3, stop_tokens=[])
        engine.run()
        assert gone_req.output == [] and gone_req.arrival_step == NOT_YET
        assert kept.output == generate(model, [kept.prompt], 3, stop_tokens=[])[0]
        assert engine.waiting_for_blocks == {} and engine.cache.num_used_blocks == 0
        assert engine.connector.stats.blocks_sent == (len(kept.prompt) - 1) // 16
    finally:
        engine.close()


def test_what_cannot_combine_is_refused_before_the_model_loads():
    both, int8, no_prefix = run_many("minipaged.serve", [
        (["--disaggregated", "--tensor-parallel", "2"], None),
        (["--disaggregated", "--kv-dtype", "int8"], None),
        (["--disaggregated", "--no-prefix-caching"], None)])
    refused(both, "tensor_parallel=2", "--tensor-parallel")
    refused(int8, "kv_dtype=int8", "--kv-dtype")
    refused(no_prefix, "--no-prefix-caching")


def test_a_refusal_loads_no_model_and_starts_no_process(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(serve_server, "load_model", loaded)
    monkeypatch.setattr("minipaged.disaggregated_engine.start_followers", loaded)
    with pytest.raises(UsageError, match="tensor_parallel=2"):
        serve_server.build(num_blocks=32, tensor_parallel=2, disaggregated=True)


def start_server(mark: str, *args) -> tuple[subprocess.Popen, int]:
    """`python -m minipaged.serve --disaggregated` in a session of its own, answering /health."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "minipaged.serve", "--port", str(port),
                          "--num-blocks", "32", "--disaggregated", *args],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                                        "TP_TEST_MARK": mark}, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    end = time.time() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return p, port
        except httpx.TransportError:
            assert p.poll() is None and time.time() < end, p.stderr.read()
            time.sleep(0.2)


def gone(mark: str, seconds: float = 5.0) -> bool:
    end = time.time() + seconds
    while marked_processes(mark) and time.time() < end:
        time.sleep(0.1)
    return marked_processes(mark) == []


def test_a_killed_server_leaves_no_prefill_process_behind():
    mark = f"minipaged-test-{uuid.uuid4()}"
    p, _ = start_server(mark)
    try:
        assert len(marked_processes(mark)) >= 2
        os.kill(p.pid, signal.SIGKILL)                 # no shutdown runs: the orphan ends itself
        p.wait(10)
    finally:
        p.kill()
        p.wait()
    assert gone(mark)


def test_ctrl_c_mid_stream_ends_the_server_and_the_prefill_process():
    model, tok = load_model(dtype=torch.float32), load_tokenizer()
    ids = tok.encode("Paging is", bos=True)
    greedy = generate(model, [ids], 12, cache="paged", stop_tokens=[])[0]
    mark = f"minipaged-test-{uuid.uuid4()}"
    p, port = start_server(mark, "--drain-seconds", "1")
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert len(marked_processes(mark)) >= 2                 # the server and the prefill
        body = {"model": "embedded", "prompt": ids, "max_tokens": 12, "ignore_eos": True}
        out = httpx.post(url, json={**body, "temperature": 0}, timeout=60).json()
        assert out["choices"][0]["text"] == tok.decode(greedy), out
        interrupt_mid_stream(p, url, body)   # both processes get SIGINT: the answer still ends
        err = p.stderr.read()
        assert "Traceback" not in err, err
    finally:
        p.kill()
        p.wait()
    assert gone(mark)
