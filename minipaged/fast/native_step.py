"""A decode step as one C++ call: `NativeStep`, which `compile_decode` gives a FusedLlama where
operators.cpp builds.

A compiled decode step (compiled.py) is a graph of a few hundred calls: 121 products and 30
attentions through torch's dispatcher, each boxing its arguments and finding its operator by
name, and a few dozen small generated loops between them, behind Dynamo's guard check and
inductor's wrappers. On SmolLM2 at one row those calls cost about 0.6 ms of a 13 ms step, a
cost llama.cpp does not pay: its token is one C call. Here a decode step on the speed layer's
paged cache (every row one new token, on stage 3b's kernel: a `DecodeAttention`) is one call
too, `minipaged_decode_step` in operators.cpp: the same products (panels.c), the same attention
(the plan `DecodeAttention.address` lays out), and between them the layer's small operations —
RMSNorm, the rotary pairs, the residual adds, SwiGLU — as plain loops over float32 rows, rounded
to bfloat16 wherever a bfloat16 model stores its tensors. The loops are written so that the
compiler vectorizes them (operators.cpp is built for the CPU, as panels.c is): SwiGLU's
exponential is a polynomial of its own rather than a call into the C library, which, at 16
rows, had cost 1.4 ms a step. The numbers are the model's up to the order of the sums, as the
compiled step's are.

Every other step (a prompt, a packed step with prompt tokens, the contiguous cache, a model with
a product panels.c does not serve) goes to the compiled graphs as before: `__call__` returns
None for those, and `FusedLlama.forward` moves on.
"""

from __future__ import annotations

import ctypes
import time

import torch

from . import operators
from .paged import decode_attention_of

# Most rows a step serves: 64, where panels.c's bfloat16 products of many rows hand over to
# torch's (matvec.DOT_ROWS), and as many as the serving benchmark's largest workload runs.
# Up to there the one call is as fast as the compiled graph or faster (SmolLM2 on the 2-core
# AMD EPYC, decode steps in ms, the two ways in turns, medians; one call against the graph):
#
#     build     dtype      1 row        8 rows       16 rows      64 rows
#     AVX-512   float32    12.0 / 13.2  12.3 / 13.7  14.4 / 15.3  47.4 / 48.7
#     AVX-512   bfloat16    5.1 / 5.3    6.5 / 8.4    9.5 / 10.6  36.1 / 40.9
#     AVX2      float32    11.6 / 12.7  13.8 / 15.4  25.7 / 27.1  98.0 / 97.4
#     AVX2      bfloat16    5.5 / 5.5   13.1 / 14.8  26.6 / 29.6  100.2 / 103.9
MOST_ROWS = 64
DTYPES = (torch.float32, torch.bfloat16)      # the models' dtypes it takes (on the CPU)


class StepLayer(ctypes.Structure):
    """A layer's weights as operators.cpp's `StepLayer` reads them."""
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "wqkv", "wo", "w13", "w2", "attention_norm", "ffn_norm")]


class StepModel(ctypes.Structure):
    """The model as operators.cpp's `StepModel` reads it."""
    _fields_ = [*((name, ctypes.c_int64) for name in (
        "layers", "dim", "hidden", "heads", "kv_heads", "head_dim", "vocab", "bf16")),
        ("eps", ctypes.c_float), ("norm_eps", ctypes.c_float),
        ("embedding", ctypes.c_void_p), ("freqs", ctypes.c_void_p),
        ("layer", ctypes.POINTER(StepLayer)), ("norm", ctypes.c_void_p),
        ("output", ctypes.c_void_p)]


def why_not_native(fast) -> str | None:
    """Why `fast`'s decode steps cannot be one C++ call, or None where they can."""
    p = next(fast.parameters())
    if operators.decode_step is None:
        return "operators.cpp is not built (compile_decode builds it)"
    if p.device.type != "cpu" or p.dtype not in DTYPES:
        return f"the model is {p.dtype} on {p.device.type}: the step takes float32 or " \
               "bfloat16 on the CPU"
    products = [m for layer in fast.layers for m in (layer.wqkv, layer.wo, layer.w13, layer.w2)]
    if any(m.panels is None or m.panels.dtype != p.dtype for m in products + [fast.output]):
        return "a product has no panels of the model's dtype (panels.c does not serve it)"
    return None


class NativeStep:
    """`fast`'s decode step on the speed layer's paged cache as one C++ call (the module's
    docstring). Holds the tensors whose addresses the C++ step reads."""

    def __init__(self, fast):
        why = why_not_native(fast)
        if why:
            raise RuntimeError(f"the decode step cannot be one call: {why}")
        args, first = fast.args, fast.layers[0]
        self.dtype = next(fast.parameters()).dtype
        self.freqs = fast.rope_freqs.float().contiguous()
        self.tensors = [fast.tok_embeddings.weight.contiguous(), fast.norm.weight.contiguous()]
        layers = (StepLayer * len(fast.layers))()
        for layer, into in zip(fast.layers, layers):
            norms = [w.contiguous() for w in (layer.attention_norm, layer.ffn_norm)]
            panels = [m.panels for m in (layer.wqkv, layer.wo, layer.w13, layer.w2)]
            self.tensors += norms + panels   # kept alive, as a frozen graph keeps its weights
            into.wqkv, into.wo, into.w13, into.w2 = (w.data_ptr() for w in panels)
            into.attention_norm, into.ffn_norm = (w.data_ptr() for w in norms)
        self.layers = layers
        self.model = StepModel(
            len(fast.layers), args.dim, first.w2.in_features, first.n_heads, first.n_kv_heads,
            first.head_dim, fast.output.out_features, self.dtype == torch.bfloat16, first.eps,
            fast.norm.eps, self.tensors[0].data_ptr(), self.freqs.data_ptr(), layers,
            self.tensors[1].data_ptr(), fast.output.panels.data_ptr())
        self.tensors.append(fast.output.panels)

    def __call__(self, tokens, cache, last_only: bool = False, logits_indices=None):
        """Logits as `FusedLlama.forward` gives them for a decode step on `cache` (every row
        one new token, on stage 3b's kernel), or None for any other step."""
        if tokens.device.type != "cpu" or tokens.numel() > MOST_ROWS:
            return None
        plan = decode_attention_of(cache)
        address = plan and plan.address()
        if address is None or plan.rows != tokens.numel():
            return None
        ids = tokens.reshape(-1).to(torch.int64).contiguous()
        positions = plan.plan.positions                                  # (rows, 1) int64
        logits = torch.empty(tokens.shape + (self.model.vocab,))
        before = operators.install(address)
        try:
            failed = operators.decode_step(ctypes.addressof(self.model), ids.data_ptr(),
                                           positions.data_ptr(), len(ids), logits.data_ptr())
        finally:
            operators.install(before)
        if failed:
            return None
        if last_only:
            return logits[:, -1:]
        return logits if logits_indices is None else logits[:, logits_indices]

    def products_seconds(self, rows: int = 1) -> float:
        """Seconds the products of a step of `rows` rows take alone, called as the step calls
        them (121 on SmolLM2), on rows of zeros: the benchmarks time them beside the step."""
        start = time.perf_counter()
        operators.step_products(ctypes.addressof(self.model), rows)
        return time.perf_counter() - start


def native_step(fast) -> NativeStep | None:
    """`fast`'s one-call decode step, or None where it cannot have one (`why_not_native`)."""
    return None if why_not_native(fast) else NativeStep(fast)
