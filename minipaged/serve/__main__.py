"""`python -m minipaged.serve`: an OpenAI-compatible server on the engine (/v1/completions,
/v1/chat/completions, /v1/models; /tokenize, /detokenize, /health, /version, /metrics), and the
pool drawn live at http://HOST:PORT/ ."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .. import cli
from ..errors import UsageError
from ..formats import PACKAGED_MODELS

try:                                   # the serve extra: fastapi, uvicorn
    from .app import MAX_BODY_BYTES
    from .server import UvicornServer, build, config, listen
    MISSING = None
except ImportError as e:
    MISSING = e.name


def install_hint(root: Path = Path(__file__).resolve().parents[2]) -> str:
    """How to add the serve extra: in a source checkout (`root` holds pyproject.toml), the
    editable install of the extra; in an installed copy, the packages the extra adds."""
    if (root / "pyproject.toml").is_file():
        return f"pip install -e '{root}[serve]'"
    return "pip install 'fastapi>=0.110' 'uvicorn>=0.29' (the serve extra's packages)"


def build_parser():
    p = cli.ArgumentParser(prog="python -m minipaged.serve", description=" ".join(__doc__.split()))
    p.add_argument("--model", help="a Llama 3 checkpoint folder, a .gguf file, or "
                   f"{' / '.join(PACKAGED_MODELS)} (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: "
                   "127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=cli.whole(0, 65535), default=8000,
                   help="the TCP port to listen on (default: 8000; 0 for a free one)")
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--num-blocks", type=cli.whole(1), help="blocks per layer in the KV pool")
    p.add_argument("--kv-budget", type=cli.size, help="memory for the KV pool, all layers "
                   "(e.g. 4MiB; default: four full contexts)")
    p.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--max-num-seqs", type=cli.whole(1), default=64,
                   help="requests running at once, at most")
    p.add_argument("--max-num-batched-tokens", type=cli.whole(1),
                   help="a token budget per step (chunked prefill; default: none)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-model-len", type=cli.whole(2), help="tokens a request may hold "
                   "(default: the model's context, at most 4096)")
    p.add_argument("--max-waiting", type=cli.whole(1), default=64,
                   help="requests that may wait for the engine; past it, 503")
    p.add_argument("--max-body-bytes", type=cli.size, default=None,
                   help="a request body past this size is refused with 413 (default: 1MiB)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-dtype", choices=["int8"], help="store the KV blocks as int8 codes with "
                   "their scales (stage 4b; default: the model's dtype)")
    p.add_argument("--tensor-parallel", type=cli.whole(1), default=1, metavar="N",
                   help="split the model and its KV blocks by heads over N processes (stage 9; "
                   "N must divide the model's KV heads; default 1)")
    p.add_argument("--disaggregated", action="store_true",
                   help="prefill on one engine, in a process of its own, and decode on another; "
                   "each prompt's KV blocks move between them (stage 9b)")
    p.add_argument("--drain-seconds", type=cli.number(at_least=0), default=5.0,
                   help="after Ctrl-C or SIGTERM, how long answers in flight may finish "
                   "before they are aborted")
    return p


@cli.program
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if MISSING:
        raise UsageError(f"the server needs the serve extra ({MISSING} is missing): "
                         f"{install_hint()}")
    sock = listen(args.host, args.port)
    loop, app, _, _ = build(args.model, getattr(torch, args.dtype), args.block_size,
                            args.num_blocks, args.kv_budget, args.preemption, args.max_num_seqs,
                            args.max_num_batched_tokens, not args.no_prefix_caching,
                            args.max_model_len, args.max_waiting, kv_dtype=args.kv_dtype,
                            max_body_bytes=args.max_body_bytes or MAX_BODY_BYTES,
                            tensor_parallel=args.tensor_parallel,
                            disaggregated=args.disaggregated)
    e = loop.engine
    print(f"minipaged serving {args.model or 'embedded'}: {e.cache.num_blocks} blocks of "
          f"{e.cache.block_size} tokens, context {e.max_seq_len}; the pool live at "
          f"http://{args.host}:{sock.getsockname()[1]}/", file=sys.stderr, flush=True)
    settings = config(app, timeout_graceful_shutdown=args.drain_seconds + 5)
    loop.start()
    try:
        UvicornServer(settings, loop, args.drain_seconds).run(sockets=[sock])
    finally:
        loop.stop()
        sock.close()
        if hasattr(e, "close"):         # --tensor-parallel, --disaggregated: the other
                                        # processes end with the server
            e.close()
    print("minipaged serve: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
