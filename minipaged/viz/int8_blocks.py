"""Stage 4b drawn: one int8 block's codes and scales beside the floats they stand for, what a
budget holds in each format, the error by layer and position, and the keys' outlier channels.

`stored_kv` reads the K/V a prompt leaves in a cache (float or int8, dequantized), so the
drawings compare an fp32 cache and an int8 cache fed the same prompt.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..kv_quant import dequantize_int8, quantize_int8, split_int8

FORMAT_COLORS = {"fp32": "#4c72b0", "bf16": "#55a868", "int8": "#c44e52"}


def stored_kv(cache, layer: int, seq_id: int = 0, which: str = "k") -> torch.Tensor:
    """(T, Hk, D) float32: the K (or V) a sequence holds in one layer, gathered through its block
    table and, for an int8 cache, dequantized."""
    m = cache.managers[layer]
    pool = m.k_cache_paged if which == "k" else m.v_cache_paged
    slots = pool[m.blocks_of(seq_id)].flatten(0, 1)[:int(m.seq_lens[seq_id])]
    return dequantize_int8(slots) if slots.dtype == torch.int8 else slots.float()


def plot_int8_block(cache, layer: int, block: int, head: int = 0, values=None, which: str = "k"):
    """One physical block of an int8 cache, one KV head: its codes (slot x channel), each slot's
    float16 scale, and (with `values`, the (block_size, D) floats written there, e.g. from an fp32
    cache fed the same tokens) those floats and what is lost: |value - code * scale|."""
    m = cache.managers[layer]
    pool = m.k_cache_paged if which == "k" else m.v_cache_paged
    codes, scales = split_int8(pool[block, :, head])                   # (bs, D), (bs,)
    panels = 4 if values is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 3.4),
                             gridspec_kw={"width_ratios": [4, 1, 4, 4][:panels]})
    im = axes[0].imshow(codes.numpy(), cmap="RdBu_r", vmin=-127, vmax=127, aspect="auto")
    axes[0].set(title=f"int8 codes (layer {layer}, block {block}, head {head})",
                xlabel="channel", ylabel="slot in the block")
    fig.colorbar(im, ax=axes[0])
    axes[1].barh(np.arange(len(scales)), scales.numpy(), color=FORMAT_COLORS["int8"])
    axes[1].set(title="scale (fp16)", ylim=(len(scales) - 0.5, -0.5), xlabel="max|x| / 127")
    if values is not None:
        values = torch.as_tensor(values).float()
        top = float(values.abs().max())
        im = axes[2].imshow(values.numpy(), cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
        axes[2].set(title="the floats written", xlabel="channel")
        fig.colorbar(im, ax=axes[2])
        err = (values - codes.float() * scales[:, None]).abs()
        im = axes[3].imshow(err.numpy(), cmap="magma", aspect="auto")
        axes[3].set(title="|value - code x scale|", xlabel="channel")
        fig.colorbar(im, ax=axes[3])
    fig.tight_layout()
    return fig


def plot_capacity(rows, budget_mib: int):
    """Tokens a KV budget holds in each format, per model: `rows` of (name, tokens fp32,
    tokens bf16, tokens int8)."""
    fig, ax = plt.subplots(figsize=(7, 3))
    x = np.arange(len(rows))
    for i, fmt in enumerate(("fp32", "bf16", "int8")):
        tokens = [r[1 + i] for r in rows]
        ax.bar(x + (i - 1) * 0.27, tokens, 0.27, label=fmt, color=FORMAT_COLORS[fmt])
        for xi, t in zip(x, tokens):
            ax.text(xi + (i - 1) * 0.27, t, f"{t:,}", ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(x, [r[0] for r in rows])
    ax.set(ylabel=f"tokens in {budget_mib} MiB of KV", title="what one KV budget holds, by format")
    ax.legend()
    fig.tight_layout()
    return fig


def quantization_error(fp32_cache, n_layers: int, seq_id: int = 0) -> dict:
    """{"k", "v"}: (layers, positions) arrays of each token's relative error after an int8 round
    trip, ||x - x'|| / ||x|| over its channels, the largest over KV heads. Each value is off by at
    most half a code; a row with one large channel spends its codes there and its small values
    lose more, relatively."""
    out = {}
    for which in ("k", "v"):
        rows = []
        for layer in range(n_layers):
            x = stored_kv(fp32_cache, layer, seq_id, which)                      # (T, Hk, D)
            err = (x - dequantize_int8(quantize_int8(x))).norm(dim=-1)           # (T, Hk)
            rows.append((err / x.norm(dim=-1).clamp_min(1e-30)).amax(-1).numpy())
        out[which] = np.stack(rows)
    return out


def plot_error_by_layer_and_position(errors: dict, logit_errors=None):
    """Heat maps of `quantization_error`'s K and V errors; with `logit_errors` (per position),
    a line of the model's largest logit error at each decode position below them."""
    panels = 3 if logit_errors is not None else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 1.6 * panels + 1.2), sharex=True)
    for ax, which in zip(axes, ("k", "v")):
        top = max(float(e.max()) for e in errors.values())
        im = ax.imshow(errors[which], aspect="auto", cmap="viridis", vmin=0, vmax=top)
        ax.set(ylabel="layer", title=f"{which.upper()}: each token's relative error "
                                     f"||x - x'|| / ||x||")
        fig.colorbar(im, ax=ax)
    if logit_errors is not None:
        axes[2].plot(np.arange(len(logit_errors)), logit_errors, color=FORMAT_COLORS["int8"])
        axes[2].set(ylabel="max |Δ logit|", title="the model's logits, int8 blocks against fp32")
    axes[-1].set_xlabel("position in the sequence")
    fig.tight_layout()
    return fig


def plot_key_channels(fp32_cache, layer: int, head: int = 0, seq_id: int = 0):
    """Per channel of one layer's keys (one head), the largest |K| over the sequence's tokens,
    beside the values': a few key channels are far larger than the rest, so one scale per token
    spends its 255 codes on them (why KIVI quantizes keys per channel)."""
    fig, ax = plt.subplots(figsize=(8, 2.8))
    for which, color in (("k", FORMAT_COLORS["fp32"]), ("v", FORMAT_COLORS["bf16"])):
        x = stored_kv(fp32_cache, layer, seq_id, which)[:, head]                 # (T, D)
        peak = x.abs().amax(0).numpy()                                           # (D,)
        ax.bar(np.arange(len(peak)) + (0.2 if which == "v" else -0.2), peak, 0.4, color=color,
               label={"k": "keys", "v": "values"}[which])
    ax.set(xlabel="channel", ylabel="max |x| over tokens",
           title=f"layer {layer}, KV head {head}: the largest value in each channel")
    ax.legend()
    fig.tight_layout()
    return fig
