"""Stage 1: Llama 3 in plain PyTorch, with Meta's parameter names, read top to bottom.

`model(tokens)` with no cache is the full causal forward, the ground truth every cache is checked
against; with a cache, only where attention gets its keys and values changes (`cache.attend`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checks import check_model_args
from .rope_scaling import RopeScalingArgs, rescale_rope_frequencies


@dataclass
class ModelArgs(RopeScalingArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None         # None: as many as n_heads (no grouping)
    vocab_size: int = 128256
    multiple_of: int = 256                # Meta's rule for the feed-forward width...
    ffn_dim_multiplier: float | None = None
    hidden_dim: int | None = None         # ...or the width itself (Hugging Face's intermediate_size)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0          # RoPE's base, rescaled as RopeScalingArgs says
    max_seq_len: int = 8192               # the longest sequence a cache will be asked to hold
    tie_word_embeddings: bool = False     # Llama 3.2 1B/3B reuse tok_embeddings as output
    stop_tokens: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_model_args(self)            # values the model could not run with (checks.py)
        if self.hidden_dim is None:       # Meta's FeedForward sizing, verbatim in spirit
            hidden = int(2 * (4 * self.dim) / 3)
            if self.ffn_dim_multiplier is not None:
                hidden = int(self.ffn_dim_multiplier * hidden)
            self.hidden_dim = self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x / sqrt(mean(x²) + eps) in float32, as Meta's code, in one fused torch op
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return xf.type_as(x) * self.weight


def rope_frequencies(args: ModelArgs):
    """The rotary frequencies theta^(-2i/d), one per (even, odd) pair of a head: (head_dim // 2,),
    rescaled as the checkpoint says (Llama 3.1+ stretches the slow ones: `rope_scaling.py`)."""
    d = args.head_dim
    exps = torch.arange(0, d, 2, device="cpu")[: d // 2].float() / d   # cpu even under a meta device
    return rescale_rope_frequencies(1.0 / (args.rope_theta ** exps), args)


def precompute_freqs_cis(freqs, positions):
    """cos + i·sin of each position's angle per frequency, (..., head_dim // 2) complex64: the rows
    a step needs, not Meta's table for every position (64 MB at a 128K context)."""
    angles = positions.float()[..., None] * freqs                  # (..., d/2)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq, xk, freqs_cis):
    """Rotate each (even, odd) pair of q and k by its position's angle (Meta's interleaved form):
    xq (B, T, Hq, D), xk (B, T, Hk, D), freqs_cis (B, T, D/2) complex."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))  # (B, T, Hq, D/2)
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[:, :, None, :]                                            # (B, T, 1, D/2)
    xq_out = torch.view_as_real(xq_ * f).flatten(3)                         # (B, T, Hq, D)
    xk_out = torch.view_as_real(xk_ * f).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, cache=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)       # (B, T, Hq, D)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)    # (B, T, Hk, D)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        if cache is None:        # no cache: plain causal attention over these T tokens
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads,
            ).transpose(1, 2)                                         # (B, T, Hq, D)
        else:                    # the ONLY place the caches differ: where k/v live
            y = cache.attend(self.layer_id, q, k, v)                  # (B, T, Hq, D)
        return self.wo(y.reshape(B, T, -1))                           # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)   # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)   # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)   # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))   # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, cache=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # A plain attribute, not a buffer: `model.to(torch.bfloat16)` must not round it.
        self.rope_freqs = rope_frequencies(args)

    def forward(self, tokens, cache=None, last_only: bool = False, logits_indices=None):
        """tokens (B, T) -> logits (B, T, vocab) float32 ((B, 1, vocab) with `last_only`, (B, K,
        vocab) at `logits_indices` (K,)). No cache: positions 0..T-1; with one, `cache.positions`."""
        B, T = tokens.shape
        if cache is None:
            positions = torch.arange(T, device=tokens.device)[None, :].expand(B, T)  # (B, T)
        else:
            positions = cache.positions.to(tokens.device)                            # (B, T)
        freqs_cis = precompute_freqs_cis(self.rope_freqs.to(tokens.device), positions)  # (B, T, D/2)
        h = self.tok_embeddings(tokens)                                              # (B, T, dim)
        for layer in self.layers:
            h = layer(h, freqs_cis, cache)
        if last_only:
            h = h[:, -1:]                                                            # (B, 1, dim)
        elif logits_indices is not None:
            h = h[:, logits_indices]                                                 # (B, K, dim)
        return self.output(self.norm(h)).float()                                     # (B, T, vocab)
