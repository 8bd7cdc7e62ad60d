"""`compare(stage, workspace)`: a stage's small example run on the learner's code and on the
package's, side by side, for a one-line notebook cell:

    from minipaged.exercises import compare
    yours, reference, figures = compare("2", "workspace")

Stage 2 draws both pools (`viz.plot_pool`: your blocks, the reference's blocks); 3b both
running softmaxes (`viz.plot_running_softmax`); 5 both timelines (`viz.plot_timeline`); 6b both
beam trees (`viz.plot_beam_tree`). Stage 7 returns the greedy tokens of the engine with n-gram
speculation and what speculation did (`{"tokens": ..., "stats": SpeculativeStats}`). The other
stages return what they produce (tokens, outputs, a KVWaste) with no figure. A function the workspace leaves unwritten makes `yours` the sentence
that says so; so does a workspace folder that does not exist (then only the reference runs and
only its figure is drawn: nothing of the package's is passed off as yours).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import NamedTuple

import torch

from .. import fragmentation, generate
from ..beams import BeamSearch
from ..cache_manager import CacheManager
from ..chunked_engine import ChunkedEngine
from ..engine import Engine
from ..online_softmax import paged_attention_v1
from ..speculative import SpeculativeEngine
from ..viz import plot_beam_tree, plot_pool, plot_running_softmax, plot_timeline
from . import checks
from .grader import load_workspace_file, stand_in
from .tasks import STAGES, select


class Comparison(NamedTuple):
    yours: object          # what the stage produced on your code (or why it could not run)
    reference: object      # the same on the package's code
    figures: list          # matplotlib figures, yours first then the reference's (may be empty)


@contextlib.contextmanager
def learner(stage: str, workspace):
    """Inside, every function of `stage` that the workspace defines stands in for the package's."""
    with contextlib.ExitStack() as stack:
        for t in select(stage):
            path = Path(workspace) / t.file
            fn = getattr(load_workspace_file(path), t.name, None) if path.exists() else None
            if fn is not None:
                stack.enter_context(stand_in(t.target, fn))
        yield


def _pool():
    """Stage 2: a CacheManager after requests were reserved, grew, and one was freed."""
    cm = CacheManager(24, 4, 1, 1, max_seqs=4, max_blocks_per_seq=24, seed=0)
    for s, n in enumerate((9, 14, 5)):
        cm.reserve(s, n)
    cm.grow([0, 2], 6)
    cm.free(1)
    cm.reserve(3, 11)
    return cm


def _walk():
    """Stage 3b: one row of 10 keys in blocks of 3, walked by paged_attention_v1 with a trace."""
    (q, k, v, k_cache, v_cache, table, _, _) = checks.stage3._paged_case(3, 1, 2, 1, [7], 3, seed=5)
    for t in range(3):
        p = 7 + t
        k_cache[int(table[0, p // 3]), p % 3], v_cache[int(table[0, p // 3]), p % 3] = k[0, t], v[0, t]
    trace = []
    out = paged_attention_v1(q, k_cache, v_cache, torch.where(table >= 0, table, 0).long(),
                             torch.tensor([10]), trace=trace)
    return out, trace


def _run(stage: str):
    model, prompts = checks.common.tiny_model(), checks.common.prompts_of((3, 9, 14))
    if stage == "1":
        return generate(model, prompts, 6, cache="contiguous", stop_tokens=[])
    if stage == "2":
        return _pool()
    if stage == "3":
        cache = checks.stage3._CallPerLayer(model.args, 64, 4, 3, model.args.max_seq_len,
                                     dtype=torch.float64)
        return generate(model, prompts, 6, cache=cache, stop_tokens=[])
    if stage == "3b":
        return _walk()
    if stage == "4":
        return fragmentation.waste([5, 9, 2], [8, 12, 4], [6, 12, 3], capacity=40,
                                   pieces=[4, 8, 4], next_need=10)
    if stage in ("5", "5b"):
        options = dict(max_num_batched_tokens=4) if stage == "5b" else {}
        engine = (Engine if stage == "5" else ChunkedEngine)(
            model, 6, 4, record=True, **options)
        for p in prompts:
            engine.add_request(p, 6, stop_tokens=[])
        engine.run()
        return engine
    if stage == "6":
        return generate(model, prompts, 5, cache="paged", block_size=4, n=2, temperature=1.0,
                        stop_tokens=[], backend="torch")
    if stage == "7":
        engine = SpeculativeEngine(model, 32, 4, max_num_seqs=4, backend="torch",
                                   speculative="ngram", num_speculative_tokens=3)
        for p in checks.stage7._repetitive_prompts():
            engine.add_request(p, 10, stop_tokens=[])
        return {"tokens": [r.output for r in engine.run()], "stats": engine.spec}
    search = BeamSearch(model, prompts[1], 3, 5, cache="paged", block_size=2, stop_tokens=[],
                        backend="torch")
    search.run()
    return search


def _draw(stage: str, result, who: str):
    if stage == "2":
        return plot_pool([result], titles=[f"{who} blocks"])
    if stage == "3b":
        fig = plot_running_softmax(result[1])
        fig.suptitle(f"{who} online-softmax walk", fontsize=10, x=0.01, ha="left")
        fig.tight_layout()
        return fig
    if stage == "5":
        return plot_timeline(result.history, title=f"{who} scheduler")
    if stage == "6b":
        return plot_beam_tree(result.history, title=f"{who} beams (each labelled with its token id)")
    return None


def compare(stage="2", workspace="workspace", draw: bool = True) -> Comparison:
    """Run stage `stage`'s example on the workspace's functions and on the package's."""
    stage = str(stage)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {' '.join(STAGES)}, not {stage!r}")
    if not Path(workspace).is_dir():
        yours = (f"no workspace at {workspace}: run `python -m minipaged.exercises start` from the "
                 f"repository root, write stage {stage}'s tasks, and run this again; "
                 f"only the reference is shown")
    else:
        try:
            with learner(stage, workspace):
                yours = _run(stage)
        except NotImplementedError as e:
            yours = str(e)
    reference = _run(stage)
    figures = []
    if draw:
        if not isinstance(yours, str):
            figures.append(_draw(stage, yours, "your"))
        figures.append(_draw(stage, reference, "the reference's"))
        figures = [f for f in figures if f is not None]
    if stage in ("5", "5b"):
        yours = yours if isinstance(yours, str) else [r.output for r in yours.requests]
        reference = [r.output for r in reference.requests]
    elif stage == "6b":
        yours = yours if isinstance(yours, str) else yours.results()
        reference = reference.results()
    return Comparison(yours, reference, figures)
