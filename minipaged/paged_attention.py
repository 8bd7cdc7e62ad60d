"""Stage 3: paged attention — attend over a KV cache scattered across fixed-size blocks.

A paged cache stores a sequence's keys and values in blocks of `block_size` slots taken from
a shared pool, `k_cache`/`v_cache` of shape (num_blocks, block_size, n_kv_heads, head_dim).
Row b's `block_table[b]` lists its blocks in order: position `pos` of the row lives in block
`block_table[b, pos // block_size]`, at offset `pos % block_size`.

`flash_attn_with_kvcache` has flash-attn's signature and meaning, so the same call runs
flash-attn's CUDA kernel where it can, and a readable PyTorch version everywhere else:

  1. write the new k/v into their slots (through a slot mapping, vLLM's word for it);
  2. gather each row's blocks into one contiguous (B, L, n_kv_heads, head_dim) tensor;
  3. attend with the masked attention the contiguous cache uses (`attention_over_cache`).

`backend=` picks the implementation: "flash_attn", "torch", any a later stage adds with
`register_backend` (stage 3b adds "triton" and "cpu"), or "auto" (flash-attn's kernel where it
can serve the call, else a registered kernel that offers itself to "auto" and can serve it, else
PyTorch). `last_backend` says which one served the last call; the first use of each is logged.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, NamedTuple

import numpy as np
import torch

from .kv_cache import attend_rows, attention_over_cache, upcast

try:  # optional: the CUDA kernel, `pip install flash-attn --no-build-isolation`
    import flash_attn
except ImportError:
    flash_attn = None

log = logging.getLogger(__name__)
last_backend: str | None = None   # the implementation that served the last call
_announced: set[str] = set()      # log lines already written, so each appears once


class Backend(NamedTuple):
    """An implementation behind `flash_attn_with_kvcache(..., backend=name)`.

    `attend(q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale, num_splits)`
    runs after the new k/v are written: row b has `seqlens_k[b]` keys in the blocks its
    `block_table` row lists (every entry a real block: see `owned_block_table`).
    `why_not(q, k_cache)` is a sentence saying why it cannot serve a call, or None.
    `auto`: "auto" may pick it, before PyTorch, for a call it can serve.
    """
    attend: Callable
    why_not: Callable = lambda q, k_cache: None
    auto: bool = False


BACKENDS: dict[str, Backend] = {}   # name -> Backend; flash-attn's kernel is called directly


def register_backend(name: str, attend: Callable, why_not: Callable | None = None,
                     auto: bool = False) -> None:
    """Make `flash_attn_with_kvcache(..., backend=name)` (and PagedCache's `backend=name`) run
    `attend`, with the write, the checks and the flash-attn semantics of every other backend;
    with `auto`, "auto" picks it where flash-attn's kernel cannot serve a call and it can."""
    BACKENDS[name] = Backend(attend, why_not or Backend._field_defaults["why_not"], auto)


def available_backends() -> list[str]:
    """The names `backend=` accepts."""
    return ["auto", "flash_attn", *BACKENDS]


def flash_attn_available() -> bool:
    """True when flash-attn's kernel imports and a CUDA GPU is present."""
    return flash_attn is not None and torch.cuda.is_available()


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, backend: str = "auto"):
    """Write `k`/`v` into the cache in place at `cache_seqlens`, then attend `q` over the cache.

    q (B, Sq, Hq, D); paged cache (num_blocks, block_size, Hk, D) with `block_table` int32
    (B, max_blocks), or flash-attn's non-paged cache (B_cache, seqlen_cache, Hk, D) with an
    optional `cache_batch_idx` int32 (B,); k, v (B, Sk, Hk, D); `cache_seqlens` an int or an
    int32 (B,) tensor of tokens already stored (None: every row fills its whole cache).
    Row b attends to cache_seqlens[b] + Sk keys; `causal` aligns the mask bottom-right.
    Returns (B, Sq, Hq, D). `backend` is one of `available_backends()`.
    """
    cache_seqlens = _check_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                  block_table)
    name = pick_backend(backend, q, k_cache, block_table)
    if name == "flash_attn":
        return flash_attn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap,
            rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
            num_splits=num_splits, return_softmax_lse=return_softmax_lse)

    unsupported = {"rotary_cos/rotary_sin": rotary_cos is not None or rotary_sin is not None,
                   "cache_leftpad": cache_leftpad is not None,
                   "window_size": tuple(window_size) != (-1, -1),
                   "softcap": softcap != 0.0,
                   "alibi_slopes": alibi_slopes is not None,
                   "return_softmax_lse": bool(return_softmax_lse)}
    asked = [name for name, used in unsupported.items() if used]
    if asked:
        raise NotImplementedError(
            f"the {name} paged attention does not implement {', '.join(asked)}; leave "
            f"{'it' if len(asked) == 1 else 'them'} at flash-attn's default, or run flash-attn's "
            f"kernel (CUDA, fp16/bf16, block size a multiple of 256)")
    table, cache_seqlens, seqlens_k = owned_block_table(q, k_cache, k, cache_seqlens,
                                                        cache_batch_idx, block_table)
    write_new_kv(k_cache, v_cache, k, v, table, cache_seqlens)
    return BACKENDS[name].attend(q, k_cache, v_cache, table, seqlens_k, causal, softmax_scale,
                                 num_splits)


# -- the PyTorch implementation ----------------------------------------------------------------

def owned_block_table(q, k_cache, k, cache_seqlens, cache_batch_idx, block_table):
    """The block table every backend but flash-attn's reads, and the lengths before and after
    the new tokens: (table (B, n), cache_seqlens (B,), seqlens_k (B,)), all on q's device.

    The table is cut to the n blocks the longest row needs, and every entry a row does not own
    points at block 0: entries past a row's last block may be padding (-1, stale ids), and any
    real block will do there, since no backend reads a slot past seqlens_k[b].
    """
    B, device = q.shape[0], q.device
    num_blocks, block_size = k_cache.shape[:2]
    if block_table is None:
        # flash-attn's non-paged mode is the paged mode with one block per row, as long as
        # a whole cache row: block_table[b] = [cache_batch_idx[b]].
        rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(B)
        block_table = rows[:, None]                                           # (B, 1)
    block_table = block_table.to(device)
    capacity = block_table.shape[1] * block_size          # slots a row's table can address
    n_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:                             # no lengths: every row is full
        cache_seqlens = torch.full((B,), capacity, dtype=torch.int32, device=device)
    seqlens_k = cache_seqlens.long() + n_new                                  # (B,) keys per row
    L = max(seqlens_k.tolist())                           # the longest row: all we gather
    if int(cache_seqlens.min()) < 0:
        raise ValueError("cache_seqlens must be >= 0: it counts the tokens a row has stored")
    if L > capacity:
        raise ValueError(
            f"a row needs {L} slots but its block table addresses only {capacity} "
            f"({block_table.shape[1]} blocks of {block_size}); give it more blocks first")

    n = -(-L // block_size)                                                   # ceil(L / bs)
    owned = torch.arange(n, device=device) * block_size < seqlens_k[:, None]  # (B, n)
    table = torch.where(owned, block_table[:, :n].long(), 0)                  # (B, n)
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_blocks):
        raise ValueError(f"block_table (or cache_batch_idx) points outside k_cache's "
                         f"{num_blocks} blocks (rows): every block a row uses must exist")
    return table, cache_seqlens, seqlens_k


def write_new_kv(k_cache, v_cache, k, v, table, cache_seqlens) -> None:
    """Write the new k/v (B, Sk, Hk, D) in place, at positions cache_seqlens[b] ... of row b.

    New token t of row b goes to position p = cache_seqlens[b] + t, which is slot
    table[b, p // block_size] * block_size + p % block_size of the pool seen as one long array
    of slots (vLLM's slot_mapping). Like vLLM's reshape_and_cache, split the slot back into
    (block, offset) to write without assuming the pool's memory layout.
    """
    if k is None:
        return
    block_size, n_new, device = k_cache.shape[1], k.shape[1], k.device
    positions = cache_seqlens[:, None].long() + torch.arange(n_new, device=device)  # (B, Sk)
    slot_mapping = table.gather(1, positions // block_size) * block_size \
        + positions % block_size                                          # (B, Sk)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k                      # in place, (B, Sk, Hk, D) slots
    v_cache[blocks, offsets] = v


def _gather_and_attend(q, k_cache, v_cache, table, seqlens_k, causal, softmax_scale, num_splits):
    """The "torch" backend: gather each row's blocks, then attend (`num_splits` is a kernel's
    knob; it means nothing here)."""
    lens = seqlens_k.tolist()
    L = max(lens)                                         # the longest row: all we gather
    if q.shape[1] == 1 and min(lens) < L:
        return _gather_rows_and_attend(q, k_cache, v_cache, table, lens, softmax_scale)
    k_ctx, v_ctx = _gather(k_cache, table, L), _gather(v_cache, table, L)    # (B, L, Hk, D)
    # the same attention as the contiguous cache
    return attention_over_cache(q, k_ctx, v_ctx, seqlens_k, causal=causal,
                                softmax_scale=softmax_scale)


def _gather(cache, table, L):
    """Copy the first L slots of each row's blocks into one contiguous (B, L, Hk, D) tensor.

    `index_select` along the block dimension copies each block as one piece of memory; the
    equivalent `cache[table]` goes element by element and takes twice as long on a CPU.
    """
    blocks = cache.index_select(0, table.reshape(-1))          # (B * n, block_size, Hk, D)
    return blocks.view(table.shape[0], -1, *cache.shape[2:])[:, :L]    # (B, L, Hk, D)


def _gather_rows_and_attend(q, k_cache, v_cache, table, lens, softmax_scale):
    """A decode step whose rows differ in length. Each row attends alone (`attend_rows`), so
    the rows need not be padded to the longest: only the blocks they own are gathered, one
    row's after the other (in a batch of 16 chat requests with one long prompt, less than
    half the blocks a padded gather copies)."""
    block_size, D = k_cache.shape[1], k_cache.shape[3]
    # The same for every layer, and a handful of numbers: Python and numpy, not torch calls.
    counts = [-(-n // block_size) for n in lens]                               # blocks per row
    held = np.arange(max(counts)) < np.array(counts)[:, None]                  # (B, n)
    owned = table[:, :held.shape[1]][torch.from_numpy(held).to(table.device)]  # row after row
    k_all = k_cache.index_select(0, owned).flatten(0, 1)   # (sum of counts * block_size, Hk, D)
    v_all = v_cache.index_select(0, owned).flatten(0, 1)
    starts = itertools.accumulate((c * block_size for c in counts), initial=0)  # first slots
    rows = [slice(s, s + length) for s, length in zip(starts, lens)]
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    q_, k_all, v_all = upcast(q, k_all, v_all)           # bf16 -> float32 once, not per row
    y = attend_rows(q_.transpose(1, 2), [k_all[r].transpose(0, 1) for r in rows],
                    [v_all[r].transpose(0, 1) for r in rows], scale)        # (B, Hq, 1, D)
    return y.transpose(1, 2).to(q.dtype)


register_backend("torch", _gather_and_attend)


# -- a whole step of a paged cache: the bookkeeping of every layer at once ---------------------

class PagedStep(NamedTuple):
    """One step of a paged cache, as every layer's attention reads it. The bookkeeping that
    `flash_attn_with_kvcache` does on each call (`owned_block_table`, the slot mapping of
    `write_new_kv`) is the same for every layer but for the block ids, so a cache does it once
    per step, on all its layers' block tables stacked into one tensor (`plan_step`)."""
    cache_seqlens: torch.Tensor   # (B,) int32: tokens each row stored before the step
    seqlens_k: torch.Tensor       # (B,) int64: keys each row attends to, the new ones included
    block_tables: torch.Tensor    # (n_layers, B, W) int32: each layer's tables, as kept
    tables: torch.Tensor          # (n_layers, B, n) int64: the blocks each row owns, else 0
    positions: torch.Tensor       # (B, T) int64: the new tokens' places in their sequences
    blocks: torch.Tensor          # (n_layers, B, T) int64: the block each new token goes to
    offsets: torch.Tensor         # (B, T) int64: its offset in that block (the same in all layers)


def plan_step(block_tables, cache_seqlens, num_new_tokens: int, block_size: int,
              device="cpu") -> PagedStep:
    """`owned_block_table` and the slot mapping of `write_new_kv` for every layer in one go:
    block_tables (n_layers, B, W) int32 and cache_seqlens (B,) int32, both on the CPU, each row
    adding `num_new_tokens` tokens; the step's tensors are put on `device` (default: the CPU).
    Layer l's table is owned_block_table's for that layer, and new token t of row b goes to
    block blocks[l, b, t] at offset offsets[b, t].

    The arithmetic is numpy's, on the CPU, as vLLM's model runner prepares a step: it is a
    dozen operations on arrays of a few dozen numbers, where each torch call would cost more
    than its work (here, for 30 layers: 25 us a step of one sequence, 38 us of sixteen).
    """
    B = block_tables.shape[1]
    before = cache_seqlens.numpy().astype(np.int64)                          # (B,)
    seqlens_k = before + num_new_tokens                                       # (B,)
    n = -(-int(seqlens_k.max()) // block_size)          # blocks the longest row needs
    owned = np.arange(n) * block_size < seqlens_k[:, None]                    # (B, n)
    tables = np.where(owned, block_tables.numpy()[:, :, :n], 0).astype(np.int64)  # (layers, B, n)
    # write_new_kv's slot mapping, split into block and offset at once
    positions = before[:, None] + np.arange(num_new_tokens)                   # (B, T)
    blocks = tables[:, np.arange(B)[:, None], positions // block_size]        # (layers, B, T)
    return PagedStep(cache_seqlens.to(device), *(torch.from_numpy(a).to(device) for a in (
        seqlens_k, block_tables.numpy(), tables, positions, blocks, positions % block_size)))


def attend_step(q, k, v, k_cache, v_cache, step: PagedStep, layer: int, name: str):
    """`flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True)` for layer `layer` of a
    step that `plan_step` planned, on the implementation `name` that `pick_backend` chose for
    the step: write the new k/v into their slots, then attend. The cache that built `step` is
    trusted: nothing is checked again here."""
    if name == "flash_attn":          # flash-attn's kernel writes k/v itself
        return flash_attn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, cache_seqlens=step.cache_seqlens,
            block_table=step.block_tables[layer], causal=True)
    blocks = step.blocks[layer]                                               # (B, T)
    k_cache[blocks, step.offsets] = k                 # in place, (B, T, Hk, D) slots
    v_cache[blocks, step.offsets] = v
    return BACKENDS[name].attend(q, k_cache, v_cache, step.tables[layer], step.seqlens_k, True,
                                 None, 0)


# -- checks and dispatch -------------------------------------------------------------------------

def _check_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """Raise ValueError with a sentence for a call flash-attn would refuse; return the lengths
    as an int32 (B,) tensor on q's device (or None)."""
    def need(ok, sentence):
        if not ok:
            raise ValueError(sentence)

    need(q.dim() == 4, f"q must be (batch, seqlen, n_heads, head_dim), got shape {tuple(q.shape)}")
    B, _, Hq, D = q.shape
    need(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
         f"k_cache and v_cache must share one 4-D shape, got {tuple(k_cache.shape)} and "
         f"{tuple(v_cache.shape)}")
    Hk = k_cache.shape[2]
    need(k_cache.shape[3] == D, f"q has head_dim {D} but the cache has {k_cache.shape[3]}")
    need(Hq % Hk == 0, f"q's {Hq} heads must be a multiple of the cache's {Hk} kv heads")
    need(q.is_floating_point(), f"q must be a floating-point tensor, not {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None:
            need(t.dtype == q.dtype, f"{name} is {t.dtype} but q is {q.dtype}; use one dtype")
            need(t.device == q.device, f"{name} is on {t.device} but q is on {q.device}")
    need((k is None) == (v is None), "pass both k and v (the new tokens), or neither")
    if k is not None:
        need(cache_seqlens is not None, "with new k/v, cache_seqlens must say where they go")
        need(k.dim() == 4 and k.shape[0] == B and k.shape[2:] == (Hk, D) and v.shape == k.shape,
             f"k and v must be (batch={B}, seqlen_new, n_kv_heads={Hk}, head_dim={D}), got "
             f"{tuple(k.shape)} and {tuple(v.shape)}")
    for name, t in (("block_table", block_table), ("cache_batch_idx", cache_batch_idx)):
        if t is not None:
            need(t.dtype == torch.int32, f"{name} must be an int32 tensor, not {t.dtype}")
            need(t.dim() == (2 if name == "block_table" else 1) and t.shape[0] == B,
                 f"{name} has shape {tuple(t.shape)}, which does not fit a batch of {B}")
    need(block_table is None or cache_batch_idx is None,
         "a paged cache (block_table) cannot be combined with cache_batch_idx")
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, int):
        need(cache_seqlens >= 0, f"cache_seqlens must be >= 0, got {cache_seqlens}")
        return torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    need(isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
         and cache_seqlens.shape == (B,),
         f"cache_seqlens must be an int or an int32 tensor of shape ({B},)")
    return cache_seqlens.to(q.device)


def pick_backend(backend: str, q, k_cache, block_table) -> str:
    """The implementation that serves a call with `backend=backend`: "auto" is flash-attn's
    kernel where it can serve the call, else the first backend registered with `auto=True`
    that can, else "torch". Raises ValueError, with the reason, for a backend that does not
    exist or cannot serve the call. Sets `last_backend`."""
    global last_backend
    if backend not in available_backends():
        raise ValueError(f"backend must be one of {', '.join(map(repr, available_backends()))}, "
                         f"not {backend!r}")
    why_not = _why_not_flash(q, k_cache, block_table)
    if backend == "flash_attn" and why_not:
        raise ValueError(f"backend='flash_attn' cannot serve this call: {why_not}")
    use_flash = backend == "flash_attn" or (backend == "auto" and why_not is None)
    name = "flash_attn" if use_flash else backend
    if backend == "auto" and not use_flash:
        # the first kernel offered to "auto" that can serve the call, else PyTorch; the log
        # line says why each one before it could not
        name, reasons = "torch", [why_not]
        for candidate in (n for n, b in BACKENDS.items() if b.auto):
            refusal = BACKENDS[candidate].why_not(q, k_cache)
            if refusal is None:
                name = candidate
                break
            reasons.append(refusal)
        why_not = "; ".join(reasons)
    elif not use_flash and (refusal := BACKENDS[name].why_not(q, k_cache)):
        raise ValueError(f"backend={name!r} cannot serve this call: {refusal}")
    last_backend = name
    _announce(name, why_not if backend == "auto" and not use_flash else None, q.is_cuda)
    return name


def _why_not_flash(q, k_cache, block_table) -> str | None:
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
