"""One decode step's block bookkeeping: Python loops over a dict per layer vs CacheManager's arrays.

    python -m minipaged.benchmarks.bookkeeping            # 64 sequences x 16 layers, block 16
    python -m minipaged.benchmarks.bookkeeping --steps 50 # quicker

Per step and per layer, both implementations do what a decode step needs: end the requests
that finished and admit new ones in their slots, grow every running sequence by one token
(taking a block when its last one is full), and produce the int32 block table for the batch.
Both replay the same precomputed schedule of requests, so they do identical work.

The workload: prompt and output lengths drawn from exponential distributions with the ShareGPT
means the vLLM paper reports (161.31 input, 337.99 output tokens; Kwon et al. 2023, Fig. 11),
clipped to [1, 2048]; requests start at random points of their output so lengths are mixed
from the first step. The pool is sized from a KV budget for Llama 3.2 1B (16 layers, 8 KV
heads, head_dim 64, bf16). Bookkeeping never touches K/V values, so the managers here are built
with 1 head of width 1 to keep memory small; the block counts are the real ones.
"""

from __future__ import annotations

import math
import random
import time

import torch

from rich.console import Console
from rich.table import Table

from .. import cli
from ..cache_manager import CacheManager
from ..errors import OutOfBlocksError
from ..kv_budget import num_blocks_for_budget


# -- the baseline: paged-attention-minimal's CacheManager, behaviour kept ----------------------

class LoopCacheManager:
    """paged-attention-minimal's bookkeeping, rewritten with its data structures and loops kept:
    a dict of [(block, filled)] lists per batch slot, a set of free blocks drawn with
    `random.choice(list(set))`, a per-slot Python loop in `update`, and a block table rebuilt
    from lists on every call. Its KV pool is left out (not bookkeeping). `admit` is its
    constructor loop for one slot, after giving back the block it keeps on free."""

    def __init__(self, num_blocks, block_size, batch_size, prompt_lens, fast_pick=False):
        self.block_size, self.batch_size = block_size, batch_size
        self.block_table = {i: [] for i in range(batch_size)}
        self.free_blocks = set(range(num_blocks))
        self.fast_pick = fast_pick          # ablation: an O(1) random pick, all else as before
        self._free_list, self._rng = list(range(num_blocks)), random.Random(1)
        for i, t in enumerate(prompt_lens):
            self.admit(i, t)

    def admit(self, i, t):
        for index, _ in self.block_table[i]:          # the block free_memory kept back
            self._give_back(index)
        self.block_table[i] = []
        num_blocks_to_reserve = math.ceil(t / self.block_size)
        num_filled_positions = t % self.block_size
        for b in range(num_blocks_to_reserve):
            index = self.get_free_block()
            if b == num_blocks_to_reserve - 1:
                self.block_table[i].append((index, num_filled_positions))
            else:
                self.block_table[i].append((index, self.block_size))

    def get_free_block(self):
        if self.fast_pick:
            ids = self._free_list
            j = self._rng.randrange(len(ids))
            ids[j], ids[-1] = ids[-1], ids[j]
            return ids.pop()
        if len(self.free_blocks) == 0:
            raise Exception("No more free blocks. Implement scheduling and preemption.")
        index = random.choice(list(self.free_blocks))
        self.free_blocks.remove(index)
        return index

    def _give_back(self, index):
        (self._free_list.append if self.fast_pick else self.free_blocks.add)(index)

    def get_block_table(self):
        max_len = max(len(b) for b in self.block_table.values())
        block_table = [[-1] * max_len for _ in range(self.batch_size)]
        for i, b in self.block_table.items():
            for j, (index, _) in enumerate(b):
                block_table[i][j] = index
        return torch.tensor(block_table, dtype=torch.int32)

    def free_memory(self, index):
        blocks = self.block_table[index]
        if len(blocks) == 1:
            return
        for i, _ in blocks[1:]:
            self._give_back(i)
        self.block_table[index] = blocks[:1]

    def update(self, eos_reached, input_text_mask):
        for i, (eos, is_prompt) in enumerate(zip(eos_reached, input_text_mask)):
            if is_prompt:
                continue
            if eos:
                self.free_memory(i)
                continue
            old_index, n = self.block_table[i][-1]
            if n == self.block_size:
                self.block_table[i].append((self.get_free_block(), 1))
            else:
                self.block_table[i][-1] = (old_index, n + 1)


# -- the workload ---------------------------------------------------------------------------------

def make_schedule(batch, steps, seed=0, max_len=2048):
    """Initial prompt lengths and, per step, the slots whose request ends and the new prompts."""
    rng = random.Random(seed)

    def draw(mean):
        return min(max_len, max(1, round(rng.expovariate(1 / mean))))

    prompts, remaining = [], []
    for _ in range(batch):             # each request starts somewhere in the middle of its output
        output = draw(337.99)
        done = rng.randrange(output)
        prompts.append(draw(161.31) + done)
        remaining.append(output - done)
    events = []                           # per step: [(slot, new prompt length), ...]
    for _ in range(steps):
        ended = []
        for i in range(batch):
            remaining[i] -= 1
            if remaining[i] <= 0:
                ended.append((i, draw(161.31)))
                remaining[i] = draw(337.99)
        events.append(ended)
    return prompts, events


def run_loops(managers, batch, events):
    no_prompt = [False] * batch
    start = time.perf_counter()
    for ended in events:
        eos = [False] * batch
        for i, _ in ended:
            eos[i] = True
        for cm in managers:                            # its per-step update, every layer
            cm.update(eos, no_prompt)
        for cm in managers:
            for i, prompt in ended:
                cm.admit(i, prompt)
        for cm in managers:                            # asked for in every layer's forward
            cm.get_block_table()
    return time.perf_counter() - start


def run_minipaged(managers, batch, events, taken=None):
    seq_ids = torch.arange(batch)                      # one tensor per step, shared by layers
    taken = [] if taken is None else taken             # blocks each grow call took
    start = time.perf_counter()
    for ended in events:
        running = seq_ids
        if ended:
            done = {i for i, _ in ended}
            running = torch.tensor([i for i in range(batch) if i not in done])
        for cm in managers:
            taken.append(cm.grow(running, 1))
            for i, prompt in ended:
                cm.free(i)
                cm.reserve(i, prompt)
        for cm in managers:
            cm.block_table_for(seq_ids)
    return time.perf_counter() - start


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.bookkeeping",
                           description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=cli.whole(1), default=64)
    p.add_argument("--layers", type=cli.whole(1), default=16)
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--steps", type=cli.whole(1), default=400)
    p.add_argument("--kv-budget", type=cli.size, default="2GiB",
                   help="the KV memory the pool is sized from, all layers (default 2GiB)")
    p.add_argument("--repeats", type=cli.whole(1), default=3, help="best of this many runs each")
    args = p.parse_args(argv)

    bs = args.block_size
    num_blocks = num_blocks_for_budget(args.kv_budget, bs, n_kv_heads=8, head_dim=64,
                                       dtype=torch.bfloat16, n_layers=args.layers)
    if args.batch > num_blocks:
        p.error(f"--batch {args.batch} needs at least one block per sequence, but "
                f"--kv-budget holds {num_blocks:,} blocks per layer")
    prompts, events = make_schedule(args.batch, args.steps)
    max_blocks = math.ceil(2 * 2048 / bs)     # prompt + output, both <= 2048

    def fresh_minipaged():
        cms = [CacheManager(num_blocks, bs, 1, 1, args.batch, max_blocks, seed=layer)
               for layer in range(args.layers)]
        for cm in cms:
            for i, t in enumerate(prompts):
                cm.reserve(i, t)
        return cms

    console = Console()
    try:                # untimed, one layer: does the schedule fit the pool?
        run_minipaged(fresh_minipaged()[:1], args.batch, events)
        # Per-call cost of the two calls a model-facing cache makes per layer per step.
        cm, ids = fresh_minipaged()[0], torch.arange(args.batch)
        calls = {}
        for name, fn in [(f"grow({args.batch} seqs, 1)", lambda: cm.grow(ids, 1)),
                         (f"block_table_for({args.batch} seqs)", lambda: cm.block_table_for(ids))]:
            n = 200
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            calls[name] = (time.perf_counter() - t0) / n * 1e6
    except OutOfBlocksError as err:
        raise OutOfBlocksError(f"{err} (here: --kv-budget of {args.kv_budget:,} bytes for "
                               f"--batch {args.batch}; raise --kv-budget)") from None

    taken = []
    runners = {
        "Python loops, dicts": lambda: run_loops(
            [LoopCacheManager(num_blocks, bs, args.batch, prompts) for _ in range(args.layers)],
            args.batch, events),
        "the same, O(1) pick": lambda: run_loops(
            [LoopCacheManager(num_blocks, bs, args.batch, prompts, fast_pick=True)
             for _ in range(args.layers)], args.batch, events),
        "minipaged CacheManager": lambda: run_minipaged(fresh_minipaged(), args.batch, events,
                                                        taken),
    }
    random.seed(0)
    times = {name: [] for name in runners}
    for _ in range(args.repeats):         # interleaved, so a busy moment hits every row alike
        for name, run in runners.items():
            times[name].append(run())
    best = {name: min(t) for name, t in times.items()}

    crossings = sum(len(e) for e in events)
    table = Table(title=f"one decode step's block bookkeeping, paged-attention-minimal's Python "
                        f"loops over a dict per layer vs CacheManager's arrays: batch {args.batch} x "
                        f"{args.layers} layers, block {bs}, {num_blocks} blocks per layer, "
                        f"{args.steps} steps ({crossings} requests ended and replaced)")
    table.add_column("implementation")
    table.add_column("µs / step", justify="right")
    table.add_column("µs / layer-step", justify="right")
    table.add_column("loops ÷ this", justify="right")
    base = best["Python loops, dicts"]
    for name, seconds in best.items():
        per_step = seconds / args.steps * 1e6
        table.add_row(name, f"{per_step:,.0f}", f"{per_step / args.layers:,.1f}",
                      f"{base / seconds:.1f}x")
    console.print(table)
    console.print("per call, one layer: " + ", ".join(f"{k} {v:.1f} µs" for k, v in calls.items()))
    console.print(f"grow took {sum(taken) / len(taken):.2f} blocks per layer-step on average: "
                  f"only those sequences cross a block boundary")
    console.print(f"best of {args.repeats} interleaved runs each; torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    raise SystemExit(main())
