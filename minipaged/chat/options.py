"""The chat's command line: its arguments, each refused while it is read (before the slow model
load) when it is out of range."""

from __future__ import annotations

from .. import cli
from ..formats import PACKAGED_MODELS, packaged_model_path


def build_parser():
    p = cli.ArgumentParser(prog="python -m minipaged.chat", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Llama 3 checkpoint folder, a .gguf file, or "
                   f"{' / '.join(PACKAGED_MODELS)} (default: the embedded model)")
    p.add_argument("--prompt", help="send one message, print the reply and exit")
    p.add_argument("--system", help="a system prompt for the conversation")
    p.add_argument("--cache", choices=["paged", "contiguous"], default="paged",
                   help="paged (the default) or stage 1's contiguous cache, to compare")
    p.add_argument("--block-size", type=cli.whole(1), default=16,
                   help="tokens per block (default 16)")
    p.add_argument("--kv-budget", type=cli.size, help="memory for the KV pool, all layers (e.g. "
                   "4MiB; default, and at most: room for one full context per conversation)")
    p.add_argument("--demo", type=cli.whole(1), metavar="N", help="run N scripted "
                   "conversations at once on the stage-5 engine and draw how their blocks "
                   "interleave in the pool")
    p.add_argument("--no-status", action="store_true", help="no status line after each reply")
    p.add_argument("--max-new-tokens", type=cli.whole(1), default=200)
    p.add_argument("--temperature", type=cli.number(at_least=0), default=0.0,
                   help="0 is greedy (the default)")
    p.add_argument("--top-p", type=cli.number(above=0, at_most=1), default=0.9)
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-dtype", choices=["int8"], help="store the paged KV blocks as int8 "
                   "codes with their scales (stage 4b; default: the model's dtype)")
    p.add_argument("--tensor-parallel", type=cli.whole(1), default=1, metavar="N",
                   help="split the model and its KV blocks by heads over N processes (stage 9; "
                   "N must divide the model's KV heads; default 1)")
    return p


def model_path(name):
    """--model: a checkpoint path, or the name of a model a package ships ("smollm2")."""
    return packaged_model_path(name) if name in PACKAGED_MODELS else name
