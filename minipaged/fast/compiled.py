"""A FusedLlama's decode step compiled into one graph: `compile_decode(fast)`.

`torch.compile` turns the step's many small operations (norms, rotary, the SwiGLU product,
residual adds) into a few generated C++ loops, and with `freezing` it treats the weights as
constants, which lets it pack them for oneDNN's matrix products (bf16) ahead of time. Without
freezing the compiled step was slower than eager here.

Attention stays outside the compiler: each layer calls the cache's `attend` through a custom
operator (`minipaged::attend`), which the compiled graph calls like any other kernel. So the
same compiled step runs on the contiguous and the paged cache, with every layer's block table,
the engine's batches of any size and stage 5b's packed steps, and the bookkeeping stays in
Python where the stages put it. Only a decode step of one sequence runs compiled, the case
where a token's small operations weigh most against its arithmetic; prompts and batches run
eager (a batch of B rows shares those operations B ways).

Compiling takes tens of seconds (`compile_decode` returns how many) and needs a C++ compiler;
if it fails, the model stays eager and a warning says why.
"""

from __future__ import annotations

import logging
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn as nn

from ..kv_cache import ContiguousCache
from .fused_llama import FusedLlama

log = logging.getLogger(__name__)
# freezing: the weights are constants; max_autotune with the "CPP" backend: inductor may write
# its own matrix products (blocked for the cache, the weights packed ahead of time).
OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
_caches: list = []       # the cache the running compiled step attends on (a stack: re-entrant)


@torch.library.custom_op("minipaged::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """`cache.attend(layer, q, k, v)` on the cache of the running step; (B, T, Hq, D)."""
    return _caches[-1].attend(layer, q, k, v).contiguous()


@attend.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape)


class DecodeStep(nn.Module):
    """A FusedLlama's forward with attention through `minipaged::attend`: what gets compiled
    (a module, so that freezing finds its weights)."""

    def __init__(self, fast: FusedLlama):
        super().__init__()
        self.fast = fast

    def forward(self, tokens, positions):
        return self.fast.run(tokens, positions, None,
                             attend_op=lambda layer, q, k, v: attend(q, k, v, layer))


class CompiledDecode:
    """The compiled decode step of a FusedLlama: `(tokens (1, 1), positions (1, 1), cache) ->
    logits (1, 1, vocab)`."""

    def __init__(self, fast: FusedLlama):
        self.step = torch.compile(DecodeStep(fast), dynamic=False)

    def __call__(self, tokens, positions, cache):
        _caches.append(cache)
        try:   # the options must hold whenever inductor compiles (torch.compile's `options=`
            with inductor_config.patch(OPTIONS):    # loses freezing), and only then
                return self.step(tokens, positions)
        finally:
            _caches.pop()


def compile_decode(fast: FusedLlama) -> float:
    """Compile `fast`'s decode step now, on a throwaway cache; returns the seconds it took (NaN
    if it failed: `fast` stays eager). Later decode steps of `fast` run compiled."""
    p = next(fast.parameters())
    start = time.perf_counter()
    try:
        step = CompiledDecode(fast)
        with torch.inference_mode():
            cache = ContiguousCache(fast.args, 1, 1, device=p.device, dtype=p.dtype)
            cache.prepare([0], 1)
            step(torch.zeros(1, 1, dtype=torch.long, device=p.device),
                 cache.positions.to(p.device), cache)
    except Exception as e:               # no C++ compiler, an unsupported op...: stay eager
        log.warning("could not compile the decode step (%s: %s); running it eager",
                    type(e).__name__, e)
        fast.compiled = None
        return float("nan")
    fast.compiled = step
    return time.perf_counter() - start
