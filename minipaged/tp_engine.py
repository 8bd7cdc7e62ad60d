"""Stage 9: one scheduler for N ranks — rank 0 decides, the other ranks (the workers) follow.

Rank 0 runs stage 7's engine, unchanged, on its shard of the model (`tensor_parallel.py`): it
schedules, allocates, prefix-caches and samples. What a worker must repeat is only the model
call, and for that it needs the call's tokens, which sequences they extend, their block tables
in every layer, and the K/V of its own heads in those blocks. So, just before each model call
(after the cache's `prepare`: the call's blocks are taken), rank 0 sends one `StepMessage`:

    number     0, 1, 2, ...: the worker's acknowledgement repeats it, so a message lost or
               taken out of order is caught before anything runs on it
    tokens     the call's (B, T) token ids, and its flags (last_only, logits_indices)
    segments   [(seq_ids, new tokens each)]: one for a plain call, several for a packed one
    lengths    {seq_id: tokens it holds once this call's are in}, for the call's sequences
    tables     per layer, what changed in the block tables since the last message
               (`step_changes`: ids appended, tables replaced, sequences gone); [] if nothing
    moves      in order, the K/V copies rank 0's pools made since then: ("copy", layer, from,
               to) copy-on-write, ("out", ...) pool -> CPU pool, ("in", ...) CPU -> pool

A worker applies it to its own copy of the tables and its own pools, acknowledges, and runs its
shard's forward on the same tokens: the all-reduces inside join it to rank 0's. Workers run no
scheduler, no allocator, no prefix cache and no sampler. The changes are taken at the call,
not after the step: a block taken and given back within one step (a rejected draft's, or the
new block of a sequence that finishes on that step) is in the tables the call reads, and gone
by the end of the step.

    engine = TensorParallelEngine(shard, 64, 16, workers=Group())     # rank 0
    follow(shard)                                                     # ranks 1..N-1

How the messages travel between processes, and how the processes start: `tp_group.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache_manager import PAD_BLOCK
from .chunked_engine import PackedBatch
from .errors import RequestError, TensorParallelError
from .kv_formats import stored_layout
from .paged_cache import PagedCache
from .sharing import SharedCacheManager, SharedPagedCache
from .speculative import SpeculativeEngine
from .swap import SwapSpace
from .tensor_parallel import apply_changes, block_tables, step_changes


@dataclass
class StepMessage:
    """One model call of rank 0's, for the workers (see the module's docstring)."""
    number: int
    tokens: list                               # (B, T) token ids, as lists
    segments: list                             # [(seq_ids, new tokens each)]
    packed: bool                               # segments packed in one row (a PackedBatch)
    lengths: dict                              # seq_id -> tokens held, this call's included
    tables: list                               # per layer, `step_changes` since the last
                                               # message ([]: no table changed)
    moves: list = field(default_factory=list)  # (kind, layer, from blocks, to blocks), in order
    last_only: bool = False
    logits_indices: list | None = None


@dataclass
class PoolSpec:
    """What a worker's pools are made of: rank 0 sends it once, before any StepMessage."""
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    dtype: torch.dtype
    kv_dtype: str | None
    backend: str


# -- rank 0: the engine, and what it writes down for the workers ---------------------------------
class LoggedManager(SharedCacheManager):
    """Stage 6's allocator, writing each copy-on-write into its cache's `moves`."""
    layer, moves = 0, None                     # set by DriverCache

    def _copy_on_write(self, cow) -> None:
        super()._copy_on_write(cow)
        if cow:
            new = [int(self._table[s, self._held[s] - 1]) for s, _ in cow]
            self.moves.append(("copy", self.layer, [old for _, old in cow], new))


class DriverCache(SharedPagedCache):
    """Rank 0's cache: stage 6's, plus the log of K/V moves and each step's sequence ids."""
    STEP = SharedPagedCache.STEP + ("seq_ids",)     # a PackedBatch keeps them per segment

    def __init__(self, *args, **kwargs):
        self.moves, self.seq_ids = [], []
        super().__init__(*args, **kwargs)
        for layer, m in enumerate(self.managers):
            m.layer, m.moves = layer, self.moves

    def new_manager(self, *args, **kwargs) -> LoggedManager:
        return LoggedManager(*args, prefix_caching=self.prefix_caching, **kwargs)

    def set_step(self, seq_ids, num_new_tokens: int) -> None:
        super().set_step(seq_ids, num_new_tokens)
        self.seq_ids = [int(s) for s in seq_ids]


class LoggedSwapSpace(SwapSpace):
    """Stage 5's CPU pool, writing each swap (every layer's blocks, from and to) into `moves`."""

    def _move(self, seq_id, src, dst, where) -> int:
        before = [m.blocks_of(seq_id) for m in src]
        n = super()._move(seq_id, src, dst, where)
        kind = "in" if dst is self.cache.managers else "out"
        self.cache.moves += [(kind, layer, b, m.blocks_of(seq_id))
                             for layer, (b, m) in enumerate(zip(before, dst))]
        return n


class Messenger:
    """Rank 0's side of the conversation with the workers: the tables they hold (those of the
    last message), and each new message. Tells the workers the pools' sizes first."""

    def __init__(self, cache: DriverCache, workers, num_cpu_blocks: int = 0):
        self.cache, self.workers, self.number = cache, workers, 0
        self.sent_tables = [{} for _ in cache.managers]        # what the workers hold now
        c = cache
        workers.start(PoolSpec(c.num_blocks, c.block_size, num_cpu_blocks, c.dtype, c.kv_dtype,
                               c.backend))

    def send(self, tokens, cache, last_only, logits_indices) -> None:
        """Send the call about to run on `cache` (rank 0's, or a PackedBatch of it), with every
        change since the last message."""
        c = self.cache
        steps = [(s["seq_ids"], n) for _, n, s in cache.segments] if cache is not c else \
            [(c.seq_ids, tokens.shape[1])]
        first = c.managers[0]
        lengths = {s: int(first.seq_lens[s]) for ids, _ in steps for s in ids}
        now = [block_tables(m) for m in c.managers]
        tables = [step_changes(b, a) for b, a in zip(self.sent_tables, now)]
        if not any(any(changes.values()) for changes in tables):
            tables = []                                 # most calls: no table changed
        moves, self.sent_tables = list(c.moves), now
        c.moves.clear()
        self.number += 1
        self.workers.send(StepMessage(self.number - 1, tokens.tolist(), steps, cache is not c,
                                      lengths, tables, moves, last_only,
                                      None if logits_indices is None else logits_indices.tolist()))

    def close(self) -> None:
        """Tell the workers to stop (they return from `follow`)."""
        self.workers.close()


class SendFirst:
    """Rank 0's model: a call is sent to the workers (`Messenger`), then run here. Anything
    else (its args, its parameters) is the model's own."""

    def __init__(self, model, messenger: Messenger):
        self.inner, self.messenger = model, messenger

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, tokens, cache, last_only: bool = False, logits_indices=None):
        self.messenger.send(tokens, cache, last_only, logits_indices)
        return self.inner(tokens, cache=cache, last_only=last_only, logits_indices=logits_indices)


class TensorParallelEngine(SpeculativeEngine):
    """Rank 0: stage 7's engine on its shard, whose every model call goes to `workers` first
    (`Group`: ranks 1..N-1 of the torch.distributed group; `LocalWorkers`: in this process)."""

    def __init__(self, model, *args, workers, draft_policy="fixed", **options):
        if draft_policy != "fixed":        # "adaptive" times steps of a second, scratch engine
            raise RequestError("tensor_parallel runs draft_policy='fixed' only: the adaptive "
                               "policy measures steps on a scratch engine the ranks do not share")
        super().__init__(model, *args, **options)
        cpu = self.swap.cpu_managers[0].num_blocks if self.swap else 0
        self.messenger = Messenger(self.cache, workers, cpu)
        self.model = SendFirst(model, self.messenger)

    def new_cache(self, *args, **kwargs) -> DriverCache:
        return DriverCache(*args, prefix_caching=self.prefix_caching, **kwargs)

    def new_swap(self, *args) -> LoggedSwapSpace:
        return LoggedSwapSpace(*args)

    def close(self) -> None:
        """Tell the workers to stop; with `start_engine`'s followers, end them too."""
        self.messenger.close()


# -- ranks 1..N-1: the workers -------------------------------------------------------------------
@dataclass
class Pool:
    """One layer's K/V blocks (this rank's heads), named as stage 2's manager names them."""
    k_cache_paged: torch.Tensor                # (num_blocks, block_size, Hk / N, D)
    v_cache_paged: torch.Tensor


class WorkerCache:
    """A worker's KV cache: pools of its own heads, and block tables ({seq_id: [block ids]} per
    layer) built only from rank 0's messages. It attends as stage 3's PagedCache does."""
    STEP = PagedCache.STEP
    attend = PagedCache.attend

    def __init__(self, args, spec: PoolSpec, device="cpu"):
        slot, store = stored_layout(args.head_dim, spec.dtype, spec.kv_dtype)

        def pools(n, where):
            shape = (n, spec.block_size, args.n_kv_heads, slot)
            return [Pool(torch.zeros(shape, dtype=store, device=where),
                         torch.zeros(shape, dtype=store, device=where))
                    for _ in range(args.n_layers)]
        self.device, self.kv_dtype, self.backend = torch.device(device), spec.kv_dtype, spec.backend
        self.managers, self.cpu = pools(spec.num_blocks, device), pools(spec.num_cpu_blocks, "cpu")
        self.tables = [{} for _ in range(args.n_layers)]
        self.lengths: dict[int, int] = {}

    def apply(self, message: StepMessage) -> None:
        """The K/V moves, in the order rank 0 made them; then the tables and lengths."""
        for kind, layer, src, dst in message.moves:
            frm = self.cpu if kind == "in" else self.managers
            to = self.cpu if kind == "out" else self.managers
            for name in ("k_cache_paged", "v_cache_paged"):
                d = getattr(to[layer], name)
                d[dst] = getattr(frm[layer], name)[src].to(d.device)   # lists of block ids
        if message.tables:
            self.tables = [apply_changes(t, c) for t, c in zip(self.tables, message.tables)]
        self.lengths = {s: n for s, n in self.lengths.items() if s in self.tables[0]}
        self.lengths.update(message.lengths)

    def prepare(self, seq_ids, num_new_tokens: int) -> None:
        """What `attend` reads for these sequences' next tokens (the blocks are rank 0's)."""
        held = torch.tensor([self.lengths[s] for s in seq_ids], dtype=torch.int32)
        self.cache_seqlens = (held - num_new_tokens).to(self.device)                 # (B,)
        self.positions = self.cache_seqlens[:, None].long() + torch.arange(
            num_new_tokens, device=self.device)                                      # (B, T)
        self.block_tables = [self._table(t, seq_ids) for t in self.tables]           # (B, W)

    def _table(self, tables, seq_ids) -> torch.Tensor:
        width = max(1, *(len(tables[s]) for s in seq_ids))
        rows = [tables[s] + [PAD_BLOCK] * (width - len(tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def for_call(self, message: StepMessage):
        """The cache the model call of `message` runs on: this one, or a PackedBatch of it."""
        if not message.packed:
            (seq_ids, n), = message.segments
            self.prepare(seq_ids, n)
            return self
        batch = PackedBatch(self)
        for seq_ids, n in message.segments:
            batch.add(seq_ids, n)
        return batch


class Worker:
    """One worker: its shard of the model and a WorkerCache; messages in order, or an error."""

    def __init__(self, model, spec: PoolSpec, rank: int = 1):
        self.model, self.rank, self.expected = model, rank, 0
        self.device = next(model.parameters()).device
        self.cache = WorkerCache(model.args, spec, self.device)

    def apply(self, message: StepMessage) -> int:
        """Apply a message; returns its number, the acknowledgement."""
        if message.number != self.expected:
            raise TensorParallelError(f"tensor parallel: rank {self.rank} got message "
                                      f"{message.number} where it expected {self.expected}: a "
                                      f"message was lost or reordered; restart the program")
        self.cache.apply(message)
        self.expected += 1
        return message.number

    @torch.inference_mode()
    def forward(self, message: StepMessage):
        """The call's forward on this rank's heads; its logits (rank 0's, after the
        all-reduces), which a worker drops: it samples nothing."""
        idx = message.logits_indices
        return self.model(torch.tensor(message.tokens, device=self.device),
                          cache=self.cache.for_call(message), last_only=message.last_only,
                          logits_indices=None if idx is None else torch.tensor(
                              idx, dtype=torch.long, device=self.device))


def check_acks(acks, number: int) -> None:
    """Every worker acknowledged message `number` (acks: rank r's at index r - 1)."""
    for r, a in enumerate(acks, start=1):
        if a != number:
            raise TensorParallelError(f"tensor parallel: rank {r} acknowledged message {a}, "
                                      f"not {number}: a message was lost or reordered")


# -- in one process, for tests and drawings ------------------------------------------------------
class LocalWorkers:
    """Workers in this process, for tests and drawings: each message is applied and run by each
    worker (a shard of world size 1 here: a whole replica) before rank 0's call. `sent` keeps
    every message; `logits` each worker's output of the last call."""

    def __init__(self, models):
        self.models, self.workers, self.sent, self.logits = models, [], [], []

    def start(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.workers = [Worker(m, spec, r) for r, m in enumerate(self.models, start=1)]

    def send(self, message: StepMessage) -> None:
        self.sent.append(message)
        check_acks([w.apply(message) for w in self.workers], message.number)
        self.logits = [w.forward(message) for w in self.workers]

    def close(self) -> None:
        pass
