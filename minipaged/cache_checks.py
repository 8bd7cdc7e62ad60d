"""Support, not a stage (not needed on a first read): the checks a cache and a call of
`flash_attn_with_kvcache` make before anything changes — memory (`check_memory`: a pool larger
than memory would be killed by the operating system's out-of-memory killer half-way through,
with no message), pools and contiguous rows, the attention call's tensors
(`check_attention_inputs`), a CacheManager's sequence ids and free blocks, a PagedCache's
arguments and step.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .checks import check_count, check_device, check_id, check_ids, check_sizes
from .errors import NotEnoughMemoryError, OutOfBlocksError, RequestError, UsageError
from .kv_formats import check_kv_dtype


# -- memory --------------------------------------------------------------------------------------

def available_memory(device) -> int | None:
    """Bytes `device` can still give without pushing anything else out: the free memory of a
    CUDA device, MemAvailable of /proc/meminfo on a Linux CPU; None where neither is known."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024          # the file counts in KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(nbytes: int, device, what: str, unit_bytes: int = 0, unit: str = "") -> None:
    """Refuse to allocate `nbytes` for `what` if `device` has less available: raise
    NotEnoughMemoryError naming the size asked for and what fits (how many `unit`s of
    `unit_bytes` bytes each), before anything is allocated."""
    available = available_memory(device)
    if available is None or nbytes <= available:
        return
    fits = f": room for at most {available // unit_bytes:,} {unit}" if unit_bytes else ""
    raise NotEnoughMemoryError(
        f"{what} needs {format_bytes(nbytes)}, but {torch.device(device)} has only "
        f"{format_bytes(available)} available{fits}. Ask for less; nothing was allocated.")


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB': a size as a person reads it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def pool_bytes(num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
               max_seqs: int, max_blocks_per_seq: int, dtype, kv_bytes_per_token) -> int:
    """Bytes one layer's pool is about to take: its K and V blocks and its block table
    (`kv_bytes_per_token`: stage 1's function). RequestError first if a size is not a positive
    integer."""
    check_sizes(num_blocks=num_blocks, block_size=block_size, n_kv_heads=n_kv_heads,
                head_dim=head_dim, max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq)
    return num_blocks * block_size * kv_bytes_per_token(n_kv_heads, head_dim, dtype) + \
        max_seqs * max_blocks_per_seq * 4                    # int32 block table


def check_budget(num_blocks: int, budget_bytes, block_size: int, n_layers: int,
                 per_block: int) -> int:
    """The blocks a KV budget holds, or OutOfBlocksError when it holds none."""
    if num_blocks < 1:
        raise OutOfBlocksError(
            f"a KV budget of {int(budget_bytes):,} bytes holds no block: one block of {block_size} "
            f"tokens in {n_layers} layers takes {per_block:,} bytes; raise the budget or shrink "
            f"block_size")
    return num_blocks


def check_pool(num_blocks, block_size, n_kv_heads, head_dim, max_seqs, max_blocks_per_seq,
               device, dtype, kv_bytes_per_token, n_layers: int | None = None) -> None:
    """Sizes positive, and room on `device` for one CacheManager's pool (`n_layers` None) or
    for a PagedCache's `n_layers` pools, before any is allocated."""
    per_layer = pool_bytes(num_blocks, block_size, n_kv_heads, head_dim, max_seqs,
                           max_blocks_per_seq, dtype, kv_bytes_per_token)
    # an integer pool cannot be attended over, but for int8: stage 4b's codes with their scales
    check_device(device, None if dtype == torch.int8 else dtype)
    block = block_size * kv_bytes_per_token(n_kv_heads, head_dim, dtype, n_layers or 1)
    if per_layer > 2 * num_blocks * block // (n_layers or 1):    # mostly block tables
        check_memory((n_layers or 1) * per_layer, device,
                     f"block tables for {max_seqs:,} sequences of up to {max_blocks_per_seq:,} "
                     f"blocks each (beside {num_blocks:,} blocks of {block_size:,} tokens)")
    if n_layers is None:
        check_memory(per_layer, device, f"a pool of {num_blocks:,} blocks of {block_size:,} tokens",
                     block, f"blocks of {block_size:,} tokens")
        return
    check_memory(n_layers * per_layer, device,
                 f"a KV pool of {num_blocks:,} blocks of {block_size:,} tokens in each of "
                 f"{n_layers} layers, block tables for {max_seqs:,} sequences included",
                 block, f"blocks of {block_size:,} tokens per layer")


def check_contiguous(args, max_batch, max_seq_len, device, dtype, kv_bytes_per_token) -> None:
    """Sizes positive, and room on `device` for a contiguous cache of `max_batch` rows."""
    check_sizes(max_batch=max_batch, max_seq_len=max_seq_len)
    row = max_seq_len * kv_bytes_per_token(args.n_kv_heads, args.head_dim, dtype, args.n_layers)
    check_memory(max_batch * row, device, f"a contiguous cache of {max_batch:,} row(s) of "
                 f"{max_seq_len:,} tokens", row, f"rows of {max_seq_len:,} tokens")


def check_rows(seq_ids, max_batch: int) -> list[int]:
    """A contiguous cache's rows: integers in [0, max_batch), at least one."""
    ids = check_ids(seq_ids)
    if not ids or min(ids) < 0 or max(ids) >= max_batch:
        raise RequestError(f"sequence ids must lie in [0, {max_batch}); got {list(seq_ids)}")
    return ids


def check_row_step(cache, seq_ids, num_new_tokens) -> tuple[list[int], int]:
    """A contiguous cache's step: its rows (`check_rows`), the count of new tokens, and room for
    them in every row (`check_row_room`), before anything changes."""
    rows, n = check_rows(seq_ids, cache.max_batch), check_count(num_new_tokens)
    check_row_room(int(cache.seq_lens[rows].max()) + n, cache.max_seq_len)
    return rows, n


def check_row_room(longest: int, max_seq_len: int) -> None:
    """OutOfBlocksError if a contiguous row would outgrow the `max_seq_len` slots it reserved."""
    if longest > max_seq_len:
        raise OutOfBlocksError(
            f"a sequence would reach {longest} tokens but each row reserves only "
            f"{max_seq_len}; ask for fewer new tokens or a larger max_seq_len")


# -- a call of flash_attn_with_kvcache -----------------------------------------------------------

def check_attention_inputs(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                           block_table, softmax_scale=None):
    """Raise UsageError (a ValueError) with a sentence for a call flash-attn would refuse;
    return the lengths as an int32 (B,) tensor on q's device (or None)."""
    def need(ok, sentence):
        if not ok:
            raise UsageError(sentence)

    need(q.dim() == 4, f"q must be (batch, seqlen, n_heads, head_dim), got shape {tuple(q.shape)}")
    B, _, Hq, D = q.shape
    need(B > 0, "q holds a batch of 0 rows; flash-attn refuses an empty batch too (\"batch size "
                "must be positive\"): call it only when at least one sequence has a token")
    need(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
         f"k_cache and v_cache must share one 4-D shape, got {tuple(k_cache.shape)} and "
         f"{tuple(v_cache.shape)}")
    Hk = k_cache.shape[2]
    need(k_cache.shape[3] == D, f"q has head_dim {D} but the cache has {k_cache.shape[3]}")
    need(Hq % Hk == 0, f"q's {Hq} heads must be a multiple of the cache's {Hk} kv heads")
    need(q.is_floating_point(), f"q must be a floating-point tensor, not {q.dtype}")
    need(softmax_scale is None or (isinstance(softmax_scale, numbers.Real)
                                   and math.isfinite(softmax_scale)),
         f"softmax_scale must be a finite number (or None: 1/sqrt(head_dim)), not {softmax_scale!r}")
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


def check_implemented(name, rotary_cos, rotary_sin, cache_leftpad, window_size, softcap,
                      alibi_slopes, return_softmax_lse) -> None:
    """NotImplementedError for flash-attn options only flash-attn's own kernel implements."""
    unsupported = {"rotary_cos/rotary_sin": rotary_cos is not None or rotary_sin is not None,
                   "cache_leftpad": cache_leftpad is not None,
                   "window_size": tuple(window_size) != (-1, -1),
                   "softcap": softcap != 0.0,
                   "alibi_slopes": alibi_slopes is not None,
                   "return_softmax_lse": bool(return_softmax_lse)}
    asked = [option for option, used in unsupported.items() if used]
    if asked:
        raise NotImplementedError(
            f"the {name} paged attention does not implement {', '.join(asked)}; leave "
            f"{'it' if len(asked) == 1 else 'them'} at flash-attn's default, or run flash-attn's "
            f"kernel (CUDA, fp16/bf16, block size a multiple of 256)")


def check_lengths(cache_seqlens, seqlens_k, width: int, block_size: int) -> None:
    """UsageError unless every row's lengths are >= 0 and fit the slots its table addresses
    (`width` blocks of `block_size`)."""
    if int(cache_seqlens.min()) < 0:
        raise UsageError("cache_seqlens must be >= 0: it counts the tokens a row has stored")
    L, capacity = max(seqlens_k.tolist()), width * block_size
    if L > capacity:
        raise UsageError(
            f"a row needs {L} slots but its block table addresses only {capacity} "
            f"({width} blocks of {block_size}); give it more blocks first")


def check_table(table, owned, num_blocks: int, cache_seqlens, block_size: int,
                writes: bool) -> None:
    """`check_blocks`, and `check_writes` when the call `writes` new tokens."""
    check_blocks(table, num_blocks)
    if writes:
        check_writes(table, owned, cache_seqlens, block_size)


def check_blocks(table, num_blocks: int) -> None:
    """UsageError unless every block a row owns exists in the pool."""
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_blocks):
        raise UsageError(f"block_table (or cache_batch_idx) points outside k_cache's "
                         f"{num_blocks} blocks (rows): every block a row uses must exist")


def check_writes(table, owned, cache_seqlens, block_size: int) -> None:
    """UsageError unless every block a row writes its new tokens into is held once, by that row:
    a block two rows share (a prefix, a fork) is read-only until one of them copies it
    (copy-on-write), or the write lands in the other row's keys. A sort of the owned ids (B x n,
    a few thousand at most); the written blocks are looked at only if some id repeats."""
    held = table[owned].sort().values                               # every owned entry, sorted
    repeated = held[1:][held[1:] == held[:-1]]                      # ids held twice or more
    if not repeated.numel():
        return
    first = cache_seqlens.long()[:, None] // block_size                         # (B, 1)
    written = owned & (torch.arange(table.shape[1], device=table.device) >= first)  # (B, n)
    targets = table[written]                                        # the blocks written into
    found = repeated[torch.searchsorted(repeated, targets).clamp(max=len(repeated) - 1)]
    clash = targets[found == targets]
    if clash.numel():
        block = int(clash[0])
        rows = sorted({int(r) for r in ((table == block) & owned).nonzero()[:, 0]})
        raise UsageError(f"block {block} is in the block tables of rows {rows}, and new keys "
                         f"would be written into it, over the keys of another row: a block "
                         f"written into must be held by one row once (copy a shared block "
                         f"first: copy-on-write)")


# -- a CacheManager's sequences and blocks --------------------------------------------------------

def check_live(cm, seq_ids, unique: bool = False) -> np.ndarray:
    """Sequence ids -> integer numpy rows, every one of them holding blocks in `cm`."""
    ids = check_ids(seq_ids)
    if not ids:
        raise RequestError("no sequence ids given")
    unknown = sorted(set(ids) - cm._live)
    if unknown:
        raise RequestError(f"sequences {unknown} hold no blocks here: reserve them first "
                           f"(or they have already been freed)")
    if unique and len(set(ids)) != len(ids):
        raise RequestError(f"a sequence id appears twice in {ids}; list each sequence once")
    return np.array(ids, dtype=np.int64)


def check_one(cm, seq_id) -> int:
    """One sequence id that holds blocks in `cm`."""
    s = check_id(seq_id)
    if s not in cm._live:
        raise RequestError(f"sequence {seq_id} holds no blocks here: reserve it first "
                           f"(or it has already been freed)")
    return s


def check_new(cm, seq_id) -> int:
    """A sequence id that may start now: inside the table and holding nothing."""
    s = check_id(seq_id)
    if not 0 <= s < cm.max_seqs:
        raise RequestError(f"sequence id {seq_id} is outside [0, {cm.max_seqs})")
    if s in cm._live:
        raise RequestError(f"sequence {s} already holds blocks; free it before reusing its id")
    return s


def check_room(cm, seqs, blocks_after, total: int, unavailable: int = 0) -> None:
    """Raise, before anything changes, if a table row or the free blocks are too few: `seqs`
    get blocks, `blocks_after[i]` is how many seqs[i] will hold (RequestError past
    max_blocks_per_seq), `total` the new blocks the call takes from the free set
    (OutOfBlocksError past the free ones; `unavailable`: free blocks it will not take)."""
    if max(blocks_after) > cm.max_blocks_per_seq:
        too_long = [s for s, k in zip(seqs, blocks_after) if k > cm.max_blocks_per_seq]
        raise RequestError(
            f"sequence(s) {too_long} would need more than max_blocks_per_seq="
            f"{cm.max_blocks_per_seq} blocks ({cm.max_blocks_per_seq * cm.block_size} "
            f"tokens); end them sooner or build the CacheManager with a longer table")
    free = cm.num_free_blocks - unavailable
    if total > free:
        raise OutOfBlocksError(
            f"out of KV blocks: this step needs {total} new block(s) but only {free} of "
            f"{cm.num_blocks} are free; finish or preempt a sequence, or size the pool "
            f"from a larger KV budget. Nothing was allocated.")


# -- a PagedCache's step --------------------------------------------------------------------------

def check_paged_cache(num_blocks, block_size, max_seq_len, kv_dtype, backend: str):
    """A PagedCache's arguments: a `kv_dtype` that `backend` serves (returned), sizes positive."""
    kv_dtype = check_kv_dtype(kv_dtype, backend)
    check_sizes(num_blocks=num_blocks, block_size=block_size, max_seq_len=max_seq_len)
    return kv_dtype


def check_step(cache, seq_ids, num_new_tokens) -> tuple[list[int], int]:
    """A step's sequence ids (`check_step_ids`) and its count of new tokens per sequence."""
    return check_step_ids(cache, seq_ids), check_count(num_new_tokens)


def check_step_ids(cache, seq_ids) -> list[int]:
    """Distinct sequence ids inside the cache's tables."""
    ids, max_seqs = check_ids(seq_ids), cache.managers[0].max_seqs
    if not ids or len(set(ids)) < len(ids) or not all(0 <= s < max_seqs for s in ids):
        raise RequestError(f"sequence ids must be distinct and lie in [0, {max_seqs}); "
                           f"got {list(seq_ids)}")
    return ids


def check_step_room(cache, needed: int, longest: int) -> None:
    """Raise before anything changes if a step needs more blocks per layer than are free, or
    would make a sequence longer than the cache's `max_seq_len`."""
    if longest > cache.max_seq_len:
        raise RequestError(f"a sequence would reach {longest} tokens, past this cache's "
                           f"max_seq_len={cache.max_seq_len}; end it sooner or build a "
                           f"larger cache. Nothing was allocated.")
    if needed > cache.num_free_blocks:
        raise OutOfBlocksError(
            f"out of KV blocks: this step needs {needed} new block(s) per layer but only "
            f"{cache.num_free_blocks} of {cache.num_blocks} are free; finish a sequence or "
            f"give the pool more memory. Nothing was allocated.")
