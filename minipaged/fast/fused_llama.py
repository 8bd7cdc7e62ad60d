"""Stage 1's Llama with its weights rearranged for decoding speed; the same model, the same cache
interface, the same forward signature, so `generate`, the engines and the tests take it as they
take a `Llama`:

    fast = FusedLlama(load_model(path))        # copies the weights into the new layout
    minipaged.generate(fast, prompts, 128, cache="paged")

What changes, and why each step is faster on a CPU at batch 1, where a token's many small
operations cost as much as its arithmetic:

  * wq, wk, wv are one matrix and w1, w3 (gate, up) another: five matrix-vector products a
    layer become three (`wqkv`, `wo`, `w13`, `w2`: four with the output projection);
  * every matrix is a `MatVec`, laid out to stream at the memory's speed for one row, with a
    copy for several rows at once: panels for a C kernel in fp32, oneDNN's packing in bf16
    (`matvec.py`);
  * the rotary embedding multiplies real (even, odd) pairs by cos and sin instead of going
    through complex numbers, q and k rotated together, in three operations;
  * nothing reads a tensor's value back into Python in a layer (no `int(tensor)`), so the
    layers can be compiled into one graph (`compiled.py`).

The arithmetic is the model's: RMSNorm in float32, Meta's interleaved rotary pairs, grouped-query
attention through `cache.attend`, SwiGLU. Results differ from `Llama`'s by rounding only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model import Llama
from .matvec import MatVec


def rms_norm(x, weight, eps: float):
    """The model's RMSNorm: in float32, scaled by `weight` in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x) * weight


def rotary_cos_sin(freqs, positions):
    """cos and sin of each position's angle, laid out as the pairs they rotate: two (B, T, D)
    float32, each angle twice; sin's copy for the even entry negated (`rotate_pairs`)."""
    angles = positions.float()[..., None] * freqs                               # (B, T, D/2)
    cos, sin = angles.cos(), angles.sin()
    return cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)  # (B, T, D)


def rotate_pairs(x, cos, sin):
    """Rotate each (even, odd) pair of the last dim of x (B, T, H, D) by its position's angle:
    Meta's `apply_rotary_emb` on real numbers, in float32. With the pairs swapped, (odd, even),
    the rotation is two products and a sum, (e*c - o*s, o*c + e*s), the same numbers as
    complex multiplication gives, in three operations a layer instead of eight."""
    x32 = x.float()
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)                   # (B, T, H, D)
    return (x32 * cos[:, :, None] + swapped * sin[:, :, None]).type_as(x)


class FusedBlock(nn.Module):
    """One transformer block of a Llama, with fused projections."""

    def __init__(self, block):
        super().__init__()
        att, ff = block.attention, block.feed_forward
        self.n_heads, self.n_kv_heads, self.head_dim = att.n_heads, att.n_kv_heads, att.head_dim
        self.eps = block.attention_norm.eps
        self.attention_norm = block.attention_norm.weight
        self.ffn_norm = block.ffn_norm.weight
        self.wqkv = MatVec(torch.cat([att.wq.weight, att.wk.weight, att.wv.weight]))
        self.wo = MatVec(att.wo.weight)
        self.w13 = MatVec(torch.cat([ff.w1.weight, ff.w3.weight]))
        self.w2 = MatVec(ff.w2.weight)

    def forward(self, h, cos, sin, attend):
        """h (B, T, dim) -> (B, T, dim); `attend(q, k, v)` stores k/v and attends q."""
        B, T, _ = h.shape
        Hq, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(rms_norm(h, self.attention_norm, self.eps))            # (B, T, (Hq+2Hk)D)
        qk = rotate_pairs(qkv[..., :(Hq + Hk) * D].view(B, T, Hq + Hk, D), cos, sin)
        q, k = qk.split([Hq, Hk], dim=2)                                        # (B, T, H, D)
        v = qkv[..., (Hq + Hk) * D:].view(B, T, Hk, D)
        h = h + self.wo(attend(q, k, v).reshape(B, T, Hq * D))
        gate, up = self.w13(rms_norm(h, self.ffn_norm, self.eps)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)                                   # SwiGLU


class FusedLlama(nn.Module):
    """A `Llama`'s weights in fused, decode-friendly matrices (the model is left as it was; a
    weight kept as it is, a norm or the embedding, is shared with it, not copied).
    Call it as the model: `fast(tokens, cache=None, last_only=False, logits_indices=None)`."""

    def __init__(self, model: Llama):
        super().__init__()
        self.args = model.args
        self.tok_embeddings = model.tok_embeddings           # shared, as is: one row is read
        self.layers = nn.ModuleList(FusedBlock(b) for b in model.layers)
        self.norm = model.norm
        self.output = MatVec(model.output.weight)
        self.rope_freqs = model.rope_freqs
        self.compiled = None     # set by `compile_decode` (compiled.py): the decode step
        self.compiled_batches = None    # and with batches=True: every other step on a cache
        self.compiled_threads = ()      # the thread counts those graphs were compiled for
        self.native = None       # set by `compile_decode`: decode steps as one C++ call

    def forward(self, tokens, cache=None, last_only: bool = False, logits_indices=None):
        """As `Llama.forward`: logits (B, T, vocab) float32, (B, 1, vocab) with `last_only`,
        (B, K, vocab) at `logits_indices`. On a cache, steps run compiled once `compile_decode`
        has compiled them (compiled.py): one sequence's decode step, and with `batches=True`
        every other step; a decode step of up to 64 rows on the speed layer's paged cache runs
        as one C++ call instead (`self.native`, native_step.py)."""
        B, T = tokens.shape
        if self.native is not None and cache is not None:       # native_step.py
            logits = self.native(tokens, cache, last_only, logits_indices)
            if logits is not None:
                return logits
        if cache is None:
            positions = torch.arange(T, device=tokens.device)[None, :].expand(B, T)  # (B, T)
        else:
            positions = cache.positions.to(tokens.device)                            # (B, T)
        if self.compiled is not None and cache is not None and (B, T) == (1, 1):
            return self.compiled(tokens, positions, cache)
        if self.compiled_batches is not None and cache is not None and B * T > 1:
            return self.compiled_batches(tokens, positions, cache, last_only, logits_indices)
        return self.run(tokens, positions, cache, last_only, logits_indices)

    def run(self, tokens, positions, cache, last_only: bool = False, logits_indices=None,
            attend_op=None):
        """The forward on given positions; `attend_op(layer, q, k, v)` replaces `cache.attend`
        (the compiled step passes one that the compiler does not look inside)."""
        cos, sin = rotary_cos_sin(self.rope_freqs.to(tokens.device), positions)
        h = self.hidden(tokens, cos, sin, cache, attend_op)                          # (B, T, dim)
        if last_only:
            h = h[:, -1:]                                                            # (B, 1, dim)
        elif logits_indices is not None:
            h = h[:, logits_indices]                                                 # (B, K, dim)
        return self.logits(h)

    def hidden(self, tokens, cos, sin, cache=None, attend_op=None):
        """The last layer's output (B, T, dim) for tokens (B, T) at the angles `cos`, `sin`."""
        h = self.tok_embeddings(tokens)                                              # (B, T, dim)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, self._attention(i, cache, attend_op))
        return h

    def logits(self, h):
        """The vocabulary's logits (float32) of hidden states h."""
        return self.output(self.norm(h)).float()

    @staticmethod
    def _attention(layer: int, cache, attend_op):
        if attend_op is not None:
            return lambda q, k, v: attend_op(layer, q, k, v)
        if cache is not None:
            return lambda q, k, v: cache.attend(layer, q, k, v)
        return lambda q, k, v: F.scaled_dot_product_attention(       # no cache: causal
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
