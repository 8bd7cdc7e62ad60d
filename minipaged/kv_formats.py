"""Support, not a stage (not needed on a first read): what a KV pool's slots hold.

`kv_dtype=None` (the default) is the model's own dtype, the pool of stages 1-4. A later stage
registers another format by name (stage 4b's "int8", `kv_quant.py`): the slot layout it stores
and the attention that reads it. Stage 3's PagedCache asks here, so it never imports the later
stage; like a `backend`, a format runs only when asked for by name.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from .errors import RequestError


class KVFormat(NamedTuple):
    """`layout(head_dim, dtype)` -> (last dimension, dtype) of the pool's slots;
    `attend(q, k_cache, v_cache, k, v, cache_seqlens, block_table, backend=...)` writes the new
    k/v into the pool in this format and attends (flash_attn_with_kvcache's paged call, causal);
    `backends`: the `backend=` names that may be asked for beside it; `write(x)`: rows
    (..., head_dim) as the slots store them, and `read(slots, dtype)`: slots back as values
    (what the speed layer calls around its own kernels)."""
    layout: Callable
    attend: Callable
    backends: tuple = ("auto", "torch")
    write: Callable | None = None
    read: Callable | None = None


KV_FORMATS: dict[str, KVFormat] = {}   # name -> KVFormat (None, the model's dtype, is not listed)


def register_kv_format(name: str, layout: Callable, attend: Callable,
                       backends: tuple = ("auto", "torch"), write: Callable | None = None,
                       read: Callable | None = None) -> None:
    KV_FORMATS[name] = KVFormat(layout, attend, backends, write, read)


def check_kv_dtype(kv_dtype, backend: str = "auto"):
    """`kv_dtype` is None or a registered format that `backend` can serve; returns it."""
    if kv_dtype is not None and kv_dtype not in KV_FORMATS:
        names = ", ".join(repr(n) for n in KV_FORMATS)
        raise RequestError(f"kv_dtype must be None (the model's dtype) or one of {names}, "
                           f"not {kv_dtype!r}")
    if kv_dtype is not None and backend not in KV_FORMATS[kv_dtype].backends:
        names = ", ".join(repr(n) for n in KV_FORMATS[kv_dtype].backends)
        raise RequestError(f"kv_dtype={kv_dtype!r} blocks are read by the backends {names}, "
                           f"not {backend!r}")
    return kv_dtype


def stored_layout(head_dim: int, dtype, kv_dtype=None):
    """(last dimension, dtype) of a pool's slots: (head_dim, dtype) for kv_dtype None."""
    return (head_dim, dtype) if kv_dtype is None else KV_FORMATS[kv_dtype].layout(head_dim, dtype)


def attend_in_format(cache, layer: int, q, k, v):
    """A PagedCache's `attend` on blocks stored as its `kv_dtype`: the format writes the new k/v
    into the layer's pool and attends over them (stage 4b's int8: quantize in, dequantize out)."""
    m = cache.managers[layer]
    return KV_FORMATS[cache.kv_dtype].attend(q, m.k_cache_paged, m.v_cache_paged, k, v,
                                             cache.cache_seqlens, cache.block_tables[layer],
                                             backend=cache.backend)
