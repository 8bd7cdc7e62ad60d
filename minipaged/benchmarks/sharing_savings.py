"""What sharing blocks saves (stage 6), measured on the engine in one run, printed as one table.

    python -m minipaged.benchmarks.sharing_savings                 # embedded model, ~1-2 min on one core
    python -m minipaged.benchmarks.sharing_savings --random-model  # same shape, random weights

1. Parallel sampling: each prompt of a ShareGPT-like trace (stage 4's lengths / --scale) asks
   for n = 2, 4, 6 samples (temperature 1, no early stop). With sharing, the n samples are one
   prefill and n-1 forks over the prompt's blocks (copy-on-write); without, n independent
   requests. KV memory is blocks held per layer, averaged over busy steps and at its peak; the
   vLLM paper (Kwon et al., SOSP 2023) reports 6-30% saved by sharing in parallel sampling and
   37-66% in beam search (stage 6b's `beam_savings`: beams also share decoded blocks).
2. Prefix caching: prefill tokens skipped and time to first token (from the moment a request
   is added to its first token), with and without prefix caching, for
   (a) many requests sharing a long system prompt, arriving together;
   (b) multi-turn chats: each turn's prompt is the whole history plus a new message.
Every pair of runs must produce the same tokens (checked; a mismatch is printed in red).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from rich.console import Console
from rich.table import Table

from .. import cli
from ..api import Engine
from ..generation import row_generator
from .serving import _load, add_model_options, sharegpt_like_trace, trace_means


def serve(model, groups, n, share, block_size, max_seq_len, prefix_caching=False):
    """groups: [(prompt, max_new_tokens)]; n samples each, forked (share) or independent."""
    rows = n * len(groups)
    engine = Engine(model, rows * -(-max_seq_len // block_size), block_size,
                    max_num_seqs=rows, max_seq_len=max_seq_len, prefix_caching=prefix_caching)
    for i, (prompt, m) in enumerate(groups):
        gens = [row_generator(0, i * n + j) for j in range(n)]
        if share:
            engine.add_request(prompt, m, temperature=1.0, stop_tokens=[], n=n, generators=gens)
        else:
            for g in gens:
                engine.add_request(prompt, m, temperature=1.0, stop_tokens=[], generator=g)
    start = time.perf_counter()
    engine.run()
    return [r.output for r in engine.requests], engine.stats, time.perf_counter() - start


def parallel_sampling(model, trace, block_size, max_seq_len, ns):
    rows = []
    for n in ns:
        out_off, off, t_off = serve(model, trace, n, False, block_size, max_seq_len)
        out_on, on, t_on = serve(model, trace, n, True, block_size, max_seq_len)
        rows.append((n, off, on, t_off, t_on, out_off == out_on))
    return rows


def timed_engine(model, block_size, max_seq_len, prefix_caching, rows):
    engine = Engine(model, rows * -(-max_seq_len // block_size), block_size, max_num_seqs=rows,
                    max_seq_len=max_seq_len, prefix_caching=prefix_caching)
    first_token = {}
    engine.callback = lambda event, req_id, token, cache: \
        first_token.setdefault(req_id, time.perf_counter())
    return engine, first_token


def run_round(engine, first_token, prompts, max_new_tokens):
    """Add prompts together, serve them; returns their outputs and times to first token."""
    reqs = [engine.add_request(p, max_new_tokens, stop_tokens=[]) for p in prompts]
    start = time.perf_counter()
    engine.run()
    return [r.output for r in reqs], [first_token[r.req_id] - start for r in reqs]


def system_prompt_case(model, vocab, args, prefix_caching):
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(vocab, (args.system_tokens,), generator=gen).tolist()
    prompts = [system + torch.randint(vocab, (int(k),), generator=gen).tolist()
               for k in torch.randint(8, 40, (args.system_requests,), generator=gen)]
    engine, first = timed_engine(model, args.block_size, 1024, prefix_caching, len(prompts))
    out, ttft = run_round(engine, first, prompts, args.new_tokens)
    return out, ttft, engine.stats


def chat_case(model, vocab, args, prefix_caching):
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(vocab, (60,), generator=gen).tolist()
    histories = [system + torch.randint(vocab, (20,), generator=gen).tolist()
                 for _ in range(args.chats)]
    engine, first = timed_engine(model, args.block_size, 1024, prefix_caching, args.chats)
    outs, ttfts = [], []
    for turn in range(args.turns):
        out, ttft = run_round(engine, first, histories, args.new_tokens)
        outs += out
        ttfts += ttft
        histories = [h + o + torch.randint(vocab, (20,), generator=gen).tolist()
                     for h, o in zip(histories, out)]
    return outs, ttfts, engine.stats


def table(par, prefix, caption):
    t = Table(title="Sharing KV blocks (stage 6)", caption=caption)
    for col in ["case", "KV blocks mean (off → on)", "peak", "saved (mean)", "paper",
                "prefill tokens (off → on)", "skipped", "mean TTFT ms (off → on)", "wall s",
                "same tokens"]:
        t.add_column(col, justify="left" if col == "case" else "right")
    for n, off, on, t_off, t_on, same in par:
        saved = 1 - on.mean_used_blocks / off.mean_used_blocks
        t.add_row(f"parallel samples, n={n}",
                  f"{off.mean_used_blocks:.0f} → {on.mean_used_blocks:.0f}",
                  f"{off.peak_used_blocks} → {on.peak_used_blocks}", f"{saved:.1%}",
                  "6-30%", f"{off.prefill_tokens:,} → {on.prefill_tokens:,}",
                  f"{off.prefill_tokens - on.prefill_tokens:,}", "",
                  f"{t_off:.1f} → {t_on:.1f}", "✓" if same else "[red]✗[/red]")
    for name, (off, on) in prefix.items():
        (out_off, ttft_off, s_off, t_off), (out_on, ttft_on, s_on, t_on) = off, on
        t.add_row(name, "", "", "", "",
                  f"{s_off.prefill_tokens:,} → {s_on.prefill_tokens:,}",
                  f"{s_on.cached_tokens:,} ({s_on.cached_tokens / s_off.prefill_tokens:.0%})",
                  f"{1e3 * sum(ttft_off) / len(ttft_off):.0f} → "
                  f"{1e3 * sum(ttft_on) / len(ttft_on):.0f}",
                  f"{t_off:.1f} → {t_on:.1f}", "✓" if out_off == out_on else "[red]✗[/red]")
    return t


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.sharing_savings",
                           description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--requests", type=cli.whole(1), default=12,
                   help="prompts for parallel sampling")
    p.add_argument("--scale", type=cli.number(above=0), default=4.0,
                   help="divide ShareGPT's lengths by this")
    p.add_argument("--samples", type=cli.whole(1), nargs="+", default=[2, 4, 6])
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--system-tokens", type=cli.whole(0), default=400)
    p.add_argument("--system-requests", type=cli.whole(1), default=16)
    p.add_argument("--chats", type=cli.whole(1), default=4)
    p.add_argument("--turns", type=cli.whole(1), default=4)
    p.add_argument("--new-tokens", type=cli.whole(1), default=16)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 180)
    model = _load(args)
    vocab = model.args.vocab_size - 256
    trace, max_seq_len = sharegpt_like_trace(args.requests, args.scale, vocab)
    with torch.inference_mode():
        par = parallel_sampling(model, trace, args.block_size, max_seq_len, args.samples)
        prefix = {}
        for name, case in [(f"{args.system_requests} requests, {args.system_tokens}-token "
                            f"system prompt", system_prompt_case),
                           (f"{args.chats} chats x {args.turns} turns", chat_case)]:
            runs = []
            for on in (False, True):
                start = time.perf_counter()
                out, ttft, stats = case(model, vocab, args, on)
                runs.append((out, ttft, stats, time.perf_counter() - start))
            prefix[name] = runs
    caption = (f"parallel sampling: {len(trace)} ShareGPT-like prompts (lengths / {args.scale:g}:"
               f" {trace_means(trace)}), temperature 1; block "
               f"{args.block_size}; KV blocks per layer held, mean over busy steps. Paper: Kwon "
               f"et al. 2023 (vLLM). TTFT from adding a round's requests to each one's first "
               f"token. Beam search (paper: 37-66%): minipaged.benchmarks.beam_savings. "
               f"{torch.get_num_threads()} torch thread(s), load average "
               f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.")
    console.print(table(par, prefix, caption))


if __name__ == "__main__":
    raise SystemExit(main())
