"""The C kernels built for every vector width `minipaged/simd.h` knows, each checked against plain
loops in double precision (tests/kernels_check.c: panels.c's products with float32, bfloat16
and float16 weights, 1 to 30 rows, 1 and 2 threads; cpu_attention.c's walk over scattered
blocks, float32 and bfloat16 keys and values, and stage 4b's int8 slots with their float16
scales, subnormal ones included):

    native   this CPU, as the package builds them (-march=native)
    avx2     AVX2 and FMA, forced with -march=x86-64-v3 on an x86 CPU that runs it
    plain    the generic x86-64 baseline (SSE2 only): simd.h's plain path
    neon     64-bit Arm, cross-compiled with Debian's gcc-aarch64-linux-gnu and run under
             qemu-user (`apt-get install gcc-aarch64-linux-gnu qemu-user`; CI installs them)

Each build prints the vector width it computed with, which must be the one asked for.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from minipaged.cpu_attention import compiler, target_flags

CHECK = Path(__file__).with_name("kernels_check.c")
X86 = platform.machine().lower() in ("x86_64", "amd64")
CROSS = "aarch64-linux-gnu-gcc"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1] for line in text.splitlines()
                     if line.startswith("flags")), "").split())


KV = {"float32": [], "bfloat16": ["-DKV_BF16"], "int8": ["-DKV_INT8"]}   # cpu_attention.c's


def build_and_run(tmp_path, cc, flags, runner=(), kv="float32") -> str:
    """Build kernels_check.c with `cc` and `flags`, run it (through `runner`), return its
    output; the build and the run must succeed."""
    exe = tmp_path / "kernels_check"
    defines = ["-DHEAD_DIM=64", "-DGROUP=3", *KV[kv]]
    subprocess.run([cc, "-O3", *flags, "-fopenmp", "-ffast-math", *defines, str(CHECK), "-o",
                    str(exe), "-lm"], check=True, capture_output=True, text=True, timeout=300)
    done = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def assert_every_check_agreed(output: str, isa: str, kv: str) -> None:
    lines = output.splitlines()
    assert lines[0].startswith(f"vector width: {isa} "), lines[0]
    verdicts = lines[1:]
    assert len(verdicts) == 4 and all(line.startswith("ok ") for line in verdicts), output
    for weights in ("float32", "bfloat16", "float16"):
        assert any(f"panel products, {weights} weights" in line for line in verdicts), output
    assert any(f"paged attention, {kv} keys" in line for line in verdicts), output


def native_isa() -> str:
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "neon" if platform.machine().lower() in ("aarch64", "arm64") else "plain"


@pytest.mark.parametrize("kv", list(KV), ids=[f"kv-{k}" for k in KV])
def test_the_native_build_agrees_with_plain_loops(tmp_path, kv):
    if os.environ.get("MINIPAGED_MARCH"):
        pytest.skip("MINIPAGED_MARCH names another CPU than this one")
    output = build_and_run(tmp_path, compiler(), target_flags(), kv=kv)
    assert_every_check_agreed(output, native_isa(), kv)


@pytest.mark.skipif(not X86, reason="x86 builds run on an x86 CPU")
@pytest.mark.parametrize("isa, march", [("avx2", "x86-64-v3"), ("plain", "x86-64")])
@pytest.mark.parametrize("kv", list(KV), ids=[f"kv-{k}" for k in KV])
def test_the_x86_builds_agree_with_plain_loops(tmp_path, isa, march, kv):
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    output = build_and_run(tmp_path, compiler(), [f"-march={march}"], kv=kv)
    assert_every_check_agreed(output, isa, kv)


def arm_tools() -> str | None:
    """Why the NEON build cannot run here, or None."""
    if not X86:
        return "the NEON build is cross-compiled on an x86 machine (on Arm, it is the native one)"
    missing = [tool for tool in (CROSS, "qemu-aarch64") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found: apt-get install gcc-aarch64-linux-gnu " \
           "qemu-user" if missing else None


@pytest.mark.parametrize("kv", list(KV), ids=[f"kv-{k}" for k in KV])
def test_the_neon_build_agrees_with_plain_loops_under_qemu(tmp_path, kv):
    why = arm_tools()
    if why and os.environ.get("CI") and X86:          # CI installs the tools: never skip there
        pytest.fail(why)
    if why:
        pytest.skip(why)
    output = build_and_run(tmp_path, CROSS, ["-static"], runner=["qemu-aarch64"],
                           kv=kv)
    assert_every_check_agreed(output, "neon", kv)
