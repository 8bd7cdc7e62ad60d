"""The live page at `/` as it is sent, before any script runs: it already holds the picture of
the pool (a running request's cells at the block ids the engine gave it), its chips name the
ids the clients got back, and `/pool/request/{id}` gives that request's block table in every
layer, as the engine's cache holds it; an unknown id is a 404 with one line.

While a request runs its tables only grow, so what the server answered between two looks at
the engine (taken by the loop, between two steps) lies between them: the first look's table is
a prefix of the answer's, and the answer's a prefix of the second look's."""

import html
import json
import re
import time

import httpx
import pytest

from minipaged.serve.server import start

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def server():
    srv = start(num_blocks=NUM_BLOCKS, max_num_seqs=4)
    yield srv
    srv.stop()


def tables(srv) -> dict:
    """{req_id: its block table in every layer} of the running requests: the engine's own."""
    def look():
        cache = srv.engine.cache
        return {r.req_id: [m.blocks_of(r.seq_id) for m in cache.managers]
                for r in srv.engine.scheduler.running}
    return srv.loop.ask(look).result()


class Running:
    """One streamed request held open on the server: its client id (from the first chunk) and
    its req_id (the only request the engine runs)."""

    def __init__(self, srv, chat: bool):
        path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}) \
            if chat else ("/v1/completions", {"prompt": "The pool"})
        end = time.time() + 20                         # the request before it has gone
        while tables(srv) and time.time() < end:
            time.sleep(0.02)
        body |= {"model": "embedded", "max_tokens": 200, "temperature": 0, "stream": True,
                 "ignore_eos": True}
        self.stream = httpx.stream("POST", srv.url + path, json=body, timeout=30)
        self.lines = self.stream.__enter__().iter_lines()
        first = next(line for line in self.lines if line.startswith("data: "))
        self.id = json.loads(first[len("data: "):])["id"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.__exit__(None, None, None)        # hang up: the server aborts it


def page_cells(page: str) -> list[tuple[str, int]]:
    """(class, owner) of each cell the page was sent with, in block order."""
    return [(k, int(o)) for k, o in
            re.findall(r'<div class="cell ([a-z ]+)"[^>]*? data-owner="(-?\d+)"', page)]


def chips(page: str, queue: str) -> dict[int, str]:
    """{req_id: the text of its chip} in a queue of the page as sent."""
    span = re.search(rf'<span id="{queue}">(.*?)</span></p>', page, re.S).group(1)
    return {int(o): html.unescape(t) for o, t in
            re.findall(r'<span data-owner="(\d+)"[^>]*>([^<]*)</span>', span)}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_the_page_is_sent_with_the_running_requests_blocks_and_its_client_id(server, chat):
    with Running(server, chat) as run:
        before = tables(server)
        page = httpx.get(server.url + "/").text
        after = tables(server)
    (req_id, first), = before.items()
    assert first[0], "the request held no block yet"
    assert run.id.startswith("chatcmpl-" if chat else "cmpl-")
    cells = page_cells(page)
    assert len(cells) == NUM_BLOCKS
    held = {b for b, (kind, owner) in enumerate(cells) if owner == req_id}
    assert all(cells[b][0] == "used" for b in held)
    assert set(first[0]) <= held <= set(after[req_id][0]), (first[0], held, after[req_id][0])
    assert not [c for c in cells if c[0] == "used" and c[1] != req_id]
    assert chips(page, "running") == {req_id: run.id}   # the id the client got back
    assert "%(" not in page                              # every blank filled


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_requests_block_tables_are_the_engines_in_every_layer(server, chat):
    with Running(server, chat) as run:
        before = tables(server)
        r = httpx.get(f"{server.url}/pool/request/{run.id}")
        after = tables(server)
        pool = httpx.get(server.url + "/pool").json()
    (req_id, first), = before.items()
    assert r.status_code == 200
    got = r.json()
    assert got["id"] == run.id and got["block_size"] == server.engine.cache.block_size
    (sample,) = got["samples"]
    assert sample["req_id"] == req_id and sample["status"] == "running"
    layers = sample["layers"]
    assert len(layers) == len(server.engine.cache.managers) > 1
    for old, now, new in zip(first, layers, after[req_id]):
        assert now[:len(old)] == old and new[:len(now)] == now, (old, now, new)
    assert pool["names"] == {str(req_id): run.id}       # what the live updates name it


def test_an_unknown_request_is_a_404_with_one_line(server):
    r = httpx.get(server.url + "/pool/request/cmpl-nosuchrequest")
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "cmpl-nosuchrequest" in message and "\n" not in message
    assert httpx.get(server.url + "/health").status_code == 200    # and nothing changed
