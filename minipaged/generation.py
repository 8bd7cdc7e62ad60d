"""Stage 1: generation as a static batch — prefill each prompt, then decode every live sequence
together until the last one ends. Each row continues at its own position (`cache_seqlens`), so
prompts of different lengths need no padding (Meta's reference pads with -1 and masks instead).
"""

from __future__ import annotations

import torch

from .checks import check_request
from .kv_cache import ContiguousCache
from .sampling import row_generator, sample   # greedy or top-p, a seeded stream per prompt


@torch.inference_mode()
def generate_static(model, prompts, max_new_tokens, cache=None, temperature: float = 0.0,
                    top_p: float = 1.0, stop_tokens=None, seed: int = 0,
                    max_seq_len: int | None = None, callback=None):
    """Continue each prompt (token ids) as one static batch; return the new tokens in prompt order.

    max_new_tokens: an int or one per prompt. cache: any cache (`kv_cache.py`) with a row per
    prompt; None builds a ContiguousCache. stop_tokens: None is the model's, [] never stops; a stop
    token ends its sequence unreturned. callback(event, seq_id, token, cache) follows every token
    (the notebooks draw the cache with it)."""
    max_seq_len = max_seq_len or getattr(cache, "max_seq_len", None) or model.args.max_seq_len
    limits = check_request(model, prompts, max_new_tokens, temperature, top_p, max_seq_len)
    stop = set(model.args.stop_tokens if stop_tokens is None else stop_tokens)
    gens = [row_generator(seed, i) if temperature > 0 else None for i in range(len(prompts))]
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if cache is None:
        cache = ContiguousCache(model.args, len(prompts), max_seq_len, device=device, dtype=dtype)
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
            if t not in stop:
                out[i].append(t)
            if t in stop or len(out[i]) == limits[i]:
                cache.free(i)                       # done: give the cache back at once
            else:
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
