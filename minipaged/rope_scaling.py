"""Support, not a stage (not needed on a first read): how a checkpoint rescales the rotary
frequencies that stage 1's `rope_frequencies` computes.

Llama 3.1 and later were trained at 8K tokens and read 128K by stretching the slow frequencies
(`use_scaled_rope`, with the factors from the checkpoint's config); a GGUF file stores the same
rule as one divisor per frequency (`rope_freq_factors`, llama.cpp's `rope_freqs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RopeScalingArgs:
    """The fields of stage 1's ModelArgs (which inherits them) that say how to rescale RoPE."""
    use_scaled_rope: bool = False         # Llama 3.1+: stretch the low rotary frequencies
    rope_scale_factor: float = 8.0        # 8 in Meta's code, 32 in HF's Llama 3.2 config: read it
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_freq_factors: list[float] | None = None  # GGUF (llama.cpp's rope_freqs): divide freq i by it


def scale_rope_frequencies(freqs, args):
    """Llama 3.1's rope scaling (a model trained at 8K reads 128K): slow frequencies are divided
    by the factor, fast ones kept, the band between blended."""
    low_wavelen = args.rope_original_max_len / args.rope_low_freq_factor     # longer: scale fully
    high_wavelen = args.rope_original_max_len / args.rope_high_freq_factor   # shorter: keep
    wavelen = 2 * math.pi / freqs
    smooth = (args.rope_original_max_len / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor)
    blended = (1 - smooth) * freqs / args.rope_scale_factor + smooth * freqs
    return torch.where(wavelen < high_wavelen, freqs,
                       torch.where(wavelen > low_wavelen, freqs / args.rope_scale_factor, blended))


def rescale_rope_frequencies(freqs, args):
    """`freqs` (head_dim // 2,) as the checkpoint (`args`, a ModelArgs) says to rescale them:
    Llama 3.1's rule, a GGUF file's divisors, or not at all."""
    if args.use_scaled_rope:
        freqs = scale_rope_frequencies(freqs, args)
    if args.rope_freq_factors is not None:
        freqs = freqs / torch.tensor(args.rope_freq_factors, dtype=torch.float32, device="cpu")
    return freqs
