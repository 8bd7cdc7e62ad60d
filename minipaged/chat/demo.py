"""`python -m minipaged.chat --demo N`: N scripted conversations served at once by the engine,
with the pool drawn while their blocks interleave.

Each conversation asks its questions one after another; a follow-up question arrives as a new
request the moment the previous answer is finished, so conversations at different turns share
one batch (continuous batching). The engine frees a request's blocks when it finishes, but
with prefix caching (stage 6) their full blocks stay cached: a follow-up finds its history's
blocks and prefills only the rest. `Conversation` (the interactive chat) keeps them outright.
"""

from __future__ import annotations

import torch
from rich.live import Live
from rich.markup import escape

from ..api import Engine
from ..formats import chat_format, check_pair, load_model, load_tokenizer
from ..sizing import pool_blocks
from ..viz.pool import seq_color
from ..viz.terminal import pool_grid, stats_table
from .conversation import format_pieces
from .options import model_path

SCRIPTS = [
    ["what is a block table?", "and what is paged attention?"],
    ["what is a KV cache?", "why does it waste memory?"],
    ["what is internal fragmentation?", "how do blocks reduce it?"],
    ["what is continuous batching?", "what is preemption?"],
    ["what is vLLM?", "what is a block?"],
    ["hello!", "what is paging?"],
]
MARKS = "abcdefghijklmnopqrstuvwxyz"


def run_demo(args, console) -> int:
    n = args.demo
    path = model_path(args.model)
    model = load_model(path, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(path)
    check_pair(model, tokenizer)
    fmt = chat_format(tokenizer)
    prefix, opening, closing = format_pieces(fmt, args.system)
    # Room for every conversation's two turns, or less if --kv-budget holds less (the engine
    # then preempts); a larger budget is not used.
    per_conv = min(model.args.max_seq_len, 2 * args.max_new_tokens + 128)
    num_blocks = n * -(-per_conv // args.block_size)
    if args.kv_budget is not None:
        num_blocks = min(num_blocks, pool_blocks(model.args, next(model.parameters()).dtype,
                                                 args.block_size, kv_budget=args.kv_budget,
                                                 kv_dtype=args.kv_dtype))
    engine = Engine(model, num_blocks, args.block_size, max_num_seqs=n, seed=args.seed,
                    prefix_caching=True, kv_dtype=args.kv_dtype)

    history = {c: list(prefix) for c in range(n)}           # conversation -> tokens so far
    asked = {c: 0 for c in range(n)}                        # questions sent so far
    conv_of, transcript = {}, {c: [] for c in range(n)}

    def ask(c):
        question = SCRIPTS[c % len(SCRIPTS)][asked[c]]
        history[c] += fmt.encode_message({"role": "user", "content": question}) + opening
        req = engine.add_request(history[c], args.max_new_tokens, args.temperature,
                                 args.top_p, stop_tokens=tokenizer.stop_tokens)
        conv_of[req.req_id] = c
        transcript[c].append([question, req])
        asked[c] += 1

    def owners():
        return {r.seq_id: (f"conv {conv_of[r.req_id]}", seq_color(conv_of[r.req_id]),
                           MARKS[conv_of[r.req_id] % 26]) for r in engine.scheduler.running}

    for c in range(n):
        ask(c)
    cm = engine.cache.managers[0]
    busiest, busiest_view = -1, None
    with Live(console=console, auto_refresh=False, transient=True) as live:
        while engine.has_unfinished():
            done = engine.step()
            used = cm.num_used_blocks
            if used > busiest:         # keep the picture with the most blocks in use
                busiest = used
                busiest_view = pool_grid(cm, owners(), title=f"step {engine.step_count}, layer 0")
            live.update(pool_grid(cm, owners(), title=f"step {engine.step_count}, layer 0"),
                        refresh=True)
            for r in done:
                c = conv_of[r.req_id]
                history[c] += r.output + closing
                if asked[c] < len(SCRIPTS[c % len(SCRIPTS)]):
                    ask(c)

    for c in range(n):
        console.print(f"[bold {seq_color(c)}]conv {c}[/]")
        for question, req in transcript[c]:
            console.print(f"  you> {escape(question)}")
            console.print(f"  model> {escape(tokenizer.decode(req.output))}", highlight=False)
    console.print("the pool when it was busiest: every conversation's blocks side by side, "
                  "scattered, none reserved ahead")
    console.print(busiest_view)
    st = engine.stats
    console.print(stats_table([
        ("conversations / requests", f"{n} / {len(engine.requests)}"),
        ("engine steps", str(st.steps)),
        ("largest batch (requests in one step)", str(st.running_max)),
        ("tokens generated", str(st.generated_tokens)),
        ("tokens prefilled", str(st.prefill_tokens)),
        ("tokens found in the prefix cache (follow-ups' histories)", str(st.cached_tokens)),
        ("preemptions", str(st.preemptions)),
        ("tokens/s", f"{st.generated_tokens / max(st.seconds, 1e-9):.0f}"),
        ("blocks free at the end", f"{engine.cache.num_free_blocks} of {engine.cache.num_blocks}"),
    ], title="the engine's run"))
    return 0
