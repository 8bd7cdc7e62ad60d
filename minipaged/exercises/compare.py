"""`compare(stage, workspace)`: the learner's code and the package's, side by side, in one call
a notebook cell can make."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .grader import load_workspace_file, stand_in
from .tasks import select


@contextlib.contextmanager
def learner(stage: str, workspace):
    """Inside, every function of `stage` the workspace defines stands in for the package's."""
    with contextlib.ExitStack() as stack:
        for t in select(stage):
            path = Path(workspace) / t.file
            fn = getattr(load_workspace_file(path), t.name, None) if path.exists() else None
            if fn is not None:
                stack.enter_context(stand_in(t.target, fn))
        yield


def _pool_after(seed: int = 0):
    """A CacheManager after three requests were reserved, grew and one was freed."""
    from ..cache_manager import CacheManager
    cm = CacheManager(24, 4, 1, 1, max_seqs=4, max_blocks_per_seq=24, seed=seed)
    for s, n in enumerate((9, 14, 5)):
        cm.reserve(s, n)
    cm.grow([0, 2], 6)
    cm.free(1)
    cm.reserve(3, 11)
    return cm


def compare(stage: str = "2", workspace="workspace", draw: bool = True):
    """Run the stage's example on your workspace and on the package; return (yours, reference)
    and, with `draw`, a figure of both. Stage 2 draws the pool grid (`viz.plot_pool`); the
    other stages return their tokens (paged vs contiguous) or outputs side by side."""
    from . import checks
    stage = str(stage)

    def run():
        if stage == "2":
            return _pool_after()
        if stage in ("1", "3", "3b"):
            return checks.contiguous_tokens.__wrapped__((3, 9, 14), 6) if stage == "1" else \
                __import__("minipaged.paged_cache", fromlist=["generate_paged"]).generate_paged(
                    checks.tiny_model(), checks.prompts_of((3, 9, 14)), 6, block_size=4,
                    backend="torch", stop_tokens=[])
        from .. import generate
        options = dict(num_blocks=6, block_size=4) if stage in ("5", "5b") else \
            dict(block_size=4, n=2, temperature=1.0)
        if stage == "5b":
            options["max_num_batched_tokens"] = 4
        return generate(checks.tiny_model(), checks.prompts_of((3, 9, 14)), 6, cache="paged",
                        stop_tokens=[], backend="torch", **options)

    try:
        with learner(stage, workspace):
            yours = run()
    except NotImplementedError as e:
        yours = f"not written yet: {e}"
    reference = run()
    if draw and stage == "2" and not isinstance(yours, str):
        from ..viz import plot_pool
        fig = plot_pool([yours, reference], titles=["your blocks", "the reference's blocks"])
        return yours, reference, fig
    return yours, reference
