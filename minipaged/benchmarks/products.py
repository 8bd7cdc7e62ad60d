"""A decode step's matrix products on this CPU, kernel by kernel, against the memory's read speed.

    python -m minipaged.benchmarks.products                     # SmolLM2's shapes, fp32 and bf16
    python -m minipaged.benchmarks.products --isa avx2          # the kernels built for AVX2 only
    python -m minipaged.benchmarks.products --rows 1 16 --dtypes bfloat16 float16

One step of SmolLM2-135M multiplies every weight once (121 products: four a layer, 30 layers,
and the logits; random weights of its shapes, 540 MB in fp32). For each dtype and row count
this times that step through each kernel that can serve it: panels.c (`matvec.panel_linear`,
the speed layer's product), oneDNN's packed kernel, and torch's own `F.linear`; the best of
--repeats. One row reads every byte of the weights once, so its rate in GB/s is compared with
the machine's read speed, measured here as the best of a plain sum over as many bytes
(`torch.sum` of a float32 tensor, the same threads).

--isa avx2 runs the whole measurement again in a child process with every kernel limited to
AVX2 and FMA: panels.c built for x86-64-v3 (`MINIPAGED_MARCH`), torch's own kernels at AVX2
(`ATEN_CPU_CAPABILITY`), oneDNN's (`ONEDNN_MAX_CPU_ISA`) and MKL's too: what a CPU without
AVX-512 runs, measured on one that has it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from .. import cli
from ..fast import kernels as what_runs
from ..fast import matvec

# SmolLM2-135M: (outputs, inputs) of a layer's four products (wqkv, wo, w13, w2), and the logits
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, LOGITS = 30, (49152, 576)
ISAS = {"avx2": {"MINIPAGED_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
                 "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def isa_environment(isa: str) -> dict:
    """The variables that limit a process's kernels to `isa` (ISAS), with caches of compiled
    graphs of their own: torch.compile's (TORCHINDUCTOR_CACHE_DIR) and vLLM's (VLLM_CACHE_ROOT).
    Sharing inductor's cache, a native process loaded a SmolLM2 decode graph compiled under
    the AVX2 limits and crashed in it (heap corruption)."""
    folder = Path(tempfile.gettempdir()) / f"minipaged-{isa}-caches"
    return {**ISAS[isa], "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
            "VLLM_CACHE_ROOT": str(folder / "vllm")}


def weights(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Random weights of SmolLM2's shapes, every product of one step."""
    g = torch.Generator().manual_seed(seed)
    shapes = LAYER * LAYERS + [LOGITS]
    return [(torch.randn(shape, generator=g) * 0.02).to(dtype) for shape in shapes]


def products(dtype: torch.dtype):
    """Each kernel that can serve `dtype`, as a function of x (M, in) and a weight's index, and
    the weights it reads prepared (panels, packed)."""
    ws = weights(dtype)
    out = {}
    panels = [matvec.panel_weight(w) for w in ws]
    if all(p is not None for p in panels):
        out["panels.c"] = lambda x, i: matvec.panel_product(x, panels[i])
    elif dtype != torch.float32 and not isinstance(matvec.panel_kernel(), str):
        panels = [w.reshape(w.shape[0] // matvec.PANEL, matvec.PANEL, -1).transpose(1, 2)
                  .contiguous() for w in ws]            # measured even where oneDNN is chosen
        out["panels.c"] = lambda x, i: matvec.panel_product(x, panels[i])
    packed = [matvec.onednn_weight(w) for w in ws]
    if all(p is not None for p in packed):
        out["oneDNN"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None,
                                                                         "none", [], "")
    out["torch"] = lambda x, i: F.linear(x, ws[i])
    return out, sum(w.numel() * w.element_size() for w in ws), ws


def best(fn, repeats: int) -> float:
    """The fewest seconds `fn` took over `repeats` calls, after one to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_speed(nbytes: int, repeats: int) -> float:
    """Bytes a second a plain sum reads over `nbytes` of float32 (all torch's threads)."""
    t = torch.ones(nbytes // 4)
    return nbytes / best(lambda: t.sum(), repeats)


def measure(dtypes, rows, repeats, console) -> None:
    table = Table(title="one decode step's products (SmolLM2's 121), best of "
                        f"{repeats}, {torch.get_num_threads()} threads")
    for col in ("dtype", "rows", "kernel", "ms", "GB/s of weights", "÷ read speed"):
        table.add_column(col, justify="right" if col not in ("dtype", "kernel") else "left")
    bandwidth = None
    for dtype in dtypes:
        kernels, nbytes, ws = products(dtype)
        if bandwidth is None:
            bandwidth = read_speed(sum(w.numel() for w in ws) * 4, repeats)
        g = torch.Generator().manual_seed(1)
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {w.shape[1] for w in ws}}
            for name, product in kernels.items():
                def step():
                    for i, w in enumerate(ws):
                        product(xs[w.shape[1]], i)
                seconds = best(step, repeats)
                rate = nbytes / seconds
                table.add_row(str(dtype).removeprefix("torch."), str(m), name,
                              f"{seconds * 1e3:.1f}", f"{rate / 1e9:.1f}",
                              f"{rate / bandwidth:.2f}" if m == 1 else "")
    console.print(table)
    console.print(f"read speed: {bandwidth / 1e9:.1f} GB/s (a sum over 540 MB of float32)")
    for dtype in dtypes:
        console.print(f"{str(dtype).removeprefix('torch.')}: {what_runs(dtype)}")


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.products",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
                   default=["float32", "bfloat16"])
    p.add_argument("--rows", type=cli.whole(1, matvec.MOST_ROWS), nargs="+",
                   default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=cli.whole(1), default=10)
    p.add_argument("--isa", choices=sorted(ISAS), help="limit every kernel to this ISA (AVX2 "
                   "on an x86 CPU with AVX-512), in a child process")
    args = p.parse_args(argv)
    console = Console()
    if args.isa:
        child = [sys.executable, "-m", "minipaged.benchmarks.products", "--dtypes", *args.dtypes,
                 "--rows", *map(str, args.rows), "--repeats", str(args.repeats)]
        return subprocess.run(child, env={**os.environ, **isa_environment(args.isa)}).returncode
    measure([getattr(torch, d) for d in args.dtypes], args.rows, args.repeats, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
