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
from ..formats.atomic import write_file


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
