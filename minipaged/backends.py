"""Support, not a stage (not needed on a first read): which implementation serves a call of
`flash_attn_with_kvcache(..., backend=name)`.

"flash_attn" is flash-attn's CUDA kernel; "torch" is stage 3's readable PyTorch path
(`paged_attention.py` registers it); a later stage adds its own kernels with `register_backend`
(stage 3b's "triton" and "cpu"), which run only when asked for by name, or through the speed
layer (`minipaged.fast`). "auto" is flash-attn's kernel where it can serve the call, else "torch".
`last_backend` says which one served the last call; the first use of each is logged once.
`dispatch` wraps the call: it checks the inputs, picks the implementation and hands flash-attn's
kernel the call as it came. `sdpa` is how torch's own attention runs on each device.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .cache_checks import check_attention_inputs, check_implemented
from .errors import UsageError

try:  # optional: the CUDA kernel, `pip install flash-attn --no-build-isolation`
    import flash_attn
except ImportError:
    flash_attn = None

log = logging.getLogger("minipaged.paged_attention")   # named for the call users make
last_backend: str | None = None   # the implementation that served the last call
_announced: set[str] = set()      # log lines already written, so each appears once


class Backend(NamedTuple):
    """An implementation behind `flash_attn_with_kvcache(..., backend=name)`.

    `attend(q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale, num_splits)`
    runs after the new k/v are written: row b has `seqlens_k[b]` keys in the blocks its
    `block_table` row lists (every entry a real block: see `owned_block_table`).
    `why_not(q, k_cache)` is a sentence saying why it cannot serve a call, or None.
    """
    attend: Callable
    why_not: Callable = lambda q, k_cache: None


BACKENDS: dict[str, Backend] = {}   # name -> Backend; flash-attn's kernel is called directly


def register_backend(name: str, attend: Callable, why_not: Callable | None = None) -> None:
    """Make `flash_attn_with_kvcache(..., backend=name)` (and PagedCache's `backend=name`) run
    `attend`, with the write, the checks and the flash-attn semantics of every other backend.
    "auto" never picks it: it runs when asked for by name."""
    BACKENDS[name] = Backend(attend, why_not or Backend._field_defaults["why_not"])


def available_backends() -> list[str]:
    """The names `backend=` accepts."""
    return ["auto", "flash_attn", *BACKENDS]


def flash_attn_available() -> bool:
    """True when flash-attn's kernel imports and a CUDA GPU is present."""
    return flash_attn is not None and torch.cuda.is_available()


def dispatch(paged_attention: Callable) -> Callable:
    """Wrap stage 3's `flash_attn_with_kvcache`: check the call's inputs (a sentence for anything
    flash-attn would refuse), pick the implementation, and hand the call, as it came, to
    flash-attn's kernel when that is the one; otherwise refuse the options only that kernel
    implements and run the wrapped function on the call's paged form, its `backend` the name
    picked."""
    signature = inspect.signature(paged_attention)

    @functools.wraps(paged_attention)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments                                   # every argument, by name
        a["cache_seqlens"] = check_attention_inputs(
            a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"],
            a["cache_batch_idx"], a["block_table"], a["softmax_scale"])
        name = pick_backend(a.pop("backend"), a["q"], a["k_cache"], a["block_table"])
        if name == "flash_attn":
            return flash_attn.flash_attn_with_kvcache(**a)
        check_implemented(name, **{option: a[option] for option in (
            "rotary_cos", "rotary_sin", "cache_leftpad", "window_size", "softcap", "alibi_slopes",
            "return_softmax_lse")})
        a["block_table"], a["cache_seqlens"] = paged_form(
            a["q"], a["k_cache"], a["cache_seqlens"], a["cache_batch_idx"], a["block_table"])
        return paged_attention(**a, backend=name)
    return call


def paged_form(q, k_cache, cache_seqlens, cache_batch_idx, block_table):
    """(block_table, cache_seqlens) of flash-attn's call in its paged form: a non-paged cache
    (B_cache, seqlen_cache, Hk, D) is a pool of B_cache blocks of seqlen_cache slots, row b's
    table the one block cache_batch_idx[b] (or b); no `cache_seqlens` means every row is full."""
    B = q.shape[0]
    if block_table is None:
        block_table = (cache_batch_idx if cache_batch_idx is not None else torch.arange(B))[:, None]
    if cache_seqlens is None:
        cache_seqlens = torch.full((B,), block_table.shape[1] * k_cache.shape[1],
                                   dtype=torch.int32, device=q.device)
    return block_table, cache_seqlens


def pick_backend(backend: str, q, k_cache, block_table, why_auto_not: str | None = None) -> str:
    """The implementation that serves a call with `backend=backend`: "auto" is flash-attn's
    kernel where it can serve the call, else "torch". Raises UsageError (a ValueError), with the
    reason, for a backend that does not exist or cannot serve the call. Sets `last_backend`.
    `why_auto_not`: a caller that chose `backend` for "auto" says why flash-attn's kernel was
    not used."""
    global last_backend
    if backend not in available_backends():
        raise UsageError(f"backend must be one of {', '.join(map(repr, available_backends()))}, "
                         f"not {backend!r}")
    why_not = why_not_flash(q, k_cache, block_table)
    if backend == "flash_attn" and why_not:
        raise UsageError(f"backend='flash_attn' cannot serve this call: {why_not}")
    name = "flash_attn" if backend == "flash_attn" or (backend == "auto" and not why_not) \
        else "torch" if backend == "auto" else backend
    if name not in ("flash_attn", "torch") and (refusal := BACKENDS[name].why_not(q, k_cache)):
        raise UsageError(f"backend={name!r} cannot serve this call: {refusal}")
    last_backend = name
    _announce(name, why_not if backend == "auto" and name == "torch" else why_auto_not, q.is_cuda)
    return name


def sdpa(q, k, v, scale, **options):
    """`F.scaled_dot_product_attention` on (B, H, T, D), grouped-query heads included, in q's
    dtype; on a CPU bf16 and fp16 are computed in float32, which is faster there and as exact.
    Stage 1's attention (`kv_cache.attention_over_cache`) runs through it."""
    dtype = q.dtype
    if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        q, k, v = q.float(), k.float(), v.float()
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                          **options).to(dtype)


def why_not_flash(q, k_cache, block_table) -> str | None:
    """Why flash-attn's kernel cannot serve this call, or None if it can."""
    if flash_attn is None:
        return "flash_attn is not installed"
    if not q.is_cuda:
        return "the tensors are not on a CUDA GPU"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn computes in fp16 or bf16, not {q.dtype}"
    if torch.cuda.get_device_capability(q.device)[0] < 8:
        return "flash-attn 2 needs an Ampere (sm80) or newer GPU"
    if q.shape[-1] > 256:
        return f"flash-attn supports head_dim up to 256, not {q.shape[-1]}"
    if block_table is not None and k_cache.shape[1] % 256:
        return f"flash-attn 2 needs a block size that is a multiple of 256, not {k_cache.shape[1]}"
    return None


def _announce(backend, why_not, on_cuda):
    """Log, once per distinct line, which implementation runs and why."""
    line = f"paged attention: {backend} implementation" + (f" ({why_not})" if why_not else "")
    if line not in _announced:
        _announced.add(line)
        # On a GPU the fallback is slow enough that a user should hear about it.
        log.log(logging.WARNING if on_cuda and backend == "torch" else logging.INFO, line)
