"""The chat's command line: its arguments, and the checks made before the (slow) model load."""

from __future__ import annotations

import argparse
import re

from ..errors import MiniPagedError
from ..formats import PACKAGED_MODELS, packaged_model_path

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


def check_args(args):
    """Refuse bad numbers before the (slow) model load."""
    if args.max_new_tokens < 1:
        raise MiniPagedError("--max-new-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise MiniPagedError(f"need --temperature >= 0 and 0 < --top-p <= 1 (top_p); got "
                             f"{args.temperature} and {args.top_p}")
    if args.block_size < 1 or (args.demo is not None and args.demo < 1):
        raise MiniPagedError("--block-size and --demo must be positive numbers")
