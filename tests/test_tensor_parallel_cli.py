"""Stage 9 in the programs: `python -m minipaged.chat --tensor-parallel N` and the server's
`--tensor-parallel N` answer what one process answers (greedy and seeded samples, several
turns, several requests), refuse a bad N with one `error:` line before any process starts,
and leave no process behind when they exit."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from cli_probes import answered, interrupt, refused, run_many

from minipaged import generate, load_model, load_tokenizer
from minipaged.errors import UsageError
from minipaged.serve import server as serve_server

ROOT = Path(__file__).resolve().parents[1]
CHAT = ["--max-new-tokens", "12", "--no-status"]
TURNS = b"what is a block table?\nand a free list?\n"


def marked_processes(mark: str) -> list[int]:
    """The processes still running whose environment holds `mark` (the program's, its ranks')."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def interrupt_mid_stream(p: subprocess.Popen, url: str, body: dict) -> None:
    """Ctrl-C at the terminal (SIGINT to the server's whole session) once a streamed answer has
    begun: the answer still ends with [DONE] and no error, and the server exits 0."""
    lines = []
    with httpx.stream("POST", url, json={**body, "max_tokens": 400, "temperature": 1.0,
                                         "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not lines:
                os.killpg(p.pid, signal.SIGINT)
            lines.append(line)
    assert p.wait(30) == 0
    lines = [x for x in lines if x]
    assert len(lines) > 3                                       # it was answering
    assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines), lines[-3:]


def test_chat_on_two_ranks_answers_as_one_process_and_leaves_none_behind():
    mark = f"minipaged-test-{uuid.uuid4()}"
    one, two, zero, minus, three, demo, piped_one, piped_two = run_many("minipaged.chat", [
        ([*CHAT, "--prompt", "what is a block?"], None),
        ([*CHAT, "--prompt", "what is a block?", "--tensor-parallel", "2"], None),
        (["--prompt", "hi", "--tensor-parallel", "0"], None),
        (["--prompt", "hi", "--tensor-parallel", "-2"], None),
        (["--prompt", "hi", "--tensor-parallel", "3"], None),
        (["--demo", "2", "--tensor-parallel", "2"], None),
        (CHAT, TURNS),
        ([*CHAT, "--tensor-parallel", "2"], TURNS)], TP_TEST_MARK=mark)
    for r in (one, two, piped_one, piped_two):
        answered(r)
    assert two["stdout"] == one["stdout"] and one["stdout"].strip()
    assert piped_two["stdout"] == piped_one["stdout"]          # two turns, the second on the first
    refused(zero, "--tensor-parallel", "at least 1")
    refused(minus, "--tensor-parallel", "at least 1")
    refused(three, "tensor_parallel=3", "2 KV heads", "choose one of 1, 2")
    refused(demo, "--demo", "--tensor-parallel")
    assert marked_processes(mark) == []


def test_a_bad_number_of_ranks_starts_no_process(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr("minipaged.tp_group.start_followers", started)
    with pytest.raises(UsageError, match="tensor_parallel=3 cannot split"):
        serve_server.build(num_blocks=32, tensor_parallel=3)


def test_server_on_two_ranks_answers_as_one_process_and_ctrl_c_stops_them_all():
    model, tok = load_model(dtype=torch.float32), load_tokenizer()
    ids = tok.encode("Paging is", bos=True)
    greedy = generate(model, [ids], 12, cache="paged", stop_tokens=[])[0]
    samples = generate(model, [ids], 12, cache="paged", stop_tokens=[], temperature=1.0,
                       top_p=0.95, seed=7, n=2)[0]
    mark = f"minipaged-test-{uuid.uuid4()}"
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "minipaged.serve", "--port", str(port),
                          "--num-blocks", "32", "--drain-seconds", "1", "--tensor-parallel", "2"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                                        "TP_TEST_MARK": mark}, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        url, end = f"http://127.0.0.1:{port}/v1/completions", time.time() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert p.poll() is None and time.time() < end, p.stderr.read()
                time.sleep(0.2)
        assert len(marked_processes(mark)) >= 2                 # the server and rank 1 (at least)
        body = {"model": "embedded", "prompt": ids, "max_tokens": 12, "ignore_eos": True}
        out = httpx.post(url, json={**body, "temperature": 0}, timeout=60).json()
        assert out["choices"][0]["text"] == tok.decode(greedy), out
        out = httpx.post(url, json={**body, "temperature": 1.0, "top_p": 0.95, "seed": 7,
                                    "n": 2}, timeout=60).json()
        got = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
        assert got == [tok.decode(t) for t in samples] and got[0] != got[1], out
        interrupt_mid_stream(p, url, body)   # every rank gets SIGINT: the answer still ends
    finally:
        p.kill()
        p.wait()
    end = time.time() + 5
    while marked_processes(mark) and time.time() < end:
        time.sleep(0.1)
    assert marked_processes(mark) == []


def test_ctrl_c_mid_reply_on_two_ranks_exits_130_and_leaves_none_behind():
    mark = f"minipaged-test-{uuid.uuid4()}"
    code, out, err = interrupt(["-m", "minipaged.chat", "--max-new-tokens", "1900",
                                "--tensor-parallel", "2"], ready=lambda out: "\n" in out,
                               stdin=b"what is a block table?\n" * 40, TP_TEST_MARK=mark)
    assert code == 130 and "Traceback" not in err, (code, err)
    assert out.strip()                                          # it was answering
    end = time.time() + 5
    while marked_processes(mark) and time.time() < end:
        time.sleep(0.1)
    assert marked_processes(mark) == []


def test_a_server_whose_rank_died_names_it_on_every_request_and_still_stops():
    srv = serve_server.start(num_blocks=32, tensor_parallel=2)
    try:
        os.kill(srv.engine.messenger.workers.followers.procs[0].pid, signal.SIGKILL)
        time.sleep(0.5)
        body = {"model": "embedded", "prompt": "Paging is", "max_tokens": 8, "temperature": 0}
        for _ in range(2):          # the loop goes on: the second request is answered too
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=20)
            assert r.status_code == 500 and "rank 1 of 2 died (killed by SIGKILL)" in r.text
    finally:
        start = time.time()
        srv.stop()
        assert time.time() - start < 10
