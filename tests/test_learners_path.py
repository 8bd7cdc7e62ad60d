"""What stage 3 runs by default is what lesson 03 teaches: no later stage's code, no speed layer.

`generate_paged(model, prompts, n)` with its defaults runs under `sys.setprofile`, which sees
every Python function call; the test fails if any function of a later stage's module (3b: the
kernels; 4, 5, 5b, 6, 6b) or of the speed layer (`minipaged/fast/`) executed, and checks that
the paged attention was served by stage 3's PyTorch path (on a CPU). Ground truth for the
tokens is the no-cache forward (`greedy_reference`).
"""

import sys
from pathlib import Path

import pytest
import torch
from conftest import greedy_reference, tiny_model

import minipaged
from minipaged import backends
from minipaged.paged_generation import generate_paged

PACKAGE = Path(minipaged.__file__).resolve().parent
LATER = ["online_softmax", "triton_attention", "cpu_attention",                  # 3b
         "fragmentation", "workloads", "simulator",                              # 4
         "scheduler", "swap", "engine",                                          # 5
         "chunked_prefill", "chunked_engine",                                    # 5b
         "prefix_cache", "sharing", "sharing_engine",                            # 6
         "beams", "api"]                                                         # 6b, above all


def later_files():
    files = {str(PACKAGE / f"{name}.py") for name in LATER}
    files |= {str(p) for p in (PACKAGE / "fast").rglob("*.py")}
    return files


def run_traced(fn):
    """Run fn() under sys.setprofile; returns (its result, the files of every Python function
    that was called)."""
    called = set()

    def profiler(frame, event, arg):
        if event == "call":
            called.add(str(Path(frame.f_code.co_filename).resolve()))

    sys.setprofile(profiler)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, called


def stage_3_default(model, prompts, n, **options):
    return lambda: generate_paged(model, prompts, n, stop_tokens=[], **options)


@pytest.mark.parametrize("model", [minipaged.load_model, lambda: tiny_model(n_layers=2)],
                         ids=["embedded", "tiny"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CPU, stage 3's default is PyTorch")
def test_stage_3s_default_runs_no_later_stage(model):
    model = model()
    prompts = [[5, 9, 2, 77, 31, 8, 4, 19, 23, 3, 1, 2, 3, 4, 5, 6, 7, 8], [100, 3]]
    out, called = run_traced(stage_3_default(model, prompts, 6, block_size=4))
    assert out == [greedy_reference(model, p, 6) for p in prompts]
    later = sorted(called & later_files())
    assert not later, f"stage 3's default path ran code of later stages: {later}"
    assert str(PACKAGE / "paged_attention.py") in called      # the call lesson 03 teaches ran
    assert backends.last_backend == "torch"


def test_the_trace_sees_a_later_stage_when_one_runs():
    """The same trace catches a later stage's code: asked for the C kernel (stage 3b), stage
    3's generation runs cpu_attention.py, and the check above would fail."""
    model = tiny_model(n_layers=2)
    _, called = run_traced(stage_3_default(model, [[5, 9, 2, 77], [100, 3]], 4, block_size=4,
                                           backend="cpu"))
    assert str(PACKAGE / "cpu_attention.py") in called & later_files()
    assert backends.last_backend == "cpu"
