"""OpenMP's wait policy: `import minipaged` makes waiting threads sleep (OMP_WAIT_POLICY=PASSIVE)
when torch is not loaded yet and the user has not chosen; GNU OpenMP's own report of its
settings (OMP_DISPLAY_ENV) is the ground truth. And the busy-machine benchmark runs small."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minipaged.benchmarks import busy_machine

ROOT = Path(__file__).resolve().parents[1]


def openmp_settings(code: str, **env) -> tuple[str, str]:
    """(OMP_WAIT_POLICY in the child's environment, GNU OpenMP's spin count as it reports it,
    or "" where the OpenMP runtime does not report one)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code + "\nimport os\n"
                          "print('policy=' + os.environ.get('OMP_WAIT_POLICY', ''))"],
                         env={**clean, "PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "verbose",
                              **env}, capture_output=True, text=True, check=True, cwd=ROOT)
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    return out.stdout.split("policy=")[-1].strip(), spin.group(1) if spin else ""


def test_importing_minipaged_first_makes_openmp_threads_sleep_when_they_wait():
    policy, spin = openmp_settings("import minipaged")
    assert policy == "PASSIVE"
    assert spin in ("0", "")                 # GNU OpenMP: no spinning at all


def test_a_users_choice_and_a_torch_loaded_first_are_left_alone():
    policy, spin = openmp_settings("import minipaged", OMP_WAIT_POLICY="active")
    assert policy == "active"
    assert spin != "0"
    policy, spin = openmp_settings("import torch, minipaged")
    assert policy == ""                      # too late to matter: not set at all
    assert spin != "0"


def test_the_benchmark_runs_each_way_quiet_and_busy():
    ways = ["spinning", "passive", "spin=1000"]
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
