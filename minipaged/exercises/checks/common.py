"""The helpers every stage's checks share: hypothesis settings, the tiny Llama 3 and its ground
truth (the contiguous cache's and the no-cache forward's greedy tokens), dense attention
written plainly, and the sentence for tokens that differ."""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, Phase, settings

from ...generation import generate_static
from ...kv_cache import ContiguousCache
from ...model import Llama, ModelArgs
from ..grader import expect


SHRINK = True       # the mutation runs switch shrinking off: they only need to know "it failed"


def prop(max_examples: int = 25):
    """hypothesis settings for a check: few examples, the same ones every run."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else [])
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    phases=phases, print_blob=False, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))


# -- the tiny model and the ground truth ---------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0) -> Llama:
    """A random tiny Llama 3 (grouped-query attention), in float64 so that no two logits tie."""
    torch.manual_seed(seed)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16,
                     max_seq_len=96)
    model = Llama(args).to(torch.float64).eval()
    with torch.no_grad():
        model.output.weight.mul_(8.0)      # wider logits: tokens differ more between steps
    return model


def prompts_of(lengths, seed=1, vocab=96):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def contiguous_tokens(lengths: tuple, n: int, seed: int = 1):
    """Greedy tokens of the contiguous cache (stage 1): what every paged run must equal."""
    model, prompts = tiny_model(), prompts_of(lengths, seed)
    cache = ContiguousCache(model.args, len(prompts), model.args.max_seq_len, dtype=torch.float64)
    return generate_static(model, prompts, n, cache=cache, stop_tokens=[])


@functools.lru_cache(maxsize=None)
def no_cache_tokens(lengths: tuple, n: int, seed: int = 1):
    """Ground truth: every token from the no-cache forward over the whole sequence so far."""
    return no_cache_greedy(prompts_of(lengths, seed), n)


def no_cache_greedy(prompts, n: int):
    """`n` greedy tokens per prompt, each from the tiny model's no-cache forward over the whole
    sequence so far."""
    model, out = tiny_model(), []
    with torch.no_grad():
        for p in prompts:
            seq, new = list(p), []
            for _ in range(n):
                t = int(model(torch.tensor([seq]))[0, -1].argmax())
                new.append(t)
                seq.append(t)
            out.append(new)
    return out


def dense_attention(q, keys, values, causal=True):
    """One row's attention in float64, written plainly: q (Sq, Hq, D), keys/values (n, Hk, D),
    the newest Sq keys belonging to the queries. Returns (Sq, Hq, D); a query that sees no key
    gets zeros."""
    Sq, Hq, D = q.shape
    n, Hk = keys.shape[0], keys.shape[1]
    out = torch.zeros(Sq, Hq, D, dtype=torch.float64)
    for i in range(Sq):
        last = n - Sq + i if causal else n - 1
        if last < 0:
            continue
        for h in range(Hq):
            kv = h // (Hq // Hk)
            k, v = keys[:last + 1, kv].double(), values[:last + 1, kv].double()
            w = torch.softmax(k @ q[i, h].double() * D ** -0.5, dim=0)
            out[i, h] = w @ v
    return out


def close(a, b, tol=1e-5) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))


def expect_same_tokens(got, want, lengths, where: str, reference: str) -> None:
    """Each prompt's greedy tokens `got` (`where`) equal `want` (`reference`'s), or a sentence."""
    for i, (g, w) in enumerate(zip(got, want)):
        expect(g == w, f"prompt {i} ({lengths[i]} tokens) continued as {g} {where}, but "
                       f"{reference} gives {w}")
