"""Stage 6b: beam search on shared blocks — survivors fork their parents' blocks, pruned beams
free theirs, so the pool holds the beams' tree instead of beam_width copies.

Beam search keeps the `beam_width` most likely continuations of one prompt. At every step each
live beam proposes every token of the vocabulary, and of the beam_width × vocab candidates the
best beam_width survive. A beam may have several surviving children, or none. On stage 6's
SharedPagedCache (`sharing.py`) that costs almost nothing:

    a beam with no surviving child      free(seq): its blocks lose a reference, at once
    its first surviving child           keeps the parent's sequence and block table
    each further child                  fork(parent, child): the table shared, every count +1
    the step's write                    prepare(beams, 1): copy-on-write on a shared last block

Blocks filled before two beams diverged stay shared for the rest of the search; only the block
they diverge in is copied. So beams share their own output as well as the prompt, which is why
the vLLM paper saves more memory in beam search (37-66%) than in parallel sampling (6-30%).
On the contiguous cache a survivor's row is copied from its parent's (`copy_rows`).

Score: sum of log-probabilities / length ** length_penalty, where length counts every token
whose log-probability is in the sum: the generated tokens, a stop token included (it is not
returned). All candidates of one step then have the same length, so ranking them by summed
log-probability ranks them by score, whatever the penalty.

End: a candidate that emits a stop token is finished and leaves the search. The search ends
after max_new_tokens steps (the live beams then finish as they are), when no beam is live, or
when beam_width hypotheses are finished and no live beam can beat the worst of them
(`cannot_improve`: an exact bound, so stopping early never changes the result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .checks import check_request, check_stop_tokens, check_whole, whole
from .engine import check_pool_options
from .errors import RequestError
from .sizing import pool_blocks
from .kv_cache import ContiguousCache
from .sharing import SharedPagedCache

PAGED_OPTIONS = ("num_blocks", "kv_budget", "seed", "backend", "kv_dtype")


@dataclass
class Beam:
    """A live hypothesis: its tokens so far, their summed log-probability, its cache row."""
    tokens: list[int]
    logprob: float
    seq_id: int


@dataclass
class Hypothesis:
    """A finished one: `length` counts the stop token, which `tokens` leaves out."""
    tokens: list[int]
    logprob: float
    length: int
    score: float


@dataclass
class BeamStep:
    """What one step did (for the drawings and the tests), one entry per survivor, best first."""
    parents: list[int]          # index of its parent among the previous step's beams
    tokens: list[int]           # the token it adds
    status: list[str]           # "live"; finished: "stop" (a stop token) or "length" (the last
                                # step); "dropped": live when the search ended, unable to win
    seq_ids: list[int]          # the cache row it continues in (-1: finished)
    forks: list[tuple[int, int]] = field(default_factory=list)   # paged: (parent, child) rows
    freed: list[int] = field(default_factory=list)               # paged: rows left childless


def score(logprob: float, length: int, length_penalty: float) -> float:
    return logprob / length ** length_penalty


def check_beam_request(model, prompt, beam_width, max_new_tokens, length_penalty, stop_tokens,
                       cache, cache_options) -> set[int]:
    """Stage 1's request check, then beam search's own; returns the stop tokens (None: the
    model's)."""
    check_request(model, [prompt], max_new_tokens, 0.0, 1.0, model.args.max_seq_len)
    vocab = model.args.vocab_size
    if not whole(beam_width) or not 1 <= beam_width <= vocab:
        raise RequestError(f"beam_width must be an integer from 1 to the vocabulary size "
                           f"({vocab}), not {beam_width!r}")
    if max_new_tokens < 1:
        raise RequestError("beam search needs max_new_tokens >= 1: a hypothesis's score "
                           "divides by its length, so each needs at least one token")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not math.isfinite(length_penalty):
        raise RequestError(f"length_penalty must be a finite number (1.0 averages the "
                           f"log-probabilities, 0 sums them), not {length_penalty!r}")
    stop = check_stop_tokens(model, stop_tokens)
    unknown = sorted(set(cache_options) - set(PAGED_OPTIONS if cache == "paged" else ()))
    if cache not in ("paged", "contiguous") or unknown:
        raise RequestError(f"beam search runs on cache='paged' (options: "
                           f"{', '.join(PAGED_OPTIONS)}) or cache='contiguous' (none); got "
                           f"cache={cache!r}" + (f" with {', '.join(unknown)}" if unknown else ""))
    check_pool_options(cache_options.get("num_blocks"), cache_options.get("kv_budget"),
                       seed=cache_options.get("seed", 0),
                       backend=cache_options.get("backend", "auto"))
    return set(stop)


def copy_rows(cache: ContiguousCache, src_rows) -> None:
    """The contiguous cache's reorder: row i becomes a copy of row src_rows[i] (K, V and
    length, in every layer); rows past len(src_rows) are emptied. Sharing nothing, it copies
    every survivor's whole history."""
    n, src = len(src_rows), torch.as_tensor(src_rows, dtype=torch.long)
    L = int(cache.seq_lens.max())
    for k, v in zip(cache.k_cache, cache.v_cache):
        k[:n, :L] = k[src.to(k.device), :L]          # (n, L, Hk, D): the gather copies first
        v[:n, :L] = v[src.to(v.device), :L]
    cache.seq_lens[:n] = cache.seq_lens[src]
    cache.seq_lens[n:] = 0


class BeamSearch:
    """One prompt's beam search, a step at a time: `step()` is `select()` (the best beam_width
    candidates), `keep()` (fork survivors, free pruned beams) and `decode()` (one batched
    forward over the live beams). `run()` steps until `done` and returns `results()`."""

    @torch.inference_mode()
    def __init__(self, model, prompt, beam_width: int, max_new_tokens: int, cache="paged",
                 block_size: int = 16, length_penalty: float = 1.0, stop_tokens=None,
                 **cache_options):
        stop = check_beam_request(model, prompt, beam_width, max_new_tokens, length_penalty,
                                  stop_tokens, cache, cache_options)
        check_whole("block_size", block_size, 1)
        self.model, self.beam_width, self.max_new_tokens = model, beam_width, max_new_tokens
        self.length_penalty, self.stop = length_penalty, stop
        self.paged = cache == "paged"
        p = next(model.parameters())
        longest = len(prompt) + max_new_tokens          # no beam grows past this
        if self.paged:                                  # default: room for every beam unshared
            num_blocks = pool_blocks(model.args, p.dtype, block_size,
                                     cache_options.get("num_blocks"),
                                     cache_options.get("kv_budget"), [longest] * beam_width,
                                     cache_options.get("kv_dtype"))
            self.cache = SharedPagedCache(model.args, num_blocks, block_size, beam_width,
                                          longest, device=p.device, dtype=p.dtype,
                                          seed=cache_options.get("seed", 0),
                                          backend=cache_options.get("backend", "auto"),
                                          kv_dtype=cache_options.get("kv_dtype"))
        else:
            self.cache = ContiguousCache(model.args, beam_width, longest, device=p.device,
                                         dtype=p.dtype)
        self.free_rows = list(range(1, beam_width))     # rows no beam holds (row 0: the prompt)
        self.beams = [Beam([], 0.0, 0)]                 # live, best first
        self.finished: list[Hypothesis] = []            # in the order they finished
        self.history: list[BeamStep] = []
        self.blocks_held: list[tuple[int, int]] = []    # per forward (paged): (shared, unshared)
        self.cache.prepare([0], len(prompt))
        logits = model(torch.tensor([prompt], device=p.device), cache=self.cache,
                       last_only=True)                  # (1, 1, V)
        self.logits = logits[:, -1]                     # (beams, V): what the beams propose
        self._count_blocks()
        self.done = False

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        self.keep(self.select())
        if not self.done:
            self.decode()

    def select(self) -> list[tuple[int, int, float]]:
        """The best beam_width of all beams × vocab candidates, as (parent index, token, summed
        log-probability), best first; ties go to the earlier beam, then the lower token id."""
        logp = torch.log_softmax(self.logits.double(), dim=-1)                # (beams, V)
        sums = torch.tensor([b.logprob for b in self.beams], dtype=torch.float64)
        cand = (sums.to(logp.device)[:, None] + logp).flatten().cpu()         # (beams * V,)
        best = cand.sort(descending=True, stable=True).indices[:self.beam_width]
        V = logp.shape[-1]
        return [(i // V, i % V, float(cand[i])) for i in best.tolist()]

    @torch.inference_mode()
    def keep(self, survivors) -> None:
        """Finish the survivors that emitted a stop token (or reached max_new_tokens); give the
        others their parents' cache rows; end the search if nothing can change the result."""
        length = len(self.history) + 1                  # tokens in every survivor now
        last = length == self.max_new_tokens
        live, status = [], []
        for parent, token, logprob in survivors:
            tokens = self.beams[parent].tokens
            if token in self.stop or last:
                kept = tokens if token in self.stop else tokens + [token]
                self.finished.append(Hypothesis(kept, logprob, length, score(
                    logprob, length, self.length_penalty)))
                status.append("stop" if token in self.stop else "length")
            else:
                live.append((parent, tokens + [token], logprob))
                status.append("live")
        step = BeamStep([s[0] for s in survivors], [s[1] for s in survivors], status, [])
        rows = self._reorder([parent for parent, _, _ in live], step)
        self.beams = [Beam(tokens, logprob, row) for (_, tokens, logprob), row in zip(live, rows)]
        next_row = iter(rows)
        step.seq_ids = [next(next_row) if s == "live" else -1 for s in status]
        self.history.append(step)
        self.done = not self.beams or self.cannot_improve()
        if self.done and self.beams:                    # given up: their blocks go back
            for b in self.beams:
                self.cache.free(b.seq_id)
            step.status = ["dropped" if s == "live" else s for s in step.status]

    def _reorder(self, parents, step: BeamStep) -> list[int]:
        """Rows for beams continuing `parents` (indices into the old beams), in order."""
        if not self.paged:
            copy_rows(self.cache, [self.beams[p].seq_id for p in parents])
            return list(range(len(parents)))
        for i, b in enumerate(self.beams):              # pruned: free first, at once
            if i not in parents:
                self.cache.free(b.seq_id)
                self.free_rows.append(b.seq_id)
                step.freed.append(b.seq_id)
        rows, claimed = [], set()
        for p in parents:
            row = self.beams[p].seq_id
            if p in claimed:                            # a second child: share the blocks
                child = min(self.free_rows)
                self.free_rows.remove(child)
                self.cache.fork(row, child)
                step.forks.append((row, child))
                row = child
            claimed.add(p)
            rows.append(row)
        return rows

    def cannot_improve(self) -> bool:
        """True when beam_width hypotheses are finished and no live beam can ever score above
        the worst of them. A live beam (sum S <= 0, length n) finishes, if ever, with a sum
        S' <= S (log-probabilities are <= 0) and a length n' in [n + 1, max_new_tokens], so its
        score is at most S / n' ** length_penalty: largest at n' = max_new_tokens when the
        penalty is positive, at n' = n + 1 otherwise. The best live beam has the largest S.
        A tie cannot beat: ties rank by finishing order, and the finished came first."""
        if len(self.finished) < self.beam_width:
            return False
        worst = sorted((h.score for h in self.finished), reverse=True)[self.beam_width - 1]
        n = len(self.history)
        longest = self.max_new_tokens if self.length_penalty > 0 else n + 1
        return score(self.beams[0].logprob, longest, self.length_penalty) <= worst

    @torch.inference_mode()
    def decode(self) -> None:
        """One forward for all live beams: each writes its last token (copy-on-write first
        where that lands in a shared block) and proposes the next."""
        ids = [b.seq_id for b in self.beams]
        self.cache.prepare(ids, 1)
        device = next(self.model.parameters()).device
        tokens = torch.tensor([[b.tokens[-1]] for b in self.beams], device=device)   # (B, 1)
        self.logits = self.model(tokens, cache=self.cache)[:, -1]                  # (B, V)
        self._count_blocks()

    def _count_blocks(self) -> None:
        """Blocks per layer the beams hold now, shared, and if each held its own copy."""
        if self.paged:
            m = self.cache.managers[0]
            self.blocks_held.append((m.num_used_blocks, int(m.refs.sum())))

    # -- the whole search ---------------------------------------------------------------------
    def results(self) -> list[tuple[list[int], float]]:
        """The beam_width best finished hypotheses, best first: (tokens, score)."""
        ranked = sorted(self.finished, key=lambda h: -h.score)     # stable: ties by finishing
        return [(h.tokens, h.score) for h in ranked[:self.beam_width]]

    def run(self) -> list[tuple[list[int], float]]:
        while not self.done:
            self.step()
        return self.results()


def beam_search(model, prompt, beam_width: int, max_new_tokens: int, cache="paged",
                block_size: int = 16, length_penalty: float = 1.0, stop_tokens=None,
                **cache_options) -> list[tuple[list[int], float]]:
    """The beam_width best continuations of `prompt` (a list of token ids), best first, as
    (tokens, score) with score = sum of log-probabilities / length ** length_penalty (length:
    the generated tokens, a stop token included; stop tokens are not returned).

    cache="paged": a SharedPagedCache whose beams share blocks (options: num_blocks or
    kv_budget, default room for every beam unshared; seed; backend). cache="contiguous": one
    row per beam, reordered by copying. stop_tokens: None uses the model's, [] never stops."""
    return BeamSearch(model, prompt, beam_width, max_new_tokens, cache, block_size,
                      length_penalty, stop_tokens, **cache_options).run()
