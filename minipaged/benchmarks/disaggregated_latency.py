"""Stage 9b's benchmark: one trace served colocated (one engine, chunked prefill) and
disaggregated (the prefill engine in a process of its own), each step of the engine the chats
decode on timed, and the worst time between two tokens of a chat.

    python -m minipaged.benchmarks.disaggregated_latency          # the table (embedded model)
    python -m minipaged.benchmarks.disaggregated_latency --save   # and record the run drawn

The trace is stage 5b's (`chunked_latency.chats_and_long_prompts`): `--chats` conversations
decode, and every `--long-every` steps a prompt of `--long-prompt` tokens arrives. A step here
is a step of the engine the chats decode on, in which a model ran; "a long prompt arrives at
step 20" means the same in both runs. Colocated, that engine runs the long prompt too, in
chunks of `--budget` tokens beside the decodes (stage 5b). Disaggregated, it only loads the
prompt's blocks from the prefill process and computes its last block; the prefill runs in the
other process at the same time.

The clock is the wall clock: the two processes run at once, and the decode process's own CPU
time would not show what the prefill process takes from it. With fewer free cores than
processes (two processes, one torch thread each), the prefill process competes with the decode
process for a core, and the decode steps it overlaps slow down: disaggregation then moves the
stall instead of removing it. The runs alternate `--repeats` times (default 3), each on fresh
engines; the table shows each figure's median, the timeline the last round.

`--save` writes the last round's timelines, with the CPU's name, to this module's
`disaggregated_latency.json` (what notebook 09b draws) and the figure to
assets/disaggregated_timeline.png (the benchmarks page's).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .. import cli
from ..api import Engine
from ..disaggregated_engine import DisaggregatedEngine
from ..errors import MiniPagedError
from ..fast.kernels import cpu_name
from ..formats import load_model
from ..viz.disaggregation import plot_step_times
from .chunked_latency import chats_and_long_prompts

RECORDED = Path(__file__).with_suffix(".json")
FIGURE = Path(__file__).resolve().parents[2] / "assets" / "disaggregated_timeline.png"


@dataclass
class Timeline:
    """One run, as the timeline draws it: each step of the chats' engine (when it began and how
    long it took, in seconds from the run's start; the tokens it ran), when each long prompt
    arrived, and the gaps between two tokens of a chat."""
    name: str
    step_start: list
    step_seconds: list
    step_tokens: list
    arrivals: list
    gaps: list
    outputs: list

    @property
    def worst_gap(self) -> float:
        return max(self.gaps)


def serve(engine, trace, chats: int, name: str, clock=time.perf_counter) -> Timeline:
    """Run `trace` ([(prompt, new tokens, arrival step)], chats first) on `engine`, adding each
    request when the engine has run its arrival step; time every step that ran a model."""
    stamps, starts, seconds, tokens, arrivals = {}, [], [], [], []
    engine.callback = lambda event, req_id, token, cache: \
        stamps.setdefault(req_id, []).append(clock())
    order = sorted(range(len(trace)), key=lambda i: trace[i][2])
    reqs, begin = {}, clock()
    while order or engine.has_unfinished():
        while order and trace[order[0]][2] <= len(starts):
            i = order.pop(0)
            reqs[i] = engine.add_request(trace[i][0], trace[i][1], stop_tokens=[])
            if i >= chats:
                arrivals.append(clock() - begin)
        start = clock()
        engine.step()
        if engine.tokens_run:                           # a model ran (not a wait for blocks)
            starts.append(start - begin)
            seconds.append(clock() - start)
            tokens.append(sum(engine.tokens_run.values()))
    gaps = [b - a for i in range(chats) for a, b in zip(stamps[reqs[i].req_id],
                                                        stamps[reqs[i].req_id][1:])]
    return Timeline(name, starts, seconds, tokens, arrivals, gaps,
                    [reqs[i].output for i in range(len(trace))])


def colocated(model, trace, chats, budget, block_size) -> Timeline:
    """One engine: the chats' decodes and the long prompts' chunks share its steps (prefix
    caching on, as on the disaggregated decode engine: the one difference is where prefill
    runs)."""
    engine = Engine(model, pool_size(trace, block_size), block_size, max_seq_len=max_len(trace),
                    max_num_batched_tokens=budget, max_num_seqs=len(trace), prefix_caching=True)
    return serve(engine, trace, chats, f"colocated (chunked prefill, budget {budget})")


def disaggregated(model, trace, chats, block_size) -> Timeline:
    """The decode engine here, the prefill engine in another process (whole prompts)."""
    engine = DisaggregatedEngine(model, pool_size(trace, block_size), block_size,
                                 max_seq_len=max_len(trace), max_num_seqs=len(trace))
    try:
        return serve(engine, trace, chats, "disaggregated (prefill in another process)")
    finally:
        engine.close()


def pool_size(trace, block_size) -> int:
    """Blocks for every request at once, and one more each: nobody is preempted."""
    return sum(-(-(len(p) + n) // block_size) + 1 for p, n, _ in trace)


def max_len(trace) -> int:
    return max(len(p) + n for p, n, _ in trace)


def figures(runs: list[Timeline]) -> dict:
    """The medians over a server's rounds, in milliseconds (and its steps)."""
    def med(f):
        return statistics.median(f(r) for r in runs)
    return {"p50": med(lambda r: 1e3 * statistics.median(r.gaps)), "worst": med(
        lambda r: 1e3 * r.worst_gap), "max step": med(lambda r: 1e3 * max(r.step_seconds)),
            "steps": med(lambda r: len(r.step_seconds))}


def results_table(colo: list[Timeline], dis: list[Timeline], caption: str) -> Table:
    t = Table(title=caption, title_justify="left")
    for col in ("server", "ITL p50 ms", "worst ITL ms", "longest step ms", "steps",
                "worst / colocated"):
        t.add_column(col, justify="left" if col == "server" else "right")
    base = figures(colo)["worst"]
    for runs in (colo, dis):
        f = figures(runs)
        t.add_row(runs[0].name, f"{f['p50']:.1f}", f"{f['worst']:.1f}", f"{f['max step']:.1f}",
                  f"{f['steps']:.0f}", f"{f['worst'] / base:.2f}x")
    return t


def rounded(run: Timeline) -> dict:
    """A run as `--save` records it: times to the microsecond, without the tokens."""
    return {k: [round(x, 6) for x in v] if k in ("step_start", "step_seconds", "arrivals", "gaps")
            else [] if k == "outputs" else v for k, v in asdict(run).items()}


def recorded() -> dict:
    """The run `--save` recorded: {"cpu", "caption", "runs": [Timeline, Timeline]}."""
    data = json.loads(RECORDED.read_text())
    return {**data, "runs": [Timeline(**r) for r in data["runs"]]}


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.disaggregated_latency",
                           description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--chats", type=cli.whole(1), default=4)
    p.add_argument("--chat-prompt", type=cli.whole(1), default=32)
    p.add_argument("--chat-tokens", type=cli.whole(1), default=160)
    p.add_argument("--long-prompt", type=cli.whole(1), default=1024)
    p.add_argument("--long-tokens", type=cli.whole(1), default=4)
    p.add_argument("--long-every", type=cli.whole(1), default=40,
                   help="steps between long prompts")
    p.add_argument("--budget", type=cli.whole(1), default=256,
                   help="the colocated engine's token budget per step (chunked prefill)")
    p.add_argument("--block-size", type=cli.whole(1), default=16)
    p.add_argument("--threads", type=cli.whole(1), default=1, help="torch threads per engine")
    p.add_argument("--repeats", type=cli.whole(1), default=3)
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--save", action="store_true", help="record the last round for notebook 09b "
                   "and draw it for the benchmarks page")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(dtype=torch.float32)
    trace = chats_and_long_prompts(args.chats, args.chat_prompt, args.chat_tokens,
                                   args.long_prompt, args.long_tokens, args.long_every,
                                   model.args.vocab_size - 256, args.seed)
    if max_len(trace) > model.args.max_seq_len:
        raise MiniPagedError(f"a request would pass the model's {model.args.max_seq_len} "
                             f"positions; shorten the prompts or the chats")
    load = os.getloadavg()[0]
    colo, dis = [], []
    with Progress(transient=True) as bar:
        task = bar.add_task("colocated and disaggregated, in turn", total=args.repeats)
        for _ in range(args.repeats):
            colo.append(colocated(model, trace, args.chats, args.budget, args.block_size))
            dis.append(disaggregated(model, trace, args.chats, args.block_size))
            bar.advance(task)
    if any(c.outputs != d.outputs for c, d in zip(colo, dis)):
        raise MiniPagedError("the two servers gave different tokens: a bug, please report it")
    longs = len(trace) - args.chats
    caption = (f"{args.chats} chats ({args.chat_prompt}-token prompts, {args.chat_tokens} new "
               f"tokens) and {longs} prompts of {args.long_prompt} tokens arriving every "
               f"{args.long_every} steps; block {args.block_size}; embedded model, float32; "
               f"{args.threads} torch thread(s) per engine; wall clock, medians of "
               f"{args.repeats} rounds; the same tokens: True")
    machine = (f"{cpu_name()}; {os.cpu_count()} CPUs, load average {load:.1f} before, "
               f"{os.getloadavg()[0]:.1f} after")
    Console(width=None if sys.stdout.isatty() else 150).print(
        results_table(colo, dis, caption), machine)
    if args.save:
        RECORDED.write_text(json.dumps({"cpu": cpu_name(), "caption": caption, "runs": [
            rounded(colo[-1]), rounded(dis[-1])]}) + "\n")
        plot_step_times([colo[-1], dis[-1]], cpu_name()).savefig(FIGURE, dpi=110)
        print(f"recorded: {RECORDED.name} and {FIGURE.name}")


if __name__ == "__main__":
    raise SystemExit(main())
