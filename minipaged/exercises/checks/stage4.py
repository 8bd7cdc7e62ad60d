"""Stage 4's checks: fragmentation counted slot by slot."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from ... import fragmentation
from ...errors import RequestError
from ..grader import expect
from .common import prop


def _slot_model(stored, allocated, final):
    """Slot by slot: slot i of a request is a token state if i < stored, reservation if it will
    be filled later (i < final), internal otherwise."""
    t = r = i = 0
    for s, a, f in zip(stored, allocated, final):
        for slot in range(a):
            if slot < s:
                t += 1
            elif slot < f:
                r += 1
            else:
                i += 1
    return t, r, i


REQS = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 12)),
                min_size=1, max_size=5)


@prop(60)
@given(REQS)
def split_allocated_counts_slot_by_slot(reqs):
    """split_allocated gives the counts of a slot-by-slot classification of every request's
    slots, for 1-D inputs and for (R, k) arrays of k moments; impossible lengths (more stored
    than allocated or than final) raise RequestError."""
    stored, allocated, final = (list(x) for x in zip(*reqs))
    ok = all(s <= min(a, f) for s, a, f in reqs)
    what = f"stored={stored}, allocated={allocated}, final={final}"
    if not ok:
        try:
            fragmentation.split_allocated(stored, allocated, final)
        except RequestError:
            return
        expect(False, f"{what}: a request stores more than it holds or than its final length; "
                      f"split_allocated should raise RequestError")
    got = tuple(int(x) for x in fragmentation.split_allocated(stored, allocated, final))
    want = _slot_model(stored, allocated, final)
    expect(got == want, f"{what}: split_allocated gave (tokens, reservation, internal) = {got}, "
                        f"counting slot by slot gives {want}")
    two = fragmentation.split_allocated(np.array([stored, stored]).T, np.array([allocated, final]).T,
                          np.array([final, final]).T)
    want2 = [_slot_model(stored, allocated, final), _slot_model(stored, final, final)]
    got2 = [tuple(int(x[i]) for x in two) for i in range(2)]
    expect(got2 == want2, f"{what}: with (R, 2) arrays (two moments) split_allocated gave "
                          f"{got2}, expected {want2}")


@prop(60)
@example([1, 1], 0, 2, False)
@example([2, 1], 0, 2, False)
@given(st.lists(st.integers(1, 9), max_size=5), st.integers(0, 6),
       st.one_of(st.none(), st.integers(1, 12)), st.booleans())
def split_free_matches_the_definition(pieces, idle_extra, next_need, paged):
    """split_free: a free slot is external only when someone waits, all free memory together
    would hold them, and the slot lies in a piece too small for them; a paged pool has none."""
    free = sum(pieces) + idle_extra if not paged else sum(pieces)
    arg = None if paged else pieces
    got = tuple(fragmentation.split_free(free, arg, next_need))
    external = 0
    if not paged and next_need is not None and free >= next_need:
        external = sum(p for p in pieces if p < next_need)
    want = (external, free - external)
    expect(got == want, f"split_free(free={free}, pieces={arg}, next_need={next_need}) gave "
                        f"(external, idle) = {got}, expected {want}")
