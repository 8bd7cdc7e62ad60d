"""A FusedLlama's steps compiled into graphs: `compile_decode(fast, batches=False,
fewer_threads=False)`.

`torch.compile` turns a step's many small operations (norms, rotary, the SwiGLU product,
residual adds) into a few generated C++ loops, and with `freezing` it treats the weights as
constants, which lets it pack them for oneDNN's matrix products ahead of time. Without
freezing the compiled step was slower than eager here.

Attention stays outside the compiler: each layer calls the cache's `attend` through a custom
operator (`minipaged::attend`), which the compiled graph calls like any other kernel. So the
same compiled step runs on the contiguous and the paged cache, with every layer's block table,
the engine's batches and stage 5b's packed steps, and the bookkeeping stays in Python where
the stages put it. On the speed layer's paged cache, a decode step (one row or many, one new
token each) attends through a `DecodeAttention` worked out once for all layers (fast/paged.py);
other steps through the cache's `attend`. Two graphs:

  * the decode step of one sequence (`CompiledDecode`), its shapes fixed, where a token's
    small operations weigh most against its arithmetic; its matrix-vector products written
    by the compiler itself (`max_autotune`), or in fp32, where the operators are registered
    in C++ (below), matvec.py's C kernel;
  * with `batches=True`, every other step on a cache (`CompiledBatches`): a batch of decode
    rows, a prompt, a packed step, its tokens laid out in one row as vLLM lays out a step and
    their number symbolic, so one graph serves every size (on SmolLM2 in bf16, a decode step
    of 16 rows took 35 ms against 50 ms eager: eager, the norms, rotary and SwiGLU are dozens
    of separate passes, each paying its own call). In bf16 its products are written by the
    compiler too, for any number of rows (`batch_options`, where the measurements are); in
    fp32 they are matvec.py's C kernel, `minipaged::panel_linear`, which the graph calls as
    it calls attention (where that kernel cannot be built, oneDNN's, packed under freezing).

`compile_decode` first registers both operators' CPU kernels in C++ (operators.py), so that
their calls stay out of Python; where no C++ compiler builds them, their Python functions serve
them, and the graph of one row keeps the compiler's products. Where they build, it also gives
the model a decode step without a graph (`fast.native`, native_step.py): on the speed layer's
paged cache, a decode step of up to 64 rows is one C++ call, and the graphs serve the rest.

Both graphs are compiled with inductor's `cpp_wrapper`: the code that calls a graph's kernels
and the two operators one after another, hundreds of calls a step, is generated C++ rather than
a Python function. On SmolLM2 in fp32 (four processes in turn, each compiling one way, medians
of five runs each, the 2-core Intel machine of the serving benchmark), a decode step of one row
took 23.7 and 24.1 ms against 24.3 and 25.0 without it, of 4 rows 27.2 and 27.6 against 28.4 and
28.5, of 16 rows 38.1 and 38.4 against 38.8 and 39.1. Compiling takes longer (both fp32 graphs:
about 75 s against 50-60).

Compiling takes tens of seconds a graph (`compile_decode` returns how many) and needs a C++
compiler; if it fails, the model stays eager and a warning says why.

Before each call of a compiled step, Dynamo checks the guards of its graphs: that each module
has its type, each weight its identity, each norm its eps — about 3,000 on SmolLM2, 0.4 ms of
an 8 ms bf16 decode step. Once compiled, a step's modules never change (freezing has made the
weights constants of the graph), so those guards are dropped (`compiled_alone`); what told one
model's graph from another's was those very guards, so each compiled step is given a copy of
its `forward`'s code object, on which Dynamo keeps the graphs: no other model's call looks
among them.

A graph is compiled for torch's thread count: most of its loops are written for that many OpenMP
threads (`#pragma omp parallel num_threads(N)`), and torch.compile guards every graph on the
count (Dynamo's global-state guard), so a step run under another count compiles the graph
again, tens of seconds in the middle of a run. `compile_decode(..., fewer_threads=True)`
compiles each graph a second time, for one thread fewer, ahead of time: both stay in
torch.compile's cache, the count in force picks one at each call, and `FastEngine` may then
drop a thread while another process holds a core (`threads.py`). The model's
`compiled_threads` names the counts its graphs exist for.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types

import torch
import torch._inductor.config as inductor_config
import torch.nn as nn

from ..kv_cache import ContiguousCache
from .fused_llama import FusedLlama, rotary_cos_sin
from . import operators
from .native_step import native_step
from .paged import decode_attention_of

log = logging.getLogger(__name__)
# freezing: the weights are constants; max_autotune with the "CPP" backend: inductor may write
# its own matrix products (blocked for the cache, the weights packed ahead of time);
# cpp_wrapper: the code calling a graph's kernels is C++ (the module's docstring).
OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
           "cpp_wrapper": True}
_caches: list = []       # the cache the running compiled step attends on (a stack: re-entrant)


# `minipaged::attend` is declared with torch.library's lower-level calls rather than
# `torch.library.custom_op`, whose wrapper checks every call's outputs for aliasing: at batch 1
# that check cost as much as a layer's attention arithmetic.
_lib = torch.library.Library("minipaged", "DEF")
_lib.define("attend(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """`cache.attend(layer, q, k, v)` on the cache of the running step, its tokens as the cache
    holds them, (B, T): the compiled graph may see them as one row; out in q's shape."""
    cache, B, T = _caches[-1]
    if tuple(q.shape[:2]) == (B, T):             # laid out as the cache holds them: no views
        return cache.attend(layer, q, k, v).contiguous()
    q_, k_, v_ = (x.view(B, T, *x.shape[2:]) for x in (q, k, v))
    return cache.attend(layer, q_, k_, v_).reshape(q.shape).contiguous()


_lib.impl("attend", attend, "CompositeExplicitAutograd")
# the same function under a second name, for operators.cpp's `attend` to fall back on: once
# that is registered for the CPU, it is what `attend` runs there
_lib.define("attend_python(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_lib.impl("attend_python", attend, "CompositeExplicitAutograd")


@torch.library.register_fake("minipaged::attend", lib=_lib)
def _(q, k, v, layer):
    return q.new_empty(q.shape)


@contextlib.contextmanager
def running_on(cache, B: int, T: int):
    """A compiled step of B rows of T tokens on `cache`, for `attend`: on the speed layer's
    paged cache, a decode step's attention worked out once for all layers (`DecodeAttention`),
    and its plan installed for the C++ kernel (operators.py)."""
    plan = decode_attention_of(cache)
    _caches.append((plan or cache, B, T))
    before = operators.install(plan and plan.address())
    try:
        yield
    finally:
        operators.install(before)
        _caches.pop()


def inference_tensors(*tensors) -> list:
    """A step's inputs as its graph was compiled for them. Every compiled step runs in inference
    mode whatever the caller's (its `__call__` is decorated so): the graphs are compiled in it,
    where freezing makes the weights constants, and torch.compile guards each graph on the mode
    and on whether each input is an inference tensor. Called with gradients on, a step was
    compiled again, without freezing, and the products inductor writes need constant weights:
    it failed. A tensor made with gradients on is copied (a step's few token ids)."""
    return [t if t.is_inference() else t.clone() for t in tensors]


class DecodeStep(nn.Module):
    """A FusedLlama's forward with attention through `minipaged::attend`: what gets compiled
    (a module, so that freezing finds its weights)."""

    def __init__(self, fast: FusedLlama):
        super().__init__()
        self.fast = fast

    def forward(self, tokens, positions):
        return self.fast.run(tokens, positions, None,
                             attend_op=lambda layer, q, k, v: torch.ops.minipaged.attend(
                                 q, k, v, layer))


def compiled_alone(module: nn.Module, dynamic: bool):
    """`torch.compile(module, dynamic=dynamic)` with no guards on its modules, and its graphs its
    own: `module.forward` becomes a copy of its class's, with a code object of its own, where
    Dynamo keeps them (the module's docstring says why)."""
    forward = type(module).forward
    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                             forward.__defaults__, forward.__closure__)
    module.forward = types.MethodType(own, module)
    return torch.compile(module, dynamic=dynamic, options={
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


class CompiledDecode:
    """The compiled decode step of a FusedLlama: `(tokens (1, 1), positions (1, 1), cache) ->
    logits (1, 1, vocab)`."""

    def __init__(self, fast: FusedLlama):
        self.step = compiled_alone(DecodeStep(fast), dynamic=False)

    @torch.inference_mode()
    def __call__(self, tokens, positions, cache):
        tokens, positions = inference_tensors(tokens, positions)
        # the options must hold whenever inductor compiles (torch.compile's `options=` loses
        # freezing), and only then
        with running_on(cache, 1, 1), inductor_config.patch(OPTIONS):
            return self.step(tokens, positions)


class BatchStep(nn.Module):
    """Any step on a cache but one sequence's decode, its tokens laid out in one row as vLLM
    lays out a step (the layers but attention treat tokens one by one): what gets compiled,
    once, for every number of tokens. The angles come in computed (inside the graph the
    compiler recomputed them in every layer), and the logits are those of the rows `keep`."""

    def __init__(self, fast: FusedLlama):
        super().__init__()
        self.fast = fast

    def forward(self, tokens, cos, sin, keep):
        h = self.fast.hidden(tokens, cos, sin,
                             attend_op=lambda layer, q, k, v: torch.ops.minipaged.attend(
                                 q, k, v, layer))
        return self.fast.logits(h[:, keep])                                  # (1, K, vocab)


class CompiledBatches:
    """The compiled step of a FusedLlama for every other step on a cache: a batch of decode
    rows, a prompt, stage 5b's packed steps. `(tokens (B, T), positions, cache, last_only,
    logits_indices) -> logits`, as `FusedLlama.forward`. One graph, the number of tokens and of
    kept rows symbolic (`dynamic=True`): no step compiles again. `options`: inductor's, as
    `batch_options` gives them."""

    def __init__(self, fast: FusedLlama, options: dict):
        self.fast, self.options = fast, options
        self.step = compiled_alone(BatchStep(fast), dynamic=True)

    @torch.inference_mode()
    def __call__(self, tokens, positions, cache, last_only=False, logits_indices=None):
        tokens, positions = inference_tensors(tokens, positions)
        B, T = tokens.shape
        if last_only:
            rows = torch.tensor([T - 1])
        elif logits_indices is not None:
            rows = logits_indices.reshape(-1).cpu()
        else:
            rows = torch.arange(T)
        keep = (torch.arange(B)[:, None] * T + rows).reshape(-1).to(tokens.device)  # (K,)
        K = len(keep)
        if K == 1:       # a size of 1 would be a second graph (the compiler treats 1 apart)
            keep = keep.repeat(2)
        cos, sin = rotary_cos_sin(self.fast.rope_freqs.to(tokens.device),
                                  positions.reshape(1, B * T))
        # a decode step on the speed layer's paged cache (a batch of rows, one token each, or
        # stage 5b's packed step of decode rows alone): its attention worked out once
        with running_on(cache, B, T), inductor_config.patch(self.options):
            logits = self.step(tokens.reshape(1, B * T), cos, sin, keep)       # (1, K', vocab)
        return logits[0, :K].view(B, K // B, -1)


# freezing without max_autotune: fp32 products in panels.c, else oneDNN's, packed
ONEDNN = {"freezing": True, "cpp_wrapper": True}


def batch_options(dtype: torch.dtype) -> dict:
    """How the batch step's products are compiled. In bf16 on a CPU with AMX inductor writes
    them (its AMX kernels, one for any number of rows): on SmolLM2 a decode step of 4 rows took
    15 ms against 19 through oneDNN, of 64 rows 34 against 38. Without AMX, MatVec gives bf16
    products to panels.c (`matvec.half_panels`) and these options leave them so. In fp32 its
    products lost to oneDNN's from 8 rows up (64 rows: 163 ms against 97), and MatVec's panel
    kernel beats both: fp32 leaves the products as MatVec gives them (`minipaged::panel_linear`,
    or oneDNN's where that kernel cannot be built)."""
    return OPTIONS if dtype == torch.bfloat16 else ONEDNN


def compile_batches(fast: FusedLlama, counts, options: dict) -> CompiledBatches:
    """`fast`'s batch step compiled, for each thread count, on a throwaway cache."""
    p = next(fast.parameters())
    many = CompiledBatches(fast, options)
    for count in counts:
        torch.set_num_threads(count)
        with torch.inference_mode():
            cache = ContiguousCache(fast.args, 2, 3, device=p.device, dtype=p.dtype)
            cache.prepare([0, 1], 3)                    # 6 tokens, 4 of them kept: sizes apart
            many(torch.zeros(2, 3, dtype=torch.long, device=p.device),
                 cache.positions.to(p.device), cache, logits_indices=torch.tensor([1, 2]))
    return many


def compile_decode(fast: FusedLlama, batches: bool = False, fewer_threads: bool = False) -> float:
    """Compile `fast`'s decode step of one sequence now, and with `batches` its step for
    everything else on a cache (compiled.py's docstring), on throwaway caches, for torch's
    thread count and with `fewer_threads` for one thread fewer too; returns the seconds it
    took (NaN if it failed: `fast` stays eager). Later steps of `fast` run compiled, and
    `fast.compiled_threads` holds the thread counts compiled for; `fast.native` is its one-call
    decode step (native_step.py), or None where it has none."""
    p = next(fast.parameters())
    if p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16):
        why = operators.build()            # the operators' kernels in C++, before any graph
        if why:
            log.info("the compiled steps' operators stay in Python: %s", why)
    threads = torch.get_num_threads()
    counts = (threads, threads - 1) if fewer_threads and threads > 1 else (threads,)
    start = time.perf_counter()
    try:
        step = CompiledDecode(fast)
        for count in counts:         # one graph per count, each kept in torch.compile's cache
            torch.set_num_threads(count)
            with torch.inference_mode():
                cache = ContiguousCache(fast.args, 1, 1, device=p.device, dtype=p.dtype)
                cache.prepare([0], 1)
                step(torch.zeros(1, 1, dtype=torch.long, device=p.device),
                     cache.positions.to(p.device), cache)
        many, options = None, batch_options(p.dtype)
        if batches:
            try:
                many = compile_batches(fast, counts, options)
            except Exception as e:   # shapes the compiler writes no product for: oneDNN's
                if options is ONEDNN:
                    raise
                log.info("the batch step's products go to oneDNN (%s)", type(e).__name__)
                many = compile_batches(fast, counts, ONEDNN)
    except Exception as e:               # no C++ compiler, an unsupported op...: stay eager
        log.warning("could not compile the decode step (%s: %s); running it eager",
                    type(e).__name__, e)
        fast.compiled = fast.compiled_batches = fast.native = None
        fast.compiled_threads = ()
        return float("nan")
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    fast.compiled, fast.compiled_batches, fast.compiled_threads = step, many, counts
    fast.native = native_step(fast)       # decode steps on the paged cache: one C++ call
    return time.perf_counter() - start
