"""Stage 3b: the block walk as a C kernel for CPUs — `backend="cpu"`.

Stage 3's PyTorch path copies each row's blocks into one tensor before it attends: on a GPU
that copy is why vLLM wrote a kernel, and on a CPU it is why paging cost a few percent at
batch 1 (lesson 03). `cpu_attention.c` is `online_softmax.py`'s walk in C, for a decode
step: each (row, KV head) reads its blocks where they lie in the pool, one tile of keys at a
time, with a running max and sum, in float32 whatever the cache holds (bf16 keys and values
are widened as they are read, not copied first). The (row, KV head) pairs are shared among
torch's threads with OpenMP.

The C compiler the machine has (`$CC`, else `cc`, `gcc` or `clang`) builds it the first time
a step needs it, once per (KV dtype, head dim, group size), into a temporary file; a build
takes under a second. Where no compiler can build it, `why_not_cpu` says so (and the speed
layer's "auto" runs stage 3's PyTorch path instead).

Only decode steps (one query per row, fp32 or bf16) reach the kernel; prompts and other
dtypes take stage 3's gather path, as vLLM's first versions sent prompts through ordinary
attention and kept the paged kernel for decode. Importing this module registers "cpu" with
`flash_attn_with_kvcache`; it runs when asked for (`backend="cpu"`), or through the speed layer
(`minipaged.fast`), whose "auto" picks it on a CPU where it builds. Stage 3's "auto" never does.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .paged_attention import BACKENDS, register_backend

SOURCE = Path(__file__).with_name("cpu_attention.c")
KV_TYPES = {torch.float32: [], torch.bfloat16: ["-DKV_BF16"],   # the kernel's KV dtypes
            torch.int8: ["-DKV_INT8"]}                           # (int8: stage 4b's slots)


def target_flags(machine: str = platform.machine()) -> list[str]:
    """The flags that say which CPU the C kernels are built for: this one, or the one the
    environment variable MINIPAGED_MARCH names (`MINIPAGED_MARCH=x86-64-v3` builds AVX2 code on
    an AVX-512 CPU, to run and measure it there). On x86, -mprefer-vector-width=512: on a CPU
    with AVX-512, gcc otherwise stops at 256-bit vectors; elsewhere the option does not exist,
    and Arm's compilers name the CPU with -mcpu=native."""
    march = os.environ.get("MINIPAGED_MARCH", "native")
    if machine.lower() in ("x86_64", "amd64", "i386", "i686"):
        return [f"-march={march}", "-mprefer-vector-width=512"]
    return ["-mcpu=native"] if march == "native" else [f"-march={march}"]


# (compile flags, link flags), tried in turn until one builds. -ffast-math lets the compiler
# use glibc's vector exp (libmvec); it is given when compiling only, never when linking, where
# gcc would add code that makes the whole process flush tiny floats to zero. Compilers without
# OpenMP (Apple's clang) or without libmvec get the later lines.
FLAGS = [(["-O3", *target_flags(), "-fopenmp", "-ffast-math"], ["-fopenmp", "-lmvec"]),
         (["-O3", *target_flags(), "-fopenmp"], ["-fopenmp"]),
         (["-O3"], [])]


def compiler() -> str | None:
    """The C compiler to build with: $CC, else the first of cc, gcc, clang on the PATH."""
    return os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))),
                                        None)


@functools.cache
def build(dtype: torch.dtype, head_dim: int, group: int):
    """The compiled `paged_attention_decode` for keys and values of `dtype`, or a sentence
    saying why it could not be built."""
    functions = build_function(SOURCE, ("paged_attention_decode", "attention_isa"),
                               [f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}", *KV_TYPES[dtype]])
    if isinstance(functions, str):
        return functions
    kernel, isa = functions
    P, I = ctypes.c_void_p, ctypes.c_int
    kernel.argtypes = [P, P, P, P, ctypes.c_int64, P, I, I, I, ctypes.c_float, P, I]
    kernel.restype = None
    isa.restype = ctypes.c_char_p
    built_for[dtype, head_dim, group] = isa().decode()
    return kernel


built_for = {}     # (dtype, head dim, group) of each kernel built: its vector width (simd.h)


def build_function(source: Path, name, defines=(), flags=FLAGS):
    """The C function `name` of `source` (a tuple of them for a tuple of names), compiled with
    `defines` by the machine's compiler, the first line of `flags` that builds it winning; or a
    sentence saying why none could."""
    cc = compiler()
    if cc is None:
        return "no C compiler was found (set CC, or install gcc or clang)"
    error = ""
    # (a system that cannot delete a loaded library, Windows, keeps the folder rather than fail)
    with tempfile.TemporaryDirectory(prefix="minipaged-", ignore_cleanup_errors=True) as tmp:
        obj, lib = Path(tmp, "kernel.o"), Path(tmp, "kernel.so")
        for cflags, ldflags in flags:
            steps = [[cc, *cflags, "-fPIC", *defines, "-c", str(source), "-o", str(obj)],
                     [cc, "-shared", str(obj), "-o", str(lib), *ldflags, "-lm"]]
            try:
                for step in steps:
                    subprocess.run(step, check=True, capture_output=True, text=True, timeout=120)
                library = ctypes.CDLL(str(lib))                        # loaded: tmp may go
                return getattr(library, name) if isinstance(name, str) else \
                    tuple(getattr(library, n) for n in name)
            except (OSError, subprocess.SubprocessError) as e:   # the next line of flags
                error = build_error(e)
    return f"{Path(cc).name} could not build {source.name}: {error}"


def build_error(e: Exception) -> str:
    """The line of a failed build that says why: the compiler's first line naming an error
    (its output may open with "In file included from ..."), else its first line, else the
    exception's."""
    lines = (getattr(e, "stderr", None) or str(e)).strip().splitlines() or [type(e).__name__]
    return next((line for line in lines if "error" in line), lines[0])


def why_not_cpu(q, k_cache) -> str | None:
    """Why the C kernel cannot serve a call (not on a CPU; no compiler builds it), or None."""
    if q.device.type != "cpu":
        return f"the C kernel runs on a CPU, and the tensors are on {q.device}"
    if k_cache.dtype not in KV_TYPES:
        return None                       # served by the gather path: nothing to build
    kernel = build(k_cache.dtype, q.shape[-1], q.shape[2] // k_cache.shape[2])
    return kernel if isinstance(kernel, str) else None


def cpu_paged_attention(q, k_cache, v_cache, block_table, seqlens_k, causal=True,
                        softmax_scale=None, num_splits=0):
    """The "cpu" backend: a decode step through the C kernel, anything else through stage 3's
    gather path. With one query per row, `causal` changes nothing (the query is the row's last
    key) and `num_splits` is a GPU kernel's knob."""
    if q.shape[1] != 1 or k_cache.dtype not in KV_TYPES or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        return BACKENDS["torch"].attend(q, k_cache, v_cache, block_table, seqlens_k, causal,
                                        softmax_scale, num_splits)
    return decode_attention(q, k_cache, v_cache, block_table, seqlens_k,
                            softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5)


def decode_attention(q, k_cache, v_cache, block_table, seqlens_k, scale):
    """The kernel's call: q (B, 1, Hq, D), row b over its seqlens_k[b] keys in the blocks of
    block_table[b] of a float32 or bfloat16 pool; (B, 1, Hq, D) out, in q's dtype."""
    B, _, Hq, D = q.shape
    block_size, Hk = k_cache.shape[1:3]
    kernel = build(k_cache.dtype, D, Hq // Hk)      # built once; a sentence if it could not be
    if isinstance(kernel, str):
        raise RuntimeError(f"the C kernel cannot run this call: {kernel}")
    q32 = q.reshape(B, Hq, D).float().contiguous()
    table = block_table.to(torch.int64).contiguous()                   # (B, width)
    lens = seqlens_k.to(torch.int64).contiguous()                      # (B,)
    out = torch.empty(B, 1, Hq, D)
    kernel(q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
           table.shape[1], lens.data_ptr(), B, Hk, block_size, scale, out.data_ptr(),
           torch.get_num_threads())
    return out.to(q.dtype)


register_backend("cpu", cpu_paged_attention, why_not_cpu)
