"""Speed, not a stage: stage 3's paged cache with the bookkeeping of a step done once for all
layers, and stage 3b's C kernel for decode steps on a CPU.

Stage 3's `PagedCache.attend` calls `flash_attn_with_kvcache` per layer, which checks its
inputs, picks a backend, cuts the block table and works out the slot mapping — the same work in
every layer but for the block ids. `FastPagedCache` does it once per step for all layers:

  * every layer's block table and lengths live in one stacked tensor (`share_bookkeeping`), so
    a step reads all tables with one indexing and, when no block changes hands (most decode
    steps), advances all lengths with one addition;
  * `plan_step` works out, for all layers at once with numpy, each layer's owned table and where
    each new token goes (a `PagedStep`); `attend_step` writes and attends on it;
  * "auto" is flash-attn's kernel where it can serve the call, else stage 3b's C kernel
    (`cpu_attention.py`) where it builds, else PyTorch, chosen once a step (`fast_backend`);
  * PyTorch decode steps whose rows differ in length attend row by row (`attend_rows`), reading
    only the blocks each row owns;
  * a step of several tokens per row (stage 7's verify pass; a prompt, or a chunk of one, whose
    rows read up to `ROW_KEYS` keys) goes to the C kernel too, each query a decode row of its
    own (`attend_queries_as_rows`);
  * a step of many tokens per row over longer rows (a long prompt's chunks) gathers each row's
    blocks for PyTorch's flash attention, in the cache's dtype (`attend_chunks`);
  * a decode step (every row one new token) on the C kernel works out what every layer's
    attention needs once (`DecodeAttention`: slots, int64 tables, kernel arguments), so a
    layer is two copies and the kernel call;
  * int8 blocks (stage 4b, `kv_dtype="int8"`) take the same ways: the new k/v are written as
    slots (quantized; in a decode step, in C straight into the pool: `int8_slots.c`), the C
    kernel reads codes and scales where they lie, and the gathering paths read the slots back
    as floats (`KVFormat.read`).

`FastSharedPagedCache` is the same over stage 6's shared blocks, and `FastEngine` is the engine
(`minipaged.Engine`) on it: `generate(model, prompts, n, cache="paged",
engine_class=FastEngine)`, or `generate_paged(..., cache_class=FastPagedCache)` for stage 3's
static batch. The results are stage 3's, up to the order of the sums.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..backends import BACKENDS, flash_attn, pick_backend, why_not_flash
from ..cache_manager import PAD_BLOCK
from ..cache_checks import check_step, check_step_room
from ..checks import check_flag
from ..chunked_engine import PackedBatch
from ..cpu_attention import FLAGS, KV_TYPES, build, build_function, decode_attention, why_not_cpu
from ..errors import RequestError
from ..kv_formats import KV_FORMATS
from ..paged_cache import PagedCache
from ..sharing import SharedPagedCache
from ..speculative import SpeculativeEngine
from . import operators
from .contiguous import attend_rows, upcast
from .threads import AdaptiveThreads


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
    slot_mapping: torch.Tensor    # (n_layers, B * T) int64: the slot each new token goes to,
                                  # block * block_size + offset, row after row


def plan_step(block_tables, cache_seqlens, num_new_tokens: int, block_size: int,
              device="cpu") -> PagedStep:
    """`owned_block_table` and the slot mapping of `write_new_kv` for every layer in one go:
    block_tables (n_layers, B, W) int32 and cache_seqlens (B,) int32, both on the CPU, each row
    adding `num_new_tokens` tokens; the step's tensors are put on `device` (default: the CPU).
    Layer l's table is owned_block_table's for that layer, and new token t of row b goes to
    slot slot_mapping[l, b * T + t] of the layer's pool seen as (num_blocks * block_size, Hk, D).

    The arithmetic is numpy's, on the CPU, as vLLM's model runner prepares a step: it is a
    dozen operations on arrays of a few dozen numbers, where each torch call would cost more
    than its work.
    """
    B = block_tables.shape[1]
    before = cache_seqlens.numpy().astype(np.int64)                          # (B,)
    seqlens_k = before + num_new_tokens                                       # (B,)
    n = -(-int(seqlens_k.max()) // block_size)          # blocks the longest row needs
    owned = np.arange(n) * block_size < seqlens_k[:, None]                    # (B, n)
    tables = np.where(owned, block_tables.numpy()[:, :, :n], 0).astype(np.int64)  # (layers, B, n)
    # write_new_kv's slot mapping
    positions = before[:, None] + np.arange(num_new_tokens)                   # (B, T)
    blocks = tables[:, np.arange(B)[:, None], positions // block_size]        # (layers, B, T)
    slot_mapping = np.ascontiguousarray(  # (numpy's fancy indexing may hand it back strided)
        (blocks * block_size + positions % block_size).reshape(len(tables), -1))
    return PagedStep(cache_seqlens.to(device), *(torch.from_numpy(a).to(device) for a in (
        seqlens_k, block_tables.numpy(), tables, positions, slot_mapping)))


def attend_step(q, k, v, k_cache, v_cache, step: PagedStep, layer: int, name: str, read=None):
    """`flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True)` for layer `layer` of a
    step that `plan_step` planned, on the implementation `name` that `pick_backend` chose for
    the step: write the new k/v into their slots, then attend. The cache that built `step` is
    trusted: nothing is checked again here. `read`: a KV format's (stage 4b's int8), whose k/v
    come already written as slots (`KVFormat.write`): the C kernel reads the slots where they
    lie, and every other path gathers them and reads them back as q's dtype first."""
    if name == "flash_attn":          # flash-attn's kernel writes k/v itself
        return flash_attn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, cache_seqlens=step.cache_seqlens,
            block_table=step.block_tables[layer], causal=True)
    # in place, into the pools seen as one row of slots: a copy along one index (index_copy_)
    # costs a fraction of an assignment through two index tensors (k_cache[blocks, offsets])
    slots = step.slot_mapping[layer]                                          # (B * T,)
    k_cache.view(-1, *k.shape[2:]).index_copy_(0, slots, k.reshape(-1, *k.shape[2:]))
    v_cache.view(-1, *v.shape[2:]).index_copy_(0, slots, v.reshape(-1, *v.shape[2:]))
    table, T = step.tables[layer], q.shape[1]
    if name == "cpu" and T > 1 and k_cache.dtype in KV_TYPES and queries_as_rows(T, step):
        return attend_queries_as_rows(q, k_cache, v_cache, table, step.seqlens_k)
    if name == "cpu" and T > 1 or read is not None and name != "cpu":
        return attend_chunks(q, k_cache, v_cache, table, step.seqlens_k, read)
    if name == "torch" and q.shape[1] == 1:
        lens = step.seqlens_k.tolist()
        if min(lens) < max(lens):
            return _gather_rows_and_attend(q, k_cache, v_cache, table, lens, None)
    return BACKENDS[name].attend(q, k_cache, v_cache, table, step.seqlens_k, True, None, 0)


# When `attend_queries_as_rows` serves a step of several tokens per row: up to QUERIES_AS_ROWS
# tokens a row, or where no row reads more than ROW_KEYS keys. The kernel reads a row's keys once
# per query, the gather path (`attend_chunks`) once per step. On the embedded model's shapes,
# over 1,000 cached tokens, the two cost about the same at 16 queries (at 5, the kernel takes
# half the time). On SmolLM2's (9 query heads over 3, 64 dimensions; AMD EPYC, Zen 5, 2
# threads, float32 and bfloat16), the kernel took 0.44-0.76 of the gather path's time on whole
# prompts of 17 to 512 tokens, 0.75-0.83 on chunks after as many cached tokens, and about the
# same (0.94-1.08) past 1,000 keys a row: a prompt's attention goes through the kernel unless
# the prompt is long.
QUERIES_AS_ROWS = 16
ROW_KEYS = 1024


def queries_as_rows(T: int, step: PagedStep) -> bool:
    """Whether a step of T new tokens per row attends through `attend_queries_as_rows`."""
    return T <= QUERIES_AS_ROWS or int(step.seqlens_k.max()) <= ROW_KEYS


def attend_queries_as_rows(q, k_cache, v_cache, table, seqlens_k):
    """A step of several new tokens per row (a speculative verify pass: the last token and its
    drafts; a prompt, or a chunk of one) through stage 3b's decode kernel: each query becomes a
    row of its own over its sequence's blocks, seeing the keys up to its own position (causal,
    bottom-right aligned). Each query gets the numbers a decode step at its position gets,
    without stage 3's gather, mask and padding: on the embedded model a verify pass of 1 + 4
    tokens costs about 1.2 plain steps at batch 1 and 1.9 at batch 16, against 1.4 and 7
    through the gather path."""
    B, T, Hq, D = q.shape
    lens = seqlens_k[:, None] - (T - 1) + torch.arange(T, device=seqlens_k.device)  # (B, T)
    y = decode_attention(q.reshape(B * T, 1, Hq, D), k_cache, v_cache,
                         table.repeat_interleave(T, 0), lens.reshape(-1), D ** -0.5)
    return y.view(B, T, Hq, D)


def attend_chunks(q, k_cache, v_cache, table, seqlens_k, read=None):
    """A step of many new tokens per row (prompts, or chunks of them): each row's keys gathered
    from its blocks, then PyTorch's flash attention in the cache's dtype (on a CPU with bf16
    matrix instructions, bf16 runs three times faster than the float32 stage 3 widens it to),
    with flash's own causal mask where the chunk is the whole prompt, else the bottom-right
    mask of a chunk after cached tokens. `read(slots, dtype)`: a KV format's slots read back
    as q's dtype once gathered (stage 4b's int8)."""
    B, T, Hq, D = q.shape
    block_size = k_cache.shape[1]
    out = []
    for b, L in enumerate(seqlens_k.tolist()):
        blocks = table[b, :-(-L // block_size)]
        k, v = (c.index_select(0, blocks).flatten(0, 1)[:L].transpose(0, 1)[None]
                for c in (k_cache, v_cache))                                 # (1, Hk, L, D)
        if read is not None:                                         # slots -> values
            k, v = read(k, q.dtype), read(v, q.dtype)
        mask = None if L == T else \
            torch.arange(L) <= torch.arange(L - T, L)[:, None]              # (T, L)
        out.append(F.scaled_dot_product_attention(
            q[b].transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
            enable_gqa=Hq != k.shape[1])[0].transpose(0, 1))                 # (T, Hq, D)
    return torch.stack(out)


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


def fast_backend(backend: str, q, k_cache, block_table) -> str:
    """The speed layer's "auto": flash-attn's kernel where it can serve the call, else stage
    3b's C kernel where it builds (on a CPU), else "torch"; the log line says why. Any other
    name is `pick_backend`'s."""
    why = why_not_flash(q, k_cache, block_table) if backend == "auto" else None
    if not why:
        return pick_backend(backend, q, k_cache, block_table)
    refusal = why_not_cpu(q, k_cache)
    return pick_backend("torch" if refusal else "cpu", q, k_cache, block_table,
                        why_auto_not="; ".join(filter(None, [why, refusal])))


def share_bookkeeping(m, block_table: torch.Tensor, seq_lens: torch.Tensor | None = None):
    """Make CacheManager `m` keep its block table (and lengths) in the caller's int32 CPU
    tensors, e.g. one layer's slice of a stacked tensor; returns `m`. Its current contents are
    copied over."""
    for name, t, shape in (("block_table", block_table, tuple(m.block_table.shape)),
                           ("seq_lens", seq_lens, tuple(m.seq_lens.shape))):
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != torch.int32 or t.device.type != "cpu":
            raise RequestError(f"{name} must be an int32 CPU tensor of shape {shape}")
        t.copy_(getattr(m, name))
        setattr(m, name, t)
    m._table, m._lens = m.block_table.numpy(), m.seq_lens.numpy()
    return m


class FastSteps:
    """What the speed layer adds to a paged cache (mixed into stage 3's and stage 6's)."""

    STEP = PagedCache.STEP + ("plan", "_implementation")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        first = self.managers[0]
        layers = len(self.managers)
        # Every layer's block table and lengths, stacked: layer i's manager keeps its own in
        # row i, so a step reads the tables of all layers with one indexing (`set_step`), and
        # advances all their lengths with one addition (`prepare`).
        self.block_table = torch.full((layers, first.max_seqs, first.max_blocks_per_seq),
                                      PAD_BLOCK, dtype=torch.int32)
        self.seq_lens = torch.zeros((layers, first.max_seqs), dtype=torch.int32)
        for layer, m in enumerate(self.managers):
            share_bookkeeping(m, self.block_table[layer], self.seq_lens[layer])
        self._tables, self._lens = self.block_table.numpy(), self.seq_lens.numpy()  # same memory
        self.plan = None                  # the PagedStep every layer's attend reads
        self._implementation = None       # the backend serving this step, once chosen
        self._decode = None               # the plan's DecodeAttention, once made

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """Stage 3's prepare, but only the rows whose last block fills up this step go through
        every layer's allocator; the lengths of the others advance in all layers at once (most
        decode steps have none or a few such rows among many). A step in which another row
        would first copy a shared block goes stage 3's way whole."""
        (ids, n), first = check_step(self, seq_ids, num_new_tokens), self.managers[0]
        if not all(s in first for s in ids):
            return super().prepare(ids, n)
        taking, _, _ = first._crossing(np.asarray(ids), n)    # rows whose last block fills up
        taken = set(taking)
        rest = [s for s in ids if s not in taken]
        if rest and first.blocks_needed(rest, n):     # a copy-on-write: stage 3's way
            return super().prepare(ids, n)
        check_step_room(self, first.blocks_needed(taking, n) if taking else 0,
                        int(self._lens[0, ids].max()) + n)      # before any layer changes
        if taking:
            for m in self.managers:
                m.grow(taking, n)
        self._lens[:, rest] += n
        self.set_step(ids, n)

    def set_step(self, seq_ids, num_new_tokens: int) -> None:
        """What every layer's `attend` reads this step, planned once for all layers; a decode
        step that goes on from the last one on the same blocks advances its plan instead."""
        device = self.managers[0].device
        lens = self._lens[0, seq_ids]                                                # (B,)
        width = max(1, -(-int(lens.max()) // self.block_size))   # blocks the longest row holds
        if self.goes_on(seq_ids, num_new_tokens, lens, width):
            for t in (self.plan.cache_seqlens, self.plan.seqlens_k, self.plan.positions,
                      self.plan.slot_mapping):
                t += 1                                # one token later, in the same blocks
            return
        self._decode = None
        self.plan = plan_step(torch.from_numpy(self._tables[:, seq_ids, :width]),
                              torch.from_numpy(lens - num_new_tokens), num_new_tokens,
                              self.block_size, device)
        self.cache_seqlens, self.positions = self.plan.cache_seqlens, self.plan.positions
        self.block_tables = self.plan.block_tables
        self._implementation = None

    def goes_on(self, seq_ids, num_new_tokens: int, lens, width: int) -> bool:
        """Whether this step is the last one's decode step, one token on: the same rows, each
        one token longer, none entering a block, on the same block tables (vLLM keeps its
        batch across steps the same way and writes only what changed). Then every number of
        the last plan is one more (the lengths, positions and slots) and the rest is as it was,
        so `set_step` adds one in place: at one row, it saves a fifth of a millisecond of a
        step's Python (the plan, and `decode_attention`'s, which reads the same tensors)."""
        plan = self.plan
        if num_new_tokens != 1 or plan is None or plan.positions.shape != (len(lens), 1) or \
                plan.block_tables.shape[2] != width or plan.seqlens_k.device.type != "cpu":
            return False
        return bool(((lens - 1) % self.block_size).all()) and \
            np.array_equal(plan.seqlens_k.numpy(), lens - 1) and \
            np.array_equal(plan.block_tables.numpy(), self._tables[:, seq_ids, :width])

    def attend(self, layer: int, q, k, v):
        """Stage 3's attend, on the step `set_step` planned. Blocks of another format (stage
        4b's int8): the new k/v written as its slots here, the C kernel reading them."""
        m, form = self.managers[layer], KV_FORMATS.get(self.kv_dtype)
        if form is not None:
            k, v = form.write(k), form.write(v)               # (B, T, Hk, slot), e.g. int8
        return attend_step(q, k, v, m.k_cache_paged, m.v_cache_paged, self.plan, layer,
                           self.implementation(q, layer), form and form.read)

    def implementation(self, q, layer: int) -> str:
        """The implementation serving this step (`fast_backend`): chosen at the step's first
        attend, the same for every layer after it."""
        if self._implementation is None:
            name = fast_backend(self.backend, q, self.managers[layer].k_cache_paged,
                                self.plan.block_tables[layer])
            # flash-attn reads caches of q's dtype: a KV format's slots go another way
            self._implementation = "torch" if name == "flash_attn" and self.kv_dtype else name
        return self._implementation


    def decode_attention(self):
        """The step's attention as a `DecodeAttention`, where it is a decode step (every row one
        new token) on stage 3b's C kernel; else None (the caller attends through `attend`)."""
        plan, m = self.plan, self.managers[0]
        if plan is None or plan.positions.shape[1] != 1 or \
                m.k_cache_paged.dtype not in KV_TYPES or m.k_cache_paged.device.type != "cpu":
            return None
        Hk, D = m.k_cache_paged.shape[2], self.args.head_dim
        q = torch.empty(plan.positions.shape[0], 1, self.args.n_heads, D,
                        dtype=self.dtype)                                     # shape, dtype
        if self.implementation(q, 0) != "cpu":
            return None
        if self._decode is None or self._decode.plan is not plan:
            self._decode = DecodeAttention(self, q.shape[2], Hk, D)
        return self._decode.again()


def decode_attention_of(cache):
    """`cache`'s `DecodeAttention` for its current step (a PackedBatch of one segment of decode
    rows is its cache's step), or None where it has none."""
    if isinstance(cache, PackedBatch):
        if len(cache.segments) != 1 or cache.segments[0][1] != 1:
            return None
        vars(cache.cache).update(cache.segments[0][2])      # the cache's step: the segment's
        cache = cache.cache
    plan = getattr(cache, "decode_attention", None)
    return plan() if plan is not None else None


@functools.cache
def int8_writer():
    """int8_slots.c's `write_int8_slots` (stage 4b's quantize-on-write, in C, straight into the
    pool), built without -ffast-math so that its divisions round as PyTorch's do; or a sentence
    saying why it could not be built."""
    fn = build_function(Path(__file__).with_name("int8_slots.c"), "write_int8_slots",
                        flags=FLAGS[1:])
    if not isinstance(fn, str):
        P, I = ctypes.c_void_p, ctypes.c_int
        fn.argtypes, fn.restype = [P, P, P, I, I, I], None
    return fn


class DecodeAttention:
    """A decode step on stage 3b's C kernel, B rows of one new token each: what every layer's
    `attend` needs, worked out once for the step. A layer's attention is a few dozen
    microseconds of arithmetic per row, and going through `attend_step` and
    `decode_attention` cost as much again in Python and small torch calls (thirty layers a
    step: the slots looked up, the tables and lengths converted to int64, the kernel found);
    here a layer writes its k and v into their slots (two copies along the pools' slots; at
    one row, two plain memory copies) and calls the kernel, nothing more. The same numbers as
    `attend`. A compiled step's `attend` does the same in C++ (operators.cpp), from the plan
    `address` lays out. Int8 blocks (stage 4b): a layer quantizes its k and v straight into
    their slots (`int8_writer`, in C: in PyTorch, quantizing cost more than attending at short
    contexts; where it cannot be built, `KVFormat.write` and a copy), and the kernel reads
    codes and scales where they lie; the C++ `attend` does the same from the plan (`address`),
    calling the same C quantizer."""

    def __init__(self, cache, Hq: int, Hk: int, D: int):
        plan, managers = cache.plan, cache.managers
        pool = managers[0].k_cache_paged
        self.dtype, self.rows = pool.dtype, plan.positions.shape[0]
        self.new_dtype = cache.dtype                             # the new k/v's (the model's)
        self.write = cache.kv_dtype and KV_FORMATS[cache.kv_dtype].write   # None: as they are
        writer = int8_writer() if cache.kv_dtype == "int8" else None
        self.write_c = None if isinstance(writer, str) else writer          # quantize in C
        self.kernel = build(self.dtype, D, Hq // Hk)
        slot = pool.shape[-1]                                    # D, or D + 2 for int8
        self.shape, self.kv_shape = (self.rows, Hq, D), (self.rows, Hk, slot)
        self.nbytes = Hk * slot * pool.itemsize                  # one token's k (or v)
        self.tables = plan.tables.contiguous()                   # (layers, B, n) int64
        self.lens = plan.seqlens_k.contiguous()                  # (B,) int64
        self.slots = plan.slot_mapping.contiguous()              # (layers, B): the new tokens'
        self.managers, self.heads = managers, (Hq, Hk, D)
        self.block_size, self.scale = cache.block_size, D ** -0.5
        self.threads = torch.get_num_threads()
        self.plan, self._plan = plan, None

    def again(self) -> DecodeAttention:
        """This, for the cache's current step: its plan may have gone on in place since
        (`FastSteps.goes_on`: every number one more). The lengths, slots and tables are the
        plan's own tensors (`plan_step` makes them contiguous), read where they lie, by
        `address`'s plan too; the slot addresses of `layers` are worked out again."""
        self.threads = torch.get_num_threads()
        self.__dict__.pop("layers", None)
        return self

    @functools.cached_property
    def layers(self) -> list:
        """Per layer: (where k and v go, the kernel's other arguments), for `attend` (the C++
        kernel reads the same from `address`'s plan)."""
        (_, Hk, _), width, table = self.heads, self.tables.shape[2], self.tables.data_ptr()
        slot = self.kv_shape[2]
        layers = []
        for layer, m in enumerate(self.managers):
            kc, vc = m.k_cache_paged, m.v_cache_paged
            if self.write_c:                                     # pools and slots, for C
                to = (kc.data_ptr(), vc.data_ptr(), self.slots[layer].data_ptr())
            elif self.rows == 1:                                 # addresses, for memmove
                slot = int(self.slots[layer, 0])
                to = (kc.data_ptr() + slot * self.nbytes, vc.data_ptr() + slot * self.nbytes)
            else:                                                # the pools as rows of slots
                to = (kc.view(-1, Hk, slot), vc.view(-1, Hk, slot), self.slots[layer])
            layers.append((to, (kc.data_ptr(), vc.data_ptr(),
                                table + layer * self.rows * width * 8, width,
                                self.lens.data_ptr(), self.rows, Hk, self.block_size,
                                self.scale)))
        return layers

    def attend(self, layer: int, q, k, v):
        """`cache.attend(layer, q, k, v)` for this step: q (B, 1, Hq, D), k and v (B, 1, Hk, D)
        in the cache's dtype, or the same tokens as one row, (1, B, ...) (a packed step); out
        in q's shape."""
        to, args = self.layers[layer]
        if self.write_c:                                       # int8: quantized into the slots
            (_, Hk, D), rows = self.heads, self.rows
            for x, pool in zip((k, v), to):
                x32 = x.reshape(rows, Hk, D).float().contiguous()
                self.write_c(x32.data_ptr(), pool, to[2], rows, Hk, D)
            return self._kernel(q, args)
        if self.write:                                         # e.g. quantized to int8 slots
            k, v = self.write(k), self.write(v)
        if k.dtype != self.dtype or v.dtype != self.dtype:    # bytes are copied as they are
            wrong = k.dtype if k.dtype != self.dtype else v.dtype
            raise RequestError(f"the new keys and values must be {self.dtype}, the cache's "
                               f"dtype (got {wrong}): convert them first")
        if self.rows == 1:
            if not (k.is_contiguous() and v.is_contiguous()):
                k, v = k.contiguous(), v.contiguous()
            ctypes.memmove(to[0], k.data_ptr(), self.nbytes)      # the new k and v, in place
            ctypes.memmove(to[1], v.data_ptr(), self.nbytes)
        else:
            to[0].index_copy_(0, to[2], k.reshape(self.kv_shape))
            to[1].index_copy_(0, to[2], v.reshape(self.kv_shape))
        return self._kernel(q, args)

    def _kernel(self, q, args):
        """Stage 3b's C kernel on this layer's blocks, the new k/v already in their slots."""
        q32 = q.reshape(self.shape).float().contiguous()
        out = torch.empty(self.shape)
        self.kernel(q32.data_ptr(), *args, out.data_ptr(), self.threads)
        return out.view(q.shape).to(q.dtype)

    def address(self) -> int | None:
        """Where this step's plan lies for operators.cpp's `attend` (`operators.install`), laid
        out once; None where no kernel serves it."""
        if isinstance(self.kernel, str) or (self.write and not self.write_c):
            return None
        if self._plan is None:
            Hq, Hk, D = self.heads
            slots = self.slots.to(torch.int64).contiguous()             # (layers, B)
            pools = (ctypes.c_void_p * (2 * len(self.managers)))(
                *(t.data_ptr() for m in self.managers for t in (m.k_cache_paged,
                                                                 m.v_cache_paged)))
            plan = operators.DecodePlan(
                ctypes.cast(self.kernel, ctypes.c_void_p).value, len(self.managers), self.rows,
                Hq, Hk, D, self.block_size, self.tables.shape[2], self.nbytes,
                self.new_dtype == torch.bfloat16, self.scale, self.lens.data_ptr(),
                slots.data_ptr(), self.tables.data_ptr(), ctypes.addressof(pools),
                ctypes.cast(self.write_c, ctypes.c_void_p).value if self.write_c else None)
            self._plan = plan, slots, pools                # what its pointers point into
        return ctypes.addressof(self._plan[0])


def compiled_thread_counts(model):
    """None for a model whose steps run eager (any thread count will do); else the thread
    counts its compiled graphs exist for, the user's first (none known: empty)."""
    if getattr(model, "compiled", None) is None and \
            getattr(model, "compiled_batches", None) is None:
        return None
    return tuple(getattr(model, "compiled_threads", ()))


class FastPagedCache(FastSteps, PagedCache):
    """Stage 3's PagedCache on the speed layer."""


class FastSharedPagedCache(FastSteps, SharedPagedCache):
    """Stage 6's SharedPagedCache on the speed layer."""


def greedy_tokens(logits) -> list[int]:
    """Each row's argmax of (B, V) logits, the first index of the largest value (of the first
    NaN, if any), as `logits.argmax(-1).tolist()`. On a CPU, float32 goes through numpy, whose
    argmax is vectorized where torch's is not: on SmolLM2's 49,152 logits a row, about a
    third of the time."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class FastEngine(SpeculativeEngine):
    """`minipaged.Engine` (every stage's options, speculative decoding included) on the speed
    layer's cache. Speculation drafts only where it pays (`draft_policy="adaptive"` by
    default; "fixed" drafts every step). With `adaptive_threads` (the default), a step runs on
    one thread fewer for each core another process holds, and a run ends on the user's thread
    count (`threads.py`: beside a busy core, every barrier of a step otherwise waits for the
    thread sharing it).
    On a model with compiled steps (`compile_decode`), only among the thread counts its graphs
    were compiled for (`compile_decode(..., fewer_threads=True)` adds one fewer than the
    user's): a step under any other count would compile its graph again, mid-run."""

    def __init__(self, *args, adaptive_threads: bool = True, **options):
        check_flag("adaptive_threads", adaptive_threads)
        options.setdefault("draft_policy", "adaptive")     # speculation only where it pays
        super().__init__(*args, **options)
        self.threads = AdaptiveThreads() if adaptive_threads else None
        self.scratch_options["adaptive_threads"] = False    # its steps are timed, not served
        # request -> (the token pairs before its last two tokens, how far it was read)
        self._pairs = weakref.WeakKeyDictionary()

    def step(self):
        if self.threads is None:
            return super().step()
        counts = compiled_thread_counts(self.model)
        if counts is not None:
            user = self.threads.user_threads or torch.get_num_threads()
            if len(counts) < 2 or counts[0] != user:
                return super().step()     # graphs for the user's count alone, or not for it
        self.threads.counts = counts
        self.threads.tick()
        try:
            finished = super().step()
        except BaseException:
            self.threads.restore()
            raise
        if not self.has_unfinished():
            self.threads.restore()
        return finished

    def run(self, *args, **kwargs):
        try:
            return super().run(*args, **kwargs)
        finally:
            if self.threads is not None:
                self.threads.restore()

    def propose(self, req) -> list[int]:
        """Stage 7's lookup, skipped where it cannot match: every n-gram of at least two tokens
        ends with the sequence's last two, so if that pair never came before, lookup finds
        nothing. Each request keeps the pairs seen so far (`_pairs`), so the check costs a set
        lookup where the scan costs a pass over the whole text, per request and step."""
        if self.prompt_lookup[0] >= 2:
            seq = req.prompt + req.output
            pairs, upto = self._pairs.get(req, (set(), 0))
            pairs.update(zip(seq[upto:len(seq) - 2], seq[upto + 1:len(seq) - 1]))
            self._pairs[req] = (pairs, max(upto, len(seq) - 2))
            if len(seq) < 3 or (seq[-2], seq[-1]) not in pairs:
                return []
        return super().propose(req)

    def _sample(self, reqs, logits) -> list[int]:
        """The engine's `_sample`; a batch of greedy requests only through `greedy_tokens`."""
        if any(r.temperature > 0 for r in reqs):
            return super()._sample(reqs, logits)
        return greedy_tokens(logits)

    def new_cache(self, *args, **kwargs) -> FastSharedPagedCache:
        return FastSharedPagedCache(*args, prefix_caching=self.prefix_caching, **kwargs)
