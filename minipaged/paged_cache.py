"""The cache the model runs on when its KV cache is paged: one CacheManager per layer (stage 2)
behind the contiguous cache's interface (`prepare`, `attend`, `free`), attending through
`flash_attn_with_kvcache` (stage 3). Stage 5 adds swapping to a CPU pool; stage 6 adds forks,
copy-on-write and prefix caching, all kept in step across the layers here.
"""

from __future__ import annotations

import torch

from .errors import OutOfBlocksError, RequestError
from .paged_attention import flash_attn_with_kvcache


class PagedCache:
    """Stage 2's per-layer CacheManagers behind the contiguous cache's interface.

    `prepare` takes blocks as sequences grow (all layers or none), `attend` calls
    `flash_attn_with_kvcache` on the layer's pool through its block table, `free` returns
    every block of a finished sequence the moment it stops, while the others continue.

    Stage 6: `fork` shares a sequence's blocks with a new one (copy-on-write happens inside the
    managers' `grow`); with `prefix_caching`, `start` begins a sequence on the cached blocks of
    its prompt's longest known prefix, and `name_blocks` names blocks as they fill.
    """

    def __init__(self, args, num_blocks: int, block_size: int, max_seqs: int, max_seq_len: int,
                 device="cpu", dtype=torch.float32, seed: int = 0, backend: str = "auto",
                 num_cpu_blocks: int = 0, prefix_caching: bool = False):
        from .cache_manager import CacheManager

        self.block_size, self.max_seq_len, self.backend = block_size, max_seq_len, backend
        self.num_blocks, self.prefix_caching = num_blocks, prefix_caching
        self.hashes: dict[int, list[bytes]] = {}      # seq id -> its full blocks' chained hashes
        max_blocks = -(-max_seq_len // block_size)
        self.managers = [CacheManager(num_blocks, block_size, args.n_kv_heads, args.head_dim,
                                      max_seqs, max_blocks, device=device, dtype=dtype,
                                      seed=seed + layer, prefix_caching=prefix_caching)
                         for layer in range(args.n_layers)]
        # Stage 5's swap space: per layer, a pool of `num_cpu_blocks` blocks in CPU memory.
        self.cpu_managers = [CacheManager(num_cpu_blocks, block_size, args.n_kv_heads,
                                          args.head_dim, max_seqs, max_blocks, device="cpu",
                                          dtype=dtype, seed=seed + 1000 + layer)
                             for layer in range(args.n_layers)] if num_cpu_blocks else []
        self.cache_seqlens = None         # (B,) int32, tokens stored before this step
        self.block_tables = None          # per layer, (B, max_blocks_used) int32

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """Before a forward: new sequences reserve blocks, known ones grow — in every layer, or
        (RequestError, OutOfBlocksError) in none. Then build each layer's block table."""
        seq_ids = [int(s) for s in seq_ids]
        first = self.managers[0]
        new = [s for s in seq_ids if s not in first]
        old = [s for s in seq_ids if s in first]
        # Every layer holds the same tokens, so every layer needs the same number of blocks:
        # check everything once, up front, so a failure leaves all layers untouched.
        lens = first.seq_lens.numpy()
        held = first.num_blocks_held.numpy()
        if not seq_ids or len(set(seq_ids)) < len(seq_ids) or \
                not all(0 <= s < first.max_seqs for s in new):
            raise RequestError(f"sequence ids must be distinct and lie in [0, {first.max_seqs}); "
                               f"got {seq_ids}")
        longest = max(int(lens[s]) if s in first else 0 for s in seq_ids) + num_new_tokens
        if longest > self.max_seq_len:
            raise RequestError(f"a sequence would reach {longest} tokens, past this cache's "
                               f"max_seq_len={self.max_seq_len}; end it sooner or build a "
                               f"larger cache. Nothing was allocated.")
        bs = self.block_size
        needed = sum(-(-num_new_tokens // bs) for _ in new) + \
            (first.blocks_needed(old, num_new_tokens) if old else 0)   # copies-on-write included
        if needed > first.num_free_blocks:
            raise OutOfBlocksError(
                f"out of KV blocks: this step needs {needed} new block(s) per layer but only "
                f"{first.num_free_blocks} of {first.num_blocks} are free; finish a sequence or "
                f"give the pool more memory. Nothing was allocated.")
        for m in self.managers:
            for s in new:
                m.reserve(s, num_new_tokens)
            if old:
                m.grow(old, num_new_tokens)
        self.cache_seqlens = first.seq_lens_for(seq_ids) - num_new_tokens     # (B,) before the step
        self.block_tables = [m.block_table_for(seq_ids) for m in self.managers]

    def attend(self, layer: int, q, k, v):
        m = self.managers[layer]
        return flash_attn_with_kvcache(q, m.k_cache_paged, m.v_cache_paged, k, v,
                                       cache_seqlens=self.cache_seqlens,
                                       block_table=self.block_tables[layer], causal=True,
                                       backend=self.backend)

    def free(self, seq_id: int) -> None:
        """A finished sequence returns every block, in every layer, at once (shared blocks
        only lose a reference)."""
        for m in self.managers:
            m.free(seq_id)
        self.hashes.pop(int(seq_id), None)

    # -- sharing (stage 6) ------------------------------------------------------------------------
    def fork(self, parent: int, child: int) -> None:
        """`child` shares every block of `parent`, in every layer; nothing is copied yet."""
        for m in self.managers:
            m.fork(parent, child)
        self.hashes[int(child)] = list(self.hashes.get(int(parent), []))

    def start(self, seq_id: int, tokens) -> int:
        """Begin a sequence whose prompt is `tokens`, reusing the cached blocks of its longest
        known prefix, and prepare the forward over the rest. Returns the tokens skipped: run
        the model on tokens[skipped:]. A hit never covers the block of the last token, whose
        logits the caller needs (a prompt seen in full still recomputes its last block)."""
        from .prefix_cache import block_hashes

        s, n, bs = int(seq_id), len(tokens), self.block_size
        hits = []
        if self.prefix_caching:
            hashes = block_hashes(tokens[:(n - 1) // bs * bs], bs)
            per_layer = [m.match_prefix(hashes) for m in self.managers]
            hits = per_layer[0][:min(len(h) for h in per_layer)]
        if not hits:
            self.prepare([s], n)
            return 0
        first = self.managers[0]
        need = -(-n // bs) - len(hits)
        reviving = sum(first.refs[b] == 0 for b in hits)
        if n > self.max_seq_len or need > first.num_free_blocks - reviving:
            raise OutOfBlocksError(f"sequence {s} needs {need} new blocks per layer beyond its "
                                   f"{len(hits)} cached ones, and {n} <= {self.max_seq_len} "
                                   f"tokens; nothing was allocated")
        for m, layer_hits in zip(self.managers, per_layer):
            m.reserve(s, n, prefix_blocks=layer_hits[:len(hits)])
        skipped = len(hits) * bs
        self.cache_seqlens = torch.tensor([skipped], dtype=torch.int32)      # (1,)
        if first.device.type != "cpu":
            self.cache_seqlens = self.cache_seqlens.to(first.device)
        self.block_tables = [m.block_table_for([s]) for m in self.managers]
        return skipped

    def name_blocks(self, seq_id: int, prompt, output=()) -> None:
        """The cache now holds prompt + output for this sequence: name its newly full blocks,
        so later prompts can find them. Cheap when no block has filled since the last call."""
        if not self.prefix_caching:
            return
        from .prefix_cache import block_hashes

        s, bs = int(seq_id), self.block_size
        have = self.hashes.setdefault(s, [])
        if (len(prompt) + len(output)) // bs <= len(have):
            return
        new = block_hashes(list(prompt) + list(output), bs, have[-1] if have else None, len(have))
        for j, h in enumerate(new, start=len(have)):
            for m in self.managers:
                m.name_block(s, j, h)
        have += new

    def blocks_to_grow(self, seq_id: int, num_new_tokens: int = 1) -> int:
        """Blocks per layer one sequence's next `num_new_tokens` take, a copy-on-write included."""
        first = self.managers[0]
        return first.blocks_needed([seq_id], num_new_tokens)

    @property
    def num_used_blocks(self) -> int:
        return self.managers[0].num_used_blocks

    # -- preemption by swap (stage 5) -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free blocks per layer (every layer holds the same tokens, so the same count)."""
        return self.managers[0].num_free_blocks

    def can_swap_out(self, seq_id: int) -> bool:
        """Is there room in the CPU pool for this sequence's blocks?"""
        return bool(self.cpu_managers) and \
            len(self.managers[0].blocks_of(seq_id)) <= self.cpu_managers[0].num_free_blocks

    def swap_out(self, seq_id: int) -> int:
        """Copy the sequence's blocks, every layer, into the CPU pool and free them here.
        Returns the blocks moved per layer."""
        return self._move(seq_id, self.managers, self.cpu_managers, "CPU swap pool")

    def swap_in(self, seq_id: int) -> int:
        """Copy a swapped sequence back into whatever blocks are free now (a new block table)."""
        return self._move(seq_id, self.cpu_managers, self.managers, "KV pool")

    def _move(self, seq_id, src, dst, where) -> int:
        n = len(src[0].blocks_of(seq_id)) if src else 0
        if not dst or n > dst[0].num_free_blocks:    # check once: all layers move, or none
            raise OutOfBlocksError(f"the {where} has no room for sequence {seq_id}'s {n} blocks "
                                   f"per layer; nothing was moved")
        for s, d in zip(src, dst):
            move_sequence(s, d, seq_id)
        return n

    def usage(self):
        """(used, reserved) slots per live sequence: tokens stored vs blocks held x block_size."""
        m = self.managers[0]
        ids = m.live_seq_ids()
        return ([int(m.seq_lens[s]) for s in ids],
                [int(m.num_blocks_held[s]) * self.block_size for s in ids])


# -- moving a sequence to another pool: stage 5's swap -------------------------------------------

def move_sequence(src: CacheManager, dst: CacheManager, seq_id: int) -> tuple[list[int], list[int]]:
    """Copy a sequence's K/V blocks from one pool into free blocks of another, then free them in
    the first. GPU -> CPU pool is a swap-out, CPU -> GPU a swap-in; the sequence lands in
    whatever blocks `dst` draws, so its block table there is new. Returns (src, dst) blocks.

    Raises (OutOfBlocksError, from `dst.reserve`) before anything changes if `dst` lacks room.
    """
    n = int(src.seq_lens_for([seq_id])[0])
    src_blocks = src.blocks_of(seq_id)
    dst_blocks = dst.reserve(seq_id, n)
    frm = torch.tensor(src_blocks, dtype=torch.long, device=src.device)     # (k,)
    to = torch.tensor(dst_blocks, dtype=torch.long, device=dst.device)      # (k,)
    dst.k_cache_paged[to] = src.k_cache_paged[frm].to(dst.device)           # (k, bs, Hk, D)
    dst.v_cache_paged[to] = src.v_cache_paged[frm].to(dst.device)
    src.free(seq_id)
    return src_blocks, dst_blocks
