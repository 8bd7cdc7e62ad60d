"""Stage 7: when drafts pay — how many drafts each request asks for, and which ones a step runs.

A verify pass is not free. On a small batch on a GPU it nearly is (the step is memory-bound),
but on a CPU the extra tokens cost arithmetic, and the packing, the logits at every position and
the rollback cost a little more per step: a pass whose drafts are all rejected takes longer
than a plain step for the same one token a row. So drafts must be paid for by acceptance.
`DraftPolicy` decides in two places, each a switch of its own:

  1. per request (`adapt_k`, `DraftPolicy.k_for`): how many drafts lookup may propose. All k
     at first; after a verify that kept every draft, twice as many as last time (at most k);
     after one that kept a of d, a + 1; after one that kept none, none for a while (1 step,
     then 2, 4, ... up to 16 while the probes keep failing), then a probe of one draft. A
     lookup that found nothing waits too (1, 2, then 4 steps): lookup scans the text, which on
     a small model costs as much as a share of the step.
  2. per step (`batch_gate`, `DraftPolicy.best_counts`): a request whose recent drafts were
     kept at rate `alpha` (each draft given that the one before it was kept) gets its i-th
     draft accepted with probability about alpha ** i. A step of B decoding rows, m of them
     running c drafts each, takes plain(B) + fixed(B) + m * c * per_draft(B) seconds (plus
     segment(B) when m < B), measured on the model at hand (`StepCosts.measure`); it yields B
     tokens plus the accepted drafts. The step runs the c and the rows that give the most
     expected tokens per second, if that beats a plain step's B / plain(B) — on a large batch
     often it does not, and no draft runs; then lookup itself pauses (1 step, 2, 4, ... up to
     16 while the gate keeps running none of what it finds, until the batch changes). The
     measured costs are corrected by the steps the engine then runs (`DraftPolicy.observe`):
     a machine that got busier, or a context that grew, moves them.

Greedy tokens are those of plain decoding whatever the policy decides: it only chooses which
drafts the verify pass sees, and the pass keeps exactly the ones the model would have produced.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

MAX_WAIT = 16                 # the longest pause (in steps) after probes that kept nothing
MAX_DRY_WAIT = 4              # the longest pause after lookups that found nothing
DECAY = 0.7                   # weight of older verify steps in a request's acceptance rate
CORRECTION = 0.2              # weight of the newest step in the costs' correction


@dataclass
class DraftState:
    """What the policy remembers of one request."""
    k: int                    # drafts to ask for next time
    wait: int = 0             # steps left without drafts
    misses: int = 0           # verify steps in a row that kept no draft
    dry: int = 0              # lookups in a row that found nothing
    kept: float = 0.5         # decayed count of drafts kept ...
    trials: float = 1.0       # ... of drafts that had the chance (prior: alpha = 0.5)
    asked: int = 0            # what k_for gave this step

    @property
    def alpha(self) -> float:
        """The chance that a draft is kept, given the one before it was."""
        return self.kept / self.trials


@dataclass
class StepCosts:
    """Seconds of a decode step by batch size (`batches`, increasing): `plain` (one token a
    row), and what a verify pass adds: `fixed` for having drafts at all, `per_draft` for each
    draft, `segment` when some rows run drafts and others do not (rows with as many drafts
    are packed as one segment, and each segment is an attention call per layer). Between
    measured batch sizes, linear; past the largest, plain and fixed grow with the batch, the
    others stay."""
    batches: list
    plain: list
    fixed: list
    per_draft: list
    segment: list

    def at(self, batch: int) -> tuple[float, float, float, float]:
        """(plain, fixed, per_draft, segment) at `batch` rows."""
        bs, columns = self.batches, (self.plain, self.fixed, self.per_draft, self.segment)
        if batch >= bs[-1]:
            scale = batch / bs[-1]
            return self.plain[-1] * scale, self.fixed[-1] * scale, *(c[-1] for c in columns[2:])
        i = next(i for i, b in enumerate(bs) if b >= batch)
        if bs[i] == batch or i == 0:
            return tuple(c[i] for c in columns)
        w = (batch - bs[i - 1]) / (bs[i] - bs[i - 1])
        return tuple((1 - w) * c[i - 1] + w * c[i] for c in columns)

    @classmethod
    def measure(cls, engine, batches=(1, 4, 16), repeat: int = 5,
                context: int = 64) -> StepCosts:
        """Time `engine`'s own steps on its model, in a scratch copy of it (`engine.scratch`,
        rows of `context` tokens: every draft attends to all of them): for each batch size, a
        plain step, verify passes with one draft a row, with k a row, and with k on every other
        row (drafts the model rejects, as a missed guess is), each the fastest of `repeat`."""
        k = max(2, engine.num_speculative_tokens)
        ways = {"plain": lambda i: 0, "one": lambda i: 1, "k": lambda i: k,
                "half": lambda i: k * (i % 2 == 0)}
        plain, fixed, per_draft, segment = [], [], [], []
        for B in batches:
            scratch = engine.scratch(B, 2 + (repeat + 1) * (4 + 2 * k), context)
            secs = {way: [] for way in ways}
            for way in list(ways) * (repeat + 1):       # the first round warms up, untimed
                scratch.scheduler.propose = lambda reqs, d=ways[way]: {
                    r: [r.output[-1]] * d(i) for i, r in enumerate(reqs) if d(i)}
                start = time.perf_counter()
                scratch.step()
                secs[way].append(time.perf_counter() - start)
            t = {way: min(s[1:]) for way, s in secs.items()}
            per = max(0.0, (t["k"] - t["one"]) / (B * (k - 1)))
            plain.append(t["plain"])
            per_draft.append(per)
            fixed.append(max(0.0, t["one"] - t["plain"] - B * per))
            half = t["plain"] + fixed[-1] + (B + 1) // 2 * k * per
            segment.append(max(0.0, t["half"] - half) if B > 1 else 0.0)
        return cls(list(batches), plain, fixed, per_draft, segment)


_MEASURED = weakref.WeakKeyDictionary()       # model -> {(engine class, options): StepCosts}


def measured_costs(engine, measure: bool = True) -> StepCosts | None:
    """`StepCosts.measure(engine)`, once per model, engine class, block size, k, thread count
    and context length (that of the engine's running requests, rounded up to a power of two
    from 64 to 1024: a draft's attention reads the whole context). With measure=False: the
    costs if already measured, else None."""
    running = engine.scheduler.running
    mean = sum(r.num_tokens for r in running) / len(running) if running else 64
    context = min(1024, max(64, 1 << (int(mean) - 1).bit_length()))
    key = (type(engine), engine.cache.block_size, engine.num_speculative_tokens,
           torch.get_num_threads(), context)
    per_model = _MEASURED.setdefault(engine.model, {})
    if key not in per_model and measure:
        per_model[key] = StepCosts.measure(engine, context=context)
    return per_model.get(key)


@dataclass
class DraftPolicy:
    """Drafts that adapt to each request's acceptance (`adapt_k`) and to the batch
    (`batch_gate`); both off is every step drafting up to k (the engine's `draft_policy="fixed"`).
    `step_costs`: a `StepCosts` to decide by (None: measured on the engine's model when first
    needed). `follow_steps`: correct the costs by the steps the engine runs (`observe`; None:
    the measured ones only, given costs are taken as they are). `trace`: a list to append one
    row per decoding request per step to (step, req_id, k it asked for, drafts lookup found,
    drafts run, drafts kept), as `online_softmax`'s trace does."""
    adapt_k: bool = True
    batch_gate: bool = True
    step_costs: StepCosts | None = None
    follow_steps: bool | None = None
    trace: list | None = None
    states: weakref.WeakKeyDictionary = field(     # request -> DraftState, while it lives
        default_factory=weakref.WeakKeyDictionary)
    plain_scale: float = 1.0      # the steps' times over the costs': plain steps ...
    draft_scale: float = 1.0      # ... and what drafts add to a step
    gate_wait: int = 0            # steps left without lookup: the gate ran none of what ...
    gate_misses: int = 0          # ... lookup found, this many steps in a row, at a batch
    gate_batch: int = 0           # of this many rows
    _memo: tuple = field(default=(None, None), repr=False)   # (engine, step, batch) -> costs

    def drafts(self, reqs, propose, engine) -> dict:
        """This step's drafts for the decoding requests `reqs`: how many each may ask for,
        lookup (`propose(req)`, which asks `k_for`) unless no draft could pay, then the gate's
        choice among what lookup found. Returns {request: drafts} for requests with drafts."""
        k = engine.num_speculative_tokens
        if len(reqs) != self.gate_batch:     # another batch: the gate may open again
            self.gate_wait, self.gate_misses, self.gate_batch = 0, 0, len(reqs)
        waiting = self.batch_gate and self.gate_wait > 0
        if waiting:        # the gate's pause: no request asks (nor counts down a pause of its own)
            self.gate_wait -= 1
        else:
            for r in reqs:
                self._ask(r, k)
        if waiting or (self.batch_gate and not self._may_pay(reqs, engine)):
            proposals = {r: [] for r in reqs}              # no lookup: nothing could pay
        else:
            proposals = {r: propose(r) for r in reqs}
            for r, ds in proposals.items():
                self._found(r, bool(ds))
        chosen = proposals
        if self.batch_gate and any(proposals.values()):
            counts = self.best_counts({r: len(ds) for r, ds in proposals.items()}, engine)
            chosen = {r: ds[:counts.get(r, 0)] for r, ds in proposals.items()}
            # the gate ran none of what lookup found: no lookup for 1, 2, 4 ... 16 steps
            self.gate_misses = 0 if counts else self.gate_misses + 1
            self.gate_wait = min(MAX_WAIT, 2 ** (self.gate_misses - 1)) if not counts else 0
        if self.trace is not None:
            for r, ds in chosen.items():
                self.trace.append(dict(step=engine.step_count, req_id=r.req_id,
                                       k=0 if waiting else self.states[r].asked,
                                       found=len(proposals[r]),
                                       drafts=len(ds), kept=0))
        return {r: ds for r, ds in chosen.items() if ds}

    def k_for(self, req, k: int) -> int:
        """Drafts `req` may ask lookup for this step (at most k)."""
        st = self.states.get(req)
        return k if st is None else min(st.asked, k)

    def _ask(self, req, k: int) -> None:
        st = self.states.setdefault(req, DraftState(k))
        if not self.adapt_k:
            st.asked = k
        elif st.wait:
            st.wait, st.asked = st.wait - 1, 0
        else:
            st.asked = min(st.k, k)

    def _found(self, req, found: bool) -> None:
        """After a lookup for `req`: one that found nothing pauses the next lookups."""
        st = self.states[req]
        if found:
            st.dry = 0
        elif self.adapt_k and st.asked:
            st.wait, st.dry = min(MAX_DRY_WAIT, 2 ** st.dry), st.dry + 1

    def _may_pay(self, reqs, engine) -> bool:
        """Whether a draft could pay this step, were lookup to find every request as many as
        it may ask for, each as likely as the likeliest request's first: if not, no lookup."""
        asking = [r for r in reqs if self.states[r].asked]
        if not asking:
            return False
        costs = self.costs(len(reqs), engine, measure=False)
        if costs is None:
            return True              # not measured yet: measured once lookup finds a draft
        B, best = len(reqs), max(self.alpha(r) for r in asking)
        plain, fixed, per, _ = costs
        m = sum(self.states[r].asked for r in asking)
        return (B + m * best) / (plain + fixed + m * per) > B / plain

    def best_counts(self, lengths: dict, engine=None) -> dict:
        """Drafts to run per request, of `lengths[r]` on offer. Draft i of request r is kept
        with probability about alpha_r ** i, so c drafts of it gain g_r(c) = alpha_r + ... +
        alpha_r ** c tokens. Every request that drafts runs the same number c (one segment);
        for each c and each m, the m requests of largest g_r(c) give the most expected tokens
        per second, (B + their gains) / (plain + fixed + m * c * per_draft [+ segment if
        m < B]). The best of these; none if none beats a plain step's B / plain."""
        if not any(lengths.values()):
            return {}
        B = len(lengths)
        plain, fixed, per, seg = self.costs(B, engine)
        best, best_rate = {}, B / plain
        for c in range(1, max(lengths.values()) + 1):
            gains = sorted(((sum(self.alpha(r) ** i for i in range(1, c + 1)), r)
                            for r, n in lengths.items() if n >= c), key=lambda g: -g[0])
            gain = 0.0
            for m, (g, _) in enumerate(gains, 1):
                gain += g
                rate = (B + gain) / (plain + fixed + m * c * per + (seg if m < B else 0.0))
                if rate > best_rate:
                    best, best_rate = {r: c for _, r in gains[:m]}, rate
        return best

    def costs(self, batch: int, engine=None, measure: bool = True):
        """(plain, fixed, per_draft, segment) seconds at `batch` rows: the measured costs
        (`step_costs`, else the engine's model's) times the corrections `observe` made; None if
        not measured yet and measure=False."""
        key = (id(engine), getattr(engine, "step_count", None), batch)
        if self._memo[0] == key:          # asked twice in a step: the same answer
            costs = self._memo[1]
        else:
            costs = self.step_costs or measured_costs(engine, measure)
            if costs is not None:
                self._memo = (key, costs)
        if costs is None:
            return None
        plain, fixed, per, seg = costs.at(batch)
        d = self.draft_scale
        return plain * self.plain_scale, fixed * d, per * d, seg * d

    def observe(self, drafts: list, seconds: float, engine=None) -> None:
        """After a step of decoding rows alone, `drafts[i]` drafts on row i, that took `seconds`
        (the whole step, as `StepCosts.measure` times it): move the corrections toward what it
        took. A plain step corrects plain(B); a verify step, given plain(B), what its drafts
        added. Each correction is a decayed mean of the steps' ratios, each ratio kept within
        [1/4, 4] (one step slowed by something else moves it little)."""
        follow = self.step_costs is None if self.follow_steps is None else self.follow_steps
        costs = self.costs(len(drafts), engine, measure=False) if drafts and follow else None
        if costs is None:
            return
        plain, fixed, per, seg = costs
        rows = sum(1 for d in drafts if d)
        if not rows:
            ratio = seconds / plain if plain > 0 else 1.0
            self.plain_scale *= (1 - CORRECTION) + CORRECTION * min(4.0, max(0.25, ratio))
            return
        added = fixed + sum(drafts) * per + (seg if rows < len(drafts) else 0.0)
        if added > 0:
            ratio = (seconds - plain) / added
            self.draft_scale *= (1 - CORRECTION) + CORRECTION * min(4.0, max(0.25, ratio))

    def update(self, req, drafts: int, kept: int) -> None:
        """After a verify pass that ran `drafts` of `req`'s drafts and kept `kept`."""
        st = self.states.setdefault(req, DraftState(drafts))
        st.kept = DECAY * st.kept + kept
        st.trials = DECAY * st.trials + kept + (kept < drafts)
        if kept == drafts:
            st.k, st.misses = max(st.k, 2 * drafts), 0
        elif kept:
            st.k, st.misses = kept + 1, 0
        else:
            st.k, st.wait, st.misses = 1, min(MAX_WAIT, 2 ** st.misses), st.misses + 1
        if self.trace:
            for row in reversed(self.trace):
                if row["req_id"] == req.req_id:
                    row["drafts"], row["kept"] = drafts, kept
                    break

    def alpha(self, req) -> float:
        st = self.states.get(req)
        return st.alpha if st is not None else DraftState(0).alpha
