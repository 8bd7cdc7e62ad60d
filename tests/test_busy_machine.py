"""OpenMP's waiting threads: `import minipaged` makes them spin 10,000 turns before they sleep
(GOMP_SPINCOUNT) when torch is not loaded yet and the user has not chosen; GNU OpenMP's own
report of its settings (OMP_DISPLAY_ENV) is the ground truth. And the busy-machine benchmark
runs small."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minipaged.benchmarks import busy_machine

ROOT = Path(__file__).resolve().parents[1]


def openmp_spin_count(code: str, **env) -> str:
    """GNU OpenMP's spin count as it reports it in a child running `code`, or "" where the
    OpenMP runtime does not report one."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code],
                         env={**clean, "PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "verbose",
                              **env}, capture_output=True, text=True, check=True, cwd=ROOT)
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    return spin.group(1) if spin else ""


def test_importing_minipaged_first_makes_waiting_threads_spin_briefly():
    assert openmp_spin_count("import minipaged") in ("10000", "")
    assert openmp_spin_count("import torch") in ("300000", "")      # OpenMP's own default


def test_a_users_choice_and_a_torch_loaded_first_are_left_alone():
    assert openmp_spin_count("import minipaged", GOMP_SPINCOUNT="500") in ("500", "")
    assert openmp_spin_count("import minipaged", OMP_WAIT_POLICY="passive") in ("0", "")
    assert openmp_spin_count("import torch, minipaged") in ("300000", "")


def test_the_benchmark_runs_each_way_quiet_and_busy():
    ways = ["spinning", "fixed", "minipaged", "passive", "spin=1000"]
    rates = busy_machine.compare(ways, "float32", 2, 2, 1, 1, random_model=True)
    assert list(rates) == ways
    for way in rates.values():
        assert len(way["quiet"]) == len(way["busy"]) == 1
        assert all(r > 0 for r in way["quiet"] + way["busy"])


@pytest.mark.parametrize("argv,named", [(["--threads", "0"], "--threads"),
                                         (["--ways", "spin=lots"], "spin=lots")])
def test_bad_arguments_get_one_error_line(argv, named):
    out = subprocess.run([sys.executable, "-m", "minipaged.benchmarks.busy_machine", *argv],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error:") and named in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
