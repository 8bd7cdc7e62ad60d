"""Which kernels run a model on this CPU, in words: `kernels(dtype)`.

The speed layer's C kernels are built on first use for the CPU they run on (`-march=native`, or
the CPU that `MINIPAGED_MARCH` names), and each computes with the widest vectors that build
offers (`minipaged/simd.h`: avx512, avx2, neon, or plain). What a product runs depends on
that and on the dtype (matvec.py): panels.c, oneDNN's packed kernel, or torch's own product;
attention runs stage 3b's C kernel where it builds, else stage 3's PyTorch path; a compiled
model's decode step of up to 64 rows is one C++ call where operators.cpp builds. The benchmarks
print this beside their figures; call it for your own code:

    >>> from minipaged.fast import kernels
    >>> kernels(torch.bfloat16)
    {'cpu': 'AMD EPYC ... (avx2 fma f16c avx512f avx512_bf16)', 'built for': 'native',
     'products': 'panels.c (avx512), bf16 weights', 'one row': ..., 'attention': ...,
     'decode step': 'one C++ call up to 64 rows (operators.cpp); more rows, the compiled graph'}
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from .. import cpu_attention
from . import matvec, native_step, operators

FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "fphp")


def cpu_name() -> str:
    """The CPU's model name and the vector features the kernels care about that it offers
    (Linux's /proc/cpuinfo; elsewhere, what `platform` knows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    info = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    offered = set((info.get("flags") or info.get("Features") or "").split())
    name = info.get("model name") or info.get("CPU part") or platform.machine()
    return f"{name} ({' '.join(f for f in FEATURES if f in offered) or 'no vector features'})"


def product_kernel(dtype: torch.dtype, rows: str = "several") -> str:
    """What multiplies `rows` ("one" or "several") rows by a weight of `dtype` (MatVec's
    choice, eager and compiled alike, except as noted)."""
    weight = torch.zeros(matvec.PANEL, 8, dtype=dtype)
    built = matvec.panel_kernel()
    panels = matvec.panel_weight(weight)
    isa = f" ({matvec.built_isa})" if not isinstance(built, str) else ""
    if rows == "one" and dtype == torch.float32:
        return f"panels.c{isa} compiled; eager, torch's bmm over 4 slabs" \
            if panels is not None else "torch's bmm over 4 slabs"
    if panels is not None:
        most = matvec.most_rows(dtype)
        beyond = f"; past {most} rows, torch's product" if most < matvec.NO_BOUND else ""
        pairs = " (several rows: in bf16 pairs)" if dtype == torch.bfloat16 and \
            matvec.bf16_dot() else ""
        return f"panels.c{isa}, {str(dtype).removeprefix('torch.')} weights{pairs}{beyond}"
    if matvec.onednn_weight(weight) is not None:
        return "oneDNN, packed " + str(dtype).removeprefix("torch.")
    reason = f" (panels.c: {built})" if isinstance(built, str) else ""
    return f"torch's product{reason}"


def attention_kernel(dtype: torch.dtype, head_dim: int = 64, group: int = 3) -> str:
    """What runs a decode step's attention over a paged cache of `dtype` in the speed layer."""
    if dtype not in cpu_attention.KV_TYPES:
        return "stage 3's PyTorch path (no C kernel for this dtype)"
    built = cpu_attention.build(dtype, head_dim, group)
    if isinstance(built, str):
        return f"stage 3's PyTorch path ({built})"
    return f"cpu_attention.c ({cpu_attention.built_for[dtype, head_dim, group]})"


def step_kernel(dtype: torch.dtype) -> str:
    """What runs a decode step of a FusedLlama of `dtype` compiled by `compile_decode`, on the
    speed layer's paged cache (native_step.py)."""
    if dtype not in native_step.DTYPES:
        return "the compiled graph (the one-call step takes float32 or bfloat16)"
    if matvec.panel_weight(torch.zeros(matvec.PANEL, 8, dtype=dtype)) is None:
        return "the compiled graph (the products have no panels: the one-call step needs them)"
    why = operators.build()
    if why:
        return f"the compiled graph (operators.cpp: {why})"
    return f"one C++ call up to {native_step.MOST_ROWS} rows (operators.cpp); more rows, " \
        "the compiled graph"


def kernels(dtype: torch.dtype = torch.float32, head_dim: int = 64, group: int = 3) -> dict:
    """The CPU, what the C kernels were built for, and what runs a model of `dtype`: its
    products of several rows and of one row, its paged attention (for heads of `head_dim`,
    `group` query heads per KV head) and its compiled decode steps."""
    return {"cpu": cpu_name(),
            "built for": os.environ.get("MINIPAGED_MARCH", "native"),
            "products": product_kernel(dtype),
            "one row": product_kernel(dtype, "one"),
            "attention": attention_kernel(dtype, head_dim, group),
            "decode step": step_kernel(dtype)}
