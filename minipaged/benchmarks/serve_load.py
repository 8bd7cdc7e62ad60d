"""The server under load: requests/s, output tokens/s, time to first token (TTFT) and inter-token
latency (ITL) against the number of concurrent clients.

    python -m minipaged.benchmarks.serve_load                     # embedded model, short
    python -m minipaged.benchmarks.serve_load --model smollm2 --clients 1,4 --requests 8

The server (`minipaged.serve`) runs in this process on 127.0.0.1; each of C clients sends its
requests one after another over HTTP with OpenAI's client, streaming, so C requests are in
flight at any time (a closed loop, as vLLM's serving benchmark with a fixed concurrency). The
requests are stage 4's ShareGPT-like trace (`workloads.synthetic`: geometric lengths with the
vLLM paper's ShareGPT means, 161.31 prompt and 337.99 output tokens) with every length divided
by `--scale`; prompts are random token ids and `ignore_eos` makes each request generate
exactly its drawn length. TTFT is from sending the request to its first token's chunk; ITL
the gaps between its later chunks. More clients raise throughput (the engine batches their
decodes) and stretch every client's ITL (each step is a bigger batch) — and their TTFT, once
requests wait for a place in the batch.

llama.cpp's own server (`llama-cpp-python[server]`, its `--parallel` slots are its continuous
batching) is measured beside it on the same requests when it can be imported, with a GGUF
model (`--model smollm2`); where it cannot, the output says why.
"""

from __future__ import annotations

import asyncio
import importlib
import shutil
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import torch
from rich.console import Console
from rich.table import Table

from .. import cli
from ..chat.options import model_path
from ..serve.server import start
from ..workloads import SHAREGPT, synthetic


def run_level(url, name, work, clients: int, vocab: int) -> dict:
    """Send `work` ((prompt length, output length) pairs) from `clients` concurrent clients to
    the server at `url` serving the model `name`."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, vocab - 300, p).tolist() for p, _ in work]
    todo = list(range(len(work)))
    ttft, itl, tokens = [], [], 0

    async def client(c):
        nonlocal tokens
        while todo:
            i = todo.pop(0)
            sent = time.perf_counter()
            last = None
            stream = await c.completions.create(model=name, prompt=prompts[i],
                                                max_tokens=int(work[i][1]), temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        itl.append(now - last)
                    last = now
            tokens += int(work[i][1])

    async def everyone():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                      timeout=600) as c:
            start_t = time.perf_counter()
            await asyncio.gather(*(client(c) for _ in range(clients)))
            return time.perf_counter() - start_t

    seconds = asyncio.run(everyone())
    pct = lambda xs, q: 1000 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"clients": clients, "requests/s": len(work) / seconds, "tokens/s": tokens / seconds,
            "ttft p50": pct(ttft, 50), "ttft p90": pct(ttft, 90), "itl p50": pct(itl, 50),
            "itl p90": pct(itl, 90)}


def table(rows, title) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("clients", "requests/s", "output tokens/s", "TTFT p50 ms", "TTFT p90 ms",
                "ITL p50 ms", "ITL p90 ms"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["clients"]), f"{r['requests/s']:.2f}", f"{r['tokens/s']:.0f}",
                  f"{r['ttft p50']:.0f}", f"{r['ttft p90']:.0f}", f"{r['itl p50']:.1f}",
                  f"{r['itl p90']:.1f}")
    return t


def llama_cpp_server(gguf, threads: int):
    """llama-cpp-python's server on the same GGUF file, on a free port of 127.0.0.1: its URL and
    process, or (None, why not)."""
    try:
        importlib.import_module("llama_cpp.server.app")     # its app needs the [server] extra
    except ImportError as e:
        found = shutil.which("llama-server")
        return None, ("llama.cpp's server: not measured — llama-cpp-python[server] does not "
                      f"import ({e})" + (f"; a llama-server binary is at {found}" if found
                                         else " and no llama-server binary is on PATH"))
    if gguf is None or not str(gguf).endswith(".gguf"):
        return None, "llama.cpp's server: not measured — it needs a GGUF model (--model smollm2)"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                             "--host", "127.0.0.1", "--port", str(port), "--model_alias",
                             "llama.cpp", "--n_threads", str(threads), "--n_ctx", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, end = f"http://127.0.0.1:{port}", time.time() + 120
    while time.time() < end and proc.poll() is None:
        try:
            httpx.get(url + "/v1/models", timeout=1)
            return (url, proc), None
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    return None, "llama.cpp's server: not measured — it did not start within 120 s"


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.serve_load",
                           description=__doc__.splitlines()[0])
    p.add_argument("--model", help="as the server's --model (default: the embedded model)")
    p.add_argument("--clients", default="1,4,16",
                   help="concurrency levels, comma-separated (default 1,4,16)")
    p.add_argument("--requests", type=cli.whole(1), default=32,
                   help="requests per level (default 32)")
    p.add_argument("--scale", type=cli.number(at_least=1), default=16.0,
                   help="ShareGPT's mean lengths divided by this (default 16)")
    p.add_argument("--threads", type=cli.whole(1), default=1, help="torch threads")
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.clients.split(",")]
        assert levels and all(x >= 1 for x in levels)
    except (ValueError, AssertionError):
        raise cli.UsageError(f"--clients takes whole numbers >= 1 separated by commas, not "
                             f"{args.clients!r}") from None
    torch.set_num_threads(args.threads)
    server = start(args.model, max_num_seqs=max(levels))
    server.name = args.model or "embedded"
    try:
        ctx = server.engine.max_seq_len
        w = synthetic(args.requests, SHAREGPT[0] / args.scale, SHAREGPT[1] / args.scale,
                      seed=0, max_seq_len=ctx)
        work = list(zip(w.prompt_lens.tolist(), w.output_lens.tolist()))
        vocab = server.model.args.vocab_size
        run_level(server.url, server.name, work[:2], 1, vocab)        # warm up
        rows = [run_level(server.url, server.name, work, n, vocab) for n in levels]
    finally:
        server.stop()
    console = Console(width=110)
    mean_in = np.mean([a for a, _ in work])
    mean_out = np.mean([b for _, b in work])
    console.print(table(rows, f"minipaged.serve, {server.name}: {len(work)} ShareGPT-like "
                              f"requests per row (mean {mean_in:.0f} prompt, {mean_out:.0f} "
                              f"output tokens), streamed over HTTP on 127.0.0.1"))
    gguf = model_path(args.model) if args.model else None
    other, why = llama_cpp_server(gguf, args.threads)
    if other is None:
        console.print(why, markup=False)
        return 0
    url, proc = other
    try:
        run_level(url, "llama.cpp", work[:2], 1, vocab)
        rows = [run_level(url, "llama.cpp", work, n, vocab) for n in levels]
    except openai.APIError as e:
        console.print(f"llama.cpp's server refused the requests: {e}")
        return 0
    finally:
        proc.terminate()
        proc.wait()
    console.print(table(rows, "llama-cpp-python's server, the same GGUF file and requests "
                              "(it serves one request at a time: no --parallel slots)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
