"""What sharing blocks saves in beam search (stage 6b), beside parallel sampling (stage 6), in
one run, printed as one table.

    python -m minipaged.benchmarks.beam_savings                 # embedded model, ~2 min on one core
    python -m minipaged.benchmarks.beam_savings --random-model  # same shape, random weights

Each prompt of a ShareGPT-like trace (stage 4's lengths / --scale, random token ids) is searched
with beam widths 2, 4 and 6 for exactly its drawn output length (no stop token, length penalty
1). After every forward, the pool's blocks per layer are counted two ways: held, with the beams
sharing blocks as stage 6b shares them; and the same beams without sharing, each holding its
own copy of its whole history (the sum of the beams' table lengths). The saving is
1 - held / unshared over all steps of all prompts. Every search runs on the contiguous cache
too, which must find the same hypotheses (checked; a mismatch is printed in red).

Beside it, stage 6's parallel sampling on the same trace (`sharing_savings.parallel_sampling`:
n samples sharing only their prompt's blocks, on the engine). The vLLM paper (Kwon et al.,
SOSP 2023) reports 6-30% saved for parallel sampling and 37-66% for beam search.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from .. import cli
from ..beams import BeamSearch
from .serving import _load, add_model_options, sharegpt_like_trace, trace_means
from .sharing_savings import parallel_sampling

PAPER_BEAM, PAPER_PARALLEL = "37-66%", "6-30%"


@dataclass
class BeamSavings:
    beam_width: int
    held: list[int]             # blocks per layer after every forward, all prompts in turn
    unshared: list[int]         # the same beams, each with its own copy
    per_prompt: list[float]     # the saving of each prompt's search
    same: bool                  # paged and contiguous found the same hypotheses
    seconds: float

    @property
    def saved(self) -> float:
        return 1 - sum(self.held) / sum(self.unshared)


def beam_savings(model, trace, beam_width: int, block_size: int = 16,
                 check: bool = True) -> BeamSavings:
    """Search every (prompt, output length) of `trace` with `beam_width` beams on the paged
    cache, counting blocks after every forward; with `check`, on the contiguous cache too."""
    held, unshared, per_prompt, same = [], [], [], True
    start = time.perf_counter()
    for prompt, out_len in trace:
        search = BeamSearch(model, prompt, beam_width, out_len, block_size=block_size,
                            stop_tokens=[])
        found = search.run()
        on, off = zip(*search.blocks_held)
        held += on
        unshared += off
        per_prompt.append(1 - sum(on) / sum(off))
        if check:
            other = BeamSearch(model, prompt, beam_width, out_len, cache="contiguous",
                               stop_tokens=[]).run()
            same &= [t for t, _ in found] == [t for t, _ in other]
    return BeamSavings(beam_width, held, unshared, per_prompt, same,
                       time.perf_counter() - start)


def table(beams, par, caption) -> Table:
    t = Table(title="Sharing KV blocks: beam search (stage 6b) beside parallel sampling (6)",
              caption=caption)
    for col in ["case", "KV blocks mean (unshared → shared)", "peak", "saved (mean)",
                "saved per prompt", "paper", "same tokens", "wall s"]:
        t.add_column(col, justify="left" if col == "case" else "right")
    mark = {True: "✓", False: "[red]✗[/red]"}
    for b in beams:
        n = len(b.held)
        t.add_row(f"beam search, width {b.beam_width}",
                  f"{sum(b.unshared) / n:.1f} → {sum(b.held) / n:.1f}",
                  f"{max(b.unshared)} → {max(b.held)}", f"{b.saved:.1%}",
                  f"{min(b.per_prompt):.0%}-{max(b.per_prompt):.0%}", PAPER_BEAM,
                  mark[b.same], f"{b.seconds:.1f}")
    for n, off, on, t_off, t_on, same in par:
        t.add_row(f"parallel sampling, n={n}",
                  f"{off.mean_used_blocks:.1f} → {on.mean_used_blocks:.1f}",
                  f"{off.peak_used_blocks} → {on.peak_used_blocks}",
                  f"{1 - on.mean_used_blocks / off.mean_used_blocks:.1%}", "", PAPER_PARALLEL,
                  mark[same], f"{t_off + t_on:.1f}")
    return t


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.beam_savings",
                           description=" ".join(__doc__.split("\n\n")[0].split()))
    add_model_options(p)
    p.add_argument("--requests", type=cli.whole(1), default=12, help="prompts of the trace")
    p.add_argument("--scale", type=cli.number(above=0), default=4.0,
                   help="divide ShareGPT's lengths by this")
    p.add_argument("--widths", type=cli.whole(1), nargs="+", default=[2, 4, 6],
                   help="beam widths, and parallel samples per prompt")
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--no-parallel", action="store_true", help="skip parallel sampling")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 180)
    model = _load(args)
    trace, max_seq_len = sharegpt_like_trace(args.requests, args.scale,
                                             model.args.vocab_size - 256)
    with torch.inference_mode():
        beams = [beam_savings(model, trace, w, args.block_size) for w in args.widths]
        par = [] if args.no_parallel else \
            parallel_sampling(model, trace, args.block_size, max_seq_len, args.widths)
    caption = (f"{len(trace)} ShareGPT-like prompts (lengths / {args.scale:g}: "
               f"{trace_means(trace)}); block {args.block_size}; KV blocks per layer. Beam "
               f"search: one prompt at a time, no stop token, length penalty 1, blocks counted "
               f"after every forward; unshared = each beam its own copy. "
               f"Parallel sampling: stage 6's engine, temperature 1, mean over busy steps. "
               f"Same tokens: paged = contiguous (beams), shared = independent (samples). "
               f"Paper: Kwon et al. 2023 (vLLM). {torch.get_num_threads()} torch thread(s), "
               f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.")
    console.print(table(beams, par, caption))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
