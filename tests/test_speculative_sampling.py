"""Stage 7's rejection sampler keeps the target's distribution.

Synthetic logits on a vocabulary of 5, many seeded draws, Pearson's chi-square at a
significance level fixed here (0.001; the critical values are the chi-square table's):
  - the first token of a verify step follows the target's distribution p0, computed here from
    the logits by hand, whatever the draft, and matches `generation.sample`'s draws (sampling
    without speculation, top-p included);
  - after an accepted draft x0, the next token follows p1 (the distribution at position 1);
  - wrong samplers fail the same test: accepting every draft, or drawing a rejected position
    from p itself instead of p without the draft.
"""

import math

import torch

from minipaged.generation import sample
from minipaged.speculative import accept_sampled

ALPHA = 0.001
CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}    # chi-square, 1 - ALPHA, by df
DRAWS = 6000
LOGITS = torch.tensor([[1.2, 0.3, -0.4, 0.9, 0.0],          # position 0: after the last token
                       [-0.5, 1.5, 0.2, 0.1, 0.7],          # position 1: after draft 0
                       [0.4, 0.4, 0.4, 0.4, 0.4]])          # position 2: after draft 1
DRAFTS = [3, 1]        # draft 0 is likely (p0(3) ~ 0.27), draft 1 the target's favourite


def by_hand(row, temperature):
    e = [math.exp(x / temperature) for x in row.tolist()]
    return [x / sum(e) for x in e]


def chi_square(counts, expected_probs):
    """Pearson's statistic and its degrees of freedom over the cells expected to be non-empty."""
    n = sum(counts)
    cells = [(c, n * p) for c, p in zip(counts, expected_probs) if p > 0]
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def two_sample(a, b):
    """Pearson's chi-square for two samples of counts drawn from the same distribution."""
    na, nb = sum(a), sum(b)
    cells = [(x, y) for x, y in zip(a, b) if x + y]
    stat = sum((x * nb - y * na) ** 2 / (na * nb * (x + y)) for x, y in cells)
    return stat, len(cells) - 1


def draws(sampler, temperature=1.0, top_p=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [sampler(DRAFTS, LOGITS, temperature, top_p, g) for _ in range(DRAWS)]


def counts(tokens):
    return [tokens.count(t) for t in range(LOGITS.shape[1])]


def passes(sampler, temperature=1.0):
    runs = draws(sampler, temperature)
    first, df = chi_square(counts([r[0] for r in runs]), by_hand(LOGITS[0], temperature))
    after = [r[1] for r in runs if r[0] == DRAFTS[0] and len(r) > 1]
    second, df2 = chi_square(counts(after), by_hand(LOGITS[1], temperature))
    return first < CRITICAL[df] and second < CRITICAL[df2], (first, second)


def always_accept(drafts, logits, temperature, top_p, generator):
    return list(drafts) + [sample(logits[len(drafts)], temperature, top_p, generator)]


def rejected_from_p(drafts, logits, temperature, top_p, generator):
    """Accepts x with probability p(x) but, rejected, draws from p again (x not removed)."""
    out = []
    for i, x in enumerate(drafts):
        p = torch.softmax(logits[i] / temperature, -1)
        if torch.rand((), generator=generator).item() < p[x]:
            out.append(x)
            continue
        return out + [int(torch.multinomial(p, 1, generator=generator))]
    return out + [sample(logits[len(drafts)], temperature, top_p, generator)]


def test_rejection_sampler_keeps_the_target_distribution():
    for temperature in (1.0, 0.7):
        ok, stats = passes(accept_sampled, temperature)
        assert ok, f"temperature {temperature}: chi-square {stats}"


def test_first_token_matches_sampling_without_speculation_with_top_p():
    g = torch.Generator().manual_seed(1)
    plain = [sample(LOGITS[0], 1.0, 0.8, g) for _ in range(DRAWS)]
    spec = [r[0] for r in draws(accept_sampled, 1.0, 0.8, seed=2)]
    assert counts(spec)[2] == counts(plain)[2] == 0           # the top-p cut drops token 2
    stat, df = two_sample(counts(spec), counts(plain))
    assert stat < CRITICAL[df], stat


def test_wrong_samplers_fail_the_same_test():
    for wrong in (always_accept, rejected_from_p):
        ok, stats = passes(wrong)
        assert not ok, f"{wrong.__name__} passed: chi-square {stats}"
