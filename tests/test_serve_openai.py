"""The server as OpenAI's clients use it (issue 48): logprobs (completions' `logprobs: k`, chat's
`logprobs` + `top_logprobs`) equal to the no-cache forward's log-softmax, streamed and whole;
`echo`; every field the server does not honour refused with a 400 naming it; /tokenize, /detokenize,
/version and /health in vLLM's shapes."""

import json
import subprocess
import sys
from importlib.metadata import version

import httpx
import openai
import pytest
import torch

from conftest import tiny_model
from minipaged import Engine
from minipaged.formats import chat_format
from minipaged.generation import row_generator
from minipaged.serve.__main__ import install_hint
from minipaged.serve.server import start

from test_serve import ROOT, client


@pytest.fixture(scope="module")
def server():
    srv = start(num_blocks=64, max_num_seqs=8, max_waiting=8)
    yield srv
    srv.stop()


def post(server, body, path="/v1/completions"):
    return httpx.post(server.url + path, json=body, timeout=30)


def forward_logprobs(model, ids):
    """Ground truth: the no-cache forward over the whole sequence, log-softmax at each place."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)


def check_against_forward(model, prompt, tokens, logprobs, rivals, k, tol):
    """Token i's logprob (and its k likeliest rivals) are the forward's at the place before it."""
    ref = forward_logprobs(model, prompt + tokens)
    for i, (t, lp, top) in enumerate(zip(tokens, logprobs, rivals)):
        row = ref[len(prompt) - 1 + i]
        assert lp == pytest.approx(float(row[t]), abs=tol)
        best = row.topk(k)
        assert [x for _, x in top] == pytest.approx(best.values.tolist(), abs=tol)
        assert {r for r, _ in top} == set(best.indices.tolist()) or tol > 1e-9   # ties only


def test_the_paged_engines_logprobs_are_the_no_cache_forwards():
    """Sampled and greedy requests, n samples forked after one prefill, a prefix-cache hit,
    prompts in chunks and recompute preemption in a small pool: each kept token's logprob is
    the forward's over the whole sequence (the raw model's, not the tempered one); requests
    that do not ask keep nothing."""
    model = tiny_model()
    engine = Engine(model, 14, 4, max_num_seqs=6, prefix_caching=True,
                    max_num_batched_tokens=12)
    system = list(range(3, 19))
    asks = []
    for j, (extra, temp, n) in enumerate([([30, 31], 1.0, 3), ([40], 0.0, 1), ([50, 51, 52], 0.7, 2)]):
        r = engine.add_request(system + extra, 10, temperature=temp, stop_tokens=[], n=n,
                               generators=[row_generator(9, j * 10 + i) if temp else None
                                           for i in range(n)], logprobs=3)
        asks += engine.requests[-n:]
    plain = engine.add_request(system + [60], 10, stop_tokens=[])
    engine.run()
    assert engine.stats.preemptions > 0 and engine.stats.cached_tokens > 0
    assert plain.token_logprobs == []
    for r in asks:
        assert len(r.token_logprobs) == len(r.output) == 10
        check_against_forward(model, r.prompt, r.output, [lp for lp, _ in r.token_logprobs],
                              [top for _, top in r.token_logprobs], 3, 1e-9)


def test_completions_logprobs_whole_and_streamed_are_the_forwards(server):
    prompt = "Paged attention keeps the cache in"
    ids = server.tokenizer.encode(prompt, bos=True)
    c = client(server)
    whole = c.completions.create(model="embedded", prompt=prompt, max_tokens=6, logprobs=2,
                                 temperature=0.8, seed=3)
    lp = whole.choices[0].logprobs
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(
        model="embedded", prompt=prompt, max_tokens=6, logprobs=2, temperature=0.8, seed=3,
        stream=True) if ch.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    tokens = [server.tokenizer.encode(t) for t in lp.tokens]     # each piece is one token
    assert all(len(t) == 1 for t in tokens)
    ref = forward_logprobs(server.model, ids + [t[0] for t in tokens])
    for i, (t, x, top) in enumerate(zip(tokens, lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(ids) - 1 + i]
        assert x == pytest.approx(float(row[t[0]]), abs=1e-4)
        want = {server.tokenizer.decode([r]): float(row[r]) for r in row.topk(2).indices}
        want[lp.tokens[i]] = x                                    # the token, and 2 rivals
        assert top == pytest.approx(want, abs=1e-4)


def test_chat_logprobs_and_no_logprobs_unless_asked(server):
    c = client(server)
    msg = [{"role": "user", "content": "What is a block table?"}]
    r = c.chat.completions.create(model="embedded", messages=msg, max_tokens=5, temperature=0,
                                  logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob and
               bytes(t.bytes).decode() == t.token for t in content)     # greedy: the best
    streamed = [t for ch in c.chat.completions.create(
        model="embedded", messages=msg, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, stream=True) if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = c.chat.completions.create(model="embedded", messages=msg, max_tokens=5,
                                      temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_echo_whole_and_streamed(server):
    body = {"model": "embedded", "prompt": "The pool", "max_tokens": 4, "temperature": 0,
            "echo": True}
    whole = post(server, body).json()["choices"][0]["text"]
    plain = post(server, {**body, "echo": False}).json()["choices"][0]["text"]
    assert whole == "The pool" + plain
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=30) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    assert events[0]["choices"][0]["text"] == "The pool"


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "top_k", 5), ("/v1/completions", "presence_penalty", 0.5),
    ("/v1/completions", "frequency_penalty", 1), ("/v1/completions", "logit_bias", {"1": 5}),
    ("/v1/completions", "suffix", "end"), ("/v1/completions", "best_of", 2),
    ("/v1/completions", "top_logprobs", 2), ("/v1/completions", "made_up", 1),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "echo", True), ("/v1/chat/completions", "min_p", 0.1),
    ("/v1/chat/completions", "top_logprobs", 2)])
def test_a_field_not_honoured_is_refused_naming_it(server, path, field, value):
    body = {"model": "embedded", "max_tokens": 2, field: value}
    body.update({"prompt": "x"} if "chat" not in path else
                {"messages": [{"role": "user", "content": "x"}]})
    r = post(server, body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_defaults_of_fields_not_honoured_pass(server):
    body = {"model": "embedded", "prompt": "x", "max_tokens": 2, "top_k": -1,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1,
            "user": "someone", "suffix": None}
    assert post(server, body).status_code == 200
    with pytest.raises(openai.BadRequestError, match="echo"):
        client(server).completions.create(model="embedded", prompt="x", echo=True, logprobs=1)


def test_a_prompt_of_several_strings_is_refused(server):
    r = post(server, {"model": "embedded", "prompt": ["one", "two"], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "several requests" in r.json()["error"]["message"]


def test_tokenize_and_detokenize_in_vllms_shapes(server):
    tok = server.tokenizer
    r = post(server, {"model": "embedded", "prompt": "Blocks of sixteen"}, "/tokenize").json()
    assert r == {"count": len(tok.encode("Blocks of sixteen", bos=True)),
                 "max_model_len": server.engine.max_seq_len,
                 "tokens": tok.encode("Blocks of sixteen", bos=True), "token_strs": None}
    r = post(server, {"prompt": "Blocks of sixteen", "add_special_tokens": False,
                      "return_token_strs": True}, "/tokenize").json()
    assert r["tokens"] == tok.encode("Blocks of sixteen")
    assert "".join(r["token_strs"]) == "Blocks of sixteen"
    msg = [{"role": "user", "content": "hi"}]
    r = post(server, {"messages": msg}, "/tokenize").json()
    assert r["tokens"] == chat_format(tok).encode_dialog_prompt(msg)
    back = post(server, {"tokens": tok.encode("Blocks of sixteen")}, "/detokenize")
    assert back.json() == {"prompt": "Blocks of sixteen"}
    for path, body, param in [("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
                              ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate")]:
        r = post(server, body, path)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_errors_speak_the_servers_flags(server, tmp_path):
    ctx = server.engine.max_seq_len
    r = post(server, {"model": "embedded", "prompt": "x", "max_tokens": 100000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens"
    assert "--max-model-len" in err["message"] and f"at most {ctx - 2} tokens" in err["message"]
    assert "max_new_tokens" not in err["message"] and "max_seq_len" not in err["message"]
    assert install_hint(ROOT) == f"pip install -e '{ROOT}[serve]'"
    assert install_hint(tmp_path).startswith("pip install 'fastapi")     # an installed copy


def test_help_is_whole_and_names_every_option():
    out = subprocess.run([sys.executable, "-m", "minipaged.serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "the pool drawn live at http://HOST:PORT/ ." in " ".join(out.stdout.split())
    for flag in ("--host HOST", "--port PORT"):
        line = next(x for x in out.stdout.splitlines() if x.strip().startswith(flag))
        assert len(line.split(flag)[1].strip()) > 10          # a help text beside it


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_version_and_health_while_the_loop_runs_and_once_it_died(server):
    """Last in this file: it kills the module's engine loop (a failure outside a step)."""
    assert httpx.get(server.url + "/version").json() == {"version": version("minipaged")}
    assert httpx.get(server.url + "/health").status_code == 200

    def broken():
        raise RuntimeError("a bug outside the engine step")
    server.loop._deliver = broken
    server.loop.ask(lambda: None)
    server.loop.thread.join(10)
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503 and "restart" in r.json()["error"]["message"]
