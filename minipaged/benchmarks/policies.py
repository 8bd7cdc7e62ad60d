"""Stage 4's comparison: where the KV memory goes under each allocation policy, on one trace.

    python -m minipaged.benchmarks.policies                     # ShareGPT-like, the table and figures
    python -m minipaged.benchmarks.policies --workload alpaca
    python -m minipaged.benchmarks.policies --workload trace.csv --no-plots
    python -m minipaged.benchmarks.policies --figures my-figures

Every policy (`simulator.POLICIES`: max, pow2 and oracle reservations, paged with block sizes
1 to 256) serves the same requests in the same KV budget; the table splits the memory into
token states, reservation, internal, external fragmentation and idle, and the figures put it
beside the vLLM paper's Figure 2: in a new temporary folder, or the one --figures names;
`--readme-figures` redraws the copies in the repository's assets/ that the README shows.
"""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
from rich.console import Console

from .. import cli, simulator, viz, workloads
from ..kv_cache import kv_bytes_per_token
from ..kv_formats import stored_layout
from ..simulator import Policy
from ..formats.atomic import write_file


def int8_line(wl, results, args) -> str:
    """The same KV memory in stage 4b's int8 blocks (Llama 3 8B's KV shape): its token slots,
    and the requests paged blocks of 16 then run at once, beside the model's-dtype figure."""
    int8_bytes = kv_bytes_per_token(8, *stored_layout(128, None, "int8"), n_layers=32)
    slots = args.kv_budget_tokens * args.bytes_per_token // int8_bytes
    paged = Policy("paged", 16)
    before = next(r for r in results if r.policy == paged)
    after = simulator.simulate(wl, paged, slots, args.max_seq_len, int8_bytes)
    return (f"The same memory in int8 blocks (stage 4b; Llama 3 8B's shape, {int8_bytes:,} bytes "
            f"a token): {slots:,} token slots, {slots / args.kv_budget_tokens:.2f}x; paged blocks "
            f"of 16 then run {after.mean_running():.1f} requests at once instead of "
            f"{before.mean_running():.1f} (python -m minipaged.benchmarks.kv_int8: accuracy).")


@cli.program
def main(argv=None) -> int:
    """Compare every policy on one workload: a table in the terminal, figures in a folder."""
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.policies",
                           description=main.__doc__)
    p.add_argument("--workload", default="sharegpt",
                   help="sharegpt, alpaca, or a trace file (.csv/.json of prompt_len, output_len)")
    p.add_argument("--requests", type=cli.whole(1), default=2000,
                   help="synthetic requests to draw")
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--max-seq-len", type=cli.whole(2), default=2048,
                   help="what the max policy reserves per request (OPT's 2048, as in the paper)")
    p.add_argument("--kv-budget-tokens", type=cli.whole(1), default=65536,
                   help="KV memory in token slots (65,536 = 8 GiB of Llama 3 8B bf16 KV)")
    p.add_argument("--bytes-per-token", type=cli.whole(1),
                   default=simulator.LLAMA3_8B_BF16_BYTES_PER_TOKEN)
    cli.add_figure_options(p, "the three PNG figures", aliases=["--assets"])
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.no_plots and (args.figures is not None or args.readme_figures):
        p.error("--no-plots draws nothing; leave out --figures and --readme-figures")
    out = cli.figures_folder(args, p)
    console = Console()
    if not console.is_terminal:          # piped or captured: do not squeeze the table to 80
        console = Console(width=132)
    wl = workloads.load(args.workload, n=args.requests, seed=args.seed,
                        max_seq_len=args.max_seq_len)
    results = simulator.compare(wl, args.kv_budget_tokens, args.max_seq_len,
                                bytes_per_slot=args.bytes_per_token)
    console.print(viz.rich_policy_table(results, wl, args.kv_budget_tokens, args.bytes_per_token))
    console.print(int8_line(wl, results, args))
    if not args.no_plots:
        matplotlib.use("Agg")
        out = cli.drawing_folder(out, "policies")
        figures = {"fragmentation_policies.png": viz.plot_waste_bars(simulator.headline(results)),
                   "fragmentation_block_size.png": viz.plot_block_size_sweep(results),
                   "fragmentation_concurrency.png": viz.plot_concurrency(results)}
        for name, fig in figures.items():
            write_file(out / name, lambda p: fig.savefig(p, format="png", dpi=120))
            plt.close(fig)
            console.print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
