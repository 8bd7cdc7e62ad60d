"""`minipaged.generate`, `minipaged.beam_search` and `minipaged.Engine`: one call above every stage.

Not a stage itself: each stage runs on its own (`generation.generate_static` for stage 1,
`paged_generation.generate_paged` for stage 3, the engines of stages 5 and 6). `generate` picks one
by its `cache` argument, so a reader can swap caches and compare tokens one for one:

    cache="contiguous"   stage 1: a static batch on the cache reserved up front
    cache="paged"        stage 7's engine (speculation if asked for, on stage 6's shared blocks)
    cache=<an object>    a static batch on that cache (a ContiguousCache, a PagedCache, ...)

`beam_search` is stage 6b's own function (`beams.py`), public as it is.
"""

from __future__ import annotations

from functools import partial

import torch

from .beams import beam_search     # stage 6b's, public as it is
from .cache_checks import check_memory
from .checks import check_request, check_stop_tokens, check_whole, whole
from .errors import RequestError
from .generation import generate_static, row_generator
from .kv_budget import bytes_per_block
from .sizing import pool_blocks
from .disaggregated_run import Job, serve_disaggregated
from .speculative import SpeculativeEngine
from .ranks import run_ranks
from .tensor_parallel import check_world_size, load_shard, rank_state_dict
from .tp_engine import TensorParallelEngine
from .tp_group import Group, follow, start_engine

__all__ = ["Engine", "PAGED_OPTIONS", "beam_search", "generate"]
PAGED_OPTIONS = ("block_size", "num_blocks", "kv_budget", "preemption", "num_cpu_blocks",
                 "watermark", "backend", "max_num_seqs", "prefix_caching",
                 "max_num_batched_tokens", "speculative", "num_speculative_tokens",
                 "draft_policy", "prompt_lookup_min", "kv_dtype")


@torch.inference_mode()
def generate(model, prompts, max_new_tokens, cache="contiguous", temperature: float = 0.0,
             top_p: float = 1.0, stop_tokens=None, seed: int = 0, max_seq_len: int | None = None,
             callback=None, n: int = 1, engine_class=None, tensor_parallel: int = 1,
             disaggregated: bool = False, **paged_options):
    """Continue each prompt (a list of token ids); return only the new tokens, in prompt order.

    max_new_tokens: one int, or one per prompt. temperature=0 is greedy; sampling is seeded, and
    prompt i draws from its own stream (`row_generator(seed, i)`), whatever the cache.
    stop_tokens: None uses the model's, [] never stops early; a stop token ends its sequence and
    is not returned. callback(event, seq_id, token, cache) follows every token.

    cache="paged" serves the prompts on the engine; its options (`PAGED_OPTIONS`): block_size
    (16), num_blocks or kv_budget (bytes; default: room for every sequence at once, so nobody
    is preempted), preemption ("recompute" or "swap"), num_cpu_blocks, watermark, backend,
    max_num_seqs, prefix_caching (False unless asked for), max_num_batched_tokens (None:
    whole prefills; N: no step runs more than N tokens, prompts are prefilled in chunks), and
    speculative="ngram" with num_speculative_tokens=k (stage 7: up to k drafts a step),
    draft_policy ("fixed", stage 7's default: every step drafts up to k; "adaptive": only
    drafts expected to pay, the speed layer's default) and kv_dtype (None: the model's dtype;
    "int8": int8 blocks with their scales, stage 4b). A pool
    too small for all the prompts at once makes the engine admit and preempt rather than fail.

    n=K returns K samples per prompt, each entry a list of K token lists (n=1 keeps the flat
    shape). Sample j of prompt i draws from stream i * K + j: the stream it would get if each
    prompt were listed K times with n=1. On the paged cache the K samples share the prompt's
    blocks; on the contiguous cache each runs alone. The tokens are the same either way.

    engine_class: the engine cache="paged" runs on (default `Engine`; the speed layer's
    `minipaged.fast.FastEngine` runs the same steps faster).

    tensor_parallel=N (stage 9) serves cache="paged" on N processes, each holding 1/N of every
    layer's heads and of their KV blocks (a kv_budget is then each process's); rank 0's engine
    schedules, the others follow its messages (`tp_engine.py`); the same tokens.

    disaggregated=True (stage 9b) prefills on one engine and decodes on another, in two
    processes, moving each prompt's KV blocks between them (the options size each engine's
    pool; max_num_batched_tokens chunks the prefills); the same tokens.
    """
    if not whole(n) or n < 1:
        raise RequestError(f"n (samples per prompt) must be a positive integer, not {n!r}")
    unknown = sorted(set(paged_options) - set(PAGED_OPTIONS))
    if unknown:
        raise RequestError(f"generate() takes no option {', '.join(unknown)}; the paged cache's "
                           f"options are {', '.join(PAGED_OPTIONS)}")
    check_arguments(model, prompts, max_new_tokens, cache, temperature, top_p, stop_tokens, seed,
                    callback, n)
    num_prompts = len(prompts) if isinstance(prompts, (list, tuple)) else 0
    if disaggregated is not False:
        out = _serve_disaggregated(model, cache, engine_class, tensor_parallel, disaggregated,
                                   prompts, max_new_tokens, temperature, top_p, stop_tokens,
                                   seed, max_seq_len, callback, n, paged_options)
    elif tensor_parallel != 1:
        out = _serve_parallel(tensor_parallel, model, cache, engine_class, prompts,
                              max_new_tokens, temperature, top_p, stop_tokens, seed, max_seq_len,
                              callback, n, paged_options)
    elif cache == "paged":
        out = _serve(engine_class or Engine, model, prompts, max_new_tokens, temperature, top_p,
                     stop_tokens, seed, max_seq_len, callback, n, **paged_options)
    elif cache == "contiguous" or not isinstance(cache, str):
        cache = None if cache == "contiguous" else cache
        if n > 1:       # no blocks to share: sample j of prompt i runs alone, as row i * n + j
            limits = check_request(model, prompts, max_new_tokens, temperature, top_p,
                                   max_seq_len or getattr(cache, "max_seq_len", None)
                                   or model.args.max_seq_len)
            prompts = [p for p in prompts for _ in range(n)]
            max_new_tokens = [m for m in limits for _ in range(n)]
        out = generate_static(model, prompts, max_new_tokens, cache, temperature, top_p,
                              stop_tokens, seed, max_seq_len, callback)
    else:
        raise RequestError(f"unknown cache {cache!r}: choose 'contiguous' or 'paged'")
    return out if n == 1 else [out[i * n:(i + 1) * n] for i in range(num_prompts)]


class Engine(SpeculativeEngine):
    """The engine with every stage's options (stage 7's, `SpeculativeEngine`). With
    `tensor_parallel=N` (stage 9) it is rank 0's engine of N processes instead
    (`tp_engine.start_engine`: a `TensorParallelEngine`, the same calls; `close()` ends the
    other processes)."""

    def __new__(cls, model, *args, tensor_parallel: int = 1, **options):
        if tensor_parallel == 1:
            return super().__new__(cls)
        return start_engine(model, tensor_parallel, *args, **options)

    def __init__(self, model, *args, tensor_parallel: int = 1, **options):
        super().__init__(model, *args, **options)


def check_arguments(model, prompts, max_new_tokens, cache, temperature, top_p, stop_tokens,
                    seed, callback, n) -> None:
    """The request (`check_request`, lengths aside: they depend on the cache), then what it
    does not see: the seed, the callback, a cache object without the cache interface, and n
    samples that could never fit in memory (refused before the n copies are even listed)."""
    limits = check_request(model, prompts, max_new_tokens, temperature, top_p, float("inf"))
    check_stop_tokens(model, stop_tokens)
    check_whole("seed", seed)
    if callback is not None and not callable(callback):
        raise RequestError(f"callback must be a function (event, seq_id, token, cache) or None, "
                           f"not {callback!r}")
    if not isinstance(cache, str) and cache is not None and not all(
            hasattr(cache, name) for name in ("prepare", "attend", "free", "cache_seqlens")):
        raise RequestError(f"cache must be 'contiguous', 'paged' or an object with the cache "
                           f"interface (prepare, positions, attend, free), not {cache!r}")
    if n == 1:
        return
    tokens = n * sum(len(q) + m for q, m in zip(prompts, limits))   # the least the cache holds
    a, p = model.args, next(model.parameters())
    check_memory(tokens * bytes_per_block(1, a.n_kv_heads, a.head_dim, p.dtype, a.n_layers),
                 p.device, f"n={n} samples of {len(prompts)} prompt(s)")


def _serve_parallel(world_size, model, cache, engine_class, *request) -> list:
    """tensor_parallel=N: refused before any process starts unless it can run (the paged cache,
    the stages' engine, no callback across processes, N splitting the heads); then rank r of N
    serves the prompts on its shard of the model (`_serve_rank`) and rank 0's tokens come back."""
    check_world_size(model.args, world_size)
    if cache != "paged" or engine_class is not None or request[-3] is not None:
        raise RequestError("tensor_parallel runs on cache='paged', with the stages' own engine "
                           "(no engine_class) and no callback (a callback cannot reach into the "
                           "other processes)")
    states = [rank_state_dict(model, r, world_size) for r in range(world_size)]
    device = next(model.parameters()).device
    outs = run_ranks(_serve_rank, world_size, (model.args, states, request), device=device)
    return outs[0]


def _serve_disaggregated(model, cache, engine_class, tensor_parallel, disaggregated, prompts,
                         max_new_tokens, temperature, top_p, stop_tokens, seed, max_seq_len,
                         callback, n, options) -> list:
    """disaggregated=True: refused before any process starts unless it can run (the paged
    cache, the stages' engine, one process per engine, no callback across processes)."""
    if disaggregated is not True or cache != "paged" or engine_class is not None or \
            tensor_parallel != 1 or callback is not None:
        raise RequestError("disaggregated=True runs on cache='paged', with the stages' own engine "
                           "(no engine_class), no tensor_parallel and no callback (a callback "
                           "cannot reach into the engines' processes)")
    max_seq_len = max_seq_len or model.args.max_seq_len
    limits = check_request(model, prompts, max_new_tokens, temperature, top_p, max_seq_len)
    stop = list(model.args.stop_tokens if stop_tokens is None else stop_tokens)
    job = Job(list(map(list, prompts)), limits, temperature, top_p, stop, seed, n,
              dict(options, max_seq_len=max_seq_len))
    return serve_disaggregated(model, job)["decode"]["outputs"]


def _serve_rank(rank, world_size, device, args, states, request) -> list | int:
    """One rank of tensor_parallel=N, on its shard of the model: rank 0 serves the prompts on
    the one engine (`TensorParallelEngine`) and returns the tokens; the others follow it."""
    shard = load_shard(args, rank, world_size, states[rank], device)
    if rank:
        follow(shard, device)
        return None
    *serve_args, options = request
    group = Group(device)
    out = _serve(partial(TensorParallelEngine, workers=group), shard, *serve_args, **options)
    group.close()
    return out


def _serve(engine_class, model, prompts, max_new_tokens, temperature, top_p, stop_tokens, seed, max_seq_len,
           callback, n, block_size: int = 16, num_blocks: int | None = None,
           kv_budget: int | None = None, preemption: str = "recompute", **engine_options):
    """cache="paged": every prompt becomes a request of the engine, all arriving at once
    (with n > 1, a group of n samples that share its blocks)."""
    max_seq_len = max_seq_len or model.args.max_seq_len
    limits = check_request(model, prompts, max_new_tokens, temperature, top_p, max_seq_len)
    if num_blocks is None and kv_budget is None:    # room for everything: nobody is preempted
        lengths = [len(p) + m for p, m in zip(prompts, limits) for _ in range(n)]
        num_blocks = pool_blocks(model.args, next(model.parameters()).dtype, block_size,
                                 lengths=lengths)
    engine_options.setdefault("max_num_seqs", len(prompts) * n)
    engine = engine_class(model, num_blocks, block_size, preemption, kv_budget=kv_budget,
                          max_seq_len=max_seq_len, seed=seed, **engine_options)
    engine.callback = callback
    stop = model.args.stop_tokens if stop_tokens is None else stop_tokens
    for i, (p, m) in enumerate(zip(prompts, limits)):
        gens = [row_generator(seed, i * n + j) if temperature > 0 else None for j in range(n)]
        engine.add_request(p, m, temperature, top_p, stop_tokens=stop, n=n, generators=gens)
    return [r.output for r in engine.run()]
