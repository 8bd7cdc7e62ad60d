"""One decode step on the CPU: the paged cache against the contiguous cache (stage 1).

    python -m minipaged.benchmarks.decode_step             # batch 16, 8 layers, dim 1024, ~1K context
    python -m minipaged.benchmarks.decode_step --steps 10  # quicker
    python -m minipaged.benchmarks.decode_step --profile   # torch.profiler's table, both caches
    python -m minipaged.benchmarks.decode_step --backend torch  # the PyTorch gather path instead
    python -m minipaged.benchmarks.decode_step --paged stage3   # stage 3's readable PagedCache

By default the paged cache is the speed layer's (`minipaged.fast.FastPagedCache`: a step's
bookkeeping planned once for all layers) with its "auto" backend, stage 3b's C kernel on a CPU
where it builds: the configuration held to the target printed under the table. `--backend
torch` (copy each row's blocks out, then attend) and `--paged stage3` (stage 3's own PagedCache,
one `flash_attn_with_kvcache` call per layer, written to be read) have no speed target.

Both caches run the same random-weight Llama 3 (GQA) over the same batch: sequences whose
contexts are drawn uniformly from [--min-context, --max-context], each adding one token a step.
Prefill is skipped — each cache is told that the prompts are stored (`prepare`) and its slots
are filled with random keys and values — because a decode step's cost does not depend on what
the keys are, only on how many there are and where they live.

Each step is split into
  prepare      the bookkeeping, `cache.prepare(seq_ids, 1)`: lengths, and for the paged cache
               growing and building every layer's block table;
  write+gather the rest of `cache.attend`: storing the new k/v and, on the PyTorch paths,
               copying each row's keys and values out of the cache and arranging them for
               the math (transposes, masks, bf16 converted to float32 for a batch attended
               row by row); on the C kernel, only the call's own preparation, since the
               kernel reads the blocks where they lie and its reading counts as attention;
  attention    the attention math itself: every call of `kv_cache.sdpa`, through which both
               caches' PyTorch paths attend, whole batches or row by row, and of stage 3b's C
               kernel (`cpu_attention.decode_attention`), which reads the blocks as it goes;
  rest         everything else in the forward: the projections, the feed-forward, the logits.
Steps alternate between the caches, so a busy moment on a shared machine hits both alike,
and each column shows the best (smallest) time over the steps.
"""

from __future__ import annotations

import time

import torch

from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from .. import cli, cpu_attention, kv_cache
from ..model import Llama, ModelArgs
from ..fast import FastContiguousCache, FastPagedCache
from ..paged_cache import PagedCache

PARTS = ("prepare", "write+gather", "attention", "rest")   # the columns, in order


class Timer:
    """Seconds spent in each part of every step of one cache."""

    def __init__(self):
        self.steps = []                              # one dict of seconds per finished step
        self.now = self._fresh()

    @staticmethod
    def _fresh():
        return dict.fromkeys(("prepare", "attend", "attention", "step"), 0.0)

    def wrap(self, part, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += time.perf_counter() - t0
        return timed

    def end_step(self):
        self.steps.append(self.now)
        self.now = self._fresh()

    def parts(self, summary=min):
        """µs per step of each part, `summary` over the steps: by default the best (smallest),
        since other processes on a shared machine only ever add time, so the minimum is the
        steadiest estimate of a part's cost. write+gather = attend minus the attention math
        inside it."""
        def over_steps(values):
            return summary(values) * 1e6
        return {"prepare": over_steps([s["prepare"] for s in self.steps]),
                "write+gather": over_steps([s["attend"] - s["attention"] for s in self.steps]),
                "attention": over_steps([s["attention"] for s in self.steps]),
                "rest": over_steps([s["step"] - s["prepare"] - s["attend"] for s in self.steps]),
                "total": over_steps([s["step"] for s in self.steps])}


def build(args):
    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, vocab_size=args.vocab,
                      max_seq_len=args.max_context + args.steps + 1)
    torch.manual_seed(0)
    model = Llama(margs).eval()
    gen = torch.Generator().manual_seed(1)
    contexts = torch.randint(args.min_context, args.max_context + 1, (args.batch,),
                             generator=gen).tolist()
    seq_ids = list(range(args.batch))
    need = sum(-(-(c + args.steps + 1) // args.block_size) for c in contexts)
    caches = {
        "contiguous": FastContiguousCache(margs, args.batch, margs.max_seq_len),
        "paged": (FastPagedCache if args.paged == "fast" else PagedCache)(
            margs, num_blocks=need + args.batch, block_size=args.block_size, max_seqs=args.batch,
            max_seq_len=margs.max_seq_len, backend=args.backend),
    }
    for cache in caches.values():                # "prefill": the prompts are stored, at random
        for i, c in zip(seq_ids, contexts):
            cache.prepare([i], c)
    pools = caches["contiguous"].k_cache + caches["contiguous"].v_cache + [
        t for m in caches["paged"].managers for t in (m.k_cache_paged, m.v_cache_paged)]
    for t in pools:
        t.normal_(generator=gen)
    return model, caches, seq_ids, contexts


def step(model, cache, seq_ids, tokens, timer):
    """One decode step of `model` on `cache`, its parts timed into `timer`; returns the logits.

    The attention math inside each cache's `attend` is timed by wrapping the functions that
    do it, for the length of the step: `kv_cache.sdpa`, which every PyTorch path calls, and
    the C kernel's `cpu_attention.decode_attention`, which reads the blocks and does the math
    at once (and `attend` itself, on this cache only), so each timer sees only its own calls."""
    timed = [(kv_cache, "sdpa"), (cpu_attention, "decode_attention")]
    originals = [getattr(module, name) for module, name in timed]
    cache.attend = timer.wrap("attend", type(cache).attend.__get__(cache))
    for (module, name), original in zip(timed, originals):
        setattr(module, name, timer.wrap("attention", original))
    try:
        t0 = time.perf_counter()
        timer.wrap("prepare", cache.prepare)(seq_ids, 1)
        logits = model(tokens, cache=cache)
        timer.now["step"] += time.perf_counter() - t0
    finally:
        for (module, name), original in zip(timed, originals):
            setattr(module, name, original)
        del cache.attend
    timer.end_step()
    return logits


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.decode_step",
                           description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=cli.whole(1), default=16)
    p.add_argument("--layers", type=int, default=8)            # (ModelArgs checks the shape)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--min-context", type=cli.whole(1), default=512)
    p.add_argument("--max-context", type=cli.whole(1), default=1536)
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--backend", choices=["auto", "torch", "cpu"], default="auto",
                   help="the paged cache's attention: auto (on the speed layer: stage 3b's C "
                        "kernel where it builds), stage 3's PyTorch path (gather, then attend), "
                        "or the C kernel (reads the blocks where they lie)")
    p.add_argument("--paged", choices=["fast", "stage3"], default="fast",
                   help="the paged cache: the speed layer's FastPagedCache, or stage 3's "
                        "readable PagedCache (no speed target)")
    p.add_argument("--steps", type=cli.whole(1), default=30, help="timed decode steps per cache")
    p.add_argument("--warmup", type=cli.whole(0), default=2)
    p.add_argument("--threads", type=cli.whole(1), default=1,
                   help="torch threads (1: steady on a shared machine, where a second thread "
                        "that waits for a busy core stalls every op)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table instead")
    args = p.parse_args(argv)
    if args.min_context > args.max_context:
        p.error(f"--min-context {args.min_context} is above --max-context {args.max_context}")
    torch.set_num_threads(args.threads)


    console = Console(width=max(Console().width, 96))     # room for the table without cutting
    model, caches, seq_ids, contexts = build(args)
    tokens = torch.randint(0, args.vocab, (args.batch, 1), generator=torch.Generator().manual_seed(2))
    timers = {name: Timer() for name in caches}

    if args.profile:
        for name, cache in caches.items():
            for _ in range(args.warmup):
                step(model, cache, seq_ids, tokens, Timer())
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(model, cache, seq_ids, tokens, Timer())
            console.print(f"[bold]{name}[/bold]: 5 decode steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        return

    with torch.inference_mode():
        for i in range(args.warmup + args.steps):
            order = list(caches.items())[::1 if i % 2 else -1]   # interleaved, each first in turn
            for name, cache in order:
                step(model, cache, seq_ids, tokens, timers[name] if i >= args.warmup else Timer())

    parts = {name: t.parts() for name, t in timers.items()}
    ratio = parts["paged"]["total"] / parts["contiguous"]["total"]
    console.print(f"one decode step on the CPU (fp32, {torch.get_num_threads()} thread(s)): batch "
                  f"{args.batch}, {args.layers} layers, dim {args.dim}, {args.heads} heads / "
                  f"{args.kv_heads} KV heads, contexts {min(contexts)}-{max(contexts)} tokens, "
                  f"block {args.block_size}, paged cache: {args.paged}, paged attention: "
                  f"backend {args.backend!r}")
    table = Table(title="µs per decode step", title_justify="left")
    table.add_column("cache")
    for part in (*PARTS, "step"):
        table.add_column(part, justify="right")
    table.add_column("÷ contiguous", justify="right")
    for name in ("contiguous", "paged"):
        row = parts[name]
        table.add_row(name, *(f"{row[k]:,.0f}" for k in (*PARTS, "total")),
                      f"{row['total'] / parts['contiguous']['total']:.2f}x")
    console.print(table)
    target = "target <= 1.25x" if args.paged == "fast" and args.backend != "torch" else \
        "no speed target: a readable path, see lesson 03"
    console.print(f"paged ÷ contiguous = {ratio:.2f}x per decode step ({target}); each "
                  f"column the best of {args.steps} interleaved steps per cache, after "
                  f"{args.warmup} warm-up; torch {torch.__version__}")


if __name__ == "__main__":
    raise SystemExit(main())
