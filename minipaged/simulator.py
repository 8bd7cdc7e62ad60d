"""Stage 4: serve a trace under a fixed KV memory budget, one token at a time, and watch the memory.

All requests wait at the start (a backlog, when memory is what limits a server). Each step:

  1. requests that produced their last token leave and free their memory;
  2. every running request stores one more token (paged: one more block when its last is full;
     if the pool is dry, the newest request is preempted — it frees everything and goes back to
     the front of the queue, to be recomputed later, as vLLM does);
  3. waiting requests are admitted first come, first served while memory allows (paged: not in
     a step that preempted), and their prompts prefilled.

How a request takes memory is the policy:

  max     one contiguous extent of max_seq_len slots (stage 1's cache, Orca (Max));
  pow2    one extent of the next power of two of its final length (Orca (Pow2));
  oracle  one extent of exactly its final length — an oracle: no real server knows it;
  paged   blocks of block_size slots from a pool, as the CacheManager hands them out.

Contiguous extents come from a real FirstFitAllocator over one region. Nothing changes between
two events (a request ending, the pool running dry) but the lengths, so the steps between them
are computed in one numpy operation: the whole comparison runs in seconds.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

import torch

from .errors import OutOfBlocksError, RequestError
from .fragmentation import KINDS, FirstFitAllocator, KVWaste, split_allocated, split_free
from .kv_cache import kv_bytes_per_token

# Llama 3 8B: 32 layers of 8 KV heads of 128 dims, in bf16 (128 KiB a token)
LLAMA3_8B_BF16_BYTES_PER_TOKEN = kv_bytes_per_token(8, 128, torch.bfloat16, n_layers=32)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


# -- the watermark: keeping a few blocks free when admitting ------------------------------------

# vLLM v0's block manager admits a sequence only if 1% of the pool stays free afterwards, so the
# decode steps right after an admission do not run dry at once. Stage 5's scheduler uses the
# same rule.
WATERMARK = 0.01


def watermark_blocks(num_blocks: int, watermark: float = WATERMARK) -> int:
    """Blocks to leave free after admitting a sequence: `watermark` of the pool, at least one
    (none when the watermark is 0)."""
    return max(1, math.ceil(watermark * num_blocks)) if watermark else 0


def admits(need: int, num_free: int, reserve: int, alone: bool) -> bool:
    """May a sequence that needs `need` blocks start now? Only if `reserve` blocks (the
    watermark) stay free afterwards — unless it would run alone, when it may take them all."""
    return need <= num_free if alone else need + reserve <= num_free


@dataclass(frozen=True)
class Policy:
    kind: str                 # "max", "pow2", "oracle" or "paged"
    block_size: int = 1       # paged only

    @property
    def label(self) -> str:
        if self.kind == "paged":
            return f"paged, block {self.block_size}"
        return {"max": "contiguous, max_seq_len", "pow2": "contiguous, next pow2",
                "oracle": "contiguous, oracle"}[self.kind]


POLICIES = [Policy("max"), Policy("pow2"), Policy("oracle")] + [
    Policy("paged", b) for b in BLOCK_SIZES]


@dataclass
class SimResult:
    """One run: per step, slots of each kind (`series[kind]`) and requests running and waiting."""
    policy: Policy
    capacity: int              # KV memory, in token slots
    bytes_per_slot: int
    series: dict               # kind -> (T,) int64, plus "running" and "waiting"
    preemptions: int
    recomputed_tokens: int     # prompt + output tokens prefilled again after a preemption

    @property
    def num_steps(self) -> int:
        return len(self.series["running"])

    def waste_at(self, step: int) -> KVWaste:
        return KVWaste(*(int(self.series[k][step]) for k in KINDS), self.bytes_per_slot)

    @property
    def saturated(self) -> bool:
        """Did a request ever wait for memory? If not, the budget never limited this policy."""
        return bool((self.series["waiting"] > 0).any())

    def busy(self) -> np.ndarray:
        """The steps during which requests wait for memory (all steps if none ever waited)."""
        busy = self.series["waiting"] > 0
        return busy if busy.any() else np.ones_like(busy)

    def mean_slots(self) -> dict:
        """Each kind's slots averaged over the busy steps: when memory is what limits the server."""
        busy = self.busy()
        return {k: float(self.series[k][busy].mean()) for k in KINDS}

    def shares(self) -> dict:
        return {k: v / self.capacity for k, v in self.mean_slots().items()}

    def token_share_of_allocated(self) -> float:
        m = self.mean_slots()
        return m["token states"] / (m["token states"] + m["reservation"] + m["internal"])

    def mean_running(self) -> float:
        return float(self.series["running"][self.busy()].mean())

    def table_entries_per_request(self) -> float:
        """Block-table entries a running request has, on average (paged only)."""
        m = self.mean_slots()
        allocated = m["token states"] + m["reservation"] + m["internal"]
        return allocated / self.policy.block_size / self.mean_running()


def reservations(policy: Policy, final_lens: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Slots each request's one extent holds under a contiguous policy, (N,)."""
    if policy.kind == "max":
        return np.full(len(final_lens), max_seq_len, dtype=np.int64)
    if policy.kind == "pow2":
        pow2 = np.array([1 << (int(f) - 1).bit_length() for f in final_lens], dtype=np.int64)
        return np.minimum(pow2, max_seq_len)
    if policy.kind == "oracle":
        return np.asarray(final_lens, dtype=np.int64).copy()
    raise RequestError(f"unknown policy {policy.kind!r}: choose max, pow2, oracle or paged")


def simulate(workload, policy: Policy, budget_slots: int, max_seq_len: int,
             bytes_per_slot: int = 1, watermark: float = WATERMARK) -> SimResult:
    """Serve `workload` with `policy` in `budget_slots` token slots of KV memory (see the module)."""
    server = _Server(workload, policy, budget_slots, max_seq_len, watermark)
    while server.finish():                          # 1. finished requests leave
        preempted = server.grow()                   # 2. the running ones store one more token
        if not preempted:
            server.admit()                          # 3. the queue's head, while it fits
        server.record_until_next_event()
    series = dict(zip(KINDS + ("running", "waiting"), server.out[:, :server.t]))
    return SimResult(policy, budget_slots, bytes_per_slot, series, server.preemptions,
                     server.recomputed)


class _Server:
    """One simulation's state: the requests running (id, tokens stored), the queue, the memory."""

    def __init__(self, workload, policy, budget_slots, max_seq_len, watermark):
        self.P, self.O, self.F = workload.prompt_lens, workload.output_lens, workload.final_lens
        self.n, self.paged, self.budget = len(workload), policy.kind == "paged", budget_slots
        if (self.P + self.O > max_seq_len).any():
            raise RequestError(f"a request of the trace needs more than max_seq_len="
                               f"{max_seq_len} positions; cut the trace or raise max_seq_len")
        self.bs = policy.block_size if self.paged else 1
        self.num_blocks = budget_slots // self.bs
        if self.num_blocks < -(-max_seq_len // self.bs):
            raise OutOfBlocksError(f"a KV budget of {budget_slots} slots cannot hold one request "
                                   f"of max_seq_len={max_seq_len} tokens ({policy.label}); raise it")
        self.watermark_blocks = watermark_blocks(self.num_blocks, watermark)
        if not self.paged:
            self.size = reservations(policy, self.F, max_seq_len)
            self.region = FirstFitAllocator(budget_slots)
        self.G = np.zeros(self.n, dtype=np.int64)     # tokens generated, kept across preemption
        self.ids = np.zeros(0, dtype=np.int64)        # running requests...
        self.S = np.zeros(0, dtype=np.int64)          # ...the tokens each has stored...
        self.order = np.zeros(0, dtype=np.int64)      # ...and when each was admitted
        self.next_new, self.requeued = 0, []          # never-admitted cursor; heap of preempted
        self.admissions = self.preemptions = self.recomputed = 0
        self.out, self.t = np.zeros((7, 1024), dtype=np.int64), 0   # per step, kinds + counts

    def blocks(self, s):
        return -(-s // self.bs)

    def head(self) -> int:
        """The next request to admit (n: none): preempted ones first, they arrived earlier."""
        return self.requeued[0] if self.requeued else self.next_new

    def _keep(self, mask):
        self.ids, self.S, self.order = self.ids[mask], self.S[mask], self.order[mask]

    def finish(self) -> bool:
        """Requests that produced their last token free their memory. False: all served."""
        done = self.G[self.ids] == self.O[self.ids]
        if not self.paged:
            for r in self.ids[done].tolist():
                self.region.free(r)
        self._keep(~done)
        return len(self.ids) > 0 or self.head() < self.n

    def grow(self) -> bool:
        """Every running request stores one more token; paged, a full last block means a new
        block, and if too few are free the newest requests are preempted. True if any was."""
        preempted = False
        if self.paged:
            grows = self.S % self.bs == 0                          # last block full (or none)
            free = self.num_blocks - self.blocks(self.S).sum()
            while grows.sum() > free:
                v = int(np.argmax(self.order))                     # the newest request
                free += self.blocks(self.S[v])
                heapq.heappush(self.requeued, int(self.ids[v]))
                keep = np.arange(len(self.ids)) != v
                self._keep(keep)
                grows = grows[keep]
                self.preemptions, preempted = self.preemptions + 1, True
        self.S = self.S + 1
        self.G[self.ids] += 1
        return preempted

    def admit(self) -> None:
        """Admit waiting requests in order while the head fits; prefill their prompts (and, for
        a preempted one, the output it had stored: recomputation)."""
        new_ids, new_S = [], []
        held = int(self.blocks(self.S).sum()) if self.paged else 0
        while self.head() < self.n:
            h = self.head()
            pre = int(self.P[h] + max(self.G[h], 1) - 1)           # prompt (+ output so far)
            if self.paged:
                need, free = -(-pre // self.bs), self.num_blocks - held
                alone = not len(self.ids) and not new_ids          # nothing runs: no watermark
                if not admits(need, free, self.watermark_blocks, alone):
                    break
                held += need
            elif self.region.allocate(h, int(self.size[h])) is None:
                break
            if self.requeued:
                heapq.heappop(self.requeued)
                self.recomputed += pre
            else:
                self.next_new += 1
            self.G[h] = max(self.G[h], 1)                          # the prefill's own token
            new_ids.append(h)
            new_S.append(pre)
        if new_ids:
            self.ids = np.concatenate([self.ids, new_ids])
            self.S = np.concatenate([self.S, new_S])
            self.order = np.concatenate([self.order, self.admissions + np.arange(len(new_ids))])
            self.admissions += len(new_ids)
        if not len(self.ids):
            raise OutOfBlocksError(f"the next request does not fit in an empty KV memory of "
                                   f"{self.budget} slots")

    def record_until_next_event(self, chunk: int = 2048) -> None:
        """Record this step and the quiet ones after it (nothing but growth happens until a
        request finishes, or, paged, until the pool runs dry), all in one numpy pass."""
        k = min(int((self.O[self.ids] - self.G[self.ids]).min()), chunk)   # quiet steps
        Sj = self.S[:, None] + np.arange(k + 1)                    # (R, k+1) tokens stored
        if self.paged:
            Aj = self.blocks(Sj) * self.bs                         # (R, k+1) slots held
            held = Aj.sum(0)                                       # (k+1,)
            k = int((held <= self.num_blocks * self.bs).sum()) - 1 # ...until the pool runs dry
            Sj, Aj = Sj[:, :k + 1], Aj[:, :k + 1]
            external, idle = 0, self.budget - held[:k + 1]         # free blocks serve anyone
        else:
            Aj = self.size[self.ids][:, None]                      # (R, 1): extents stay put
            head = self.head()
            external, idle = split_free(self.budget - int(Aj.sum()),
                                        [s for _, s in self.region.holes()],
                                        int(self.size[head]) if head < self.n else None)
        tok, res, internal = split_allocated(Sj, Aj, self.F[self.ids][:, None])
        waiting = self.n - self.next_new + len(self.requeued)
        if self.t + k + 1 > self.out.shape[1]:
            self.out = np.concatenate([self.out, np.zeros_like(self.out)], axis=1)
        for row, value in enumerate((tok, res, internal, external, idle, len(self.ids), waiting)):
            self.out[row, self.t:self.t + k + 1] = value
        self.t += k + 1
        self.S, self.G[self.ids] = self.S + k, self.G[self.ids] + k


def compare(workload, budget_slots: int, max_seq_len: int, policies=POLICIES,
            bytes_per_slot: int = LLAMA3_8B_BF16_BYTES_PER_TOKEN) -> list[SimResult]:
    """Every policy on the same workload and budget."""
    return [simulate(workload, p, budget_slots, max_seq_len, bytes_per_slot) for p in policies]


def headline(results) -> list[SimResult]:
    """The four policies of the vLLM paper's Fig. 2: max, pow2, oracle and paged with block 16."""
    pick = [Policy("max"), Policy("pow2"), Policy("oracle"), Policy("paged", 16)]
    by_policy = {r.policy: r for r in results}
    return [by_policy[p] for p in pick if p in by_policy]
