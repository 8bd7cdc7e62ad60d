"""Stage 7: speculative decoding on paged blocks — draft, verify in one forward, roll back.

A decode step reads every weight of the model to produce one token per sequence: on a small
batch it is bound by memory traffic, not arithmetic, so running k + 1 tokens of a sequence
through the model costs about as much as running one. Speculative decoding spends that spare
arithmetic: guess k next tokens cheaply (the draft), run [last token + k drafts] through the
model in one forward (the verify pass), and keep the drafts the model agrees with.

Drafts here need no second model: n-gram prompt lookup (vLLM's `ngram` method) finds the last
n tokens of the sequence earlier in it (prompt + output, n from `prompt_lookup_max` down to
`prompt_lookup_min`) and proposes the tokens that followed. Text that repeats what it has seen
(a summary, an edit, code) drafts well; open chat rarely finds a match, and then the step is an
ordinary decode.

On the paged cache a step is:

    1. lookahead slots: the scheduler grows a decoding sequence by 1 + k tokens, not 1
       (`SpeculativeScheduler`), taking only blocks that are free — drafts never preempt anyone
       and count against the token budget. Growing copies a shared last block first (stage 6's
       copy-on-write), so no draft is written where another table reads.
    2. verify: one forward over [last token + drafts] per row, packed like stage 5b's chunks;
       the logits at every one of those positions (`logits_indices`).
    3. accept (`accept_greedy`, `accept_sampled`): the longest prefix of drafts the target
       would have produced, plus one token from the target itself (the bonus token).
    4. roll back (`rollback`): the cache keeps the K/V of the last token and the accepted
       drafts; lengths are wound back in every layer, and a block left holding only rejected
       tokens goes back to the pool. Blocks are named for the prefix cache only after that, so
       a hash never names a block holding a rejected token.

How many drafts each request asks for and which of them a step runs is `DraftPolicy`'s choice
(`draft_policy.py`): drafts that adapt to their acceptance and to the batch, so that a verify
pass runs only where it is expected to pay for itself.

Greedy, the tokens are exactly those of decoding without speculation. Sampling, `accept_sampled`
is the rejection sampler for a draft that is one token with probability 1: accept draft x with
probability p(x), else draw from p without x; the tokens follow the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_manager import PAD_BLOCK
from .chunked_engine import PackedBatch
from .draft_policy import DraftPolicy
from .errors import RequestError
from .sampling import tempered_softmax
from .sharing_engine import SharingEngine, SharingScheduler

METHODS = ("ngram",)


# -- 1. drafts -------------------------------------------------------------------------------------
def ngram_propose(tokens, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k draft tokens: for n from max_n down to min_n, find the last n tokens earlier in
    `tokens` (the most recent such place) and return the k tokens that followed it; [] if no
    n-gram of those lengths appears before."""
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):      # latest first, never the tail itself
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


# -- 3. accept -------------------------------------------------------------------------------------
def accept_greedy(drafts, logits) -> list[int]:
    """drafts (d,), logits (d + 1, V) at [last token + drafts]: the target's own tokens up to and
    including its first disagreement with the drafts (a + 1 tokens for a accepted drafts)."""
    best = logits.argmax(-1).tolist()                                   # (d + 1,)
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return best[:a + 1]


def target_probs(logits, temperature: float, top_p: float):
    """(..., V) logits -> the distribution `sampling.sample` draws from: softmax at the
    temperature, cut to the smallest set of tokens reaching top_p, renormalised."""
    probs = tempered_softmax(logits, temperature)
    sorted_p, order = torch.sort(probs, descending=True, dim=-1)
    keep = sorted_p.cumsum(-1) - sorted_p <= top_p
    cut = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return cut / cut.sum(-1, keepdim=True)


def accept_sampled(drafts, logits, temperature: float, top_p: float, generator=None) -> list[int]:
    """The rejection sampler for deterministic drafts. For each draft x in order, with p the
    target's distribution at its position: accept x with probability p(x); on the first
    rejection, draw from p with x removed (renormalised) and stop. If every draft is accepted,
    the bonus token is drawn from p at the last position. Returns a + 1 tokens."""
    probs = target_probs(logits, temperature, top_p)                    # (d + 1, V)
    out = []
    for i, x in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        if u < probs[i, x].item():
            out.append(x)
            continue
        rest = probs[i].clone()
        rest[x] = 0.0                        # p(x) < 1 here (else u < p(x)), so rest is not 0
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


# -- 4. roll back ----------------------------------------------------------------------------------
def rollback(cache, seq_id: int, num_tokens: int) -> int:
    """Wind sequence `seq_id` back to its first `num_tokens` tokens in every layer
    (`cache.managers`: a stage-6 manager per layer, with stage 2's `_table`, `_held`, `_lens`,
    `blocks_for` and `_release`): the length shrinks, and the blocks past
    ceil(num_tokens / block_size) go back to the pool (a shared block only loses a reference).
    Its prefix-cache names (`cache.hashes[seq_id]`, stage 6: one per full block, in order) are
    cut to the num_tokens // block_size blocks still full of kept tokens. RequestError,
    changing nothing, unless 0 <= num_tokens <= its length. Returns the blocks per layer given
    back."""
    s = int(seq_id)
    freed = 0
    for m in cache.managers:
        held, keep = int(m._held[s]), m.blocks_for(num_tokens)
        if not 0 <= num_tokens <= int(m._lens[s]):
            raise RequestError(f"cannot roll sequence {s} back to {num_tokens} tokens: it holds "
                               f"{int(m._lens[s])}")
        m._release(m._table[s, keep:held].tolist())
        m._table[s, keep:held] = PAD_BLOCK
        m._held[s], m._lens[s] = keep, num_tokens
        freed = held - keep
    hashes = getattr(cache, "hashes", {}).get(s)
    if hashes is not None:                        # names of blocks still full of kept tokens
        del hashes[num_tokens // cache.block_size:]
    return freed


def make_policy(draft_policy) -> DraftPolicy:
    """The engine's `draft_policy` option as a `DraftPolicy`."""
    if isinstance(draft_policy, DraftPolicy):
        return draft_policy
    if draft_policy == "adaptive":
        return DraftPolicy()
    if draft_policy == "fixed":
        return DraftPolicy(adapt_k=False, batch_gate=False)
    raise RequestError(f"draft_policy must be 'adaptive', 'fixed' or a DraftPolicy, not "
                       f"{draft_policy!r}")


# -- 1. lookahead slots ----------------------------------------------------------------------------
class SpeculativeScheduler(SharingScheduler):
    """Stage 6's scheduler; then each decoding request also gets room for its drafts, oldest
    first, from the blocks (and, under a budget, the tokens) left over. `drafts` holds this
    step's drafts per request; `propose(reqs)` makes them for all decoding requests at once."""

    def __init__(self, *args, propose=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.propose = propose
        self.drafts: dict = {}

    def schedule(self):
        self.drafts = {}
        return super().schedule()

    def _schedule_decodes(self, out) -> int:
        committed = super()._schedule_decodes(out)          # one token each, preempting if dry
        drafts = self.propose(list(out.decode)) if self.propose else {}
        for req in [r for r in out.decode if r in drafts]:
            extra = self._lookahead(req, drafts[req], self.cache.num_free_blocks - committed,
                                    None)
            committed += extra
        return committed

    def _schedule_decode_tokens(self, out) -> None:
        super()._schedule_decode_tokens(out)                # one token each, within the budget
        drafts = self.propose(list(out.decode)) if self.propose else {}
        for req in [r for r in out.decode if r in drafts]:
            extra = self._lookahead(req, drafts[req], self._free(out), self._budget_left(out))
            out.num_tokens[req] += len(self.drafts.get(req, ()))
            out.new_blocks[req] += extra

    def _lookahead(self, req, drafts, free_blocks: int, budget: int | None) -> int:
        """Give `req` as many of its drafts as the free blocks and the budget hold; returns the
        blocks those drafts add to its one-token growth."""
        if budget is not None:
            drafts = drafts[:max(0, budget)]
        one = self.cache.blocks_to_grow(req.seq_id, 1)
        while drafts and self.cache.blocks_to_grow(req.seq_id, 1 + len(drafts)) - one \
                > free_blocks:
            drafts = drafts[:-1]
        if drafts:
            self.drafts[req] = drafts
        return self.cache.blocks_to_grow(req.seq_id, 1 + len(drafts)) - one


@dataclass
class SpeculativeStats:
    """What speculation did over a run."""
    verify_rows: int = 0          # decode rows that carried at least one draft
    draft_tokens: int = 0         # drafts run through the model
    accepted_tokens: int = 0      # drafts the target agreed with
    decode_rows: int = 0          # decode rows in all (with or without drafts)
    decode_tokens: int = 0        # tokens those rows produced (accepted drafts + one each)
    rolled_back_blocks: int = 0   # blocks per layer given back by rollbacks

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(1, self.draft_tokens)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decoding sequence gained per step (1.0 without speculation)."""
        return self.decode_tokens / max(1, self.decode_rows)


# -- the engine ------------------------------------------------------------------------------------
class SpeculativeEngine(SharingEngine):
    """Stage 6's engine with `speculative="ngram"` and `num_speculative_tokens=k` (None: stage
    6's engine, unchanged). `prompt_lookup_min`/`prompt_lookup_max`: the n-gram lengths tried.
    `draft_policy`: "fixed" (every step drafts up to k: the mechanism, step by step),
    "adaptive" (drafts that adapt to each request's acceptance and to the batch, measured on
    the model: `draft_policy.py`; the speed layer's default), or a `DraftPolicy`."""

    def __init__(self, model, num_blocks: int | None = None, block_size: int = 16,
                 preemption: str = "recompute", *, speculative: str | None = None,
                 num_speculative_tokens: int | None = None, prompt_lookup_min: int = 2,
                 prompt_lookup_max: int = 4, draft_policy="fixed", **options):
        k = num_speculative_tokens
        if speculative is not None and speculative not in METHODS:
            raise RequestError(f"speculative must be one of {', '.join(METHODS)} (or None), not "
                               f"{speculative!r}")
        if speculative is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise RequestError(f"speculative={speculative!r} needs num_speculative_tokens, the "
                               f"drafts per step: a positive integer, not {k!r}")
        if speculative is None and k is not None:
            raise RequestError("num_speculative_tokens needs speculative='ngram'")
        lo, hi = prompt_lookup_min, prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise RequestError(f"prompt_lookup_min and prompt_lookup_max must be integers with "
                               f"1 <= min <= max, not {lo!r} and {hi!r}")
        self.speculative, self.num_speculative_tokens = speculative, k
        self.prompt_lookup = (lo, hi)
        self.policy = make_policy(draft_policy)
        self.scratch_options = {o: options[o] for o in ("backend", "kv_dtype") if o in options}
        self.spec = SpeculativeStats()
        super().__init__(model, num_blocks, block_size, preemption, **options)

    def new_scheduler(self, *args) -> SpeculativeScheduler:
        return SpeculativeScheduler(*args, max_num_batched_tokens=self.max_num_batched_tokens,
                                    propose=self.draft if self.speculative else None)

    def draft(self, reqs) -> dict:
        """This step's drafts: each decoding request's proposal, cut by the policy (no lookup
        at all where the policy sees that no draft could pay)."""
        return self.policy.drafts(reqs, self.propose, self)

    def propose(self, req) -> list[int]:
        """Drafts for a decoding request: as many as the policy allows it, never more than
        would take it past max_new_tokens (the verify pass always adds one token of its own)."""
        k = min(self.policy.k_for(req, self.num_speculative_tokens),
                req.max_new_tokens - len(req.output) - 1)
        if k <= 0:
            return []
        return ngram_propose(req.prompt + req.output, k, *self.prompt_lookup)

    def scratch(self, batch: int, max_new_tokens: int, context: int = 16) -> SpeculativeEngine:
        """A copy of this engine (class, model, block size, backend) with `batch` requests of
        one prompt of `context` tokens prefilled (once: the others share its blocks through
        the prefix cache), drafting nothing of its own: `StepCosts.measure` times its steps."""
        bs = self.cache.block_size
        engine = type(self)(self.model, batch * -(-(context + max_new_tokens) // bs), bs,
                            max_num_seqs=batch, speculative="ngram", prefix_caching=True,
                            num_speculative_tokens=self.num_speculative_tokens,
                            draft_policy="fixed", **self.scratch_options)
        prompt = [1 + j % 7 for j in range(context)]
        engine.add_request(prompt, max_new_tokens, stop_tokens=[])
        engine.step()                                            # the prompt, once
        for _ in range(batch - 1):
            engine.add_request(prompt, max_new_tokens, stop_tokens=[])
        engine.step()                                            # the prefills
        return engine

    def _run_model(self, plan) -> list:
        """The decodes first, with their drafts, in one verify forward; then stage 6's calls for
        the step's prefills and chunks. A step where no row has a draft is stage 6's step."""
        self._step_drafts = [len(self.scheduler.drafts.get(r, [])) for r in plan.decode]
        if not any(self._step_drafts):
            for _ in plan.decode if self.speculative else ():
                self._count(0, 1)             # no draft found: stage 6's plain decode step
            return super()._run_model(plan)
        sampled = self._verify(plan.decode)
        decodes, plan.decode = plan.decode, []
        counts = getattr(plan, "num_tokens", None)
        saved = {r: counts.pop(r) for r in decodes if r in counts} if counts is not None else {}
        try:
            sampled += super()._run_model(plan)
        finally:
            plan.decode = decodes
            if counts is not None:
                counts.update(saved)
        return sampled

    def _count_step(self, plan, seconds) -> None:
        """Stage 5's counters; and a step of decoding rows alone tells the policy what it took
        (`DraftPolicy.observe`: the costs it decides by follow the machine)."""
        super()._count_step(plan, seconds)
        if self.speculative and plan.decode and not plan.prefill:
            self.policy.observe(self._step_drafts, seconds, self)

    def _verify(self, reqs) -> list:
        """One forward over every decoding row's [last token + drafts], rows with as many drafts
        packed as one segment; accept, roll back, return (request, token, "decode") triples."""
        drafts = {r: self.scheduler.drafts.get(r, []) for r in reqs}
        groups: dict[int, list] = {}
        for r in reqs:
            groups.setdefault(len(drafts[r]), []).append(r)
        batch, tokens, order = PackedBatch(self.cache), [], []
        for d, rows in sorted(groups.items()):
            batch.add([r.seq_id for r in rows], 1 + d)
            for r in rows:
                tokens += [r.output[-1]] + drafts[r]
                order.append(r)
        logits = self.model(torch.tensor([tokens], device=self.device), cache=batch,
                            logits_indices=torch.arange(len(tokens), device=self.device))[0]
        sampled, start = [], 0
        for r in order:
            d = len(drafts[r])
            rows = logits[start:start + d + 1]                               # (d + 1, V)
            start += d + 1
            out = self.accept(r, drafts[r], rows)
            if d:
                self.policy.update(r, d, len(out) - 1)
            held = int(self.cache.managers[0].seq_lens[r.seq_id])
            self.spec.rolled_back_blocks += rollback(self.cache, r.seq_id, held - d + len(out) - 1)
            self.tokens_run[r] = 1 + d
            self._count(d, len(out))
            sampled += [(r, t, "decode") for t in self._within_limits(r, out)]
        return sampled

    def accept(self, r, drafts, logits) -> list[int]:
        """The tokens a row keeps: greedy or by rejection sampling, as the request samples."""
        if r.temperature == 0:
            return accept_greedy(drafts, logits)
        return accept_sampled(drafts, logits, r.temperature, r.top_p, r.generator)

    @staticmethod
    def _within_limits(r, out) -> list[int]:
        """The accepted run, cut after a stop token or at max_new_tokens: nothing past either
        is ever returned."""
        out = out[:r.max_new_tokens - len(r.output)]
        for i, t in enumerate(out):
            if t in r.stop_tokens:
                return out[:i + 1]
        return out

    def _count(self, drafts: int, produced: int) -> None:
        st = self.spec
        st.decode_rows += 1
        st.decode_tokens += produced
        if drafts:
            st.verify_rows += 1
            st.draft_tokens += drafts
            st.accepted_tokens += produced - 1
