"""Stage 5b's benchmark: what a long prompt does to the conversations already running, with whole
prefills and under token budgets.

    python -m minipaged.benchmarks.chunked_latency      # the table (embedded model, 1 thread)

The trace: `--chats` conversations decode (prompts of `--chat-prompt` tokens, `--chat-tokens`
new tokens each, all arriving at step 0), and every `--long-every` steps a long prompt of
`--long-prompt` tokens arrives (it generates `--long-tokens`). Arrivals are counted in engine
steps from the start, so "a long prompt arrives after the chats' 40th token" means the same in
every run. The pool holds everything: nobody is preempted, so only the budget differs.

Served four ways — whole prompts (stage 5: no budget) and `max_num_batched_tokens` of 1024, 256
and 64 — the table shows, per run:

  * inter-token latency of the chats (the time between two tokens of one chat): p50, p99, max;
  * time to first token of the long prompts (from the start of the step they arrive in);
  * generated tokens per second over the whole run, and the steps it took;

and each run's p99, max and throughput beside the whole-prompt run's, as ratios. The four are
served in turn `--repeats` times (default 3), so that a change in the machine's load falls on
all of them alike; each figure is the median of its repeats.

Times are this process's CPU time by default (`--clock cpu`): with one torch thread it is the
time the engine computed, and other programs on a shared machine disturb it far less than the
wall clock (`--clock wall`), which also counts the time the process waited for a core.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from .. import cli
from ..chunked_engine import ChunkedEngine
from ..embedded.train import N_RANKS, embedded_model_args
from ..errors import MiniPagedError
from ..formats import load_model
from ..model import Llama


def chats_and_long_prompts(chats: int = 8, chat_prompt: int = 64, chat_tokens: int = 256,
                           long_prompt: int = 1536, long_tokens: int = 16, long_every: int = 70,
                           vocab: int = 4096, seed: int = 0):
    """[(prompt token ids, new tokens, arrival step)]: the chats first, then the long prompts,
    one every `long_every` steps while the chats run."""
    gen = torch.Generator().manual_seed(seed)
    arrivals = [0] * chats + list(range(long_every // 2, chat_tokens, long_every))
    return [(torch.randint(vocab, (chat_prompt if k < chats else long_prompt,),
                           generator=gen).tolist(),
             chat_tokens if k < chats else long_tokens, step)
            for k, step in enumerate(arrivals)]


@dataclass
class Run:
    name: str
    inter_token: list          # seconds between two tokens of a chat, every chat
    first_token: list          # seconds from arrival to first token, every long prompt
    generated_tokens: int
    seconds: float
    steps: int
    max_step_tokens: int

    def figures(self) -> dict:
        """What the table shows, in seconds and tokens per second."""
        gaps = torch.tensor(self.inter_token)
        return {"p50": float(gaps.quantile(0.5)), "p99": float(gaps.quantile(0.99)),
                "max": float(gaps.max()), "ttft": sum(self.first_token) / len(self.first_token),
                "tokens/s": self.generated_tokens / self.seconds}


def medians(repeats: list[Run]) -> dict:
    """Each figure's median over the repeats of one server."""
    per_run = [r.figures() for r in repeats]
    return {k: float(torch.tensor([f[k] for f in per_run]).median()) for k in per_run[0]}


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def serve(model, trace, budget, chats: int, block_size: int = 16, clock=time.process_time) -> Run:
    """One run of the trace; a token's time is the end of the step that sampled it."""
    tokens = sum(len(p) + n for p, n, _ in trace)
    engine = ChunkedEngine(model, -(-tokens // block_size) + len(trace), block_size,
                           max_num_batched_tokens=budget, max_num_seqs=len(trace))
    for prompt, n, arrival in trace:
        engine.add_request(prompt, n, stop_tokens=[], arrival_step=arrival)
    stamps, step_start = {}, []
    engine.callback = lambda event, req_id, token, cache: \
        stamps.setdefault(req_id, []).append(clock())
    start = clock()
    while engine.has_unfinished():
        step_start.append(clock())
        engine.step()
    seconds = clock() - start
    gaps = [b - a for i in range(chats) for a, b in zip(stamps[i], stamps[i][1:])]
    ttft = [stamps[i][0] - step_start[arrival]
            for i, (_, _, arrival) in enumerate(trace) if i >= chats]
    st = engine.stats
    name = "whole prompts" if budget is None else f"budget {budget}"
    return Run(name, gaps, ttft, st.generated_tokens, seconds, st.steps, st.max_step_tokens)


def results_table(servers: list[list[Run]], title: str):
    """One row per server (its repeats' medians), the first server the base of the ratios."""
    t = Table(title=title, title_justify="left")
    for col in ("server", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "TTFT mean ms", "tokens/s",
                "steps", "max step tokens", "p99 / whole", "max / whole", "tok/s / whole"):
        t.add_column(col, justify="left" if col == "server" else "right")
    base = medians(servers[0])
    for repeats in servers:
        m, r = medians(repeats), repeats[0]
        t.add_row(r.name, f"{1e3 * m['p50']:.1f}", f"{1e3 * m['p99']:.1f}",
                  f"{1e3 * m['max']:.1f}", f"{1e3 * m['ttft']:.0f}", f"{m['tokens/s']:.0f}",
                  str(r.steps), str(r.max_step_tokens), f"{m['p99'] / base['p99']:.2f}x",
                  f"{m['max'] / base['max']:.2f}x",
                  f"{m['tokens/s'] / base['tokens/s']:.2f}x")
    return t


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.chunked_latency",
                           description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", help="a Llama 3 checkpoint folder (default: the embedded model)")
    p.add_argument("--random-model", action="store_true",
                   help="the embedded model's shape with random weights")
    p.add_argument("--chats", type=cli.whole(1), default=8)
    p.add_argument("--chat-prompt", type=cli.whole(1), default=64)
    p.add_argument("--chat-tokens", type=cli.whole(1), default=256)
    p.add_argument("--long-prompt", type=cli.whole(1), default=1536)
    p.add_argument("--long-tokens", type=cli.whole(1), default=16)
    p.add_argument("--long-every", type=cli.whole(1), default=70,
                   help="steps between long prompts")
    p.add_argument("--budgets", type=cli.whole(1), nargs="+", default=[1024, 256, 64])
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--threads", type=cli.whole(1), default=1)
    p.add_argument("--repeats", type=cli.whole(1), default=3,
                   help="rounds over the servers (default 3)")
    p.add_argument("--clock", choices=list(CLOCKS), default="cpu",
                   help="this process's CPU time (default) or the wall clock")
    p.add_argument("--seed", type=cli.seed, default=0)
    args = p.parse_args(argv)

    console = Console(width=None if sys.stdout.isatty() else 150)
    torch.set_num_threads(args.threads)
    model = _load(args)
    trace = chats_and_long_prompts(args.chats, args.chat_prompt, args.chat_tokens,
                                   args.long_prompt, args.long_tokens, args.long_every,
                                   model.args.vocab_size - 256, args.seed)
    if args.chat_prompt + args.chat_tokens > model.args.max_seq_len or \
            args.long_prompt + args.long_tokens > model.args.max_seq_len:
        raise MiniPagedError(f"a request would pass the model's {model.args.max_seq_len} "
                             f"positions; shorten the prompts or the chats")
    load = os.getloadavg()[0]
    clock = CLOCKS[args.clock]
    serve(model, trace[:1], 64, 1, args.block_size, clock)               # warm up
    budgets = [None] + sorted(args.budgets, reverse=True)
    servers = [[] for _ in budgets]
    for _ in range(args.repeats):                  # in turn, so load drifts hit all alike
        for repeats, b in zip(servers, budgets):
            repeats.append(serve(model, trace, b, args.chats, args.block_size, clock))
    longs = len(trace) - args.chats
    caption = (f"{args.chats} chats ({args.chat_prompt}-token prompts, {args.chat_tokens} new "
               f"tokens) and {longs} prompts of {args.long_prompt} tokens arriving every "
               f"{args.long_every} steps; block {args.block_size}; medians of {args.repeats} "
               f"rounds; {'CPU time of this process' if args.clock == 'cpu' else 'wall clock'}; "
               f"{torch.get_num_threads()} torch thread(s); load average {load:.1f} before, "
               f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    console.print(results_table(servers, caption))


def _load(args):
    if args.random_model:
        torch.manual_seed(0)
        return Llama(embedded_model_args(N_RANKS + 256)).eval()
    return load_model(args.model)


if __name__ == "__main__":
    raise SystemExit(main())
