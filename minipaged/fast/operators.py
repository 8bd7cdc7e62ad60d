"""Two operators' CPU kernels in C++, for the compiled steps: `build()`, `install(address)`.

A compiled step (compiled.py) calls `minipaged::panel_linear` for its products (121 calls a
SmolLM2 step) and `minipaged::attend` for its attention (30), through torch's dispatcher. Both
are declared in Python, with Python functions behind them; called from the compiled graph, each
call went back into the interpreter, converted its arguments and ran a few small torch calls
around the C kernel. `build()` compiles operators.cpp with panels.c against torch's libraries
and registers C++ kernels for both on the CPU, which then serve every CPU call:

  * `panel_linear`: the same work as matvec.py's `panel_linear`;
  * `attend`: while a decode step's plan is installed (`install`, which compiled.py does for
    each compiled step on the speed layer's paged cache), the same work as paged.py's
    `DecodeAttention.attend` — each row's new k and v copied into its slot (on int8 blocks,
    quantized into it by fast/int8_slots.c, whose function the plan points at), then stage
    3b's C kernel; any other call (no plan: a prompt, a packed step with prompt tokens, the
    contiguous cache; or a call the plan does not fit) goes to the Python function through
    `minipaged::attend_python`.

Measured on SmolLM2 in fp32, decode steps in ms, each comparison two builds in processes taking
turns, two of each, medians of five (the 2-core Intel machine of the serving benchmark):

    panel_linear in C++ against Python      4 rows 27.9, 27.1 against 30.0, 28.6
                                            16 rows 39.1, 38.5 against 41.6, 41.1
    then one row through the kernel too     1 row 24.0, 24.1 against 25.0, 25.7
    (with the Python function it gained nothing)
    then attend in C++ too                  1 row 21.0, 21.7 against 23.4, 23.7
                                            4 rows 24.0, 24.1 against 26.5, 26.8
                                            16 rows 33.8, 34.3 against 36.6, 36.8

Before, a layer's attention at one row spent 35 of its 63 microseconds in Python around the
kernel, and the trip from the compiled graph into Python came on top.

The same library holds `minipaged_decode_step`: a decode step of up to 64 rows as one call, on
the installed plan (native_step.py). It is built for this CPU, as panels.c is (`target_flags`:
AVX-512, AVX2 or NEON code), so that the step's small loops are vectorized.

The build takes a few seconds, once a process, and needs the C compiler panels.c builds with
and a C++ compiler ($CXX, else c++, g++ or clang++); where either is missing, `build` returns a
sentence saying why and the Python functions keep serving both operators. One plan is installed
at a time, for the process: the engine runs one step at a time.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..cpu_attention import build_error, compiler, target_flags
from . import matvec

SOURCE = Path(__file__).with_name("operators.cpp")
_install = None          # operators.cpp's `minipaged_install_plan`, once built
decode_step = None       # and its `minipaged_decode_step` (native_step.py)
step_products = None     # and `minipaged_step_products` (the benchmarks time it)
swiglu = None            # and `minipaged_swiglu`, the step's SwiGLU (the tests check it)


class DecodePlan(ctypes.Structure):
    """A decode step's plan as operators.cpp's `DecodePlan` reads it (paged.py fills it in)."""
    _fields_ = [("kernel", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in (
                    "layers", "rows", "heads", "kv_heads", "head_dim", "block_size", "width",
                    "token_bytes", "bf16")),
                ("scale", ctypes.c_float),
                ("lens", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("pools", ctypes.c_void_p),
                ("quantize", ctypes.c_void_p)]


def cxx_compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else the first of c++, g++, clang++ on the PATH."""
    return os.environ.get("CXX") or next(filter(None, map(shutil.which,
                                                          ("c++", "g++", "clang++"))), None)


@functools.cache
def build() -> str | None:
    """Build operators.cpp and register its kernels (the module's docstring); None once they
    are, else a sentence saying why not. Once a process: `compile_decode` asks for it."""
    global _install, decode_step, step_products, swiglu
    kernel = matvec.panel_kernel()
    if isinstance(kernel, str):
        return kernel
    cxx = cxx_compiler()
    if cxx is None:
        return "no C++ compiler was found (set CXX, or install g++ or clang++)"
    from torch.utils.cpp_extension import include_paths, library_paths     # (slow to import)
    cflags, ldflags = matvec.FLAGS[0]
    with tempfile.TemporaryDirectory(prefix="minipaged-") as tmp:
        obj, lib = Path(tmp, "panels.o"), Path(tmp, "operators.so")
        steps = [[compiler(), *cflags, "-fPIC", "-c", str(SOURCE.with_name("panels.c")), "-o",
                  str(obj)],
                 [cxx, "-O3", *target_flags(), "-std=c++20", "-fPIC", "-shared", str(SOURCE),
                  str(obj), "-o", str(lib), f"-DPANEL={matvec.PANEL}",
                  f"-DMOST_ROWS={matvec.most_rows(torch.float32)}",
                  f"-DMOST_BF16_ROWS={matvec.most_rows(torch.bfloat16)}",
                  f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                  *(f"-I{p}" for p in include_paths()), *(f"-L{p}" for p in library_paths()),
                  "-ltorch_cpu", "-lc10", *ldflags]]
        try:
            for step in steps:
                subprocess.run(step, check=True, capture_output=True, text=True, timeout=300)
            torch.ops.load_library(str(lib))                           # loaded: tmp may go
            library = ctypes.CDLL(str(lib))
            _install, decode_step = library.minipaged_install_plan, library.minipaged_decode_step
            step_products, swiglu = library.minipaged_step_products, library.minipaged_swiglu
        except (OSError, subprocess.SubprocessError) as e:
            return f"{Path(cxx).name} could not build {SOURCE.name}: {build_error(e)}"
    _install.argtypes, _install.restype = [ctypes.c_void_p], ctypes.c_void_p
    decode_step.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
    decode_step.restype = ctypes.c_int
    step_products.argtypes, step_products.restype = [ctypes.c_void_p, ctypes.c_int64], None
    swiglu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    swiglu.restype = None
    matvec.panel_helper(False)        # (where panel_kernel's copy had one running)
    matvec.add_helper("operators", library.panel_helper, library.panel_helper_state,
                      library.panel_helper_stall)
    matvec.operator_in_cpp = True
    return None


def install(address: int | None) -> int | None:
    """Install the `DecodePlan` at `address` (None: none) for the C++ `attend`'s calls that
    follow; returns the address of the plan it replaces, to put back with `install(before)`.
    Nothing where the kernels are not built."""
    return None if _install is None else _install(address)
