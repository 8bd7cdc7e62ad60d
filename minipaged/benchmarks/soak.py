"""The server over thousands of requests: does anything grow? Memory, open files, threads and
KV blocks sampled as the requests go by, and /metrics' latency while 48 clients stream.

    python -m minipaged.benchmarks.soak                    # 10,000 requests, embedded model
    python -m minipaged.benchmarks.soak --requests 2000    # shorter

The server runs as its own process (`python -m minipaged.serve`), so that what is sampled —
its resident memory (VmRSS), file descriptors and threads, read from /proc — is the server's
alone. Clients send a mix, drawn with a fixed seed: whole completions and chats, streams,
streams whose client hangs up after two chunks, requests with `n` = 2, and refusals (a model
not served, `n` past the engine's rows, a body that is not JSON). After each quarter the load
pauses until the server is idle, and the sample is taken there: every block free, and memory
flat after the first quarter (the warm-up) if nothing is kept per request.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .. import cli
from ..errors import UsageError
from ..serve.metrics import parse_metrics
from ..serve.server import listen

KINDS = {"whole": 30, "chat": 15, "stream": 25, "hang-up": 10, "n=2": 10, "refused": 10}


def request_for(kind: str, rng: random.Random) -> tuple[str, dict | bytes]:
    """(path, body) of one request of `kind`."""
    words = " ".join(rng.choice(["page", "block", "cache", "token", "table", "free"])
                     for _ in range(rng.randint(3, 60)))
    base = {"model": "embedded", "max_tokens": rng.randint(1, 24), "temperature": 0.8,
            "ignore_eos": True, "prompt": words}
    if kind == "chat":
        del base["prompt"]
        return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": words}]}
    if kind in ("stream", "hang-up"):
        return "/v1/completions", {**base, "stream": True, "max_tokens": rng.randint(8, 32)}
    if kind == "n=2":
        return "/v1/completions", {**base, "n": 2}
    if kind == "refused":
        return "/v1/completions", rng.choice([{**base, "model": "gpt-4"}, {**base, "n": 10**6},
                                              b'{"prompt": '])
    return "/v1/completions", base


async def send(h: httpx.AsyncClient, url: str, kind: str, path: str, body) -> int:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    if kind not in ("stream", "hang-up"):
        return (await h.post(url + path, **kw)).status_code
    async with h.stream("POST", url + path, **kw) as r:
        chunks = 0
        async for line in r.aiter_lines():
            chunks += line.startswith("data: ")
            if kind == "hang-up" and chunks == 2:
                break                               # leaving closes the connection
        return r.status_code


def proc_figures(pid: int) -> dict:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(status["Threads"])}


async def wait_idle(h, url) -> dict:
    while True:
        m = parse_metrics((await h.get(url + "/metrics")).text)
        if m["minipaged_requests_running"] == 0 and m["minipaged_requests_waiting"] == 0:
            return m
        await asyncio.sleep(0.05)


async def soak(url: str, pid: int, requests: int, clients: int, seed: int, bar) -> list[dict]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=requests)
    work = [(kind, *request_for(kind, rng)) for kind in kinds]
    marks = sorted({requests * q // 4 for q in range(1, 5)})
    rows, done, codes = [], 0, {}
    task = bar.add_task("soak", total=requests)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as h:
        m = await wait_idle(h, url)
        rows.append({"requests": 0, **proc_figures(pid), "blocks": m["minipaged_kv_blocks_used"]})
        for mark in marks:
            todo = iter(range(done, mark))

            async def client():
                for i in todo:
                    code = await send(h, url, *work[i])
                    codes[code] = codes.get(code, 0) + 1
                    bar.advance(task)
            await asyncio.gather(*(client() for _ in range(clients)))
            done = mark
            m = await wait_idle(h, url)
            rows.append({"requests": mark, **proc_figures(pid),
                         "blocks": m["minipaged_kv_blocks_used"], "codes": dict(codes)})
    return rows


async def metrics_latency(url: str, streams: int, seconds: float) -> list[float]:
    """/metrics' answer times (s) while `streams` clients stream long answers."""
    stop, times = asyncio.Event(), []
    body = {"model": "embedded", "prompt": "paging " * 40, "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0.8}

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=streams + 4)) \
            as h:
        async def streamer():
            while not stop.is_set():
                async with h.stream("POST", url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        if stop.is_set():
                            break

        async def poller():
            await asyncio.sleep(1.0)                  # the streams have started
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t = time.perf_counter()
                await h.get(url + "/metrics")
                times.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)
            stop.set()
        await asyncio.gather(poller(), *(streamer() for _ in range(streams)))
    return times


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.soak",
                           description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=cli.whole(4), default=10_000)
    p.add_argument("--clients", type=cli.whole(1, 256), default=16,
                   help="requests in flight at once")
    p.add_argument("--streams", type=cli.whole(1, 256), default=48,
                   help="streams beside /metrics in the latency run")
    p.add_argument("--seconds", type=cli.number(at_least=1), default=10.0,
                   help="length of the latency run")
    p.add_argument("--seed", type=cli.whole(0), default=0)
    args = p.parse_args(argv)

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen([sys.executable, "-m", "minipaged.serve", "--port", str(port),
                               "--max-num-seqs", "16", "--max-waiting", "64",
                               "--num-blocks", "512"], stderr=log, text=True)
    url, console = f"http://127.0.0.1:{port}", Console()
    try:
        while True:
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.TransportError:
                if server.poll() is not None:
                    log.seek(0)
                    raise UsageError(f"the server did not start: {log.read()[-500:]}")
                time.sleep(0.2)
        with Progress(transient=True) as bar:
            rows = asyncio.run(soak(url, server.pid, args.requests, args.clients, args.seed,
                                    bar))
        latency = asyncio.run(metrics_latency(url, args.streams, args.seconds))
    finally:
        server.terminate()
        server.wait(30)
        log.seek(0)
        errors = [line for line in log if "Traceback" in line or "ERROR" in line]

    table = Table(title=f"the server over {args.requests} requests ({args.clients} at once)")
    for col in ("requests", "RSS MiB", "fds", "threads", "blocks used", "answers so far"):
        table.add_column(col, justify="right")
    for r in rows:
        codes = " ".join(f"{k}:{v}" for k, v in sorted(r.get("codes", {}).items()))
        table.add_row(f"{r['requests']:,}", f"{r['rss_mib']:.1f}", str(r["fds"]),
                      str(r["threads"]), f"{r['blocks']:.0f}", codes)
    console.print(table)
    warm, end = rows[1], rows[-1]
    growth = (end["rss_mib"] - warm["rss_mib"]) * 1024 / max(1, end["requests"] - warm["requests"])
    console.print(f"memory after the warm-up: {growth:+.2f} KiB a request "
                  f"({warm['requests']:,} -> {end['requests']:,} requests)")
    ms = sorted(t * 1000 for t in latency)
    console.print(f"the server's log: {len(errors)} error line(s)" +
                  (f", the first: {errors[0].strip()}" if errors else ""))
    console.print(f"/metrics during {args.streams} streams: median {statistics.median(ms):.1f} ms, "
                  f"worst {ms[-1]:.1f} ms ({len(ms)} requests)")


if __name__ == "__main__":
    raise SystemExit(main())
