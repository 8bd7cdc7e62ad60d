"""Speed, not a stage: stage 1's contiguous cache with a decode step that copies nothing.

Stage 1's `ContiguousCache.attend` copies each row's first L slots out (`k_cache[rows, :L]`)
and attends with one masked call. Here, in a decode step, each row's one query attends over
views of its own first n slots, row by row (`attend_rows`): nothing is copied or masked, and on
a CPU that loop beats one masked call over rows padded to the longest. Prompts are copied out
with `index_select`, which copies a row's slots as one piece (indexing goes element by element,
about three times slower on a CPU). The benchmarks time this cache beside `FastPagedCache`.
"""

from __future__ import annotations

import torch

from .. import kv_cache
from ..kv_cache import ContiguousCache, attention_over_cache


def upcast(*tensors):
    """The tensors in the dtype `kv_cache.sdpa` computes in: float32 for bf16 and fp16 on a CPU,
    else as they are; a batch attended row by row is converted once, not row by row."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype in (torch.bfloat16, torch.float16):
        return tuple(t.float() for t in tensors)
    return tensors


def attend_rows(q, keys, values, scale):
    """Row b's one query, q[b] (Hq, 1, D), over its own keys[b] and values[b] (Hk, n_b, D):
    (B, Hq, 1, D). Each row sees exactly its keys, so nothing is masked; a row with no key gets
    zeros, as in flash-attn."""
    return torch.cat([kv_cache.sdpa(q[b:b + 1], k[None], v[None], scale) if k.shape[1] else
                      torch.zeros_like(q[b:b + 1]) for b, (k, v) in enumerate(zip(keys, values))])


class FastContiguousCache(ContiguousCache):
    """`ContiguousCache` with the step's device tensors made once per step, decode row by row."""

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        super().prepare(seq_ids, num_new_tokens)
        device = self.k_cache[0].device
        self._rows_dev = self.rows.to(device)
        self._seqlens_k = self.cache_seqlens.to(device) + num_new_tokens          # (B,)
        after = self.seq_lens[self.rows]
        self._max_len = int(after.max())
        self._row_lens = list(zip(self.rows.tolist(), after.tolist()))   # (row, keys it holds)

    def attend(self, layer: int, q, k, v):
        rows, positions, L = self._rows_dev, self.positions, self._max_len
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache[rows[:, None], positions] = k
        v_cache[rows[:, None], positions] = v
        if q.shape[1] == 1:      # decode: attend over views of each row's slots
            keys = [k_cache[r, :n].transpose(0, 1) for r, n in self._row_lens]    # (Hk, n, D)
            values = [v_cache[r, :n].transpose(0, 1) for r, n in self._row_lens]
            return attend_rows(q.transpose(1, 2), keys, values,
                               q.shape[-1] ** -0.5).transpose(1, 2)             # (B, 1, Hq, D)
        k_ctx = k_cache[:, :L].index_select(0, rows)                          # (B, L, Hk, D)
        v_ctx = v_cache[:, :L].index_select(0, rows)
        return attention_over_cache(q, k_ctx, v_ctx, self._seqlens_k, causal=True)
