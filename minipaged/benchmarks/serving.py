"""The benchmark that justifies paging: one trace, one KV memory budget, three ways to serve it.

    python -m minipaged.benchmarks.serving          # the table (embedded model, 2 CPU cores)
    python -m minipaged.benchmarks.serving --sweep  # also tokens/s against the KV budget, drawn

(a) contiguous, static batches — stage 1's cache, as paged-attention-minimal serves: every
    request in a batch reserves `max_seq_len` slots, so the budget fixes the batch at
    budget // max_seq_len requests, and the next batch starts when the slowest one ends.
(b) paged, static batches — blocks instead of reservations: a batch admits as many requests
    as their prompts' blocks allow, and preempts when they outgrow the pool; still, nobody new
    joins until the whole batch is done.
(c) paged, continuous batching — stage 5's engine: a finished request's blocks go to a waiting
    one at the next step.

The trace is stage 4's ShareGPT-like workload (`workloads.synthetic`: geometric lengths with
the means the vLLM paper reports for ShareGPT, 161.31 prompt and 337.99 output tokens; Kwon et
al. 2023, Fig. 11) with every length divided by `--scale` (4), and the context limit scaled the
same way (the paper's OPT models have 2048 positions; 2048 / 4 = 512, where a longer request is
cut). Every request arrives at once (offline serving, as in vLLM's throughput benchmark),
prompts are random token ids, and stop tokens are ignored so each request generates exactly its
drawn output length — the same work for all three.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from .. import cli, viz
from ..embedded.train import N_RANKS, embedded_model_args
from ..engine import Engine
from ..errors import OutOfBlocksError
from ..formats import load_model
from ..formats.atomic import write_file
from ..generation import generate_static
from ..cache_checks import check_memory
from ..kv_cache import ContiguousCache, kv_bytes_per_token
from ..model import Llama
from ..workloads import SHAREGPT, synthetic

PAPER_CONTEXT = 2048          # the context of the OPT models the vLLM paper served


def sharegpt_like_trace(num_requests: int, scale: float = 4.0, vocab: int = 4096, seed: int = 0):
    """[(prompt token ids, output length)] and the context limit: stage 4's ShareGPT-like
    lengths (geometric, the paper's means) divided by `scale`, prompts of random ids < vocab
    (the CLI passes the vocabulary without Llama 3's 256 special tokens)."""
    limit = int(PAPER_CONTEXT / scale)
    lengths = synthetic(num_requests, SHAREGPT[0] / scale, SHAREGPT[1] / scale, seed=seed,
                        max_seq_len=limit)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(vocab, (int(n),), generator=gen).tolist()
               for n in lengths.prompt_lens]
    return list(zip(prompts, lengths.output_lens.tolist())), limit


@dataclass
class Result:
    name: str
    seconds: float                  # wall clock
    cpu_seconds: float              # CPU time this process got: steadier on a shared machine
    requests: int
    generated_tokens: int
    mean_concurrent: float          # requests in a step's batch, averaged over steps
    max_concurrent: int
    preemptions: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.generated_tokens / self.cpu_seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


class _CountingContiguousCache(ContiguousCache):
    """ContiguousCache that remembers each decode step's batch size."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches = []

    def prepare(self, seq_ids, num_new_tokens):
        super().prepare(seq_ids, num_new_tokens)
        if num_new_tokens == 1:
            self.batches.append(len(seq_ids))


def serve_contiguous_static(model, trace, budget_bytes, max_seq_len) -> Result:
    """(a): batches of budget // (max_seq_len slots) requests, each run to its end."""
    a, dtype = model.args, next(model.parameters()).dtype
    batch = budget_bytes // (max_seq_len * kv_bytes_per_token(a.n_kv_heads, a.head_dim, dtype,
                                                             a.n_layers))
    if batch < 1:
        raise OutOfBlocksError(f"a budget of {budget_bytes:,} bytes cannot reserve even one "
                               f"{max_seq_len}-token row")
    batches, start, cpu = [], time.perf_counter(), time.process_time()
    for i in range(0, len(trace), batch):
        part = trace[i:i + batch]
        cache = _CountingContiguousCache(a, len(part), max_seq_len, dtype=dtype)
        generate_static(model, [p for p, _ in part], [o for _, o in part], cache=cache,
                        stop_tokens=[])
        batches += cache.batches
    return Result("(a) contiguous, static", time.perf_counter() - start,
                  time.process_time() - cpu, len(trace), sum(o for _, o in trace),
                  sum(batches) / len(batches), max(batches), 0)


def serve_paged(model, trace, budget_bytes, max_seq_len, block_size=16, static=False,
                preemption="recompute", progress=False) -> Result:
    """(b) with `static`, else (c): stage 5's engine over a pool sized from the budget."""
    engine = Engine(model, None, block_size, preemption, kv_budget=budget_bytes,
                    max_seq_len=max_seq_len, static_batches=static)
    for prompt, o in trace:
        engine.add_request(prompt, o, stop_tokens=[])
    name = "(b) paged, static" if static else "(c) paged, continuous"
    start, cpu = time.perf_counter(), time.process_time()
    engine.run(progress=progress, description=name)
    st = engine.stats
    return Result(name, time.perf_counter() - start, time.process_time() - cpu, len(trace),
                  st.generated_tokens, st.mean_running, st.running_max, st.preemptions)


def run_all(model, trace, budget_bytes, max_seq_len, block_size=16, preemption="recompute",
            progress=False) -> list[Result]:
    return [serve_contiguous_static(model, trace, budget_bytes, max_seq_len),
            serve_paged(model, trace, budget_bytes, max_seq_len, block_size, True, preemption,
                        progress),
            serve_paged(model, trace, budget_bytes, max_seq_len, block_size, False, preemption,
                        progress)]


def results_table(results, title: str):
    """The three side by side, plus (c)/(a) and (c)/(b), as a rich Table."""
    t = Table(title=title, title_justify="left")
    for col in ("server", "requests/s", "tokens/s", "tokens/CPU-s", "mean conc.", "max conc.",
                "preempted", "wall s"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for r in results:
        t.add_row(r.name, f"{r.requests_per_s:.2f}", f"{r.tokens_per_s:,.0f}",
                  f"{r.tokens_per_cpu_s:,.0f}", f"{r.mean_concurrent:.1f}",
                  str(r.max_concurrent), str(r.preemptions), f"{r.seconds:.1f}")
    a, b, c = results
    for other in (a, b):
        t.add_row(f"(c) / {other.name[:3]}", f"{c.requests_per_s / other.requests_per_s:.2f}x",
                  f"{c.tokens_per_s / other.tokens_per_s:.2f}x",
                  f"{c.tokens_per_cpu_s / other.tokens_per_cpu_s:.2f}x",
                  f"{c.mean_concurrent / other.mean_concurrent:.2f}x", "", "", "", style="bold")
    return t


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.serving",
                           description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Llama 3 checkpoint folder (default: the embedded model)")
    p.add_argument("--random-model", action="store_true",
                   help="the embedded model's shape with random weights (speed does not depend "
                        "on the weights)")
    p.add_argument("--requests", type=cli.whole(1), default=120)
    p.add_argument("--scale", type=cli.number(above=0), default=4.0,
                   help="divide ShareGPT's lengths by this")
    p.add_argument("--budget-rows", type=cli.whole(1), default=8,
                   help="KV budget, in contiguous rows of max_seq_len tokens (default 8)")
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--threads", type=cli.whole(1), default=1,
                   help="torch threads (default 1: a model this small gains nothing from a second "
                        "thread, and loses a lot when the cores are shared)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype (default float32: a CPU without bf16 units runs bf16 slowly)")
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--sweep", action="store_true",
                   help="also serve the trace at budgets of 4, 8, 16 and 32 rows and draw it")
    cli.add_figure_options(p, "--sweep's figure, bench_throughput_vs_budget.png")
    args = p.parse_args(argv)
    figures = cli.figures_folder(args, p)

    console = Console(width=None if sys.stdout.isatty() else 120)
    torch.set_num_threads(args.threads)
    model = _load(args)
    trace, max_seq_len = sharegpt_like_trace(args.requests, args.scale,
                                             model.args.vocab_size - 256, args.seed)
    a, weight = model.args, next(model.parameters())
    per_token = kv_bytes_per_token(a.n_kv_heads, a.head_dim, weight.dtype, a.n_layers)
    budget = args.budget_rows * max_seq_len * per_token
    largest = max([args.budget_rows] + ([32] if args.sweep else []))
    check_memory(largest * max_seq_len * per_token, weight.device,  # now, not after server (a)
                 f"a KV budget of {largest} rows of {max_seq_len} tokens",
                 max_seq_len * per_token, "rows (--budget-rows)")
    mean_in = sum(len(q) for q, _ in trace) / len(trace)
    mean_out = sum(o for _, o in trace) / len(trace)
    caption = (f"{len(trace)} requests, ShareGPT-like lengths / {args.scale:g} (mean in "
               f"{mean_in:.1f}, out {mean_out:.1f}; max_seq_len {max_seq_len}); KV budget "
               f"{budget / 2**20:.1f} MiB = {args.budget_rows * max_seq_len:,} tokens; block "
               f"{args.block_size}, preemption by {args.preemption}; {torch.get_num_threads()} "
               f"torch thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    bars = console.is_terminal                 # progress bars only where someone watches
    results = run_all(model, trace, budget, max_seq_len, args.block_size, args.preemption,
                      progress=bars)
    console.print(results_table(results, caption))
    if args.sweep:
        rows_list = [4, 8, 16, 32]
        sweep = {r: (results if r == args.budget_rows else
                     run_all(model, trace, r * max_seq_len * per_token, max_seq_len,
                             args.block_size, args.preemption, progress=bars))
                 for r in rows_list}
        fig = viz.plot_throughput_vs_budget(
            [r * max_seq_len * per_token for r in rows_list], [sweep[r] for r in rows_list],
            title=f"{len(trace)} ShareGPT-like requests (lengths / {args.scale:g}), "
                  f"{torch.get_num_threads()} CPU thread(s)")
        plot = cli.drawing_folder(figures, "serving") / "bench_throughput_vs_budget.png"
        write_file(plot, lambda p: fig.savefig(p, format="png", dpi=120))
        console.print(f"wrote {plot}")


def add_model_options(p) -> None:
    """The options the sharing benchmarks share: which model, its dtype, torch threads."""
    p.add_argument("--model", help="a Llama 3 checkpoint folder (default: the embedded model)")
    p.add_argument("--random-model", action="store_true",
                   help="the embedded model's shape with random weights")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=cli.whole(1), default=1)


def trace_means(trace) -> str:
    """"mean in X, out Y": a trace's mean prompt and output lengths, for captions."""
    mean_in = sum(len(q) for q, _ in trace) / len(trace)
    mean_out = sum(o for _, o in trace) / len(trace)
    return f"mean in {mean_in:.0f}, out {mean_out:.0f}"


def _load(args):
    dtype = getattr(torch, args.dtype)
    if args.random_model:
        torch.manual_seed(0)
        return Llama(embedded_model_args(N_RANKS + 256)).to(dtype).eval()
    return load_model(args.model, dtype=dtype)


if __name__ == "__main__":
    raise SystemExit(main())
