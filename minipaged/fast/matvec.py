"""A linear layer laid out for decoding on a CPU, where one token is a matrix-vector product.

Decoding one token multiplies a vector by every weight matrix of the model once, so it runs at
the speed memory streams weights in. On the 2-core machine this repository was measured on
(AMD EPYC, torch 2.13's MKL), `F.linear` on one row streams SmolLM2's 540 MB of fp32 weights
at about 12 GB/s whether torch has one thread or two, while a plain reduction over as many
bytes reads about 27 GB/s: the product runs on one thread. Two changes reach the bound:

  * the weight stored transposed, (in, out): MKL's kernel for a row times an (in, out) matrix
    streams faster than its kernel for an (out, in) one (17 GB/s);
  * that matrix cut along `in` into `splits` slabs, (splits, in / splits, out): `torch.bmm`
    runs one product per slab and spreads the slabs over the threads, and the partial results
    are summed (31 GB/s at best, with 4 slabs on 2 threads).

The sum adds the slabs' partial products in another order than one product would, so results
differ from `F.linear` by rounding only (about 1e-7 relative in fp32).

Several rows at once (a serving step's decodes, a prompt) in fp32 go to `panels.c`, a C
kernel built on first use (as stage 3b's is) for the CPU's vector width (AVX-512, AVX2, NEON,
or plain C: `minipaged/simd.h`): the weight stored again as panels of 32 outputs, (out / 32,
in, 32), each panel one contiguous stream, multiplied by up to 12 rows a pass (3 on AVX2)
while the next panel is fetched at an even rate (`panel_weight`). The oneDNN
kernel it replaced reads the same bytes but waits on memory between its multiplications.
Measured on SmolLM2 (the products of one step, every layer's weights read once, 2 threads, the
2-core Intel machine of the serving benchmark): 2, 4, 16 and 64 rows took 19.0, 19.3, 25.8 and
49.0 ms against oneDNN's 26.3, 28.2, 38.0 and 76.7. It takes up to MOST_ROWS rows (a whole
prompt chunk of the engines' default budget): on that Intel machine torch's plain product (MKL)
was level with it at 512 rows and faster beyond (597 ms against 673 at 768), while on an AMD
EPYC (Zen 5), where MKL runs its AVX2 code, the kernel's 121 products of 512 rows took 303 ms
against MKL's 737 (and 674 against 713 built for AVX2).
Compiled steps call it as `minipaged::panel_linear`, whose CPU kernel `compile_decode` has
registered in C++ (operators.py, with the measurements) where a C++ compiler builds it, so
that the hundreds of calls a step make no trip back into Python. Then the compiled step of one
row multiplies through the kernel too (on SmolLM2, separate processes in turn, medians of five:
24.0 and 24.1 ms against 25.0 and 25.7 with the compiler's own products); through the Python
function it gained nothing.

Half precision goes to panels.c too, as bf16 or fp16 panels widened to fp32 as they stream in
(half the bytes of fp32), unless the CPU has AMX, whose tiles multiply bf16 faster
(`half_panels`, with the measurements; `python -m minipaged.benchmarks.products` times the
kernels side by side). On a CPU with AVX-512's bf16 dot products but no AMX, panels.c
multiplies bf16 pairs (panels.c says how) and bf16 rows beyond `most_rows` go to torch's
product (oneDNN's, which multiplies pairs too): SmolLM2's 121 products of 64 rows took 29.0 ms
in the kernel against torch's 32.9, of 128 rows 55.8 against 51.0, of 512 rows 222 against
173 (AMD EPYC, Zen 5). In bf16 on a CPU with AMX, and in fp32 where the kernel cannot
be built, several rows go to oneDNN's kernel, on a
copy of the weight that oneDNN has packed ahead of time into the tiles its kernel reads
(`onednn_weight`; `torch.compile` packs weights the same way under freezing), and to one plain
product where neither serves (fp64, another device, a weight whose outputs are not a multiple
of 32 that oneDNN cannot pack). One row in
fp32, run eager, stays with the slabs, which stream faster still (a decode step took 31 ms,
against 40 ms through oneDNN). The extra copy costs the weight's size again.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu_attention import build_function, target_flags

PANEL = 32                                   # outputs a panel (panels.c's NR)
# the machine's vector width (or MINIPAGED_MARCH's) and OpenMP; without OpenMP, one thread
FLAGS = [(["-O3", *target_flags(), "-fopenmp"], ["-fopenmp"]), (["-O3", *target_flags()], [])]
MOST_ROWS = 512          # more fp32 rows than this (a prompt chunk past 512): one plain product
DOT_ROWS = 64            # more bf16 rows than this, with bf16 dot products: torch's product
NO_BOUND = 2 ** 30       # most_rows where panels.c takes every row count
KERNELS = {torch.float32: "panel_linear", torch.bfloat16: "panel_linear_bf16",
           torch.float16: "panel_linear_f16"}         # panels.c's product for each weight dtype
kernels = {}             # the built products, by weight dtype (panel_kernel fills it in)
built_isa = None         # the vector width panels.c was built for (simd.h), once built
dot_pairs = False        # and whether it multiplies bf16 pairs (simd.h's DOT_BF16)


@functools.cache
def panel_kernel():
    """panels.c's float32 `panel_linear`, or a sentence saying why it could not be built
    (`FLAGS`). Built, `kernels` holds the product for each weight dtype, `built_isa` the
    vector width it computes with and `dot_pairs` whether its bf16 products multiply pairs."""
    global built_isa
    global dot_pairs
    functions = build_function(Path(__file__).with_name("panels.c"),
                               (*KERNELS.values(), "panel_isa", "panel_bf16_dot", "panel_helper",
                                "panel_helper_state", "panel_helper_stall"), flags=FLAGS)
    if isinstance(functions, str):
        return functions
    *products, isa, dot, start_stop, state, stall = functions
    P, I = ctypes.c_void_p, ctypes.c_int
    for dtype, kernel in zip(KERNELS, products):
        kernel.argtypes, kernel.restype = [P, P, P, I, I, I, I], None
        kernels[dtype] = kernel
    isa.restype = ctypes.c_char_p
    built_isa = isa().decode()
    dot_pairs = bool(dot())
    add_helper("ctypes", start_stop, state, stall)
    return kernels[torch.float32]


helpers = {}      # each built copy of panels.c: its panel_helper, _state and _stall


def add_helper(library: str, start_stop, state, stall) -> None:
    """Keep the helper functions of a built copy of panels.c (`panel_kernel`'s, "ctypes", or
    operators.py's, "operators") for `panel_helper`."""
    start_stop.argtypes, start_stop.restype = [ctypes.c_int], ctypes.c_int
    state.argtypes, state.restype = [ctypes.POINTER(ctypes.c_long)], None
    stall.argtypes, stall.restype = [ctypes.c_int], ctypes.c_int
    helpers[library] = start_stop, state, stall


def serving() -> str:
    """Which built copy of panels.c serves the products: operators.py's where it is built."""
    return "operators" if operator_in_cpp else "ctypes"


def panel_helper(start: bool) -> int:
    """Start panels.c's helper thread (start=True; called again, it is placed anew), or stop it
    and wait for it to end (False): while it runs, products on one thread share their panels
    with it (the end of panels.c says how). Started in the copy of panels.c that serves the
    products (operators.py's where it is built), stopped in every copy. Returns 0, else an
    errno; 0 where no kernel is built."""
    errors = [start_stop(int(start and library == serving()))
              for library, (start_stop, *_) in helpers.items()]
    return next(filter(None, errors), 0)


def panel_helper_state() -> tuple[bool, int, int]:
    """Whether the helper is on in the copy of panels.c that serves the products, how many
    chunks of panels it has multiplied there so far, and how many were taken back from it;
    (False, 0, 0) where no kernel is built."""
    state = (ctypes.c_long * 3)()
    library = helpers.get(serving())
    if library is not None:
        library[1](state)
    return bool(state[0]), state[1], state[2]


def panel_helper_stall(pauses: int) -> int:
    """For tests: make the helper, in the copy of panels.c that serves the products, pause this
    many times after each chunk before committing it, as if the scheduler had stopped it there;
    returns the setting it replaces (-1 where no kernel is built)."""
    library = helpers.get(serving())
    return -1 if library is None else library[2](pauses)


def half_panels(dtype: torch.dtype) -> bool:
    """Whether a half-precision weight goes to panels.c (bf16 and fp16 panels, widened to fp32
    as they stream in) rather than to oneDNN and the compiler's products: always for fp16,
    which oneDNN's packing does not take; for bf16 unless panels.c was built for AVX-512 on a
    CPU with AMX, whose tile instructions multiply bf16 faster than any fp32 FMA. Without AMX
    the other ways were slower: emulated bf16 on AVX2, and on an AVX-512 CPU with bf16 dot
    products but no AMX (AMD EPYC, SmolLM2's compiled decode steps) 15.7, 60.3 and 170.4 ms at
    1, 16 and 64 rows against 7.9, 15.7 and 55.2 through panels.c."""
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not (built_isa == "avx512" and amx())


def amx() -> bool:
    """Whether the CPU has AMX's tile instructions (torch's check; False where it has none)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def most_rows(dtype: torch.dtype) -> int:
    """The most rows of x that `panel_linear` gives panels.c for weights of `dtype`; more go to
    torch's product: fp32 beyond MOST_ROWS; bf16 beyond DOT_ROWS where panels.c is built for
    a CPU with bf16 dot products (`bf16_dot`); else NO_BOUND."""
    if dtype == torch.float32:
        return MOST_ROWS
    return DOT_ROWS if dtype == torch.bfloat16 and bf16_dot() else NO_BOUND


def bf16_dot() -> bool:
    """Whether panels.c is built for a CPU with bf16 dot products (AVX512_BF16): its bf16
    products of several rows multiply bf16 pairs, and so does oneDNN's bf16 product, which
    outruns them beyond DOT_ROWS."""
    return not isinstance(panel_kernel(), str) and dot_pairs


def panel_weight(weight: torch.Tensor):
    """`weight` (out, in) as panels of 32 outputs, (out / 32, in, 32), in its own dtype, for
    `panel_linear`; or None where the kernel cannot serve it: not on a CPU, `out` not a
    multiple of 32, no kernel built, a dtype panels.c has no product for, or a half dtype
    oneDNN serves (`half_panels`)."""
    out_features, in_features = weight.shape
    if weight.device.type != "cpu" or out_features % PANEL or weight.dtype not in KERNELS \
            or isinstance(panel_kernel(), str) or \
            weight.dtype != torch.float32 and not half_panels(weight.dtype):
        return None
    return weight.detach().reshape(out_features // PANEL, PANEL, in_features).transpose(1, 2) \
        .contiguous()


_lib = torch.library.Library("minipaged", "FRAGMENT")
_lib.define("panel_linear(Tensor x, Tensor panels, Tensor weight_t) -> Tensor")


def panel_linear(x: torch.Tensor, panels: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ W.T for W stored as `panels` (`panel_weight`) and as `weight_t`, W.T (in,
    out): (M, out) in x's dtype, through the kernel (`panel_product`); rows beyond
    `most_rows`, where torch's product is faster, through `x @ weight_t`. (Without bf16 dot
    products torch's own half-precision product was 2-4 times slower at 256-512 rows, AVX2.)"""
    panel_kernel()
    if x.shape[0] > most_rows(panels.dtype):
        return x @ weight_t
    return panel_product(x, panels)


def panel_product(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x (M, in) @ W.T through panels.c at any number of rows, on torch's threads: (M, out) in
    x's dtype (half-precision rows widened to fp32 first: the kernel sums in fp32)."""
    rows = x.contiguous().float()
    M, K = rows.shape
    y = rows.new_empty(M, panels.shape[0] * PANEL)
    if M:
        panel_kernel()
        kernels[panels.dtype](rows.data_ptr(), panels.data_ptr(), y.data_ptr(), M, y.shape[1], K,
                              torch.get_num_threads())
    return y.to(x.dtype)


_lib.impl("panel_linear", panel_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("minipaged::panel_linear", lib=_lib)
def _(x, panels, weight_t):
    return x.new_empty(x.shape[0], panels.shape[0] * PANEL)


operator_in_cpp = False     # operators.py has registered the C++ kernel: one row goes too


def onednn_weight(weight: torch.Tensor):
    """`weight` (out, in) packed for oneDNN's linear kernel, or None where oneDNN cannot serve it:
    a CPU weight in fp32, or bf16 on a CPU with bf16 instructions."""
    supported = weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and (
        weight.dtype == torch.float32 or
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()) if supported \
        else None


class MatVec(nn.Module):
    """`y = x @ weight.T` for a weight (out, in), in the layout that streams fastest."""

    def __init__(self, weight: torch.Tensor, splits: int = 4):
        super().__init__()
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        split = weight.dtype == torch.float32 and weight.device.type == "cpu" and \
            splits > 1 and in_features % splits == 0
        self.splits = splits if split else 1
        if split:     # (splits, in / splits, out): slab j holds rows j*in/splits... of weight.T
            w = weight.detach().t().contiguous().view(splits, in_features // splits, out_features)
        else:
            w = weight.detach().contiguous()                                 # (out, in)
        self.weight = nn.Parameter(w, requires_grad=False)
        self._pack(weight)

    def _pack(self, weight):
        """The copy several rows are multiplied by: panels (`panel_weight`: fp32, and bf16 or
        fp16 where `half_panels`), else oneDNN's (`onednn_weight`), else none. A parameter, so
        that freezing sees it as a constant."""
        panels = panel_weight(weight)
        self.panels = None if panels is None else nn.Parameter(panels, requires_grad=False)
        self.packed = onednn_weight(weight) if panels is None else None

    def forward(self, x):
        *lead, n = x.shape
        rows = x.reshape(-1, n)                                              # (M, in)
        M, s = rows.shape[0], self.splits
        # compiled for any number of rows, M is symbolic: `one_row` must not test its value
        one_row = isinstance(M, int) and M == 1
        if torch.compiler.is_compiling():
            if self.panels is not None and (not one_row or operator_in_cpp):
                y = self._panel_product(rows)           # the C kernel
            else:                   # the compiler packs the weight its own way
                y = self._one_product(rows)
        elif one_row and s > 1:                 # one row in fp32: the slabs, over the threads
            slabs = rows.view(M, s, n // s).transpose(0, 1)                  # (s, M, in/s)
            y = torch.bmm(slabs, self.weight).sum(0)                         # (M, out)
        elif self.panels is not None:           # several rows in fp32, or half: the C kernel
            y = self._panel_product(rows)
        elif self.packed is not None:           # several rows, or bf16: oneDNN's kernel
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        else:
            y = self._one_product(rows)
        return y.view(*lead, self.out_features)

    def _panel_product(self, rows):
        return torch.ops.minipaged.panel_linear(rows, self.panels, self._weight_t())

    def _one_product(self, rows):
        if self.splits == 1:
            return F.linear(rows, self.weight)
        return rows @ self._weight_t()

    def _weight_t(self):
        """The weight transposed, (in, out): a view."""
        if self.splits == 1:
            return self.weight.t()
        return self.weight.view(self.in_features, self.out_features)

    def _apply(self, fn, recurse=True):
        """`.to(...)` and the like move or convert the weight: pack the result again."""
        super()._apply(fn, recurse)
        w = self.weight if self.splits == 1 else \
            self.weight.view(self.in_features, self.out_features).t()
        self._pack(w)
        return self
