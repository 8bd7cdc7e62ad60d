"""Stage 9 measured: tokens/s and KV capacity per rank at N ranks, and what rank 0's messages
cost, in one run.

    python -m minipaged.benchmarks.tensor_parallel                  # embedded model, N = 1, 2
    python -m minipaged.benchmarks.tensor_parallel --model smollm2 --ranks 1 3

For each N, N processes (gloo on a CPU) each load their shard and, inside the group, time one
all-reduce of a decode step's activations (1 token x dim floats, as each layer does twice);
then rank 0 serves --prompts greedy prompts of --prompt-len random tokens for --tokens new
tokens each on the one engine (`tp_engine.TensorParallelEngine`), the other ranks following
its messages (the process start and the weights' transfer are not counted). Rank 0 records
each model call's `StepMessage`: how many, their pickled size (mean and largest) and the time
it spends sending them and hearing the acknowledgements (one broadcast and one all-gather a
call). At N = 1 the messages are built but go nowhere. KV capacity: the blocks of 16 tokens a
--kv-budget holds on each rank. Every N must give N = 1's tokens (checked). All N share the
same cores: on one CPU, expect N > 1 to be slower; the point of the split is memory per
device, on GPUs.
"""

from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from .. import cli
from ..formats import load_model, packaged_model_path
from ..kv_budget import bytes_per_block
from ..sizing import pool_blocks
from ..ranks import run_ranks
from ..tensor_parallel import check_world_size, load_shard, rank_state_dict
from ..tp_engine import LocalWorkers, TensorParallelEngine
from ..tp_group import Group, follow


def _timed(fn, repeats: int) -> float:
    """Mean seconds of fn() over `repeats` calls, after 10 untimed ones, every rank together."""
    for _ in range(10):
        fn()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


class Timed:
    """A transport that counts what goes through it: the pickled size of each message, and the
    seconds spent sending (the size is taken outside the timed part)."""

    def __init__(self, transport):
        self.transport, self.sizes, self.seconds, self.sizing = transport, [], 0.0, 0.0

    def start(self, spec) -> None:
        self.transport.start(spec)

    def send(self, message) -> None:
        t = time.perf_counter()
        self.sizes.append(len(pickle.dumps(message)))
        start = time.perf_counter()
        self.sizing += start - t
        self.transport.send(message)
        self.seconds += time.perf_counter() - start

    def close(self) -> None:
        self.transport.close()


def _measure(rank, world_size, device, args, states, prompts, tokens, repeats) -> dict:
    """One rank: the all-reduce's time, then the prompts served (rank 0) or followed."""
    model = load_shard(args, rank, world_size, states[rank], device)
    x = torch.randn(1, 1, args.dim, dtype=next(model.parameters()).dtype)
    all_reduce_s = _timed((lambda: dist.all_reduce(x)) if world_size > 1 else (lambda: None),
                          repeats)
    if rank:
        follow(model, device)
        return {}
    workers = Timed(Group(device) if world_size > 1 else LocalWorkers([]))
    engine = TensorParallelEngine(model, num_blocks=pool_blocks(model.args, x.dtype, 16, lengths=[
        len(p) + tokens for p in prompts]), block_size=16, max_num_seqs=len(prompts),
        workers=workers)
    for p in prompts:
        engine.add_request(p, tokens, stop_tokens=[])
    start = time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - start - workers.sizing
    engine.close()
    sizes = workers.sizes
    return {"seconds": seconds, "all_reduce_s": all_reduce_s, "steps": engine.step_count,
            "messages": len(sizes), "send_s": workers.seconds / max(1, len(sizes)),
            "mean_bytes": sum(sizes) / max(1, len(sizes)), "max_bytes": max(sizes, default=0),
            "outputs": [r.output for r in engine.requests]}


@cli.program
def main(argv=None) -> int:
    """Serve the same prompts on 1 to N processes; tokens/s, KV capacity, message costs."""
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.tensor_parallel",
                           description=main.__doc__)
    p.add_argument("--model", default="embedded", help="embedded or smollm2")
    p.add_argument("--ranks", type=cli.whole(1), nargs="+", default=[1, 2])
    p.add_argument("--prompts", type=cli.whole(1), default=4)
    p.add_argument("--prompt-len", type=cli.whole(1), default=64)
    p.add_argument("--tokens", type=cli.whole(1), default=64, help="new tokens per prompt")
    p.add_argument("--kv-budget", type=cli.size, default=64 * 2**20,
                   help="KV memory per rank, for the capacity column (default 64MiB)")
    p.add_argument("--repeats", type=cli.whole(1), default=200)
    a = p.parse_args(argv)
    if a.model not in ("embedded", "smollm2"):
        p.error(f"--model is embedded or smollm2, not {a.model!r}")
    model = load_model(None if a.model == "embedded" else packaged_model_path(a.model),
                       dtype=torch.float32)
    for n in a.ranks:
        check_world_size(model.args, n)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.args.vocab_size, (a.prompt_len,), generator=gen).tolist()
               for _ in range(a.prompts)]
    table = Table(title=f"{a.model}: {a.prompts} prompts of {a.prompt_len} tokens, {a.tokens} "
                        f"new tokens each, fp32, every rank on the same CPU")
    for col in ("ranks", "tokens/s", "vs 1 rank", "KV bytes per block (16 tokens) per rank",
                f"blocks per rank in {a.kv_budget / 2**20:g} MiB", "all-reduce (dim floats)",
                "messages (model calls) / steps", "message: mean / largest",
                "send + ack per message", "same tokens"):
        table.add_column(col, justify="right")
    first = None
    for n in a.ranks:
        states = [rank_state_dict(model, r, n) for r in range(n)]
        res = run_ranks(_measure, n, (model.args, states, prompts, a.tokens, a.repeats),
                        threads=max(1, torch.get_num_threads() // n))[0]
        rate = a.prompts * a.tokens / res["seconds"]
        first = first or (rate, res["outputs"])
        args = model.args
        block = bytes_per_block(16, args.n_kv_heads // n, args.head_dim, torch.float32,
                                args.n_layers)                  # all layers, this rank's heads
        table.add_row(str(n), f"{rate:.1f}", f"{rate / first[0]:.2f}x", f"{block:,}",
                      f"{a.kv_budget // block:,}",
                      f"{res['all_reduce_s'] * 1e6:.0f} µs" if n > 1 else "-",
                      f"{res['messages']} / {res['steps']}",
                      f"{res['mean_bytes']:.0f} / {res['max_bytes']} bytes",
                      f"{res['send_s'] * 1e6:.0f} µs" if n > 1 else "-",
                      str(res["outputs"] == first[1]))
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
