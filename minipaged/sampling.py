"""Support, not a stage (not needed on a first read): how generation draws a token from logits —
greedy at temperature 0, else top-p — each prompt from its own seeded stream.
"""

from __future__ import annotations

import torch


def sample(logits, temperature: float, top_p: float, generator=None) -> int:
    """One token id from a (vocab,) row of logits: greedy at temperature 0, else top-p."""
    if temperature == 0:
        return int(torch.argmax(logits))
    if generator is not None:     # drawn where the seeded stream lives (a CPU generator): the
        logits = logits.to(generator.device)   # same seed, the same token, on any device
    probs = tempered_softmax(logits, temperature)
    probs_sorted, order = torch.sort(probs, descending=True)
    keep = probs_sorted.cumsum(-1) - probs_sorted <= top_p          # the smallest set reaching top_p
    probs_sorted = probs_sorted * keep
    choice = torch.multinomial(probs_sorted / probs_sorted.sum(), 1, generator=generator)
    return int(order[choice])


def token_logprobs(logits, token: int, k: int) -> tuple:
    """(token's log-probability, [(id, log-probability)] of the k likeliest) under the model's
    own distribution: the raw logits' log-softmax, before temperature and top-p (vLLM's
    default, `raw_logprobs`), so a sampled token has the same logprob as a greedy one."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, min(k, logp.numel())) if k else None
    rivals = list(zip(top.indices.tolist(), top.values.tolist())) if k else []
    return float(logp[token]), rivals


def tempered_softmax(logits, temperature: float):
    """softmax(logits / temperature) over the last dimension, for any temperature > 0. The
    largest logit is taken off first and the temperature is at least float32's smallest normal
    number, so a tiny temperature sends every other logit to -inf (probability 0), the limit
    greedy decoding is — never inf - inf (NaN)."""
    logits = logits.float()
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    return torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)


def row_generator(seed: int, index: int) -> torch.Generator:
    """A prompt's own seeded stream (modulo 2**64, the seeds torch takes), so its tokens do not
    depend on which prompts share its batch, nor on when it runs."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**64)
