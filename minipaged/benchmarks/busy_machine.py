"""Serving beside a busy core: how much `minipaged.fast`'s engine slows down when one other
CPU-bound process runs beside it, as OpenMP's waiting threads spin or sleep.

    python -m minipaged.benchmarks.busy_machine                 # SmolLM2, fp32, 2 threads
    python -m minipaged.benchmarks.busy_machine --dtype bfloat16 --ways spinning fixed minipaged

torch runs its matrix products, its larger element-wise ops and the C kernel's attention on
one pool of OpenMP threads. A decode step is a few hundred short parallel regions, and each
ends at a barrier: the threads that finish first wait there for the last one. GNU OpenMP waits
by spinning, 300,000 turns of a busy loop by default, before it sleeps. On a quiet machine that
saves a wake-up per region. Beside a busy process it is a collapse: the thread that shares its
core with the other process waits for the scheduler's next time slice, while the thread that
finished keeps its own core busy spinning, so no core is free to take the late thread, region
after region. A thread that sleeps at once (`OMP_WAIT_POLICY=PASSIVE`) frees its core, but then
every region on a quiet machine pays for waking it. `import minipaged` sets a short spin,
`GOMP_SPINCOUNT=10000`, when torch is not loaded yet and neither variable is set.

A short spin is not the end of it: the thread that shares its core still gets half of it, and
every barrier still waits for it, so the step runs at that thread's pace. `FastEngine` watches
how much CPU other processes take and, while one holds a core, runs its steps on one thread
fewer (`fast/threads.py`), back up when the machine is quiet again.

Each measurement runs in a child process, started one of these ways (`--ways`):

    spinning    imports torch first: OpenMP's default, as a script that loads torch before
                minipaged gets it
    fixed       imports minipaged first (its short spin), the thread count fixed
                (`FastEngine(adaptive_threads=False)`)
    minipaged   imports minipaged first, FastEngine's default: the short spin, and one thread
                fewer while another process holds a core
    passive     OMP_WAIT_POLICY=PASSIVE
    spin=N      GOMP_SPINCOUNT=N

All but `minipaged` run on a fixed thread count, so they compare OpenMP's ways of waiting alone.

Each child serves the same requests in turns, quiet and with `python -c "while True: pass"`
running beside it; the table gives tokens per second and the busy/quiet ratio of each way, the
best of its runs (`--repeats` children of each way, in turns, each with `--turns` quiet and
busy runs).
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from .. import cli
from ..api import generate
from ..fast import FastEngine, FusedLlama
from ..formats import load_model, load_tokenizer, packaged_model_path
from ..model import Llama, ModelArgs
from .smollm2 import chat_prompts

TORCH_FIRST = "import torch  # OpenMP starts with its default policy\n"
WAYS = {   # how a child starts: OpenMP's wait policy is fixed by whichever loads torch first
    "spinning": TORCH_FIRST,
    "fixed": "import minipaged  # sets GOMP_SPINCOUNT before torch loads\n",
    "minipaged": "import minipaged  # sets GOMP_SPINCOUNT before torch loads\n",
    "passive": TORCH_FIRST,
}
CHILD = "import sys\nfrom minipaged.benchmarks.busy_machine import child\nchild(sys.argv[1:])\n"
SPINNER = "while True: pass"


def requests(random_model: bool, dtype):
    """The model on the speed layer and the prompts: SmolLM2 and the SmolLM2 benchmark's 16
    chat prompts, or a small random Llama and 16 random prompts (for a quick check)."""
    if random_model:
        torch.manual_seed(0)
        args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                         max_seq_len=256)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(256, (int(n),), generator=gen).tolist()
                   for n in torch.randint(4, 60, (16,), generator=gen)]
        return FusedLlama(Llama(args).to(dtype)), prompts
    path = packaged_model_path("smollm2")
    return FusedLlama(load_model(path, dtype=dtype)), chat_prompts(load_tokenizer(path))


def serve_rate(fast, prompts, n, adaptive_threads: bool = True) -> float:
    """Tokens per second of the engine serving `prompts`, `n` tokens each, one step budget of
    512 tokens (the SmolLM2 benchmark's); `adaptive_threads` as FastEngine's."""
    start = time.perf_counter()
    engine = functools.partial(FastEngine, adaptive_threads=adaptive_threads)
    out = generate(fast, prompts, n, cache="paged", stop_tokens=[], engine_class=engine,
                   max_seq_len=max(map(len, prompts)) + n,
                   max_num_batched_tokens=max(512, max(map(len, prompts)) + 16))
    return sum(map(len, out)) / (time.perf_counter() - start)


def child(argv) -> None:
    """One child: serve in turns, quiet then beside a spinning process; print a JSON line."""
    dtype_name, threads, n, turns, random_model = argv[0], int(argv[1]), int(argv[2]), \
        int(argv[3]), argv[4] == "random"
    adaptive = argv[5] == "adaptive"
    torch.set_num_threads(threads)
    fast, prompts = requests(random_model, getattr(torch, dtype_name))
    serve_rate(fast, prompts, 2, adaptive)                # warm: the C kernel's build
    rates = {"quiet": [], "busy": []}
    for _ in range(turns):
        rates["quiet"].append(serve_rate(fast, prompts, n, adaptive))
        spinner = subprocess.Popen([sys.executable, "-c", SPINNER])
        try:
            time.sleep(0.2)
            rates["busy"].append(serve_rate(fast, prompts, n, adaptive))
        finally:
            spinner.kill()
            spinner.wait()
    print(json.dumps(rates))


def run_child(way: str, dtype_name: str, threads: int, n: int, turns: int,
              random_model: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if way.startswith("spin="):      # spin that many turns, then sleep (GNU OpenMP's knob)
        env["GOMP_SPINCOUNT"] = way.removeprefix("spin=")
    elif way == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-c", WAYS.get(way, TORCH_FIRST) + CHILD, dtype_name,
                          str(threads),
                          str(n), str(turns), "random" if random_model else "smollm2",
                          "adaptive" if way == "minipaged" else "fixed"],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(ways, dtype_name: str, threads: int, n: int, repeats: int, turns: int,
            random_model: bool) -> dict:
    """{way: {"quiet": [tokens/s...], "busy": [...]}}: `repeats` children of each way, in turns."""
    rates = {way: {"quiet": [], "busy": []} for way in ways}
    for _ in range(repeats):
        for way in ways:
            got = run_child(way, dtype_name, threads, n, turns, random_model)
            for k in got:
                rates[way][k] += got[k]
    return rates


def parse_way(text: str) -> str:
    """A --ways entry: a name of WAYS, or spin=N with N a whole number."""
    if text in WAYS or text.startswith("spin=") and text[5:].isdigit():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not spinning, fixed, minipaged, passive or "
                                     "spin=N")


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.busy_machine",
                           description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=cli.whole(1), default=2)
    p.add_argument("--new-tokens", type=cli.whole(1), default=16)
    p.add_argument("--repeats", type=cli.whole(1), default=2,
                   help="children of each way, in turns")
    p.add_argument("--turns", type=cli.whole(1), default=2,
                   help="quiet and busy runs in each child, in turns")
    p.add_argument("--ways", nargs="+", type=parse_way, default=list(WAYS),
                   help="spinning, fixed, minipaged, passive, or spin=N (GOMP_SPINCOUNT=N: N "
                        "turns, then sleep)")
    p.add_argument("--random-model", action="store_true",
                   help="a small random model instead of SmolLM2 (a quick check)")
    args = p.parse_args(argv)
    console = Console()
    load = os.getloadavg()
    rates = compare(args.ways, args.dtype, args.threads, args.new_tokens, args.repeats,
                    args.turns, args.random_model)
    table = Table(title=f"serving 16 requests x {args.new_tokens} tokens, {args.dtype}, "
                        f"{args.threads} threads; load average before "
                        f"{load[0]:.1f} / after {os.getloadavg()[0]:.1f}")
    for column in ("way", "quiet tok/s", "busy tok/s", "busy / quiet"):
        table.add_column(column)
    for way, r in rates.items():
        quiet, busy = max(r["quiet"]), max(r["busy"])
        table.add_row(way, f"{quiet:.1f}", f"{busy:.1f}", f"{busy / quiet:.2f}")
    console.print(table)
    console.print("busy: one `python -c \"while True: pass\"` beside the engine; best of "
                  f"{args.repeats * args.turns} runs each")


if __name__ == "__main__":
    raise SystemExit(main())
