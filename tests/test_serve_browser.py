"""The live pool page (`GET /`) in a real browser: headless Chromium loads it while clients
stream, and what it drew — cells counted in the DOM it leaves — is checked against the server's
own figures for the same moments (`/pool/trace`), and once the load is over against `/metrics`.

Needs Debian's `chromium` (apt-get install -y chromium). Without it this test fails, saying so:
a browser test that quietly skips proves nothing."""

import re
import shutil
import subprocess
import threading

import httpx
import openai
import pytest

from minipaged.serve.metrics import parse_metrics
from minipaged.serve.server import start

NUM_BLOCKS = 48


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("the live page's test needs a browser: install Debian's chromium "
                    "(apt-get install -y chromium)")
    return exe


def dump_dom(url: str) -> str:
    """The DOM after the page drew its pictures (`?frames=N` makes it stop listening)."""
    r = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                        "--virtual-time-budget=20000", "--dump-dom", url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def drawn(dom: str):
    """(version, used cells, cached cells, shared cells) per picture, as the page counted them
    from the cells it had just drawn; and the cells in the DOM now, by kind."""
    pre = re.search(r'<pre id="drawn">(.*?)</pre>', dom, re.S).group(1)
    pictures = [tuple(map(int, line.split())) for line in pre.split("\n") if line.strip()]
    cells = re.findall(r'<div class="cell ([a-z ]+)"', dom)
    return pictures, cells


def test_the_page_draws_what_the_pool_holds_while_clients_stream():
    srv = start(num_blocks=NUM_BLOCKS, max_num_seqs=8)
    stop = threading.Event()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)

    def load(i):                               # a shared system prompt, samples in pairs
        while not stop.is_set():
            c.chat.completions.create(
                model="embedded", n=2, max_tokens=40, temperature=1.0, extra_body={
                    "ignore_eos": True}, messages=[
                    {"role": "system", "content": "You explain paged attention, briefly."},
                    {"role": "user", "content": f"Question {i}: what is a block?"}])
    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        pictures, cells = drawn(dump_dom(srv.url + "/?frames=25"))
        trace = {v: (used, cached) for v, used, cached in
                 srv.loop.ask(lambda: list(srv.loop.trace)).result()}
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(pictures) == 25 and len(cells) == NUM_BLOCKS
    busy = [p for p in pictures if p[1] > 0]
    assert busy, "the page never drew a block in use while clients streamed"
    assert any(p[3] > 0 for p in busy), "samples share their prompt's blocks: none drawn shared"
    for version, used, cached, shared in pictures:
        if version in trace:                   # the server's figures for that same moment
            assert (used, cached) == trace[version], version
    assert sum(v in trace for v, *_ in pictures) >= 20

    # once the load is over: the page against /metrics
    end_dom = dump_dom(srv.url + "/?frames=1")
    m = parse_metrics(httpx.get(srv.url + "/metrics").text)
    srv.stop()
    (_, used, cached, _), = drawn(end_dom)[0]
    end_cells = drawn(end_dom)[1]
    assert used == end_cells.count("used") == m["minipaged_kv_blocks_used"] == 0
    assert cached == sum("cached" in k for k in end_cells) == m["minipaged_kv_blocks_cached_free"]
    assert cached > 0                          # the shared system prompt stays cached
    assert len(end_cells) == m["minipaged_kv_blocks_total"] == NUM_BLOCKS
