"""Batched generation: prefill each prompt, then decode every live sequence together.

Prompts of different lengths share one batch without padding: each prompt is prefilled on its
own (the cache remembers how long each sequence is), then every step feeds one token per live
sequence, and each row continues at its own position (`cache.cache_seqlens`). Meta's reference
instead pads prompts with -1 and replays the longer prompts token by token under an
`input_text_mask`; per-sequence positions make that unnecessary, and they are what the paged
cache and continuous batching (stage 5) need anyway.
"""

from __future__ import annotations

import torch

from .errors import RequestError
from .kv_cache import ContiguousCache


def sample(logits, temperature: float, top_p: float, generator=None) -> int:
    """One token id from a (vocab,) row of logits: greedy at temperature 0, else top-p."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs_sorted, order = torch.sort(probs, descending=True)
    keep = probs_sorted.cumsum(-1) - probs_sorted <= top_p          # the smallest set reaching top_p
    probs_sorted = probs_sorted * keep
    choice = torch.multinomial(probs_sorted / probs_sorted.sum(), 1, generator=generator)
    return int(order[choice])


def row_generator(seed: int, index: int) -> torch.Generator:
    """Each prompt samples from its own seeded stream, so its tokens do not depend on which
    other prompts share its batch (or, in stage 5, on when it was scheduled).

    With n samples per prompt (stage 6), sample j of prompt i draws from stream i * n + j: the
    same stream it would get if each prompt were listed n times in a row with n=1. So n=1 keeps
    stage 1's streams, and sharing blocks can never change what a sample draws."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def check_request(model, prompts, max_new_tokens, temperature, top_p, max_seq_len) -> list[int]:
    """Refuse a request that cannot be served, before any work is done. Returns the limit of
    new tokens for each prompt (`max_new_tokens` may be one int or one per prompt)."""
    vocab = model.args.vocab_size
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise RequestError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise RequestError(f"prompt {i} is empty or not a list of token ids")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in p):
            raise RequestError(f"prompt {i} holds a token id outside [0, {vocab}) or a non-integer")
    limits = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else \
        [max_new_tokens] * len(prompts)
    if len(limits) != len(prompts) or not all(isinstance(m, int) and m >= 0 for m in limits):
        raise RequestError(f"max_new_tokens must be a non-negative integer, or one per prompt, "
                           f"not {max_new_tokens!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise RequestError(f"need temperature >= 0 and 0 < top_p <= 1; got {temperature}, {top_p}")
    for i, (p, m) in enumerate(zip(prompts, limits)):
        if len(p) + m > max_seq_len:
            raise RequestError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={m} it needs "
                f"{len(p) + m} positions, but the cache holds {max_seq_len} per sequence. "
                "Shorten the prompt, ask for fewer new tokens, or raise max_seq_len.")
    return limits


def make_cache(kind: str, model, prompts, max_new_tokens, max_seq_len: int,
               block_size: int = 16, num_blocks: int | None = None, kv_budget: int | None = None,
               seed: int = 0, backend: str = "auto"):
    """The KV cache `generate` runs on.

    "contiguous" (stage 1) reserves max_seq_len slots for every prompt. "paged" (stage 3) keeps
    a pool of `num_blocks` blocks per layer — or as many as `kv_budget` bytes hold, or else just
    enough for every prompt's full length — and hands them out as sequences grow.
    """
    p = next(model.parameters())
    if kind == "contiguous":
        return ContiguousCache(model.args, len(prompts), max_seq_len, device=p.device, dtype=p.dtype)
    if kind == "paged":
        from .kv_budget import num_blocks_for_budget
        from .paged_cache import PagedCache

        if not isinstance(block_size, int) or block_size < 1:
            raise RequestError(f"block_size must be a positive integer, not {block_size!r}")
        a = model.args
        if num_blocks is None and kv_budget is not None:
            num_blocks = num_blocks_for_budget(kv_budget, block_size, a.n_kv_heads, a.head_dim,
                                               p.dtype, a.n_layers)
        if num_blocks is None:
            limits = max_new_tokens if isinstance(max_new_tokens, list) else \
                [max_new_tokens] * len(prompts)
            num_blocks = sum(-(-(len(q) + m) // block_size) for q, m in zip(prompts, limits))
        if num_blocks < 1:
            raise RequestError(f"a KV budget of {kv_budget} bytes holds no block of {block_size} "
                               "tokens; give it more memory or use smaller blocks")
        return PagedCache(a, num_blocks, block_size, len(prompts), max_seq_len,
                          device=p.device, dtype=p.dtype, seed=seed, backend=backend)
    raise RequestError(f"unknown cache {kind!r}: choose 'contiguous' or 'paged'")


@torch.inference_mode()
def generate(model, prompts, max_new_tokens, cache="contiguous", temperature: float = 0.0,
             top_p: float = 1.0, stop_tokens=None, seed: int = 0, max_seq_len: int | None = None,
             callback=None, n: int = 1, prefix_caching: bool = True, **cache_options):
    """Continue each prompt (a list of token ids); return only the new tokens, in prompt order.

    max_new_tokens: one int, or one per prompt. cache: "contiguous", "paged" (options:
    block_size, num_blocks, kv_budget, backend, preemption="recompute"|"swap", watermark), or
    a cache object already built. With "paged", stage 5's engine serves the prompts: a pool too
    small for all of them at once makes it admit and preempt rather than fail.
    stop_tokens: None uses the model's (`model.args.stop_tokens`), [] never stops early; a stop
    token ends its sequence and is not returned. callback(event, seq_id, token, cache) is called
    after every prefill and decode token — the notebooks use it to draw the cache as it fills.

    Stage 6: n=K returns K samples per prompt (each entry a list of K token lists; n=1 keeps
    the flat shape). Sample j of prompt i uses `row_generator(seed, i * K + j)`. On the paged
    cache the K samples share the prompt's blocks (copy-on-write), and `prefix_caching` reuses
    the blocks of prompts' common full-block prefixes instead of prefilling them again. The
    tokens are the same either way; the contiguous cache simply runs each prompt K times.
    """
    if not isinstance(n, int) or n < 1:
        raise RequestError(f"n (samples per prompt) must be a positive integer, not {n!r}")
    max_seq_len = max_seq_len or getattr(cache, "max_seq_len", None) or model.args.max_seq_len
    limits = check_request(model, prompts, max_new_tokens, temperature, top_p, max_seq_len)
    stop = set(model.args.stop_tokens if stop_tokens is None else stop_tokens)
    gens = [row_generator(seed, i) if temperature > 0 else None
            for i in range(len(prompts) * n)]
    if cache == "paged":
        out = _generate_with_engine(model, prompts, limits, temperature, top_p, stop, gens,
                                    max_seq_len, callback, n, prefix_caching, **cache_options)
        return out if n == 1 else [out[i * n:(i + 1) * n] for i in range(len(prompts))]
    if n > 1:                               # no blocks to share: run each prompt n times
        out = generate(model, [p for p in prompts for _ in range(n)],
                       [m for m in limits for _ in range(n)], cache, temperature, top_p,
                       stop_tokens, seed, max_seq_len, callback, **cache_options)
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]
    if isinstance(cache, str):
        cache = make_cache(cache, model, prompts, limits, max_seq_len, **cache_options)
    device = next(model.parameters()).device
    out = [[] for _ in prompts]
    live = []                                       # sequences still generating
    next_token = {}

    for i, p in enumerate(prompts):                 # prefill: one prompt at a time, no padding
        if limits[i] == 0:
            continue
        cache.prepare([i], len(p))
        logits = model(torch.tensor([p], device=device), cache=cache, last_only=True)  # (1, 1, V)
        next_token[i] = sample(logits[0, -1], temperature, top_p, gens[i])
        live.append(i)
        if callback:
            callback("prefill", i, next_token[i], cache)

    while live:                                     # decode: one token for every live sequence
        still = []
        for i in live:                              # record the token each row just produced
            t = next_token[i]
            if t in stop or len(out[i]) >= limits[i]:
                cache.free(i)                       # done: give the cache back at once
                continue
            out[i].append(t)
            if len(out[i]) == limits[i]:
                cache.free(i)
                continue
            still.append(i)
        live = still
        if not live:
            break
        cache.prepare(live, 1)
        tokens = torch.tensor([[next_token[i]] for i in live], device=device)      # (B, 1)
        logits = model(tokens, cache=cache)                                         # (B, 1, V)
        for row, i in enumerate(live):
            next_token[i] = sample(logits[row, -1], temperature, top_p, gens[i])
            if callback:
                callback("decode", i, next_token[i], cache)
    return out


def _generate_with_engine(model, prompts, limits, temperature, top_p, stop, gens, max_seq_len,
                          callback, n=1, prefix_caching=True, block_size: int = 16,
                          num_blocks: int | None = None, kv_budget: int | None = None,
                          preemption: str = "recompute", **engine_options):
    """cache="paged": every prompt becomes a request of stage 5's engine, all arriving at once
    (with n > 1, a group of n samples that share its blocks)."""
    from .engine import Engine

    if num_blocks is None and kv_budget is None:    # room for everything: nobody is preempted
        num_blocks = n * sum(-(-(len(p) + m) // block_size) for p, m in zip(prompts, limits))
    engine = Engine(model, num_blocks, block_size, preemption, kv_budget=kv_budget,
                    max_num_seqs=len(prompts) * n, max_seq_len=max_seq_len,
                    prefix_caching=prefix_caching, **engine_options)
    engine.callback = callback
    for i, (p, m) in enumerate(zip(prompts, limits)):
        engine.add_request(p, m, temperature, top_p, stop_tokens=stop, n=n,
                           generators=gens[i * n:(i + 1) * n])
    return [r.output for r in engine.run()]
