"""Stage 7's benchmark: speculative decoding (n-gram drafts) against plain decoding, side by side.

    python -m minipaged.benchmarks.speculative                  # embedded model (about 30 s)
    python -m minipaged.benchmarks.speculative --model smollm2  # SmolLM2-135M-Instruct

Two kinds of prompt, each at batch 1 (one request at a time) and at 16 requests at once:

  * lookup-friendly: a question asked again after the model answered it once, a text to
    repeat or edit, code to continue — the continuation reuses the prompt's tokens, so n-gram
    lookup finds drafts the model agrees with;
  * open chat: short questions, where the answer shares little with the prompt.

Both runs serve the same requests on the same engine (the speed layer's `FastEngine`, which
takes stage 7's options) and greedy, so their tokens must be the same (column "same").
They are taken in turn `--repeat` times, and each keeps its fastest time.
Columns: acceptance rate (accepted drafts / drafts run), tokens a decoding sequence gains per
step (1.0 without speculation), tokens/s of each, the speed-up, and the speed-up in the
process's CPU time (plain's over speculative's): on a machine other work shares, the wall
clock also counts the time spent waiting for a core, CPU time does not.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .. import cli
from ..api import generate
from ..fast import FastEngine
from ..formats import chat_format, load_model, load_tokenizer, packaged_model_path

TEXT = ("The scheduler keeps three queues: waiting, running and swapped. Every step it finds a "
        "slot for the next token of every running request, oldest first. When the pool is dry "
        "it preempts the most recently admitted request, by recompute or by swap.")
CODE = Path(__file__).resolve().parents[1] / "cache_manager.py"
CHAT = ["What is the capital of France?", "Tell me a joke about cats.", "Why is the sky blue?",
        "Give me three ideas for a birthday party.", "What should I cook tonight?",
        "How do plants grow?", "Write a haiku about rain.", "What is a good name for a dog?"]


def prompts(model, tok, kind: str, count: int) -> list[list[int]]:
    fmt = chat_format(tok)
    if kind == "lookup":
        # a question asked again after the model answered it: the answer is in the prompt
        first = [fmt.encode_dialog_prompt([{"role": "user", "content": q}]) for q in CHAT[:4]]
        answers = generate(model, first, 48)
        again = [fmt.encode_dialog_prompt([{"role": "user", "content": q},
                                           {"role": "assistant", "content": tok.decode(a)},
                                           {"role": "user", "content": q}])
                 for q, a in zip(CHAT, answers)]
        code = CODE.read_text().splitlines()
        asks = [f"Repeat this text exactly:\n\n{TEXT}",
                f"Rewrite this text, changing 'request' to 'sequence':\n\n{TEXT}"]
        out = [fmt.encode_dialog_prompt([{"role": "user", "content": a}]) for a in asks]
        out = [x for pair in zip(again, out + out) for x in pair]
        out += [tok.encode("\n".join(code[i:i + 30])) for i in range(0, len(code) - 30, 20)][:8]
    else:
        out = [fmt.encode_dialog_prompt([{"role": "user", "content": q}]) for q in CHAT[4:] + CHAT[:4]]
    return [out[i % len(out)] for i in range(count)]


def serve(model, reqs, max_new: int, batch: int, **spec):
    """Serve `reqs` `batch` at a time; outputs, seconds (wall clock, and the process's CPU
    time), the engines' speculation stats."""
    outs, seconds, cpu_seconds, stats = [], 0.0, 0.0, []
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        blocks = sum(-(-(len(p) + max_new) // 16) for p in group)    # nobody is preempted
        engine = FastEngine(model, blocks, 16, max_num_seqs=len(group), **spec)
        for p in group:
            engine.add_request(p, max_new, stop_tokens=[])
        start, cpu_start = time.perf_counter(), time.process_time()
        outs += [r.output for r in engine.run()]
        seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - cpu_start
        stats.append(engine.spec)
    return outs, seconds, cpu_seconds, stats


def side_by_side(model, reqs, max_new: int, batch: int, repeat: int, **spec):
    """Plain and speculative runs of the same requests, taken in turn `repeat` times; each way
    keeps its fastest times (on a shared machine, the run least disturbed by other work), and
    its outputs only if every run gave the same (else None)."""
    runs = {"plain": [], "spec": []}
    for _ in range(repeat):
        runs["plain"].append(serve(model, reqs, max_new, batch))
        runs["spec"].append(serve(model, reqs, max_new, batch, **spec))

    def fastest(rs):
        outs = rs[0][0] if all(r[0] == rs[0][0] for r in rs) else None
        return outs, min(r[1] for r in rs), min(r[2] for r in rs), rs[0][3]
    return fastest(runs["plain"]), fastest(runs["spec"])


def row(name, plain, spec):
    (out0, s0, c0, _), (out1, s1, c1, st) = plain, spec
    tokens = sum(map(len, out0 or out1 or []))
    drafts, accepted = sum(s.draft_tokens for s in st), sum(s.accepted_tokens for s in st)
    per_step = sum(s.decode_tokens for s in st) / max(1, sum(s.decode_rows for s in st))
    return [name, f"{accepted / max(1, drafts):.0%}", f"{per_step:.2f}", f"{tokens / s0:.1f}",
            f"{tokens / s1:.1f}", f"{s0 / s1:.2f}x", f"{c0 / c1:.2f}x",
            "✓" if out0 is not None and out0 == out1 else "[red]✗[/red]"]


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.speculative",
                           description=__doc__.splitlines()[0])
    p.add_argument("--model", help="'smollm2', or a Llama 3 checkpoint (default: embedded)")
    p.add_argument("--k", type=cli.whole(1, 16), default=4, help="num_speculative_tokens")
    p.add_argument("--new-tokens", type=cli.whole(2), default=48)
    p.add_argument("--requests", type=cli.whole(1), default=16, help="the large batch")
    p.add_argument("--single", type=cli.whole(1), default=4,
                   help="requests served one at a time for batch 1")
    p.add_argument("--min-n", type=cli.whole(1, 4), default=1,
                   help="prompt_lookup_min: the shortest n-gram matched (the longest is 4)")
    p.add_argument("--threads", type=cli.whole(1), default=1)
    p.add_argument("--repeat", type=cli.whole(1), default=3,
                   help="plain and speculative runs taken in turn; each keeps its fastest")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    path = packaged_model_path("smollm2") if args.model == "smollm2" else args.model
    model, tok = load_model(path), load_tokenizer(path)
    console = Console(width=None if sys.stdout.isatty() else 160)
    t = Table(title=f"Speculative decoding (stage 7): n-gram drafts, k={args.k}, greedy")
    for col in ["prompts", "batch", "acceptance", "tokens/step", "plain tok/s", "spec tok/s",
                "speed-up", "CPU time", "same"]:
        t.add_column(col, justify="left" if col == "prompts" else "right")
    spec_options = dict(speculative="ngram", num_speculative_tokens=args.k,
                        prompt_lookup_min=args.min_n, prompt_lookup_max=max(args.min_n, 4))
    with torch.inference_mode():
        warm = prompts(model, tok, "lookup", 2)          # first calls are slow: not timed
        serve(model, warm, 8, 2)
        serve(model, warm, 8, 1, **spec_options)
        for kind in ("lookup", "chat"):
            for batch, count in ((1, args.single), (args.requests, args.requests)):
                reqs = prompts(model, tok, kind, count)
                r = row(kind, *side_by_side(model, reqs, args.new_tokens, batch, args.repeat,
                                            **spec_options))
                t.add_row(r[0], str(batch), *r[1:])
    t.caption = (f"{args.new_tokens} new tokens per request, stop tokens ignored; batch 1 serves "
                 f"{args.single} requests one after the other; the fastest of {args.repeat} "
                 f"runs each, taken in turn. FastEngine; {torch.get_num_threads()} torch "
                 f"thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.")
    console.print(t)


if __name__ == "__main__":
    raise SystemExit(main())
