"""`compare(stage)`: a stage's small examples run on the learner's code and on the package's,
side by side, for a one-line notebook cell:

    from minipaged.exercises import compare
    yours, reference, figures = compare("2")    # workspace/ here or in the folder above

Stage 2 runs three scenarios (reserve/grow/free, an exact fill of the pool, and refusals that
must change nothing) and returns, per scenario, each call with what it returned or the error
that refused it; it draws every scenario's block tables beside its pool
(`viz.plot_block_tables`), yours first. Stage 6 does the same on a SharedCacheManager (forks
and copy-on-write, an exact fill through shared blocks, refused forks and a grow past a row),
beside parallel samples (`"samples"`: the tokens of n=2 samples per prompt). 3b draws both running softmaxes
(`viz.plot_running_softmax`); 5 both timelines (`viz.plot_timeline`); 6b both beam trees
(`viz.plot_beam_tree`). Stage 7 returns the greedy tokens of the engine with n-gram speculation
and what speculation did (`{"tokens": ..., "stats": SpeculativeStats}`). The other stages return
what they produce (tokens, outputs, a KVWaste; 4b the greedy tokens on int8 blocks) with no
figure.

`yours` is a sentence instead when the workspace has no folder, leaves a function unwritten,
or raises (the error and your line that raised it): then only the reference runs and is drawn,
so nothing of the package's is passed off as yours.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import NamedTuple

import torch

from .. import fragmentation, generate, tensor_parallel
from ..beams import BeamSearch
from ..cache_manager import CacheManager
from ..chunked_engine import ChunkedEngine
from ..engine import Engine
from ..errors import OutOfBlocksError, RequestError
from ..online_softmax import paged_attention_v1
from ..sharing import SharedCacheManager
from ..speculative import SpeculativeEngine
from ..viz import plot_beam_tree, plot_block_tables, plot_running_softmax, plot_timeline
from . import checks
from .grader import raised_where, load_workspace_file, stand_in
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


class PoolRun(NamedTuple):
    """Stage 2's result for one scenario: the manager after it, and each call with what it
    returned (or the error that refused it)."""
    manager: CacheManager
    calls: list


def _calls(cm, calls) -> PoolRun:
    """Run (method, *args) calls on `cm`, recording each result or refusal in a line."""
    out = []
    for name, *args in calls:
        shown = f"{name}({', '.join(map(str, args))})"
        try:
            out.append(f"{shown} -> {getattr(cm, name)(*args)}")
        except (OutOfBlocksError, RequestError) as e:
            out.append(f"{shown} -> refused: {type(e).__name__}")
    return PoolRun(cm, out)


# stage 2's scenarios: (pool: num_blocks, block_size, max_blocks_per_seq), the calls
POOL_SCENARIOS = {
    "reserve, grow, free, reserve again": ((24, 4, 24), [
        ("reserve", 0, 9), ("reserve", 1, 14), ("reserve", 2, 5), ("grow", [0, 2], 6),
        ("free", 1), ("reserve", 3, 11)]),
    "an exact fill: every block full": ((12, 4, 6), [
        ("reserve", 0, 18), ("reserve", 1, 16), ("reserve", 2, 10), ("grow", [0, 2], 2)]),
    "refusals: too few blocks, a row too short, ids not live or live already": ((8, 4, 4), [
        ("reserve", 0, 14), ("reserve", 1, 9), ("reserve", 2, 7), ("grow", [1], 8),
        ("grow", [3], 1), ("reserve", 1, 4), ("free", 0), ("free", 0), ("reserve", 2, 7)]),
}


# stage 6's scenarios, on a SharedCacheManager: the same shape as stage 2's
SHARING_SCENARIOS = {
    "fork, then both write: copy-on-write": ((12, 4, 6), [
        ("reserve", 0, 6), ("fork", 0, 1), ("grow", [0, 1], 1), ("fork", 1, 2),
        ("grow", [2], 3), ("free", 0)]),
    "an exact fill through shared blocks": ((6, 4, 6), [
        ("reserve", 0, 16), ("fork", 0, 1), ("fork", 0, 2), ("grow", [1], 4), ("grow", [2], 4),
        ("grow", [0], 1)]),
    "refusals: a fork from a sequence not live, onto a live one, a grow past a row": ((8, 4, 3), [
        ("reserve", 0, 9), ("fork", 2, 3), ("reserve", 1, 2), ("fork", 0, 1), ("grow", [0], 4),
        ("free", 1), ("fork", 0, 1), ("grow", [0, 1], 1)]),
}


def _pools(scenarios=POOL_SCENARIOS, manager=CacheManager) -> dict:
    """Stages 2 and 6: each scenario on a fresh manager (seed 0)."""
    out = {}
    for name, ((num_blocks, block_size, row), calls) in scenarios.items():
        cm = manager(num_blocks, block_size, 1, 1, max_seqs=4, max_blocks_per_seq=row, seed=0)
        out[name] = _calls(cm, calls)
    return out


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


def _ranks():
    """Stage 9: the shapes of layer 0's attention weights on each of 2 ranks, and a worker's
    tables after each of 6 steps' messages."""
    model = checks.stage9._model(False)
    shapes = {r: {k: tuple(w.shape) for k, w in tensor_parallel.rank_state_dict(model, r, 2).items()
                  if k.startswith("layers.0.attention.")} for r in range(2)}
    worker, tables = {}, []
    for before, after in checks.stage9._random_steps(0, 6):
        worker = tensor_parallel.apply_changes(worker, tensor_parallel.step_changes(before, after))
        tables.append(worker)
    return {"weights per rank": shapes, "a worker's tables, step by step": tables}


def _run(stage: str):
    model, prompts = checks.common.tiny_model(), checks.common.prompts_of((3, 9, 14))
    if stage == "1":
        return generate(model, prompts, 6, cache="contiguous", stop_tokens=[])
    if stage == "2":
        return _pools()
    if stage == "3":
        cache = checks.stage3._CallPerLayer(model.args, 64, 4, 3, model.args.max_seq_len,
                                     dtype=torch.float64)
        return generate(model, prompts, 6, cache=cache, stop_tokens=[])
    if stage == "3b":
        return _walk()
    if stage == "4":
        return fragmentation.waste([5, 9, 2], [8, 12, 4], [6, 12, 3], capacity=40,
                                   pieces=[4, 8, 4], next_need=10)
    if stage == "4b":
        return generate(model, prompts, 6, cache="paged", block_size=4, kv_dtype="int8",
                        stop_tokens=[], backend="torch")
    if stage in ("5", "5b"):
        options = dict(max_num_batched_tokens=4) if stage == "5b" else {}
        engine = (Engine if stage == "5" else ChunkedEngine)(
            model, 6, 4, record=True, **options)
        for p in prompts:
            engine.add_request(p, 6, stop_tokens=[])
        engine.run()
        return engine
    if stage == "6":
        samples = generate(model, prompts, 5, cache="paged", block_size=4, n=2, temperature=1.0,
                           stop_tokens=[], backend="torch")
        return {"samples": samples, **_pools(SHARING_SCENARIOS, SharedCacheManager)}
    if stage == "7":
        engine = SpeculativeEngine(model, 32, 4, max_num_seqs=4, backend="torch",
                                   speculative="ngram", num_speculative_tokens=3)
        for p in checks.stage7._repetitive_prompts():
            engine.add_request(p, 10, stop_tokens=[])
        return {"tokens": [r.output for r in engine.run()], "stats": engine.spec}
    if stage == "9":
        return _ranks()
    search = BeamSearch(model, prompts[1], 3, 5, cache="paged", block_size=2, stop_tokens=[],
                        backend="torch")
    search.run()
    return search


def _draw(stage: str, result, who: str):
    """The figures of one run; stage 2 draws each scenario's block tables beside the pool."""
    if stage in ("2", "6"):
        return [plot_block_tables(run.manager, title=f"{who} blocks: {name}")
                for name, run in result.items() if isinstance(run, PoolRun)]
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


def find_workspace(workspace=None) -> Path:
    """The workspace folder: the one given, else `workspace/` in the current folder or the one
    above it (a notebook runs in notebooks/, a script in the repository root)."""
    if workspace is not None:
        return Path(workspace)
    here = Path.cwd()
    for folder in (here / "workspace", here.parent / "workspace"):
        if folder.is_dir():
            return folder
    return Path("workspace")


def _yours(stage: str, workspace: Path, given: bool):
    """The stage's run on the workspace's functions, or the sentence that says why not."""
    if not workspace.is_dir():
        where = workspace if given else "workspace/ (looked here and in the folder above)"
        return (f"no workspace at {where}: run `python -m minipaged.exercises start` from the "
                f"repository root, write stage {stage}'s tasks, and run this again; only the "
                f"reference is shown")
    try:
        with learner(stage, workspace):
            return _run(stage)
    except NotImplementedError as e:
        return str(e)
    except Exception as e:                      # the learner's code broke: one sentence
        return f"your code raised {raised_where(e)}; the reference's run is shown beside it"


def compare(stage="2", workspace=None, draw: bool = True) -> Comparison:
    """Run stage `stage`'s example on the workspace's functions and on the package's.
    `workspace`: a folder, or None for `workspace/` here or in the folder above."""
    stage = str(stage)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {' '.join(STAGES)}, not {stage!r}")
    yours = _yours(stage, find_workspace(workspace), workspace is not None)
    reference = _run(stage)
    figures = []
    if draw:
        for result, who in ((yours, "your"), (reference, "the reference's")):
            if not isinstance(result, str):
                drawn = _draw(stage, result, who)
                figures += drawn if isinstance(drawn, list) else [drawn]
        figures = [f for f in figures if f is not None]
    if stage in ("2", "6"):
        def calls(run):
            return {k: r.calls if isinstance(r, PoolRun) else r for k, r in run.items()}
        yours = yours if isinstance(yours, str) else calls(yours)
        reference = calls(reference)
    elif stage in ("5", "5b"):
        yours = yours if isinstance(yours, str) else [r.output for r in yours.requests]
        reference = [r.output for r in reference.requests]
    elif stage == "6b":
        yours = yours if isinstance(yours, str) else yours.results()
        reference = reference.results()
    return Comparison(yours, reference, figures)
