"""Stage 7's benchmark: speculative decoding (n-gram drafts) against plain decoding, side by side.

    python -m minipaged.benchmarks.speculative                  # embedded model (about 30 s)
    python -m minipaged.benchmarks.speculative --model smollm2  # SmolLM2-135M-Instruct

Two kinds of prompt, each at batch 1 (one request at a time) and at 16 requests at once:

  * lookup-friendly: a question asked again after the model answered it once, a text to
    repeat or edit, code to continue — the continuation reuses the prompt's tokens, so n-gram
    lookup finds drafts the model agrees with;
  * open chat: short questions, where the answer shares little with the prompt.

Three ways serve the same requests on the speed layer (`FusedLlama`, whose products stream the
weights once for all the rows of a step — so a verify pass over a few tokens costs about what a
plain step does at batch 1 — on `FastEngine`, which takes stage 7's options; `--stage-model`:
stage 1's `Llama` instead, whose products cost clearly more for a few rows than for one; the
step costs printed below the table say how much), greedy: plain decoding, speculation with
`draft_policy="fixed"` (every step drafts up to k) and with `draft_policy="adaptive"` (drafts
that adapt to their acceptance and to the batch, the default). Their tokens must be the same
(column "same").
The ways are taken in turn `--repeat` times, and each keeps its fastest time.
Columns: per policy, acceptance rate (accepted drafts / drafts run), tokens a decoding sequence
gains per step (1.0 without speculation) and tokens/s; plain tokens/s; each policy's speed-up
over plain, and the adaptive one's in the process's CPU time (plain's over its): on a machine
other work shares, the wall clock also counts the time spent waiting for a core, CPU time does
not. Below the table, the step costs the adaptive policy measured on the model (a verify pass
with one and with k drafts a row, over a plain step), and how often a match of n tokens
proposed the right next token (why lookup needs a match of `prompt_lookup_min` = 2).
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
from ..draft_policy import measured_costs
from ..fast import FastEngine, FusedLlama
from ..formats import chat_format, load_model, load_tokenizer, packaged_model_path
from ..speculative import ngram_propose

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


def cost_ratios(model, k: int, requests: int) -> list[str]:
    """The step costs the adaptive policy measures on `model` (as the benchmark's engines do),
    as ratios to a plain step of the same batch."""
    engine = FastEngine(model, 64, 16, max_num_seqs=requests, speculative="ngram",
                        num_speculative_tokens=k)
    costs = measured_costs(engine)
    out = []
    for b in costs.batches:
        plain, fixed, per, seg = costs.at(b)
        out.append(f"batch {b}: {(plain + fixed + b * per) / plain:.2f}x with 1 draft a row, "
                   f"{(plain + fixed + b * k * per) / plain:.2f}x with {k}"
                   + (f", {(plain + fixed + (b + 1) // 2 * k * per + seg) / plain:.2f}x with {k} "
                      "on every other row" if b > 1 else ""))
    return out


def side_by_side(model, reqs, max_new: int, batch: int, repeat: int, **spec):
    """Plain runs and speculative runs under each policy, of the same requests, taken in turn
    `repeat` times; each way keeps its fastest times (on a shared machine, the run least
    disturbed by other work), and its outputs only if every run gave the same (else None)."""
    ways = {"plain": {}, **{p: dict(spec, draft_policy=p) for p in POLICIES}}
    runs = {way: [] for way in ways}
    for _ in range(repeat):
        for way, options in ways.items():
            runs[way].append(serve(model, reqs, max_new, batch, **options))

    def fastest(rs):
        outs = rs[0][0] if all(r[0] == rs[0][0] for r in rs) else None
        return outs, min(r[1] for r in rs), min(r[2] for r in rs), rs[0][3]
    return [fastest(runs[way]) for way in ways]


POLICIES = ("fixed", "adaptive")


def first_draft_kept(reqs, outs) -> dict:
    """n -> (kept, tried): at every position of the greedy outputs, the longest n-gram match
    (n from 4 down to 1) that lookup finds, and whether its first draft is the token that
    came: how likely a match of each length is."""
    tried = {n: [0, 0] for n in range(1, 5)}
    for prompt, out in zip(reqs, outs):
        seq = prompt + out
        for t in range(len(prompt), len(seq)):
            for n in range(4, 0, -1):
                d = ngram_propose(seq[:t], 1, n, n)
                if d:
                    tried[n][0] += d[0] == seq[t]
                    tried[n][1] += 1
                    break
    return tried


def row(name, plain, *policies):
    out0, s0, c0, _ = plain
    tokens = sum(map(len, out0 or []))
    cells, speedups = [], []
    for out, s, c, st in policies:
        drafts, accepted = sum(x.draft_tokens for x in st), sum(x.accepted_tokens for x in st)
        per_step = sum(x.decode_tokens for x in st) / max(1, sum(x.decode_rows for x in st))
        cells += [f"{accepted / max(1, drafts):.0%}", f"{per_step:.2f}", f"{tokens / s:.1f}"]
        speedups.append(f"{s0 / s:.2f}x")
    same = out0 is not None and all(p[0] == out0 for p in policies)
    return [name, f"{tokens / s0:.1f}", *cells, *speedups, f"{c0 / policies[-1][2]:.2f}x",
            "✓" if same else "[red]✗[/red]"]


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
    p.add_argument("--min-n", type=cli.whole(1, 4), default=2,
                   help="prompt_lookup_min: the shortest n-gram matched (the longest is 4)")
    p.add_argument("--threads", type=cli.whole(1), default=1)
    p.add_argument("--stage-model", action="store_true",
                   help="serve on stage 1's Llama instead of the speed layer's FusedLlama")
    p.add_argument("--repeat", type=cli.whole(1), default=3,
                   help="plain and speculative runs taken in turn; each keeps its fastest")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    path = packaged_model_path("smollm2") if args.model == "smollm2" else args.model
    model, tok = load_model(path), load_tokenizer(path)
    if not args.stage_model:
        model = FusedLlama(model)                        # the speed layer's products
    console = Console(width=None if sys.stdout.isatty() else 160)
    t = Table(title=f"Speculative decoding (stage 7): n-gram drafts, k={args.k}, greedy")
    columns = [f"{p} {c}" for p in POLICIES for c in ("acceptance", "tokens/step", "tok/s")]
    for col in ["prompts", "batch", "plain tok/s", *columns,
                *(f"{p} speed-up" for p in POLICIES), "adaptive CPU time", "same"]:
        t.add_column(col, justify="left" if col == "prompts" else "right")
    spec_options = dict(speculative="ngram", num_speculative_tokens=args.k,
                        prompt_lookup_min=args.min_n, prompt_lookup_max=max(args.min_n, 4))
    with torch.inference_mode():
        warm = prompts(model, tok, "lookup", 2)          # first calls are slow: not timed
        serve(model, warm, 8, 2)
        serve(model, warm, 8, 1, **spec_options)
        costs = cost_ratios(model, args.k, args.requests)
        matches = {}
        for kind in ("lookup", "chat"):
            for batch, count in ((1, args.single), (args.requests, args.requests)):
                reqs = prompts(model, tok, kind, count)
                ways = side_by_side(model, reqs, args.new_tokens, batch, args.repeat,
                                    **spec_options)
                r = row(kind, *ways)
                t.add_row(r[0], str(batch), *r[1:])
                matches[kind] = first_draft_kept(reqs, ways[0][0] or [])
    t.caption = (f"{args.new_tokens} new tokens per request, stop tokens ignored; batch 1 serves "
                 f"{args.single} requests one after the other; the fastest of {args.repeat} "
                 f"runs each, taken in turn. FastEngine on {type(model).__name__}; {torch.get_num_threads()} torch "
                 f"thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.")
    console.print(t)
    console.print("The adaptive policy's measured step costs (a verify pass over a plain step): "
                  + "; ".join(costs))
    for kind, tried in matches.items():
        console.print(f"First draft kept, by the length of the n-gram match ({kind}, the larger "
                      "batch's plain tokens): " + ", ".join(
                          f"{n}: {k / t:.0%} of {t}" for n, (k, t) in tried.items() if t))


if __name__ == "__main__":
    raise SystemExit(main())
